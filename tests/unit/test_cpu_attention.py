"""The CPU attention path (page gathers + SDPA) against the kernels' torch reference."""

import pytest
import torch

from pagemesh.kernels.reference import paged_attention_ref
from pagemesh.kernels.testing import make_paged_batch
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
