"""workers/model/llama.py runs a long CPU step's MLP in row slices (MLP_SLICE_ROWS) to bound its
widest activation where each row's numbers do not depend on the others (quantized weights on fp32
rows, the batch-invariant kernels): every row's numbers stay those of the whole step, through the
engine (the prompt's logprobs at every position, and the tokens after)."""

from __future__ import annotations

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.llm_tiny import tiny_engine, tiny_llama
from pagemesh.workers.model import llama

PROMPTS = [[(11 * i + 7 * j) % 250 + 1 for j in range(40 + 9 * i)] for i in range(3)]  # 147 tokens a step


def run(model, **options):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    return [
        (r.token_ids, r.logprobs, r.prompt_logprobs)
        for r in tiny_engine(model, page_size=8, **options).generate(PROMPTS, params)
    ]


@pytest.fixture
def model():  # an engine quantizes or flags its model in place: one each
    return tiny_llama(seed=9)


@pytest.mark.parametrize("options", [{"int8": True}, {"batch_invariant": True}])
def test_a_sliced_mlp_gives_the_whole_steps_numbers(model, monkeypatch, options):
    if options.pop("int8", False):  # weight-only int8, as --quantization int8 loads it
        from pagemesh.workers.model.quantization import quantize_int8_model

        assert quantize_int8_model(model) > 0
    calls = []
    mlp = model.model.layers[0].mlp if hasattr(model, "model") else model.layers[0].mlp
    original = mlp.gate_up_proj.forward
    monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda x: calls.append(x.shape[0]) or original(x))
    whole = run(model, **options)
    assert max(calls) == sum(map(len, PROMPTS))  # the prefill ran as one step of every prompt's rows
    calls.clear()
    monkeypatch.setattr(llama, "MLP_SLICE_ROWS", 32)
    sliced = run(model, **options)
    assert max(calls) == 32
    assert sliced == whole


def test_a_dense_fp32_model_is_not_sliced(model, monkeypatch):
    """(its GEMM's numbers may follow the row count)"""
    calls = []
    mlp = model.model.layers[0].mlp if hasattr(model, "model") else model.layers[0].mlp
    original = mlp.gate_up_proj.forward
    monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda x: calls.append(x.shape[0]) or original(x))
    monkeypatch.setattr(llama, "MLP_SLICE_ROWS", 32)
    run(model)
    assert max(calls) == sum(map(len, PROMPTS))


@pytest.mark.parametrize("adapted", ["gate_up_proj", "down_proj"])
def test_an_mlp_with_a_lora_adapter_is_not_sliced(model, monkeypatch, adapted):
    """(an adapter's rows map to their requests over the whole step)"""
    from pagemesh.workers.model.quantization import quantize_int8_model

    assert quantize_int8_model(model) > 0
    mlp = model.model.layers[0].mlp if hasattr(model, "model") else model.layers[0].mlp
    seen = []
    getattr(mlp, adapted).lora = type("Adapter", (), {"add_to": lambda self, y, x: seen.append(len(x)) or y})()
    monkeypatch.setattr(llama, "MLP_SLICE_ROWS", 32)
    run(model)
    assert max(seen) == sum(map(len, PROMPTS))
