"""Multi-LoRA serving on the default model against HF + peft (issue 31), in fp32.

Two adapters made here by peft on the default model (random non-zero B; rank 8 on every linear,
rank 16 with rsLoRA on every linear) run beside the base model in ONE mixed batch, and every
request gives the greedy continuation HF + peft gives under its adapter. The prefix cache keeps
each adapter's pages apart, slots are reused LRU, and an adapter loaded at run time serves too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagemesh.common.lora import AdapterError
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.lora_adapters import hf_tokens, make_adapters
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

TOKENS = 24


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory):
    return make_adapters(model_path, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def engine(adapters):
    _, folders = adapters
    return Engine(
        EngineConfig(
            dtype="float32",
            num_pages=256,
            max_num_batched_tokens=64,
            max_prefill_chunk=32,
            enable_lora=True,
            lora_modules=tuple(folders.items()),
            max_loras=2,
            max_lora_rank=16,
        )
    )


def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    texts = ["The capital of France is", "Write a haiku about rain.", "def fibonacci(n):", "Once upon a time"]
    return [tok.encode_chat([{"role": "user", "content": t}]) if i % 2 else tok.encode(t) for i, t in enumerate(texts)]


def test_base_and_two_adapters_in_one_mixed_batch_each_give_hf_peft_greedy_tokens(engine, adapters):
    peft_model, _ = adapters
    ps = prompts(engine)
    runs = [(None, ps[0]), ("poet", ps[1]), ("coder", ps[2]), ("poet", ps[3]), ("coder", ps[0]), (None, ps[2])]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    for i, (lora, prompt) in enumerate(runs):
        engine.add_request(f"mixed-{i}", prompt, replace(params, lora=lora))
    tokens: dict[str, list[int]] = {}
    while engine.scheduler.waiting:  # (the step's token budget admits them over a step or two)
        _tokens(engine.step(), tokens)
    # all six run together: each step is one batch of base, a and b rows
    assert engine.adapters.slots.running() == {"poet": 2, "coder": 2} and len(engine.scheduler.running) == 6
    tokens = dict(_run(engine, tokens))
    for i, (lora, prompt) in enumerate(runs):
        got = tokens[f"mixed-{i}"]
        assert len(got) == TOKENS
        assert got == hf_tokens(peft_model, lora, prompt, got), (i, lora)
    assert tokens["mixed-0"] != tokens["mixed-4"]  # the same prompt: adapter b really changes the output
    assert engine.adapters.slots.running() == {}
    engine.blocks.check_invariants()
    engine.adapters.slots.check_invariants()


def test_the_prefix_cache_never_serves_one_adapters_pages_to_another(engine, adapters):
    peft_model, _ = adapters
    prompt = engine.tokenizer.encode("Pages of a prompt no other test sends: " * 6)  # several full pages
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hits = []
    for lora in (None, "poet", "coder", "poet", None):
        rid = f"prefix-{len(hits)}"
        engine.add_request(rid, prompt, replace(params, lora=lora))
        hits.append(engine.requests[rid].seqs[0])
        (result,) = [r for r in _run(engine) if r[0] == rid]
        assert result[1] == hf_tokens(peft_model, lora, prompt, result[1]), lora
    cached = [seq.num_prefix_hit_tokens for seq in hits]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] == 0  # each the first of its kind
    assert cached[3] > 0 and cached[4] > 0  # a again, the base again: their own pages


def _tokens(outputs, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    for out in outputs:
        for so in out.outputs:
            tokens.setdefault(out.request_id, []).extend(so.new_token_ids)
    return tokens


def _run(engine, tokens: dict[str, list[int]] | None = None) -> list[tuple[str, list[int]]]:
    """Step until every request is done: each request's tokens (with those in `tokens` so far)."""
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished():
        _tokens(engine.step(), tokens)
    return list(tokens.items())


def test_one_slot_serves_adapters_in_turn_and_a_run_time_adapter_and_refusals(adapters):
    peft_model, folders = adapters
    engine = Engine(EngineConfig(dtype="float32", num_pages=128, enable_lora=True, max_loras=1, max_cpu_loras=2))
    engine.adapters.add("coder", folders["coder"])  # loaded at run time
    ps = prompts(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # only one adapter fits a step: b's requests wait until a's are done, then take the slot
    results = engine.generate([ps[0], ps[1], ps[2]], params, loras=["coder", None, "coder"])
    for (lora, prompt), r in zip([("coder", ps[0]), (None, ps[1]), ("coder", ps[2])], results):
        assert r.token_ids[0] == hf_tokens(peft_model, lora, prompt, r.token_ids[0])
    with pytest.raises(AdapterError, match="rank 16 of q_proj is above --max-lora-rank 8"):
        Engine(
            EngineConfig(
                dtype="float32",
                num_pages=16,
                enable_lora=True,
                lora_modules=(("coder", folders["coder"]),),
                max_lora_rank=8,
            )
        )
    with pytest.raises(AdapterError, match="is loaded already"):
        engine.adapters.add("coder", folders["poet"])
    with pytest.raises(ValueError, match="no adapter named 'critic' is loaded"):
        engine.add_request("unknown", ps[0], replace(params, lora="critic"))
    engine.add_request("running", ps[0], replace(params, lora="coder"))
    engine.step()
    with pytest.raises(ValueError, match="in use by 1 running sequences"):
        engine.adapters.remove("coder")
    _run(engine)
    engine.adapters.remove("coder")
    with pytest.raises(ValueError, match="no adapter named 'coder'"):
        engine.add_request("gone", ps[0], replace(params, lora="coder"))
    assert engine.adapters.slots.loads >= 1
