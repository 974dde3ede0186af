"""The CPU attention path (page gathers + SDPA) against the kernels' torch reference."""

import pytest
import torch

from kernels.reference import paged_attention_ref
from kernels.testing import make_paged_batch
from workers.engine.attention import AttentionMetadata, paged_attention_torch


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("page_size", [8, 16])
def test_mixed_decodes_and_chunks_match_the_reference(heads, kv_heads, page_size):
    # decodes first (as the scheduler orders them), then a fresh prompt and a continuing chunk
    query_lens = [1, 1, 1, 7, 5]
    seq_lens = [9, 33, 16, 7, 29]
    batch = make_paged_batch(query_lens, seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=32, page_size=page_size,
                             dtype=torch.float32, device="cpu", seed=3, poison=False)
    tables = [row[: -(-n // page_size)].tolist() for row, n in zip(batch.block_tables, seq_lens)]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, torch.device("cpu"), for_cpu=True)
    got = paged_attention_torch(batch.q, batch.kv_layer, md, batch.scale)
    want = paged_attention_ref(batch.q, batch.kv_layer, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                               batch.scale, batch.max_query_len, batch.max_seq_len)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
