"""Preemption, beam search and best_of on real (tiny) models."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

pytestmark = pytest.mark.slow


def tiny_engine(folder, **overrides) -> Engine:
    cfg = dict(model=str(folder), dtype="float32", max_num_batched_tokens=64, max_prefill_chunk=64, num_pages=256)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def run_checked(engine: Engine, prompts, params) -> list[list[int]]:
    """generate() with the block manager's invariants checked after every step."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            for so in o.outputs:
                out[o.request_id] += so.new_token_ids
        engine.blocks.check_invariants([s.block_table for s in engine.scheduler.live_sequences])
    return [out[rid] for rid in ids]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_memory_pressure_changes_no_greedy_output_and_leaks_no_page(tiny_qwen2, mode):
    folder, _ = tiny_qwen2
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (20, 35, 50, 12, 28, 44)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = run_checked(tiny_engine(folder), prompts, params)
    tight_engine = tiny_engine(folder, num_pages=16, page_size=8, preemption_mode=mode, swap_space_gb=0.01)
    tight = run_checked(tight_engine, prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy
    assert tight_engine.blocks.num_used_pages == 0
    assert not tight_engine.runner.host_pages and tight_engine.scheduler.swapped_pages == 0


def test_prompt_logprobs_survive_preemption_and_forks_and_go_out_once(tiny_qwen2):
    folder, _ = tiny_qwen2
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (30, 45, 20, 38)]
    params = SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=30, ignore_eos=True, prompt_logprobs=2)

    def run(engine):
        sent: dict[str, list] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished():
            for o in engine.step():
                if o.prompt_logprobs is not None:
                    sent.setdefault(o.request_id, []).append(o.prompt_logprobs)
        assert all(len(v) == 1 for v in sent.values()) and len(sent) == len(prompts)  # once per request
        return [sent[f"r{i}"][0] for i in range(len(prompts))]

    roomy = run(tiny_engine(folder))
    tight_engine = tiny_engine(folder, num_pages=20, page_size=8, max_num_batched_tokens=16, max_prefill_chunk=16)
    tight = run(tight_engine)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [[lp.token_id for lp in r] for r in roomy] == [p[1:] for p in prompts]
    for a, b in zip(itertools.chain(*roomy), itertools.chain(*tight)):  # other chunk sizes: other rounding
        assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids) and abs(a.logprob - b.logprob) < 1e-3
    assert tight_engine.blocks.num_used_pages == 0


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    """A 16-token vocabulary, so beam search can be checked against exhaustive search."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-vocab")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def sequence_logprob(model, prompt: list[int], continuation: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(continuation))


def test_beam_search_with_full_width_equals_exhaustive_search(tiny_vocab_model):
    """Width 16 over a 16-token vocabulary keeps every prefix, so after 2 tokens the beams are
    exactly the best of all 256 continuations (length_penalty 0: score = cumulative logprob)."""
    folder, hf = tiny_vocab_model
    engine = tiny_engine(folder, num_pages=512, page_size=4)
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(n=4, best_of=16, use_beam_search=True, length_penalty=0.0, max_tokens=2, ignore_eos=True)
    [result] = engine.generate([prompt], params)
    scored = sorted(
        ((sequence_logprob(hf, prompt, list(c)), list(c)) for c in itertools.product(range(16), repeat=2)), reverse=True
    )
    assert result.token_ids == [c for _, c in scored[:4]]
    assert engine.blocks.num_used_pages == 0
    engine.blocks.check_invariants([])


def test_beams_share_pages_copy_on_write(tiny_vocab_model):
    folder, _ = tiny_vocab_model
    engine = tiny_engine(folder, num_pages=512, page_size=4)
    prompt = list(range(1, 15))  # 3 full pages + 2 tokens
    engine.add_request(
        "beam", prompt, SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=6, ignore_eos=True)
    )
    peak_live = 0
    while engine.has_unfinished():
        engine.step()
        live = [s for s in engine.scheduler.running]
        if len(live) == 4:
            distinct = {p for s in live for p in s.block_table}
            peak_live = max(peak_live, len(live))
            assert len(distinct) < sum(len(s.block_table) for s in live)  # prompt pages shared
        engine.blocks.check_invariants([s.block_table for s in engine.scheduler.live_sequences])
    assert peak_live == 4
    assert engine.blocks.num_used_pages == 0


def test_best_of_returns_the_n_most_likely_samples(tiny_vocab_model):
    folder, hf = tiny_vocab_model
    engine = tiny_engine(folder, num_pages=512, page_size=4)
    prompt = [2, 7, 1, 8]
    [result] = engine.generate(
        [prompt], SamplingParams(n=2, best_of=6, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    )
    assert len(result.token_ids) == 2
    scores = [sequence_logprob(hf, prompt, c) for c in result.token_ids]
    assert scores[0] >= scores[1] - 1e-4
    engine.add_request("all", prompt, SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True))
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            for so in o.outputs:
                samples.setdefault(so.index, []).extend(so.new_token_ids)
    # the same seeds draw the same six samples; best_of kept the two most likely of them
    ranked = sorted(samples.values(), key=lambda c: -sequence_logprob(hf, prompt, c))
    assert result.token_ids == ranked[:2]


def test_a_request_larger_than_the_kv_pool_is_refused_or_cut_instead_of_waiting_for_ever(tiny_qwen2):
    folder, _ = tiny_qwen2
    engine = tiny_engine(folder, num_pages=20, page_size=4)  # 19 usable pages: 76 tokens
    with pytest.raises(ValueError, match="do not fit this worker's KV pool"):
        engine.add_request("long", list(range(1, 91)), SamplingParams(max_tokens=4))
    assert not engine.has_unfinished()
    params = SamplingParams(n=2, temperature=0, max_tokens=400, ignore_eos=True)
    (tokens_a, tokens_b) = run_checked_choices(engine, list(range(1, 55)), params)
    assert len(tokens_a) == len(tokens_b) == 76 - 54  # the pool was the context: cut, and ended
    assert engine.blocks.num_used_pages == 0


def run_checked_choices(engine: Engine, prompt: list[int], params) -> list[list[int]]:
    engine.add_request("r", prompt, params)
    out: dict[int, list[int]] = {}
    reasons = set()
    while engine.has_unfinished():
        for o in engine.step():
            for so in o.outputs:
                out.setdefault(so.index, []).extend(so.new_token_ids)
                if so.finish_reason is not None:
                    reasons.add(so.finish_reason)
        engine.blocks.check_invariants([s.block_table for s in engine.scheduler.live_sequences])
    assert reasons == {"length"}
    return [out[i] for i in sorted(out)]
