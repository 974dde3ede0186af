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


def test_sliding_window_frees_the_pages_behind_it_and_keeps_the_table_shape():
    bm = BlockManager(num_pages=12, page_size=4, enable_prefix_caching=False, window=6)
    table: list[int] = []
    bm.grow(table, 10)
    assert table == [1, 2, 3]
    # the next query (position 10) sees keys 5..10: page 1 (positions 0-3) is behind the window
    assert bm.free_passed(table, num_computed=10, num_cached_pages=0) == 1
    assert table == [0, 2, 3] and list(bm.free)[-1] == 1  # the null page keeps the slot; page 1 is free
    bm.check_invariants([table])
    bm.grow(table, 14)
    assert table == [0, 2, 3, 4]
    assert bm.free_passed(table, 14, 0) == 1  # keys 9.. : positions 4-7 (page 2) passed
    assert table == [0, 0, 3, 4]
    assert bm.free_passed(table, 14, 0) == 0  # nothing more until the window moves a page on
    bm.check_invariants([table])
    assert bm.num_used_pages == 2
    bm.free_table(table)  # the freed entries are not released twice
    assert table == [] and bm.num_free_pages == 11
    bm.check_invariants([])


def test_no_window_frees_nothing():
    bm = BlockManager(num_pages=12, page_size=4, enable_prefix_caching=False)
    table: list[int] = []
    bm.grow(table, 40)
    assert bm.free_passed(table, 40, 0) == 0 and table == list(range(1, 11))


def test_freed_published_pages_stay_exact_prefix_hits_until_evicted():
    bm = BlockManager(num_pages=8, page_size=4, window=5)
    tokens = list(range(100, 116))
    table: list[int] = []
    bm.grow(table, 16)
    assert bm.cache_full_pages(table, tokens, 0, num_computed=16) == 4
    # the next query (16) sees keys 12..: pages 1-3 passed; published, they wait evictable
    assert bm.free_passed(table, 16, num_cached_pages=4) == 3
    assert table == [0, 0, 0, 4] and list(bm.evictable) == [3, 2, 1]  # tail first, as free_table
    bm.check_invariants([table])
    # a prompt with the same 12 first tokens is served the freed pages: their content is intact
    hits = bm.match_prefix(tokens[:12] + [7, 7])
    assert hits == [1, 2, 3]
    bm.check_invariants([table, hits])
    bm.free_table(hits)
    other: list[int] = []
    bm.grow(other, 4 * 4)  # the free pages 5, 6, 7, then the least recently used: 3
    assert other == [5, 6, 7, 3]
    hits = bm.match_prefix(tokens[:12] + [7, 7])
    assert hits == [1, 2]  # page 3's key went with it
    bm.free_table(hits)
    bm.grow(other, 6 * 4)
    assert other == [5, 6, 7, 3, 2, 1]
    assert bm.match_prefix(tokens[:12] + [7, 7]) == []  # the head is gone: no hit at all
    bm.check_invariants([table, other])


def test_a_window_shorter_than_a_page_keeps_the_prefix_chain():
    bm = BlockManager(num_pages=10, page_size=4, window=2)
    tokens = list(range(50, 67))
    table: list[int] = []
    bm.grow(table, 13)
    cached = bm.cache_full_pages(table, tokens, 0, 13)
    assert cached == 3 and bm.free_passed(table, 13, cached) == 2 and table == [0, 0, 3, 4]
    bm.grow(table, 16)
    cached = bm.cache_full_pages(table, tokens, cached, 16)
    assert cached == 4 and bm.free_passed(table, 16, cached) == 1 and table == [0, 0, 0, 4]
    # page 4's key chains on the freed pages' keys: the whole 16-token prefix is one exact hit
    hits = bm.match_prefix(tokens[:16] + [0])
    assert hits == [1, 2, 3, 4]
    bm.check_invariants([table, hits])


def test_fork_keeps_freed_entries_and_invariants_place_them_first():
    bm = BlockManager(num_pages=10, page_size=4, enable_prefix_caching=False, window=4)
    table: list[int] = []
    bm.grow(table, 12)
    bm.free_passed(table, 12, 0)
    child = bm.fork(table)
    assert child == table == [0, 0, 3] and bm.pages[3].ref_count == 2
    bm.check_invariants([table, child])
    with pytest.raises(AssertionError, match="after a live page"):
        bm.check_invariants([[3, 0], child])
    with pytest.raises(AssertionError, match="null page in a live table"):
        BlockManager(num_pages=4, page_size=4).check_invariants([[0]])  # no window: nothing is freed


def test_a_table_with_freed_pages_it_never_published_publishes_nothing():
    """free_passed frees only published pages while prefix caching is on, so the engine never
    makes this table; should one reach cache_full_pages, the null page never enters the cache."""
    bm = BlockManager(num_pages=10, page_size=4, window=4)
    table = [0, 0]
    bm.grow(table, 12)
    assert bm.cache_full_pages(table, list(range(12)), 0, 12) == 0
    assert bm.hash_to_page == {} and bm.pages[0].hash is None
    bm.check_invariants([table])
