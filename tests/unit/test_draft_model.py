"""Self-speculation with a quantized draft (workers/engine/draft_model.py): the config, the draft
pool's valid-position bookkeeping (pure), then the engine on a tiny random model with an int8
draft of itself: outputs equal without speculation through forks, rollbacks and preemption, the
draft's pool addressed by the target's block tables, nothing left in use."""

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.unit.test_speculative import PROMPT, _tiny_engine
from pagemesh.workers.engine.draft_model import DraftProposer, draft_positions
from pagemesh.workers.engine.sequence import Sequence
from pagemesh.workers.engine.speculative import PENDING_DRAFT, SpeculativeConfig, Speculator

DRAFT = SpeculativeConfig(
    method="draft_quantized", num_speculative_tokens=3, quantization="int8", max_decode_rows=10_000
)


def test_config_names_the_method_and_the_drafts_quantization():
    cfg = SpeculativeConfig.from_json('{"method": "draft_quantized", "num_speculative_tokens": 5}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.quantization) == ("draft_quantized", 5, "gguf")
    assert SpeculativeConfig.from_json(cfg.to_json()) == cfg
    for text, field in [
        ('{"method": "draft", "num_speculative_tokens": 2}', "method"),
        ('{"method": "draft_quantized", "quantization": "q4"}', "quantization"),
    ]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_json(text)


def test_the_engine_config_refuses_the_draft_beside_pipeline_stages():
    from pagemesh.workers.engine.config import EngineConfig

    # -tp: the draft runs whole on rank 0 (tests/integration/test_parallel_quantized.py)
    assert EngineConfig(speculative_config=DRAFT, tensor_parallel_size=2).speculative_config == DRAFT
    with pytest.raises(ValueError, match="draft_quantized needs pipeline_parallel_size 1"):
        EngineConfig(speculative_config=DRAFT, pipeline_parallel_size=2)


def test_a_draft_model_proposes_placeholders_the_engine_fills_after_planning():
    spec = Speculator(DRAFT, 256)
    assert spec.uses_draft_model
    assert spec.drafts([1, 2, 3], 10) == [PENDING_DRAFT] * 3  # any text: no lookup
    assert spec.drafts([1, 2, 3], 2) == [PENDING_DRAFT] * 2 and spec.drafts([1], 0) == []


def test_draft_positions_stop_at_what_the_target_kept_and_reset_after_preemption():
    seq = Sequence("r", 0, list(range(20)), 10, SamplingParams(temperature=0))
    assert draft_positions(seq) == 0  # a new sequence: the draft has seen nothing
    seq.num_computed = 14
    seq.draft_kv = (17, 0)  # the draft wrote 17 positions; the target kept 14 (drafts rejected)
    assert draft_positions(seq) == 14
    seq.num_computed = 19
    assert draft_positions(seq) == 17  # decodes ran without drafting since: caught up next time
    seq.num_preemptions = 1  # its pages went back to the pool (recompute or swap)
    assert draft_positions(seq) == 0


def _run_checked(engine, prompts, params):
    """Step to completion, checking after every step the block manager's invariants and that no
    sequence's draft positions run past what its target holds. Returns {(request, choice): tokens}."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    tokens: dict[tuple[int, int], list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for choice in out.outputs:
                tokens.setdefault((int(out.request_id[1:]), choice.index), []).extend(choice.new_token_ids)
        live = engine.scheduler.live_sequences
        engine.blocks.check_invariants([s.block_table for s in live])
        for s in live:
            assert draft_positions(s) <= s.num_computed
    return tokens


@pytest.mark.parametrize("num_pages", [2048, 40])  # 40 pages of 4 tokens: sequences get preempted
def test_outputs_equal_those_without_speculation_through_forks_rollback_and_preemption(num_pages):
    """Greedy and seeded rows, n = 2 forks sharing the prompt's partial page (copy-on-write in
    both pools), a random prompt per request (nothing for n-gram lookup to find)."""
    prompts = [[(7 * i + 3 * j) % 8 for j in range(10 + i % 5)] for i in range(12)]
    params = [
        SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, n=1 + i % 2, max_tokens=14, ignore_eos=True)
        for i in range(12)
    ]
    plain = _tiny_engine(None, num_pages).generate(prompts, params)
    engine = _tiny_engine(DRAFT, num_pages)
    assert isinstance(engine.drafter, DraftProposer)
    assert engine.drafter.runner.kv_cache.shape == engine.runner.kv_cache.shape  # page for page
    tokens = _run_checked(engine, prompts, params)
    for i, r in enumerate(plain):
        for k, want in enumerate(r.token_ids):
            assert tokens[(i, k)] == want, (i, k)
    stats = engine.stats.speculation
    assert stats.passes > 0 and 0 < stats.accepted < stats.proposed, stats  # kept and rolled back
    assert stats.acceptance_rate > 0.5, stats  # an int8 copy of the model mostly agrees with it
    if num_pages == 40:
        assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_used_pages == 0  # the draft's pool is freed with the target's pages
    engine.blocks.check_invariants([])


def test_a_request_that_opts_out_runs_no_draft():
    engine = _tiny_engine(DRAFT)
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, speculative=False))
    assert engine.drafter.forwards == 0 and engine.stats.speculation.passes == 0
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    # one sequence: a draft forward per draft token (the catch-up proposes the first, each
    # further one runs the one before it)
    stats = engine.stats.speculation
    assert stats.passes > 0 and engine.drafter.forwards == stats.proposed


def test_the_kv_budget_holds_the_draft_pool_at_its_own_size():
    """An fp8 target pool (1 byte a value) beside the draft's (the model dtype, fp32 here: 4):
    the pages a KV budget buys count both at their own sizes."""
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    model = _tiny_engine(None).runner.model
    budget_gb = 0.001
    config = EngineConfig(
        device="cpu", dtype="float32", kv_cache_memory_gb=budget_gb, kv_cache_dtype="fp8_e4m3", speculative_config=DRAFT
    )
    engine = Engine(config, model=model)
    assert engine.drafter is not None
    target, draft = (
        r.kv_cache[:, 0].numel() * r.kv_cache.element_size() for r in (engine.runner, engine.drafter.runner)
    )
    assert (target, draft) == (
        2 * 2 * 16 * 1 * 16 * 1,
        2 * 2 * 16 * 1 * 16 * 4,
    )  # layers x K|V x slots x head x dim x bytes
    assert engine.runner.kv_cache.shape[1] == int(budget_gb * 2**30 // (target + draft))
