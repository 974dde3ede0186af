"""paged_attention (Triton) against paged_attention_ref, and the reference against dense SDPA.

Shapes are small so the CPU interpreter stays fast; tests/gpu repeats the checks at model sizes.
Tolerances (output magnitudes are O(1)): fp32 atol=rtol=1e-4; fp16 atol=rtol=3e-3 (a few fp16
ulps: P is rounded to fp16 before P@V); bf16 atol=rtol=2e-2 (a few bf16 ulps). The pool is
poisoned with NaN outside the live context, so a read past the context shows up as NaN.

Under the interpreter, bf16 operands are upcast to fp32 before `tl.dot` (the interpreter
multiplies bf16 bit patterns, triton#11584), so the bf16 tensor-core path itself is exercised
only when this suite runs on a GPU (scripts/gpu_check.sh).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import pagemesh.kernels
from pagemesh.kernels.attention import AttentionConfig, choose_config, choose_num_splits
from pagemesh.kernels.reference import paged_attention_ref, write_kv_ref
from pagemesh.kernels.testing import free_window_pages, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (query_lens, seq_lens): decode of a 1-token context, decode mid-page, fresh prefill, a chunk
# continuing 41 keys of earlier context, decode ending exactly on a page boundary, a chunk that
# crosses several tiles and ends mid-page, a decode and a chunk whose first query sits one and
# two keys before a 64-key tile boundary (where the unmasked/masked tile split is decided).
MIXED = ([1, 1, 20, 9, 1, 17, 1, 12], [1, 37, 20, 50, 64, 83, 63, 74])
# Decodes plus short speculative-style queries: all fit one query block per sequence.
DECODES = ([1, 3, 1, 2, 1, 1], [1, 15, 16, 17, 130, 63])


def run_and_compare(batch, dtype, **kwargs):
    out = pagemesh.kernels.paged_attention(*batch.attention_args(), **kwargs)
    ref = paged_attention_ref(*batch.attention_args())
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "kernel read a slot outside the live context"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def build(lens, group, page_size, dtype=torch.float16, head_dim=64, num_kv_heads=2, **kwargs):
    return make_paged_batch(
        *lens,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        device=DEVICE,
        **kwargs,
    )


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_matches_reference(group, page_size, num_splits):
    batch = build(MIXED, group, page_size, seed=group * 100 + page_size)
    run_and_compare(batch, torch.float16, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_batch_matches_reference(group, num_splits):
    batch = build(DECODES, group, 16, seed=group)
    assert choose_config(batch.max_query_len, group, torch.float16).block_m == 16
    run_and_compare(batch, torch.float16, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dtypes(dtype, num_splits):
    run_and_compare(build(MIXED, 4, 16, dtype=dtype, seed=7), dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_head_dim_128(num_splits):
    batch = build(MIXED, 4, 32, head_dim=128, num_kv_heads=1, seed=3)
    run_and_compare(batch, torch.float16, num_splits=num_splits)


@pytest.mark.parametrize(
    "config, page_size",
    [
        (AttentionConfig(block_m=32, tile_n=16, num_warps=4, num_stages=1), 32),  # tiles < page
        (AttentionConfig(block_m=16, tile_n=128, num_warps=4, num_stages=1), 16),  # tile > seq
        (AttentionConfig(block_m=128, tile_n=32, num_warps=4, num_stages=1), 16),
    ],
)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tile_shapes(config, page_size, num_splits):
    batch = build(MIXED, 4, page_size, seed=11)
    run_and_compare(batch, torch.float16, config=config, num_splits=num_splits)


def test_sequences_without_new_tokens_are_skipped():
    # Idle sequences (q_len 0) between busy ones, in the multi-block (prefill) path.
    batch = build(([0, 5, 0, 1, 0, 18], [3, 21, 8, 40, 16, 18]), 3, 16, seed=5)
    run_and_compare(batch, torch.float16, num_splits=1)
    run_and_compare(batch, torch.float16, num_splits=2)


def test_more_splits_than_tiles():
    # 8 splits over contexts of 1..2 tiles: most splits are empty and must weigh nothing.
    batch = build(([1, 4, 1], [1, 70, 9]), 4, 16, seed=9)
    run_and_compare(batch, torch.float16, num_splits=8)


def test_empty_batch():
    batch = build(([1], [5]), 2, 16)
    q = batch.q[:0]
    out = pagemesh.kernels.paged_attention(
        q, batch.kv_layer, batch.block_tables[:0], batch.seq_lens[:0], batch.query_start_loc[:1], batch.scale, 0, 0
    )
    assert out.shape == (0, 4, 64)


def _huge_pool_batch(lens, group):
    # kv_layer[num_pages, 2, 16, 1, 64] fp16 has a page stride of 2048 elements; with more than
    # 2**21 pages the pages in use sit past element 2**32. An int32 offset would wrap to a low,
    # never-written page (zeros) instead of crashing, so the comparison catches it. The pool is
    # ~8.6 GB of address space, but only the pages in use and the null page are touched (lazy
    # mmap on CPU; a real allocation on a GPU).
    num_pages = 2**21 + 64
    try:
        return build(lens, group, 16, num_kv_heads=1, num_pages=num_pages, pages_at_end=True)
    except (RuntimeError, MemoryError) as err:  # no overcommit on this machine
        pytest.skip(f"cannot map an 8.6 GB pool: {err}")


@pytest.mark.parametrize("num_splits", [1, 2])
def test_page_offsets_past_int32(num_splits):
    batch = _huge_pool_batch(([1, 6, 1], [19, 22, 40]), 2)
    last_page = int(batch.block_tables.max())
    assert last_page * batch.kv_layer.stride(0) > 2**32
    run_and_compare(batch, torch.float16, num_splits=num_splits)


def test_choose_num_splits():
    # One sequence at 32k on a 132-SM GPU: 64 splits of 512 keys.
    assert choose_num_splits(1, 8, 32768, 132) == 64
    # 32 x 8 = 256 programs < 4 per SM: round 528/256 -> 3 down to 2.
    assert choose_num_splits(32, 8, 4096, 132) == 2
    # Enough programs already, or contexts too short to split.
    assert choose_num_splits(256, 8, 32768, 132) == 1
    assert choose_num_splits(1, 8, 300, 132) == 1
    assert choose_num_splits(1, 8, 1024, 132) == 4


def test_reference_matches_dense_sdpa():
    # The reference reads pages; check it against SDPA on the same K/V kept contiguous, with the
    # pages filled through write_kv_ref (independent of make_paged_batch's layout code).
    torch.manual_seed(0)
    query_lens, seq_lens = [3, 1, 12], [10, 33, 12]
    heads, kv_heads, dim, page = 6, 2, 32, 8
    pages_needed = [math.ceil(s / page) for s in seq_lens]
    perm = torch.randperm(sum(pages_needed)) + 1
    pool = torch.full((sum(pages_needed) + 1, 2, page, kv_heads, dim), float("nan"))
    tables = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
    dense = []
    for s, n in enumerate(pages_needed):
        tables[s, :n] = perm[sum(pages_needed[:s]) : sum(pages_needed[:s]) + n]
        k, v = torch.randn(2, seq_lens[s], kv_heads, dim)
        pos = torch.arange(seq_lens[s])
        slots = tables[s, pos // page].long() * page + pos % page
        write_kv_ref(k, v, pool, slots)
        dense.append((k, v))
    q = torch.randn(sum(query_lens), heads, dim)
    starts = torch.tensor([0, 3, 4, 16], dtype=torch.int32)
    out = paged_attention_ref(q, pool, tables, torch.tensor(seq_lens, dtype=torch.int32), starts, dim**-0.5, 12, 33)
    for s, (k, v) in enumerate(dense):
        qs = q[starts[s] : starts[s + 1]].transpose(0, 1)  # [H, q, D]
        kk = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vv = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        q_len, seq_len = query_lens[s], seq_lens[s]
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        expect = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expect, atol=1e-5, rtol=1e-5)


# Sliding windows and soft-capping (constexpr SLIDING / SOFTCAP). The pages a window leaves
# behind are freed as the engine frees them (NaN, their table entries on the NaN null page), so a
# kernel that visits a tile before the window shows it. (query_lens, seq_lens): decodes before,
# at and far past the window, a fresh prompt longer than it, chunks continuing earlier context
# that cross tile and page boundaries.
WINDOWED = ([1, 1, 1, 1, 40, 9, 17, 1], [5, 24, 25, 150, 40, 50, 83, 63])


def run_windowed(lens, group, page_size, dtype=torch.float16, window=None, softcap=None, **kwargs):
    batch = build(lens, group, page_size, dtype=dtype, seed=group * 10 + page_size)
    if window is not None:
        assert free_window_pages(batch, lens[0], window) > 0
    out = pagemesh.kernels.paged_attention(*batch.attention_args(), window=window, softcap=softcap, **kwargs)
    ref = paged_attention_ref(*batch.attention_args(), window=window, softcap=softcap)
    assert not out.isnan().any(), "kernel read a page before the window"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window, page_size", [(24, 16), (7, 16), (33, 32)])
def test_sliding_window_matches_reference(window, page_size, num_splits):
    run_windowed(WINDOWED, 2, page_size, window=window, num_splits=num_splits)


@pytest.mark.parametrize("softcap", [0.3, 5.0])
def test_softcap_matches_reference(softcap):
    run_windowed(MIXED, 3, 16, softcap=softcap, num_splits=2)


def test_window_and_softcap_together_fp32_and_small_tiles():
    config = AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)
    run_windowed(WINDOWED, 4, 16, dtype=torch.float32, window=20, softcap=1.5, config=config, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_decode_batch(num_splits):
    # one query block per sequence (the decode launch), split-KV over the window's tiles only
    run_windowed(([1, 3, 1, 2, 1, 1], [1, 40, 16, 17, 130, 63]), 4, 16, window=16, num_splits=num_splits)
