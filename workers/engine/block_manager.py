"""Paged KV memory bookkeeping: which page holds what, who shares it, what may be evicted.

Pure Python (no torch): the model runner owns the tensors, this owns the page ids.

    page ids:   0 | 1 2 3 ... num_pages-1
                ^ null page: padding in block tables, never handed out

    a page is in exactly one of three places:
      free        unreferenced, holds nothing reusable         (deque, FIFO)
      evictable   unreferenced, holds a full hashed prefix page (LRU, oldest first)
      in use      ref_count >= 1                                (shared when > 1)

Prefix cache: a full page is keyed by a hash chained over the parent page's hash and its own
token ids, so equal keys mean equal whole prefixes; a hit also compares the token ids. The key
is stable across processes (blake2b, not Python's `hash`), so the mesh scheduler computes the
same keys from a prompt (`pagemesh.common.page_hash.prefix_page_hashes`) and knows which worker holds which prefix: the
manager reports each key it publishes, evicts or clears to `events` (workers/engine/kv_events.py),
and `cached_keys` lists every key held (a snapshot for a scheduler that starts over).
Copy-on-write: `fork` shares every page of a block table; the first write into a shared page
makes the writer move to a private copy (`ensure_writable` returns the copy to perform).

Sliding windows: with `window` W (a model whose every layer slides: the widest window), a
sequence's next query, at position p, sees keys from p - W + 1 on; `free_passed` hands back the
pages wholly before that while the sequence runs. The table keeps its length for the kernels:
a freed entry becomes the null page, which no window lets a kernel read, and freed entries
only ever lead a table:

    block table   [ 0, 0, 0, 9, 4, 11 ]      freed (the null page) | the pages the window still sees

With prefix caching only published pages are freed, and never the last published one (the next
page's key chains on its hash), which a window shorter than a page would otherwise pass.
A freed page that is published keeps its content and its key (evictable, as after a finish), so a
later prompt's prefix hit on it is exact; once evicted, its key is gone and the chain of keys after
it is unreachable (a hit is always a run of pages from the first).

Offload tier (`offload`, --kv-offload-gb / --kv-offload-dir): a published page taken for reuse is
first handed to the tier (its content copied out, under its key), and `match_prefix` goes on past
the pool's last hit with the tier's pages, each copied into a page taken here and published again:

    pool   k0 k1 .. ──miss k2──▶ tier.load(k2 → new page) ──▶ k3 ... until the tier misses too
    evict  k5's page ──▶ tier.offload(k5, its page) ──▶ the page is reused

The tier copies at once, before the page's new holder can write it (workers/engine/kv_offload.py).
A key the tier keeps is reported stored in the tier ("CPU" events) as it leaves the pool ("GPU"):
the worker can serve it without computing it, so the scheduler may place the prefix's requests
here; it is reported removed from the tier once no tier holds it (`OffloadTier.on_forget`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagemesh.common.kv_events import MEDIUM_CPU
from pagemesh.common.page_hash import chain_hash

if TYPE_CHECKING:
    from pagemesh.workers.engine.kv_events import KVEventCollector

NULL_PAGE = 0


class OffloadTier(Protocol):
    """Where evicted prefix pages go and come back from (workers/engine/kv_offload.py)."""

    on_forget: Callable[[int], None] | None  # called with each key the tier stops holding

    def offload(self, key: int, page_id: int, token_ids: tuple[int, ...]) -> bool:
        """Copy page `page_id`'s content out under `key` now: the page is reused right after.
        False: the tier did not keep it."""

    def load(self, key: int, page_id: int, token_ids: tuple[int, ...]) -> bool:
        """Copy `key`'s page (if held, and holding `token_ids`) into page `page_id`; False: not held."""

    def held_keys(self) -> Iterable[int]:
        """Every key the tier holds."""

    def persist(self, pages: Iterable[tuple[int, int, tuple[int, ...]]]) -> None:
        """Write what can outlive the process (pages in host memory, and these pool pages: key,
        page id, token ids) to the tier's disk, if it has one."""

    def clear(self) -> None:
        """Forget every page held."""


