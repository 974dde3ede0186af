"""rms_norm, fused_add_rms_norm, rotary_embedding and silu_and_mul against their references.

The kernels and references both compute in fp32 and round once, so they differ only by the
order of the RMS sum: tolerance is about one ulp of the output dtype (fp32 1e-5, fp16 1e-3,
relative and absolute), and two for bf16 (1.6e-2) because the interpreter's fp32 -> bf16 cast
truncates where the GPU rounds to nearest.
"""

import pytest
import torch

import pagemesh.kernels
from pagemesh.kernels.reference import (
    fused_add_rms_norm_ref,
    rms_norm_ref,
    rope_cos_sin_cache,
    rotary_embedding_ref,
    silu_and_mul_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def randn(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000])
def test_rms_norm(hidden, dtype):
    x = randn(7, hidden, dtype=dtype) * 3
    weight = randn(hidden, dtype=dtype, seed=1)
    out = pagemesh.kernels.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    x = randn(5, 576, dtype=dtype)
    residual = randn(5, 576, dtype=dtype, seed=2)
    weight = randn(576, dtype=dtype, seed=3)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = pagemesh.kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    expect_out, expect_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        # The interpreter's fp32 -> bf16 cast truncates instead of rounding: 1 ulp apart.
        torch.testing.assert_close(new_residual, expect_residual, atol=0, rtol=2**-7)
    else:  # same fp32 add, same single rounding
        assert torch.equal(new_residual, expect_residual)
    torch.testing.assert_close(out, expect_out, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_strided_rows():
    # Rows of a wider buffer (row stride != hidden): the kernel must honour the stride.
    buf = randn(6, 256, dtype=torch.float32)
    x = buf[:, :200]
    weight = randn(200, dtype=torch.float32, seed=4)
    torch.testing.assert_close(
        pagemesh.kernels.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (3, 1, 128)])
def test_rotary_embedding(heads, kv_heads, dim, dtype):
    num_tokens, max_pos = 9, 20000
    cache = rope_cos_sin_cache(dim, max_pos, 500000.0, LLAMA3, DEVICE)
    positions = torch.tensor([0, 1, 2, 17, 300, 4095, 8191, 12000, max_pos - 1], device=DEVICE)
    # q and k as strided views of one fused qkv output.
    qkv = randn(num_tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    before = qkv.clone()
    q_out, k_out = pagemesh.kernels.rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv, before), "rotary_embedding is out of place"
    assert not torch.allclose(q_out[1:].float(), q[1:].float(), atol=1e-2)  # it did rotate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500])
def test_silu_and_mul(inter, dtype):
    x = randn(7, 2 * inter, dtype=dtype) * 4
    out = pagemesh.kernels.silu_and_mul(x)
    assert out.shape == (7, inter)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=TOL[dtype], rtol=TOL[dtype])
