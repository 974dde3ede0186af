"""AttentionMetadata.build (numpy index arithmetic) against the per-token definition."""

import random

import pytest
import torch

from pagemesh.workers.attention.metadata import AttentionMetadata


def random_batch(rng, page_size):
    num_decodes, num_prefills = rng.randint(0, 5), rng.randint(0, 4)
    query_lens = [1] * num_decodes + [rng.randint(1, 40) for _ in range(num_prefills)]
    if not query_lens:
        query_lens = [1]
    seq_lens = [q + rng.randint(0, 70) for q in query_lens]  # fresh prompts and chunks with context
    counts = [-(-s // page_size) + rng.randint(0, 1) for s in seq_lens]  # some hold a page reserved ahead
    pages = rng.sample(range(1, 5000), sum(counts))
    tables = [pages[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    return query_lens, seq_lens, tables


@pytest.mark.parametrize("page_size", [1, 16])
def test_positions_slots_and_tables_match_the_definition(page_size):
    rng = random.Random(page_size)
    for _ in range(200):
        query_lens, seq_lens, tables = random_batch(rng, page_size)
        md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, torch.device("cpu"), for_cpu=True)
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        slots = [
            t[p // page_size] * page_size + p % page_size
            for q, s, t in zip(query_lens, seq_lens, tables)
            for p in range(s - q, s)
        ]
        assert md.positions.tolist() == positions and md.positions.dtype == torch.int64
        assert md.slot_mapping.tolist() == slots and md.slot_mapping.dtype == torch.int64
        starts = [sum(query_lens[:i]) for i in range(len(query_lens) + 1)]
        assert md.query_start_loc.tolist() == starts and md.query_start_loc.dtype == torch.int32
        assert md.seq_lens.tolist() == seq_lens and md.seq_lens.dtype == torch.int32
        width = max(map(len, tables))
        assert md.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        assert md.block_tables.dtype == torch.int32
        assert md.num_decodes == next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        assert (md.max_query_len, md.max_seq_len) == (max(query_lens), max(seq_lens))
        assert len(md.prefills) == len(query_lens) - md.num_decodes
        for p, s in zip(md.prefills, range(md.num_decodes, len(query_lens))):
            assert (p.query_start, p.query_len) == (starts[s], query_lens[s])
            assert p.key_index.tolist() == [
                tables[s][i // page_size] * 2 * page_size + i % page_size for i in range(seq_lens[s])
            ]