class OutOfPages(RuntimeError):
    """No free or evictable page is left."""


@dataclass
class Page:
    page_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class BlockManager:
    """Allocates, shares, caches and frees fixed-size KV pages."""

    num_pages: int
    page_size: int
    enable_prefix_caching: bool = True
    window: int | None = None  # keys a query sees (its position's included); None: all of them
    events: KVEventCollector | None = None  # KV cache events (the scheduler's and --kv-events-config's)
    offload: OffloadTier | None = None  # where evicted prefix pages go (--kv-offload-gb, --kv-offload-dir)
    pages: list[Page] = field(init=False)
    free: deque[int] = field(init=False)
    evictable: OrderedDict[int, None] = field(init=False)
    hash_to_page: dict[int, int] = field(init=False)
    prefix_hits: int = field(default=0, init=False)
    prefix_queries: int = field(default=0, init=False)
    offload_hits: int = field(default=0, init=False)  # of prefix_hits: pages loaded back from the tier

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError("num_pages: need at least 2 (page 0 is the null page)")
        self.pages = [Page(i) for i in range(self.num_pages)]
        self.free = deque(range(1, self.num_pages))
        self.evictable = OrderedDict()
        self.hash_to_page = {}

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now (free + evictable)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    def pages_needed(self, block_table: Sequence[int], num_tokens: int) -> int:
        """New pages a table needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(block_table))

    # ---- allocation -----------------------------------------------------------------------
    def _take_page(self) -> int:
        if self.free:
            page_id = self.free.popleft()
        elif self.evictable:
            page_id, _ = self.evictable.popitem(last=False)
            page = self.pages[page_id]
            if self.hash_to_page.get(page.hash) == page_id:
                kept = self.offload is not None and self.offload.offload(page.hash, page_id, page.token_ids)
                del self.hash_to_page[page.hash]
                if self.events is not None:  # a key a tier keeps is still this worker's to load
                    if kept:
                        self.events.offloaded(page.hash)
                    self.events.removed(page.hash)
            page.hash = None
            page.token_ids = None
        else:
            raise OutOfPages("KV cache is full")
        self.pages[page_id].ref_count = 1
        return page_id

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages to `block_table` (in place) so it holds `num_tokens` tokens."""
        needed = self.pages_needed(block_table, num_tokens)
        if needed > self.num_free_pages:
            raise OutOfPages(f"need {needed} pages, {self.num_free_pages} free")
        for _ in range(needed):
            block_table.append(self._take_page())

    def _acquire(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            self.evictable.pop(page_id, None)
        page.ref_count += 1

    def _release(self, page_id: int) -> None:
        page = self.pages[page_id]
        page.ref_count -= 1
        if page.ref_count > 0:
            return
        if page.hash is not None and self.hash_to_page.get(page.hash) == page_id:
            self.evictable[page_id] = None  # most recently used at the end
        else:
            page.hash = None
            page.token_ids = None
            self.free.append(page_id)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Shrink `block_table` (in place) to the pages holding its first `num_tokens` tokens,
        dropping one reference to each page past them (speculative decoding's rollback of
        rejected drafts: a page only they reached falls free; a shared page stays with its
        other holders)."""
        keep = -(-num_tokens // self.page_size)
        for page_id in reversed(block_table[keep:]):
            self._release(page_id)
        del block_table[keep:]

    def free_table(self, block_table: list[int]) -> None:
        """Drop one reference to every page of a table (in reverse, so a prefix's tail is
        evicted before its head) and empty the table."""
        for page_id in reversed(block_table):
            if page_id != NULL_PAGE:  # freed by free_passed
                self._release(page_id)
        block_table.clear()

    def free_passed(self, block_table: list[int], num_computed: int, num_cached_pages: int) -> int:
        """With a `window`: drop the table's references to the pages wholly before the first key
        position `num_computed` sees (num_computed - window + 1), setting their entries to the null
        page; returns how many were freed. With prefix caching, only published pages go, and
        never the last published one (`cache_full_pages` chains the next key on its hash)."""
        if self.window is None:
            return 0
        end = min(max(0, num_computed - self.window + 1) // self.page_size, len(block_table))
        if self.enable_prefix_caching:
            end = min(end, num_cached_pages - 1)
        freed = 0
        for i in range(end - 1, -1, -1):  # back to the previous call's last freed entry
            if block_table[i] == NULL_PAGE:
                break
            self._release(block_table[i])
            block_table[i] = NULL_PAGE
            freed += 1
        return freed

    # ---- sharing --------------------------------------------------------------------------
    def fork(self, block_table: Sequence[int]) -> list[int]:
        """A new table sharing every page of `block_table` (copy-on-write; freed entries stay
        freed)."""
        for page_id in block_table:
            if page_id != NULL_PAGE:
                self._acquire(page_id)
        return list(block_table)

    def ensure_writable(self, block_table: list[int], position: int) -> tuple[int, int] | None:
        """Before writing the token at `position`: if its page is shared, move this table to a
        private copy and return (src_page, dst_page) for the runner to copy; else None."""
        index = position // self.page_size
        page_id = block_table[index]
        if self.pages[page_id].ref_count == 1:
            return None
        new_id = self._take_page()
        self._release(page_id)
        block_table[index] = new_id
        return page_id, new_id

    # ---- prefix cache ---------------------------------------------------------------------
    def attach_offload(self, tier: OffloadTier) -> None:
        """Evicted prefix pages go to `tier` from now on, and are reported stored there ("CPU")
        until it forgets them. The keys it holds already (a disk tier's files) are in `cached_keys`."""
        self.offload = tier
        tier.on_forget = self._tier_forgot

    def published_pages(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(key, page id, token ids) of every page in the prefix cache, least recently used first
        (evictable pages, then those in use)."""
        order = [*self.evictable, *(p for p in self.hash_to_page.values() if self.pages[p].ref_count)]
        return [(self.pages[p].hash, p, self.pages[p].token_ids) for p in order if self.pages[p].hash is not None]

    def cached_keys(self) -> tuple[list[int], list[int]]:
        """Every key held: (in the pool, in the offload tier); a key may be in both."""
        return list(self.hash_to_page), [] if self.offload is None else list(self.offload.held_keys())

    def _tier_forgot(self, key: int) -> None:
        if self.events is not None:
            self.events.removed(key, MEDIUM_CPU)

    def match_prefix(self, token_ids: Sequence[int], root: int | None = None) -> list[int]:
        """Cached pages holding the longest prefix of `token_ids` made of full pages, leaving at
        least one token uncached (its logits are needed). Takes a reference on each hit. `root`:
        the first page's parent key (a LoRA adapter's: `pagemesh.common.page_hash.root_hash`)."""
        if not self.enable_prefix_caching:
            return []
        max_pages = (len(token_ids) - 1) // self.page_size
        hits: list[int] = []
        parent: int | None = root
        self.prefix_queries += max_pages
        for i in range(max_pages):
            chunk = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            key = chain_hash(parent, chunk)
            page_id = self.hash_to_page.get(key)
            if page_id is None and self.offload is not None:
                page_id = self._load_offloaded(key, chunk, parent if i else None, root)  # referenced
                if page_id is None:
                    break
            elif page_id is None or self.pages[page_id].token_ids != chunk:
                break
            else:  # at once: loading a later page from the tier may take an evictable page
                self._acquire(page_id)
            hits.append(page_id)
            parent = key
        self.prefix_hits += len(hits)
        return hits

    def _load_offloaded(self, key: int, chunk: tuple[int, ...], parent: int | None, root: int | None) -> int | None:
        """A page taken from the pool, filled with the tier's copy of `key` and published; None
        when the tier does not hold it or no page is left (nothing changes then)."""
        if not self.free and not self.evictable:
            return None
        page_id = self._take_page()
        if not self.offload.load(key, page_id, chunk):
            self._release(page_id)  # unhashed: back to the free list
            return None
        page = self.pages[page_id]
        page.hash, page.token_ids = key, chunk
        self.hash_to_page[key] = page_id
        if self.events is not None:
            self.events.stored(key, parent, chunk, root)
        self.offload_hits += 1
        return page_id

    def cache_full_pages(
        self,
        block_table: Sequence[int],
        token_ids: Sequence[int],
        num_cached_pages: int,
        num_computed: int,
        root: int | None = None,
    ) -> int:
        """Publish pages that became full (all `num_computed` tokens written) to the prefix cache.
        `num_cached_pages` pages at the front are already published; returns the new count.
        `root`: as match_prefix's."""
        if not self.enable_prefix_caching:
            return num_cached_pages
        full = min(num_computed // self.page_size, len(block_table))
        parent = self.pages[block_table[num_cached_pages - 1]].hash if num_cached_pages else root
        for i in range(num_cached_pages, full):
            if block_table[i] == NULL_PAGE:  # freed unpublished: no key can chain past it
                return i
            chunk = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            key = chain_hash(parent, chunk)
            page = self.pages[block_table[i]]
            if key not in self.hash_to_page:
                self.hash_to_page[key] = page.page_id
                if self.events is not None:  # a first page's parent is the root: none for the events
                    self.events.stored(key, parent if i else None, chunk, root)
            if page.hash is None:
                page.hash, page.token_ids = key, chunk
            parent = key
        return max(full, num_cached_pages)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page's key (as vLLM's reset_prefix_cache): only while no page is
        in use (a running sequence chains its next keys on its pages'); False then, else True."""
        if self.num_used_pages:
            return False
        for page_id in self.evictable:
            self.pages[page_id].hash = self.pages[page_id].token_ids = None
            self.free.append(page_id)
        self.evictable.clear()
        self.hash_to_page.clear()
        if self.offload is not None:
            self.offload.clear()
        if self.events is not None:  # after the tier's own removals, which it makes moot
            self.events.cleared()
        return True

    # ---- checks ---------------------------------------------------------------------------
    def check_invariants(self, live_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. With `live_tables`, also
        check that reference counts equal the number of tables holding each page."""
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free), "a page is twice in the free list"
        assert not (free & evictable), "a page is both free and evictable"
        assert NULL_PAGE not in free and NULL_PAGE not in evictable, "null page in a pool"
        for page in self.pages[1:]:
            in_pool = page.page_id in free or page.page_id in evictable
            assert (page.ref_count == 0) == in_pool, f"page {page.page_id}: ref {page.ref_count}, pooled {in_pool}"
            assert page.ref_count >= 0
            if page.page_id in free:
                assert page.hash is None, f"free page {page.page_id} still hashed"
            if page.page_id in evictable:
                assert self.hash_to_page.get(page.hash) == page.page_id, f"evictable page {page.page_id} unreachable"
        for key, page_id in self.hash_to_page.items():
            assert self.pages[page_id].hash == key, f"hash map points at page {page_id} with another hash"
        if live_tables is not None:
            counts: dict[int, int] = {}
            for table in live_tables:
                freed = next((i for i, page_id in enumerate(table) if page_id != NULL_PAGE), len(table))
                assert freed == 0 or self.window is not None, "null page in a live table"
                for page_id in table[freed:]:
                    assert page_id != NULL_PAGE, "null page in a live table after a live page"
                    counts[page_id] = counts.get(page_id, 0) + 1
            for page in self.pages[1:]:
                assert page.ref_count == counts.get(page.page_id, 0), (
                    f"page {page.page_id}: ref {page.ref_count} but {counts.get(page.page_id, 0)} tables"
                )
