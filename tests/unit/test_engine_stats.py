"""KV utilization as the engine reports it, against its definition page by page."""

import random
from types import SimpleNamespace

from pagemesh.workers.engine.stats import kv_utilization


def by_definition(seqs, page_size):
    filled = {}
    for seq in seqs:
        for i, page in enumerate(seq.block_table):
            used = min(page_size, max(0, seq.num_computed - i * page_size))
            filled[page] = max(used, filled.get(page, -1))
    return sum(filled.values()) / (len(filled) * page_size) if filled else 1.0


def test_matches_the_definition_with_shared_prefixes_partial_and_reserved_pages():
    rng = random.Random(0)
    for trial in range(300):
        page_size = rng.choice([1, 4, 16])
        next_page, seqs = 0, []
        for _ in range(rng.randint(0, 6)):
            parent = rng.choice(seqs) if seqs and rng.random() < 0.5 else None
            shared = parent.block_table[: rng.randint(0, len(parent.block_table))] if parent else []
            own = list(range(next_page, next_page + rng.randint(0, 5)))
            next_page += len(own)
            table = shared + own
            # computed up to anywhere in the table; pages past it are reserved for this step
            computed = rng.randint(len(shared) * page_size - (page_size - 1) if shared else 0, len(table) * page_size)
            seqs.append(SimpleNamespace(block_table=table, num_computed=max(0, computed)))
        assert kv_utilization(seqs, page_size) == by_definition(seqs, page_size), trial


def test_examples():
    seq = SimpleNamespace(block_table=[7, 3, 9], num_computed=20)  # 16 + 4 of 48 slots
    assert kv_utilization([seq], 16) == 20 / 48
    fork = SimpleNamespace(block_table=[7, 3], num_computed=30)  # page 3: 14 slots for the fork
    assert kv_utilization([seq, fork], 16) == (16 + 14) / 48
    assert kv_utilization([], 16) == 1.0
