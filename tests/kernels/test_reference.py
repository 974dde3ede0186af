"""The references themselves, against Hugging Face transformers and first principles."""

import math

import pytest
import torch
import torch.nn.functional as F

from pagemesh.kernels.reference import (
    fused_add_rms_norm_ref,
    rms_norm_ref,
    rope_cos_sin_cache,
    rope_inv_freq,
    rotary_embedding_ref,
    silu_and_mul_ref,
)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_frequency_bands():
    # With theta 500000 and head_dim 128: wavelengths below 8192/4 = 2048 keep their frequency,
    # above 8192/1 are divided by 8, and in between the blend is strictly in between.
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, LLAMA3)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 2048, wavelen > 8192
    band = ~high & ~low
    assert high.any() and low.any() and band.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8, atol=0, rtol=1e-6)
    assert ((scaled[band] < plain[band]) & (scaled[band] > plain[band] / 8)).all()


def test_default_rope_cache_values():
    cache = rope_cos_sin_cache(8, 5, 10000.0, None, "cpu")
    inv_freq = torch.tensor([10000.0 ** (-i / 8) for i in (0, 2, 4, 6)])
    angles = torch.arange(5.0)[:, None] * inv_freq
    torch.testing.assert_close(cache, torch.cat((angles.cos(), angles.sin()), 1))


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="yarn"):
        rope_cos_sin_cache(64, 8, 10000.0, {"rope_type": "yarn", "factor": 4.0}, "cpu")


def _hf_llama(rope_scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
    )
    return config, modeling_llama


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3])
def test_rope_matches_transformers(rope_scaling):
    config, modeling_llama = _hf_llama(rope_scaling)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 5, 1000, 9000, 70000])
    x = torch.randn(1, len(positions), 64)  # only its dtype and device are used
    cos, sin = rotary(x, positions[None])
    cache = rope_cos_sin_cache(64, 70001, 500000.0, rope_scaling, "cpu")
    torch.testing.assert_close(cache[positions, :32], cos[0, :, :32], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache[positions, 32:], sin[0, :, :32], atol=1e-6, rtol=1e-6)

    q, k = torch.randn(len(positions), 4, 64), torch.randn(len(positions), 2, 64)
    q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rms_norm_matches_transformers():
    _, modeling_llama = _hf_llama(None)
    norm = modeling_llama.LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(4, 96)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-6), norm(x).detach())


def test_rms_norm_by_hand():
    x = torch.tensor([[3.0, 4.0]])
    out = rms_norm_ref(x, torch.tensor([1.0, 2.0]), 0.0)
    rms = math.sqrt((9 + 16) / 2)
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 8 / rms]]))


def test_fused_add_rms_norm_rounds_the_sum():
    x = torch.tensor([[1.0, 2.0**-9]], dtype=torch.bfloat16)
    residual = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    out, new_residual = fused_add_rms_norm_ref(x, residual, torch.ones(2), 0.0)
    assert new_residual.tolist() == [[2.0, 1.0]]  # 1 + 2**-9 rounds to 1 in bf16
    assert torch.equal(out, rms_norm_ref(new_residual, torch.ones(2), 0.0))


def test_silu_and_mul_by_hand():
    x = torch.tensor([[0.0, 2.0, 5.0, 3.0]])
    expect = torch.tensor([[0.0, 2.0 / (1 + math.exp(-2.0)) * 3.0]])
    torch.testing.assert_close(silu_and_mul_ref(x), expect)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(x[:, :2]) * x[:, 2:])
