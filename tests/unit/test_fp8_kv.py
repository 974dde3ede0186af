"""An fp8 KV pool (workers/engine/kv_quant.py): the write quantizes, attention dequantizes.

Two checks per kernel, at small shapes:
- exact: attention over the fp8 pool equals the fp32 reference over the same pool dequantized
  (fp32 rounding only, 1e-5): the kernel reads the right bytes with the right head's scale;
- quantization error: against the fp32 reference over the values before quantization, within a
  bound derived from fp8's rounding, not tuned. Round-to-nearest moves a value x by at most
  u*|x| + s*t (u = 2^-4 for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2; t = half the smallest
  subnormal, 2^-10 / 2^-17; s = the head's scale). A score q.k*c then moves by at most
  m = c * sum_d |q_d| (u|k_d| + s t), so each softmax weight by a factor within e^(+-2m), and the
  output by at most (e^(2m) - 1) * max|v'| + max|v' - v| (v' the dequantized V).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagemesh.kernels.reference import paged_attention_ref
from pagemesh.kernels.testing import make_paged_batch, quantize_kv_layer
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.attention import paged_attention_torch, write_kv_fp8_torch
from pagemesh.workers.engine.kv_quant import quantize, scales_from_amax

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ROUNDING = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}
QUERY_LENS = [1, 1, 1, 7, 5]  # three decodes, a fresh prompt (read from its pages), a chunk after context
SEQ_LENS = [9, 33, 16, 7, 29]


def fp8_batch(dtype: torch.dtype, heads: int, kv_heads: int, page_size: int = 8):
    batch = make_paged_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=32,
        page_size=page_size,
        dtype=torch.float32,
        device="cpu",
        seed=7,
        poison=False,
    )
    # heads of different magnitudes, as in a real model, so a wrong head's scale shows
    batch.kv_layer *= torch.tensor([4.0, 0.25, 1.0, 9.0][:kv_heads])[:, None]
    batch.kv_layer[:, 1] *= 0.3
    fp8_layer, scales, dequantized = quantize_kv_layer(batch.kv_layer, dtype)
    return batch, fp8_layer, scales, dequantized


def reference(batch, kv_layer: torch.Tensor) -> torch.Tensor:
    return paged_attention_ref(
        batch.q,
        kv_layer,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        batch.max_query_len,
        batch.max_seq_len,
    )


def error_bound(batch, original: torch.Tensor, dequantized: torch.Tensor, scales, dtype) -> torch.Tensor:
    """[T, H, 1] bound on |attention(fp8 pool) - attention(original)| (module docstring)."""
    u, t = ROUNDING[dtype]
    page_size, kv_heads, _ = original.shape[2:]
    group = batch.q.shape[1] // kv_heads
    bounds = torch.zeros(batch.q.shape[0], batch.q.shape[1], 1)
    starts = batch.query_start_loc.tolist()
    for s, n in enumerate(batch.seq_lens.tolist()):
        pages = batch.block_tables[s, : math.ceil(n / page_size)].long()
        k = original[pages, 0].reshape(-1, kv_heads, original.shape[-1])[:n]
        v_deq = dequantized[pages, 1].reshape(-1, kv_heads, original.shape[-1])[:n]
        v = original[pages, 1].reshape(-1, kv_heads, original.shape[-1])[:n]
        dk = u * k.abs() + scales[0][None, :, None] * t  # [n, KVH, D]
        q = batch.q[starts[s] : starts[s + 1]].abs()  # [q, H, D]
        m = batch.scale * torch.einsum("qhd,khd->qhk", q, dk.repeat_interleave(group, 1)).amax(-1)  # [q, H]
        v_max = v_deq.abs().amax(dim=(0, 2)).repeat_interleave(group)  # [H]
        v_err = (v_deq - v).abs().amax(dim=(0, 2)).repeat_interleave(group)
        bounds[starts[s] : starts[s + 1], :, 0] = torch.expm1(2 * m) * v_max + v_err
    return bounds + 1e-5


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_torch_path_reads_fp8_pages_exactly_and_within_the_rounding_bound(fmt, heads, kv_heads):
    dtype = FP8[fmt]
    batch, fp8_layer, scales, dequantized = fp8_batch(dtype, heads, kv_heads)
    tables = [row[: -(-n // 8)].tolist() for row, n in zip(batch.block_tables, SEQ_LENS)]
    md = AttentionMetadata.build(QUERY_LENS, SEQ_LENS, tables, 8, torch.device("cpu"), for_cpu=True)
    got = paged_attention_torch(batch.q, fp8_layer, md, batch.scale, kv_scales=scales)
    torch.testing.assert_close(got, reference(batch, dequantized), atol=1e-5, rtol=1e-5)
    error = (got - reference(batch, batch.kv_layer)).abs()
    bound = error_bound(batch, batch.kv_layer, dequantized, scales, dtype)
    assert (error <= bound).all(), f"max error {error.max():.4g}, its bound {bound.flatten()[error.argmax()]:.4g}"
    # the bound is not vacuous: fp8 really moved the output, by less than the bound allows
    assert 0 < error.max() and (error.amax(-1, keepdim=True) < bound).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_write_quantizes_each_head_with_its_scale_into_its_slot(fmt):
    dtype = FP8[fmt]
    pool = torch.zeros(6, 2, 4, 2, 8, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 2, 8, generator=gen) * torch.tensor([3.0, 0.1])[:, None]
    v = torch.randn(3, 2, 8, generator=gen)
    scales = torch.tensor([[0.5, 0.01], [0.02, 0.03]])
    md = AttentionMetadata.build([1, 2], [3, 6], [[5], [2, 4]], 4, torch.device("cpu"), for_cpu=True)
    write_kv_fp8_torch(k, v, pool, md, scales)
    raw = pool.view(torch.uint8)
    want_k, want_v = quantize(k, scales[0], dtype), quantize(v, scales[1], dtype)
    for row, (page, slot) in enumerate([(5, 2), (4, 0), (4, 1)]):
        assert torch.equal(raw[page, 0, slot], want_k[row].view(torch.uint8))
        assert torch.equal(raw[page, 1, slot], want_v[row].view(torch.uint8))
    written = want_k.view(torch.uint8).count_nonzero() + want_v.view(torch.uint8).count_nonzero()
    assert int(raw.count_nonzero()) == int(written)  # nothing else in the pool changed
    # saturation, not overflow to NaN/inf: a value 10x past the range stores fp8's largest
    big = quantize(torch.full((1, 2, 8), 10 * torch.finfo(dtype).max), torch.ones(2), dtype)
    assert torch.equal(big.float(), torch.full((1, 2, 8), torch.finfo(dtype).max))


def test_calibrated_scales_map_each_heads_amax_below_the_fp8_maximum():
    amax = torch.tensor([[[8.0, 0.0]], [[1.0, 2.0]]]).view(1, 2, 2)
    scales = scales_from_amax(amax, torch.float8_e4m3fn)
    assert torch.equal(scales, torch.tensor([[[8.0 / 112, 1.0], [1.0 / 112, 2.0 / 112]]]))


def c_kernels():
    import pagemesh.kernels.cpu as ck

    if not ck.available():
        pytest.skip(f"C kernels did not build: {ck.load_error()}")
    return ck


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    # (the AVX2 item's V passes: group 1, 3, 8 at 64 and 2, 4, 5 at 128 cover whole and partial last passes)
    [(4, 4, 32), (9, 3, 64), (8, 2, 128), (6, 3, 24), (2, 2, 64), (16, 2, 64), (4, 2, 128), (10, 2, 128)],
)
def test_c_kernel_reads_fp8_pages_exactly_and_within_the_rounding_bound(fmt, heads, kv_heads, head_dim):
    ck, dtype = c_kernels(), FP8[fmt]
    batch = make_paged_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=8,
        dtype=torch.float32,
        device="cpu",
        seed=11,
        poison=False,
    )
    batch.kv_layer *= torch.tensor([4.0, 0.25, 1.0, 9.0][:kv_heads])[:, None]
    fp8_layer, scales, dequantized = quantize_kv_layer(batch.kv_layer, dtype)
    got = ck.paged_attention(
        batch.q, fp8_layer, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale, kv_scales=scales
    )
    # fp32 sums in another order and the kernels' polynomial exp, on scores up to 9x those of
    # test_cpu_kernels (heads scaled): 1e-4, still two orders below fp8's own error here
    torch.testing.assert_close(got, reference(batch, dequantized), atol=1e-4, rtol=1e-4)
    error = (got - reference(batch, batch.kv_layer)).abs()
    assert (error <= error_bound(batch, batch.kv_layer, dequantized, scales, dtype)).all()
    # bf16 queries and output: the same, rounded once at the end
    got16 = ck.paged_attention(
        batch.q.bfloat16(),
        fp8_layer,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        kv_scales=scales,
    )
    want16 = paged_attention_ref(batch.q.bfloat16(), dequantized, *batch.attention_args()[2:])
    torch.testing.assert_close(got16, want16, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 128), (12, 2, 64)])
@pytest.mark.parametrize("page_size", [16, 32])
def test_c_kernel_bf16_path_over_full_and_partial_16_key_passes(fmt, heads, kv_heads, head_dim, page_size):
    """bf16 queries take the fp8 -> bf16 table path (16 keys per pass, a group's V sums in
    registers; a group of 6 x 64 is its largest): pages of 16 and 32 keys, full and cut passes."""
    ck, dtype = c_kernels(), FP8[fmt]
    batch = make_paged_batch(
        [1, 1, 6, 1],
        [40, 16, 70, 97],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=torch.float32,
        device="cpu",
        seed=13,
        poison=False,
    )
    batch.kv_layer *= torch.tensor([3.0, 0.5, 2.0])[:kv_heads, None]
    fp8_layer, scales, dequantized = quantize_kv_layer(batch.kv_layer, dtype)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)
    got = ck.paged_attention(batch.q.bfloat16(), fp8_layer, *args, kv_scales=scales)
    want = paged_attention_ref(batch.q.bfloat16().float(), dequantized, *batch.attention_args()[2:])
    # the same sums as the fp32 path but over bf16 queries, rounded to bf16 once at the end
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    wide = ck.paged_attention(batch.q.bfloat16().float(), fp8_layer, *args, kv_scales=scales)  # the generic path
    torch.testing.assert_close(got.float(), wide, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_c_write_kv_stores_the_same_bytes_as_the_torch_path(fmt):
    ck, dtype = c_kernels(), FP8[fmt]
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(3, 2, 8, generator=gen).bfloat16(), torch.randn(3, 2, 8, generator=gen).bfloat16()
    scales = torch.tensor([[0.5, 0.01], [0.02, 0.03]])
    md = AttentionMetadata.build([1, 2], [3, 6], [[5], [2, 4]], 4, torch.device("cpu"), for_cpu=True)
    torch_pool, c_pool = torch.zeros(6, 2, 4, 2, 8, dtype=dtype), torch.zeros(6, 2, 4, 2, 8, dtype=dtype)
    write_kv_fp8_torch(k, v, torch_pool, md, scales)
    ck.write_kv(k, v, c_pool, md.slot_mapping, kv_scales=scales)
    assert torch.equal(torch_pool.view(torch.uint8), c_pool.view(torch.uint8))
    assert torch_pool.view(torch.uint8).count_nonzero() > 0
    with pytest.raises(ValueError, match="kv_scales"):
        ck.write_kv(k, v, c_pool, md.slot_mapping)


def test_config_takes_vllms_names_with_or_without_parallel_ranks():
    from pagemesh.workers.engine.config import EngineConfig

    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    # each rank calibrates its heads (tests/integration/test_parallel_quantized.py)
    config = EngineConfig(kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert config.kv_cache_dtype == "fp8_e4m3"
