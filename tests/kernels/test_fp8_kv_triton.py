"""The Triton kernels on an fp8 KV pool (`FP8` flag), against the fp32 reference over the same
pool dequantized: under TRITON_INTERPRET=1 at small shapes on CPU, compiled on a GPU.

Tolerances are those of test_attention.py for the query dtype (fp32 1e-4, bf16 2e-2): the kernel
widens each fp8 value exactly to q's dtype and applies the head's scales in fp32, so it adds no
error of its own beyond the dtype's; fp8's own error (vs the unquantized values) is bounded in
tests/unit/test_fp8_kv.py."""

from __future__ import annotations

import pytest
import torch

from pagemesh.kernels import paged_attention, write_kv
from pagemesh.kernels.reference import paged_attention_ref
from pagemesh.kernels.testing import make_paged_batch, quantize_kv_layer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_reads_fp8_pages_with_each_heads_scales(fmt, dtype, num_splits):
    query_lens, seq_lens = ([1, 1, 1], [9, 33, 16]) if num_splits > 1 else ([1, 1, 7, 5], [9, 33, 7, 29])
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        page_size=8,
        dtype=torch.float32,
        device="cpu",
        seed=5,
        poison=False,
    )
    batch.kv_layer *= torch.tensor([4.0, 0.25])[:, None]  # heads apart, so a wrong head's scale shows
    fp8_layer, scales, dequantized = quantize_kv_layer(batch.kv_layer, FP8[fmt])
    q = batch.q.to(dtype)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale, max(query_lens), max(seq_lens))
    on = {t: t.to(DEVICE) for t in (q, fp8_layer, scales, *args[:3])}
    got = paged_attention(
        on[q],
        on[fp8_layer],
        *(on[t] for t in args[:3]),
        *args[3:],
        num_splits=num_splits,
        kv_scales=on[scales],
    )
    want = paged_attention_ref(q, dequantized, *args)  # fp32 math on the exact dequantized values
    torch.testing.assert_close(got.cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_write_kv_quantizes_with_each_heads_scale(fmt):
    dtype = FP8[fmt]
    gen = torch.Generator().manual_seed(2)
    # fp8 values times power-of-two scales: x / scale is exact, no rounding to disagree on.
    # (Triton 3.9's interpreter drops the carry when fp32 -> fp8 rounding overflows the
    # mantissa: 31.52 -> 16, not 32; compiled kernels convert with the hardware's cvt.)
    scales = torch.tensor([[2.0**-4, 2.0**-10], [2.0**-6, 2.0**-5]])
    k = (torch.randn(3, 2, 16, generator=gen) * 40).to(dtype).float() * scales[0][:, None]
    v = (torch.randn(3, 2, 16, generator=gen) * 40).to(dtype).float() * scales[1][:, None]
    slots = torch.tensor([21, 8, 9])
    pool = torch.zeros(6, 2, 4, 2, 16, dtype=dtype, device=DEVICE)
    write_kv(k.to(DEVICE), v.to(DEVICE), pool, slots.to(DEVICE), kv_scales=scales.to(DEVICE))
    limit = torch.finfo(dtype).max
    for row, slot in enumerate(slots.tolist()):
        for kind, x in ((0, k), (1, v)):
            want = (x[row] / scales[kind][:, None]).clamp(-limit, limit).to(dtype)
            assert torch.equal(pool[slot // 4, kind, slot % 4].cpu().view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="kv_scales"):
        write_kv(k.to(DEVICE), v.to(DEVICE), pool, slots.to(DEVICE))
