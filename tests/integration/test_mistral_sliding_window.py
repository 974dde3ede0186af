"""A Mistral checkpoint whose sliding window is shorter than its context (issue 30): every layer
attends to the last 16 positions only, as HF's, over the whole context, and the pages the window
has passed are handed back while the sequences run.

A tiny random Mistral (window 16, 3 layers, fp32, its head scaled so no near-tie decides a token)
gives HF's greedy tokens, teacher-forced (`hf_argmax_after_each`), for 8 prompts x 24 new tokens,
every sequence well past the window: through the Engine (prompt chunks of 8 beside decodes, pages
of 8 tokens) with the C kernels and with the torch fallback, and once through a mesh
(`pagemesh up`: a prefill worker hands the prompt's pages to a decode worker) with the official
openai client."""

import json

import pytest
import torch

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.common.model_config import default_max_model_len
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration import moe_checkpoints
from pagemesh.tests.integration.conftest import hf_argmax_after_each
from pagemesh.workers.engine.block_manager import NULL_PAGE
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.speculative import SpeculativeConfig

WINDOW = 16
NEW_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 9, 15, 17, 24, 33, 40)  # with 24 new tokens: 25 to 64 positions, all past 16


def mistral(window: int | None):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=moe_checkpoints.VOCAB_SIZE,  # its tokenizer's (a byte-level BPE): every id decodes
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=window,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # spread-out logits: no near-tie decides a greedy token
    return model


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """(folder, HF model): the tiny random Mistral with a 16-token window as safetensors + tokenizer."""
    model = mistral(WINDOW)
    folder = moe_checkpoints.save(model, tmp_path_factory.mktemp("tiny-mistral-sw"))
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == WINDOW
    return folder, model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, moe_checkpoints.VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_hf_window_changes_every_position_past_it(tiny_mistral):
    """What the tests below rest on: HF's windowed Mistral equals full attention at every query
    position below W and differs at W and after, so a served window that were ignored shows."""
    _, windowed = tiny_mistral
    full = mistral(None)
    full.load_state_dict(windowed.state_dict())
    ids = torch.tensor([prompts()[-1]])
    with torch.inference_mode():
        diff = (windowed(ids).logits - full(ids).logits)[0].abs().amax(-1)
        assert diff[:WINDOW].max() == 0 and (diff[WINDOW:] > 0).all()
        assert hf_argmax_after_each(windowed, ids[0, :WINDOW].tolist(), ids[0, WINDOW:].tolist()) != (
            hf_argmax_after_each(full, ids[0, :WINDOW].tolist(), ids[0, WINDOW:].tolist())
        )


VARIANTS = {
    "c-kernels": {},
    "torch-fallback": {},
    # 14 pages of 8 for 8 sequences of up to 64 positions: preempted, swapped out while whole, else
    # recomputed (a table with freed pages is never swapped: swapped-in pages are published whole)
    "preempt-swap": {"num_pages": 14, "preemption_mode": "swap"},
    # drafts ride as queries past the window; rollback truncates behind the freed pages
    "ngram-spec": {"speculative_config": SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_gives_hf_greedy_tokens_past_the_window_and_frees_pages(tiny_mistral, variant, monkeypatch):
    folder, hf = tiny_mistral
    if variant == "torch-fallback":  # the path taken where no C compiler is found
        monkeypatch.setattr("pagemesh.workers.engine.backend.cpu_kernels_usable", lambda dtype: False)
    fields = {"num_pages": 96, "page_size": 8, "max_num_batched_tokens": 8, "max_prefill_chunk": 8} | VARIANTS[variant]
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", **fields))
    torch_path = variant == "torch-fallback"
    assert type(engine.runner.attention).__name__ == (
        "TorchAttentionBackend" if torch_path else "CpuKernelAttentionBackend"
    )
    assert engine.model_config.layer_windows == (WINDOW,) * 3 and engine.blocks.window == WINDOW
    assert engine.max_model_len == 256 and default_max_model_len(folder) == 256  # the whole context is served

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPT_LENGTHS))}
    most_freed = 0  # entries on the null page across the running tables, at the step that had most
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].new_token_ids
        tables = [s.block_table for s in engine.scheduler.running]
        engine.blocks.check_invariants(tables)
        most_freed = max(most_freed, sum(t.count(NULL_PAGE) for t in tables))
    for i, prompt in enumerate(prompts()):
        assert len(tokens[f"r{i}"]) == NEW_TOKENS
        assert tokens[f"r{i}"] == hf_argmax_after_each(hf, prompt, tokens[f"r{i}"]), f"prompt {i}"
    assert most_freed >= 6  # pages of 8, window 16: a sequence at 64 positions keeps 3-4 of its 8 pages
    if variant == "preempt-swap":
        assert engine.scheduler.num_preemptions > 0
    if variant == "ngram-spec":
        assert engine.stats.speculation.accepted > 0
    engine.blocks.check_invariants([])
    assert engine.blocks.num_used_pages == 0


@pytest.mark.slow
def test_mesh_gives_hf_greedy_tokens_past_the_window(tiny_mistral):
    """The default topology: a prefill worker (which keeps every prompt page for the handoff) and
    a decode worker (which frees what the window passed once it decodes)."""
    folder, hf = tiny_mistral
    with running_mesh("--model", str(folder), "--dtype", "float32", "--max-prefill-chunk", "16") as url:
        served = moe_checkpoints.mesh_greedy_tokens(url, prompts(), NEW_TOKENS)
    for prompt, tokens in zip(prompts(), served):
        assert len(tokens) == NEW_TOKENS and tokens == hf_argmax_after_each(hf, prompt, tokens)


def test_a_quantized_draft_keeps_every_page_and_the_target_stays_hf(tiny_mistral):
    """A draft model catches up over whole prompts (workers/engine/draft_model.py), so with one
    attached nothing is freed; the verified tokens are still HF's."""
    folder, hf = tiny_mistral
    spec = SpeculativeConfig(method="draft_quantized", num_speculative_tokens=3, quantization="int8")
    engine = Engine(
        EngineConfig(model=str(folder), dtype="float32", num_pages=96, page_size=8, speculative_config=spec)
    )
    assert engine.blocks.window is None
    chosen = prompts()[-2:]
    results = engine.generate(chosen, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, result in zip(chosen, results):
        assert result.token_ids[0] == hf_argmax_after_each(hf, prompt, result.token_ids[0])
    assert engine.stats.speculation.proposed > 0
