"""The CPU attention paths (page gathers + SDPA; the C kernels with a window or a soft-cap) against the
kernels' torch reference."""

import pytest
import torch

import pagemesh.kernels.cpu as cpu_kernels
from pagemesh.kernels.reference import paged_attention_ref
from pagemesh.kernels.testing import free_window_pages, make_paged_batch
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.attention import paged_attention_torch


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("page_size", [8, 16])
def test_mixed_decodes_and_chunks_match_the_reference(heads, kv_heads, page_size):
    # decodes first (as the scheduler orders them), then a fresh prompt and a continuing chunk
    query_lens = [1, 1, 1, 7, 5]
    seq_lens = [9, 33, 16, 7, 29]
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=32,
        page_size=page_size,
        dtype=torch.float32,
        device="cpu",
        seed=3,
        poison=False,
    )
    tables = [row[: -(-n // page_size)].tolist() for row, n in zip(batch.block_tables, seq_lens)]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, torch.device("cpu"), for_cpu=True)
    got = paged_attention_torch(batch.q, batch.kv_layer, md, batch.scale)
    want = paged_attention_ref(
        batch.q,
        batch.kv_layer,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        batch.max_query_len,
        batch.max_seq_len,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3)])
def test_fresh_prompts_read_this_steps_k_v_and_match_the_reference(heads, kv_heads):
    # two decodes, a run of three fresh 6-token prompts (one batched SDPA call), a fresh 4-token
    # prompt, a chunk with earlier context, and a fresh 6 after it (not adjacent to the run)
    page_size = 4
    query_lens = [1, 1, 6, 6, 6, 4, 5, 6]
    seq_lens = [9, 20, 6, 6, 6, 4, 12, 6]
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
        page_size=page_size,
        dtype=torch.float32,
        device="cpu",
        seed=5,
        poison=False,
    )
    tables = [row[: -(-n // page_size)].tolist() for row, n in zip(batch.block_tables, seq_lens)]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, torch.device("cpu"), for_cpu=True)
    # this step's K/V rows, as the projection hands them to the backend: read back from their slots
    k_rows, v_rows = [], []
    for table, q_len, s_len in zip(tables, query_lens, seq_lens):
        for pos in range(s_len - q_len, s_len):
            page, offset = table[pos // page_size], pos % page_size
            k_rows.append(batch.kv_layer[page, 0, offset])
            v_rows.append(batch.kv_layer[page, 1, offset])
    k, v = torch.stack(k_rows), torch.stack(v_rows)
    want = paged_attention_ref(
        batch.q,
        batch.kv_layer,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        batch.max_query_len,
        batch.max_seq_len,
    )
    torch.testing.assert_close(
        paged_attention_torch(batch.q, batch.kv_layer, md, batch.scale, k, v), want, atol=1e-5, rtol=1e-5
    )
    # the rows really come from k and v: with other values there, the fresh prompts' outputs move
    got = paged_attention_torch(batch.q, batch.kv_layer, md, batch.scale, k, v * 2)
    assert not torch.allclose(got[2:24], want[2:24]) and not torch.allclose(got[29:], want[29:])
    torch.testing.assert_close(got[24:29], want[24:29], atol=1e-5, rtol=1e-5)  # the chunk reads its pages


# Sliding windows and soft-capping. A window's freed pages: every page wholly before the first key
# any of a sequence's queries sees points at the null page, and both hold NaN, so a path that
# reads one shows it. (query_lens, seq_lens): decodes before, inside and far past a window of 10,
# a fresh prompt longer than it, a chunk continuing 20 keys, a chunk shorter than the window.
WINDOWED = ([1, 1, 1, 1, 13, 6, 3], [4, 10, 11, 45, 13, 26, 40])


def windowed_batch(heads, kv_heads, page_size, window, dtype=torch.float32, head_dim=32, seed=4):
    """make_paged_batch with the pages a `window` frees pointed at the null page and poisoned."""
    query_lens, seq_lens = WINDOWED
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        device="cpu",
        seed=seed,
    )
    freed = free_window_pages(batch, query_lens, window)
    assert freed >= 4 or window >= max(seq_lens)  # a window frees pages
    return batch


def reference(batch, **variant):
    return paged_attention_ref(*batch.attention_args(), **variant)


@pytest.mark.parametrize("variant", [{"window": 10}, {"softcap": 0.5}, {"window": 10, "softcap": 0.5}])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_torch_path_honours_window_and_softcap(variant, heads, kv_heads):
    page_size = 4
    batch = windowed_batch(heads, kv_heads, page_size, variant.get("window", 10**6))
    query_lens, seq_lens = WINDOWED
    tables = [row[: -(-n // page_size)].tolist() for row, n in zip(batch.block_tables, seq_lens)]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, torch.device("cpu"), for_cpu=True)
    # the decodes' gather reads whole pages, masked: the engine's pool is finite there (zeros)
    batch.kv_layer.nan_to_num_(0.0)
    rows = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    slots = batch.block_tables[seq, rows // page_size].long(), rows % page_size
    k, v = batch.kv_layer[slots[0], 0, slots[1]], batch.kv_layer[slots[0], 1, slots[1]]
    want = reference(batch, **variant)
    got = paged_attention_torch(batch.q, batch.kv_layer, md, batch.scale, k, v, **variant)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if "window" in variant:  # the window changes what the long sequences see
        assert not torch.allclose(want[3], reference(batch)[3])


@pytest.mark.skipif(not cpu_kernels.available(), reason="C kernels did not build")
@pytest.mark.parametrize("variant", [{"window": 10}, {"softcap": 0.5}, {"window": 7, "softcap": 2.0}])
@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim", [(torch.float32, 6, 2, 32), (torch.bfloat16, 8, 2, 64)])
def test_c_kernel_honours_window_and_softcap(variant, dtype, heads, kv_heads, head_dim):
    batch = windowed_batch(heads, kv_heads, 4, variant.get("window", 10**6), dtype=dtype, head_dim=head_dim)
    got = cpu_kernels.paged_attention(
        batch.q, batch.kv_layer, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale, **variant
    )
    assert not got.isnan().any(), "the kernel read a page before the window"
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, reference(batch, **variant), atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_kernels.available(), reason="C kernels did not build")
def test_c_kernel_fp8_pool_honours_window_and_softcap():
    from pagemesh.kernels.testing import quantize_kv_layer

    batch = windowed_batch(8, 2, 4, 10, dtype=torch.bfloat16, head_dim=64)
    fp8, scales, exact = quantize_kv_layer(batch.kv_layer, torch.float8_e4m3fn)
    variant = {"window": 10, "softcap": 1.0}
    got = cpu_kernels.paged_attention(
        batch.q, fp8, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale, scales, **variant
    )
    want = paged_attention_ref(batch.q, exact.to(torch.bfloat16), *batch.attention_args()[2:], **variant)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
