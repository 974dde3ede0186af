"""Kernels at model shapes on a CUDA GPU (run by scripts/gpu_check.sh; skipped without CUDA).

Llama-3-8B attention shapes (32 query heads, 8 kv heads, head_dim 128, bf16, page 16), SmolLM2
shapes (9 / 3 heads, head_dim 64: GQA 3), contexts up to 32k, mixed prefill + decode batches,
split-KV off / forced / by heuristic, and CUDA-graph capture of a decode step. Tolerances as in
tests/kernels: bf16 atol=rtol=2e-2, fp16 3e-3, fp32 1e-4 (IEEE dot, no TF32).
"""

import pytest
import torch

import pagemesh.kernels
from pagemesh.kernels.reference import (
    fused_add_rms_norm_ref,
    paged_attention_ref,
    rms_norm_ref,
    rope_cos_sin_cache,
    rotary_embedding_ref,
    silu_and_mul_ref,
    write_kv_ref,
)
from pagemesh.kernels.testing import make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _mixed_lens(num_decodes, max_ctx, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (num_decodes,), generator=gen).tolist()
    # decodes, a 512-token chunk continuing 1000 keys, a fresh 1024-token prompt, a 3-token query
    return [1] * num_decodes + [512, 1024, 3], ctx + [1512, 1024, 700]


def _check(batch, dtype, **kwargs):
    out = pagemesh.kernels.paged_attention(*batch.attention_args(), **kwargs)
    ref = paged_attention_ref(*batch.attention_args())
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    return out


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_llama8b_mixed_batch(num_splits):
    lens = _mixed_lens(48, 8192, seed=1)
    batch = make_paged_batch(
        *lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda", seed=1
    )
    _check(batch, torch.bfloat16, num_splits=num_splits)


@pytest.mark.parametrize("batch_size, ctx", [(1, 32768), (8, 16384), (64, 4096)])
def test_llama8b_long_decode_uses_heuristic_splits(batch_size, ctx):
    lens = ([1] * batch_size, [ctx - 37 * i for i in range(batch_size)])
    batch = make_paged_batch(
        *lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=batch_size,
    )
    _check(batch, torch.bfloat16)
    _check(batch, torch.bfloat16, num_splits=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_smollm_gqa3_page32(dtype):
    lens = _mixed_lens(20, 3000, seed=2)
    batch = make_paged_batch(
        *lens, num_heads=9, num_kv_heads=3, head_dim=64, page_size=32, dtype=dtype, device="cuda", seed=2
    )
    _check(batch, dtype, num_splits=None)
    _check(batch, dtype, num_splits=4)


@pytest.mark.parametrize("page_size", [8, 64, 128])
def test_other_page_sizes(page_size):
    lens = _mixed_lens(16, 2000, seed=page_size)
    batch = make_paged_batch(
        *lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=page_size, dtype=torch.bfloat16, device="cuda"
    )
    _check(batch, torch.bfloat16, num_splits=None)


def test_decode_step_replays_in_a_cuda_graph():
    lens = ([1] * 16, [4000 + 11 * i for i in range(16)])
    batch = make_paged_batch(
        *lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda", seed=4
    )
    args = batch.attention_args()
    expect = pagemesh.kernels.paged_attention(*args)  # also compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pagemesh.kernels.paged_attention(*args)
    batch.q.copy_(torch.randn_like(batch.q))
    graph.replay()
    torch.testing.assert_close(captured, paged_attention_ref(*args), atol=2e-2, rtol=2e-2)
    assert not torch.equal(captured, expect)


def test_write_kv_model_shape():
    pool = torch.randn(4097, 2, 16, 8, 128, device="cuda").bfloat16()
    expect = pool.clone()
    slots = torch.randperm(4096 * 16, device="cuda")[:4096] + 16
    k, v = torch.randn(2, 4096, 8, 128, device="cuda").bfloat16()
    pagemesh.kernels.write_kv(k, v, pool, slots)
    write_kv_ref(k, v, expect, slots)
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("hidden", [4096, 8192])
def test_norms_model_shape(hidden):
    x, residual = torch.randn(2, 4096, hidden, device="cuda").bfloat16()
    weight = torch.randn(hidden, device="cuda").bfloat16()
    torch.testing.assert_close(
        pagemesh.kernels.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), atol=1.6e-2, rtol=1.6e-2
    )
    out, new_residual = pagemesh.kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    expect_out, expect_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expect_residual)
    torch.testing.assert_close(out, expect_out, atol=1.6e-2, rtol=1.6e-2)


def test_rotary_model_shape():
    cache = rope_cos_sin_cache(128, 131072, 500000.0, LLAMA3, "cuda")
    positions = torch.randint(0, 131072, (4096,), device="cuda")
    qkv = torch.randn(4096, 48, 128, device="cuda").bfloat16()
    q, k = qkv[:, :32], qkv[:, 32:40]
    q_out, k_out = pagemesh.kernels.rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(k_out, k_ref, atol=1.6e-2, rtol=1.6e-2)


def test_silu_and_mul_model_shape():
    x = torch.randn(4096, 2 * 14336, device="cuda").bfloat16()
    torch.testing.assert_close(pagemesh.kernels.silu_and_mul(x), silu_and_mul_ref(x), atol=1.6e-2, rtol=1.6e-2)
