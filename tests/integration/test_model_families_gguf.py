"""Qwen3 and Phi-3 from GGUF files as llama.cpp writes them (issue 30): the engine's greedy
tokens equal those of transformers reading the same file (its GGUF reader is the oracle of the
file's conventions), dense and on the file's own Q8_0 blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.test_model_families import NEW_TOKENS, SHAPE, VOCAB, hf_greedy_all, prompts

pytestmark = pytest.mark.slow

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",  # Qwen3
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: llama.cpp keeps gate and up fused under ffn_up
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(hf, path: Path, arch: str) -> None:
    """`hf` as llama.cpp's converter writes a Qwen3 or a Phi-3 (no Q/K row reordering, unlike
    Llama), every linear weight in Q8_0 blocks, with a word-level vocabulary."""
    import gguf
    import numpy as np

    c, p = hf.config, f"{arch}."
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "vocab_size": VOCAB,
    }.items():
        w.add_uint32(p + key, value)
    if arch == "phi3":  # what llama.cpp's converter writes for every Phi-3: no window is 0
        w.add_uint32(p + "rope.scaling.original_context_length", c.max_position_embeddings)
        w.add_uint32(p + "attention.sliding_window", 0)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(p + "rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"w{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * VOCAB)
    w.add_array("tokenizer.ggml.merges", [])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    for name, t in hf.state_dict().items():
        if name in GGUF_TOP:
            gname = GGUF_TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        array = t.float().numpy()
        if array.ndim == 2 and gname != "token_embd.weight":
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            w.add_tensor(gname, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_source(arch: str):
    """A tiny model for a GGUF file, in what transformers' GGUF reader can read back: Qwen3 with
    head_dim 128 (the reader takes 128 whatever the file says), Phi-3 without a sliding window
    (the reader drops it) or LongRoPE (llama.cpp keeps it in tensors the reader does not read)."""
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = {**SHAPE, "num_hidden_layers": 2, "tie_word_embeddings": False}
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=128))
    else:
        model = Phi3ForCausalLM(Phi3Config(**shape))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_gguf_gives_the_greedy_tokens_of_transformers_reading_the_same_file(arch, quantization, tmp_path):
    """transformers' GGUF reader is the oracle of the file's conventions. Dense (the blocks
    widened at load) the tokens are its greedy ones; on the GGUF's own Q8_0 blocks (int8
    activations in the matmuls) nearly all of them."""
    from transformers import AutoModelForCausalLM

    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    path = tmp_path / f"tiny-{arch}-q8_0.gguf"
    write_gguf(gguf_source(arch), path, arch)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    engine = Engine(
        EngineConfig(
            model=str(path), dtype="float32", max_num_batched_tokens=16, num_pages=128, quantization=quantization
        )
    )
    assert engine.model_config.architecture == arch and engine.model_config.qk_norm == (arch == "qwen3")
    ps = prompts()
    results = engine.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    served = [r.token_ids[0] for r in results]
    expected = hf_greedy_all(hf, ps, served)
    if quantization == "none":
        assert served == expected
    else:
        from pagemesh.kernels.quantized import is_quantized
        from pagemesh.workers.model.quantization import _linears

        assert all(is_quantized(m.packed) for _, m in _linears(engine.runner.model))  # fused Phi-3 ones too
        agree = sum(a == b for s, e in zip(served, expected) for a, b in zip(s, e))
        assert agree >= 0.9 * len(ps) * NEW_TOKENS
