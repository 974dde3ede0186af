"""write_kv (Triton) against write_kv_ref: the whole pool must come out bit-identical."""

import pytest
import torch

import pagemesh.kernels
from pagemesh.kernels.reference import write_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(num_pages, page_size, kv_heads, dim, dtype, gen):
    return torch.randn((num_pages, 2, page_size, kv_heads, dim), generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size, kv_heads, dim", [(16, 2, 64), (32, 3, 128), (8, 1, 64)])
def test_write_kv_matches_reference(page_size, kv_heads, dim, dtype):
    gen = torch.Generator().manual_seed(page_size + kv_heads)
    num_pages, num_tokens = 12, 40
    pool = _pool(num_pages, page_size, kv_heads, dim, dtype, gen)
    expect = pool.clone()
    # Distinct random slots anywhere but the null page; two padding tokens (slot -1) skipped.
    slots = torch.randperm((num_pages - 1) * page_size, generator=gen)[:num_tokens] + page_size
    slots[[5, 17]] = -1
    slots = slots.to(DEVICE)
    # k and v as strided views of a fused qkv projection output, like the model produces.
    qkv = torch.randn((num_tokens, 4 + 2 * kv_heads, dim), generator=gen).to(DEVICE, dtype)
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    pagemesh.kernels.write_kv(k, v, pool, slots)
    write_kv_ref(k, v, expect, slots)
    assert torch.equal(pool, expect)
    assert not torch.equal(
        pool, _pool(num_pages, page_size, kv_heads, dim, dtype, torch.Generator().manual_seed(page_size + kv_heads))
    )


def test_write_kv_past_int32_offsets():
    # Slots whose element offset exceeds 2**32 in an ~8.6 GB pool (lazily mapped on CPU; only
    # the written pages are touched). An int32 offset would land in page 1..3 instead.
    page_size, dim = 16, 64
    num_pages = 2**21 + 8
    try:
        pool = torch.empty((num_pages, 2, page_size, 1, dim), dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as err:
        pytest.skip(f"cannot map an 8.6 GB pool: {err}")
    low_pages = pool[:8]
    low_pages.zero_()
    pages = torch.tensor([num_pages - 1, num_pages - 3, num_pages - 6], device=DEVICE)
    slots = pages * page_size + torch.tensor([0, 7, 15], device=DEVICE)
    assert int(slots.min()) // page_size * pool.stride(0) > 2**32
    k, v = torch.randn(2, 3, 1, dim, device=DEVICE).half()
    pagemesh.kernels.write_kv(k, v, pool, slots)
    torch.testing.assert_close(pool[pages, 0, slots % page_size], k, atol=0, rtol=0)
    torch.testing.assert_close(pool[pages, 1, slots % page_size], v, atol=0, rtol=0)
    assert not low_pages.any(), "an offset wrapped around into the low pages"
