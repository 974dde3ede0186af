"""Block manager: exact page ids, sharing, prefix cache and eviction order."""

import pytest

from pagemesh.workers.engine.block_manager import BlockManager, OutOfPages


def test_pages_are_allocated_on_demand_and_reused_after_free():
    bm = BlockManager(num_pages=5, page_size=4)
    table: list[int] = []
    bm.grow(table, 1)
    assert table == [1]
    bm.grow(table, 4)
    assert table == [1]  # still fits in one page
    bm.grow(table, 5)
    assert table == [1, 2]
    bm.check_invariants([table])
    bm.free_table(table)
    assert table == [] and bm.num_free_pages == 4
    other: list[int] = []
    bm.grow(other, 16)
    assert sorted(other) == [1, 2, 3, 4]  # freed pages come back
    with pytest.raises(OutOfPages):
        bm.grow(other, 17)
    bm.check_invariants([other])


def test_fork_shares_pages_and_copy_on_write_moves_the_writer():
    bm = BlockManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    parent: list[int] = []
    bm.grow(parent, 6)  # pages [1, 2], the second half full
    child = bm.fork(parent)
    assert child == parent == [1, 2]
    assert bm.pages[1].ref_count == 2 and bm.pages[2].ref_count == 2
    bm.check_invariants([parent, child])
    copy = bm.ensure_writable(child, 6)  # position 6 lives in page index 1 (shared)
    assert copy == (2, 3)
    assert child == [1, 3] and parent == [1, 2]
    assert bm.pages[2].ref_count == 1 and bm.pages[3].ref_count == 1
    assert bm.ensure_writable(parent, 6) is None  # now private: write in place
    bm.check_invariants([parent, child])
    bm.free_table(child)
    bm.free_table(parent)
    bm.check_invariants([])
    assert bm.num_free_pages == 7


def test_prefix_cache_hits_full_pages_and_leaves_one_token_to_compute():
    bm = BlockManager(num_pages=10, page_size=4)
    tokens = list(range(100, 110))  # 10 tokens: 2 full pages + 2
    table: list[int] = []
    bm.grow(table, len(tokens))
    assert bm.cache_full_pages(table, tokens, 0, num_computed=10) == 2
    bm.free_table(table)
    bm.check_invariants([])
    # same prefix, different tail: both full pages hit, in order
    hits = bm.match_prefix(tokens[:8] + [7, 7])
    assert hits == [1, 2]
    bm.check_invariants([hits])
    bm.free_table(hits)
    # exactly 8 tokens: only the first page may be reused (the last token must be computed)
    assert bm.match_prefix(tokens[:8]) == [1]
    # a different first page breaks the chain even if the second page's tokens match
    assert bm.match_prefix([0, 0, 0, 0] + tokens[4:]) == []


def test_unreferenced_cached_pages_are_evicted_lru_after_free_pages():
    bm = BlockManager(num_pages=4, page_size=2)  # usable pages 1, 2, 3
    a, b = [], []
    bm.grow(a, 2)
    bm.cache_full_pages(a, [1, 2], 0, 2)
    bm.grow(b, 2)
    bm.cache_full_pages(b, [3, 4], 0, 2)
    assert (a, b) == ([1], [2])
    bm.free_table(a)  # page 1 becomes evictable first
    bm.free_table(b)  # then page 2
    assert list(bm.evictable) == [1, 2]
    c: list[int] = []
    bm.grow(c, 2)
    assert c == [3]  # a never-cached free page goes first
    bm.grow(c, 4)
    assert c == [3, 1]  # then the least recently used cached page
    assert bm.match_prefix([1, 2, 9]) == []  # its hash is gone
    assert bm.match_prefix([3, 4, 9]) == [2]  # the other survives
    bm.check_invariants([c, [2]])


def test_check_invariants_catches_a_wrong_reference_count():
    bm = BlockManager(num_pages=4, page_size=2)
    table: list[int] = []
    bm.grow(table, 2)
    bm.pages[table[0]].ref_count = 2
    with pytest.raises(AssertionError):
        bm.check_invariants([table])
