"""A llama.cpp `qwen3moe` GGUF file (issue 30): its experts stacked [experts, rows, cols], F32 or
Q8_0, give the greedy tokens of transformers' own GGUF reader (8 prompts x 24 tokens, through the
Engine): exactly where they are served dense (dequantized at load), and mostly where
`--quantization gguf` keeps the Q8_0 experts' blocks (its CPU kernel rounds activations to int8
too). The file is written here from a tiny random Qwen3-MoE (tests/integration/moe_checkpoints.py)."""

from __future__ import annotations

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration import moe_checkpoints
from pagemesh.tests.integration.conftest import hf_argmax_after_each

MAX_TOKENS = 24
Q8_0_AGREEMENT_FLOOR = 0.85  # teacher-forced greedy agreement of the quantized experts (0.93 measured)


@pytest.fixture(scope="module")
def gguf_file(request, tmp_path_factory):
    """(path, transformers' model read from it, the model it was written from) per expert type.
    transformers takes neither norm_topk_prob nor the experts' intermediate size from a qwen3moe
    GGUF: they are given, as the model has them."""
    from transformers import AutoModelForCausalLM

    model = moe_checkpoints.qwen3_moe_model(mlp_only_layers=(), norm_topk_prob=True)
    path = tmp_path_factory.mktemp("qwen3moe-gguf") / f"tiny-qwen3moe-{request.param}.gguf"
    moe_checkpoints.save_qwen3moe_gguf(model, path, request.param)
    oracle = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        norm_topk_prob=True,
        moe_intermediate_size=model.config.moe_intermediate_size,
    ).eval()
    return path, oracle, model


def generate(path, quantization: str = "none"):
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    config = EngineConfig(
        model=str(path),
        dtype="float32",
        num_pages=64,
        max_num_batched_tokens=16,
        max_prefill_chunk=16,
        quantization=quantization,
    )
    engine = Engine(config)
    prompts = moe_checkpoints.prompts()
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return engine, prompts, [r.token_ids[0] for r in results]


@pytest.mark.parametrize("gguf_file", ["F32", "Q8_0"], indirect=True)
def test_dense_experts_give_transformers_greedy_tokens(gguf_file):
    path, oracle, model = gguf_file
    ids = torch.tensor([moe_checkpoints.prompts()[0]])
    with torch.inference_mode():
        difference = (oracle(ids).logits - model(ids).logits).abs().max()
    assert (difference == 0) if "F32" in path.name else (difference > 0)  # the model itself, or its Q8_0 rounding
    engine, prompts, served = generate(path)
    assert engine.model_config.moe.renormalize and engine.tokenizer.eos_token_id == 0
    for prompt, tokens in zip(prompts, served):
        assert len(tokens) == MAX_TOKENS and tokens == hf_argmax_after_each(oracle, prompt, tokens)


@pytest.mark.parametrize("gguf_file", ["Q8_0"], indirect=True)
def test_quantized_experts_keep_the_files_blocks(gguf_file):
    path, oracle, _ = gguf_file
    engine, prompts, served = generate(path, quantization="gguf")
    for layer in engine.runner.model.layers:
        w13, w2 = layer.mlp.quantized
        assert len(w13) == len(w2) == moe_checkpoints.EXPERTS and {q.format for q in w13 + w2} == {"q8_0"}
        assert layer.mlp.w13.numel() == 0  # the dense copy released
    agree = sum(
        sum(a == b for a, b in zip(tokens, hf_argmax_after_each(oracle, prompt, tokens)))
        for prompt, tokens in zip(prompts, served)
    )
    assert agree / (MAX_TOKENS * len(prompts)) >= Q8_0_AGREEMENT_FLOOR, agree
