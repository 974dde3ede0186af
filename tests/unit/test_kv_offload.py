"""The KV offload tier (workers/engine/kv_offload.py) over a small pool tensor, and the block
manager's use of a tier: evicted pages go out under their keys, a prefix that misses the pool
comes back from the tier page by page, the disk tier survives a restart and removes a file that
fails its checks, and the budgets hold."""

from __future__ import annotations

import pytest
import torch

from pagemesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagemesh.common.page_hash import prefix_page_hashes
from pagemesh.services.scheduler.kv_event_index import HeldPages
from pagemesh.workers.engine.block_manager import BlockManager, OutOfPages
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.kv_events import KVEventCollector
from pagemesh.workers.engine.kv_offload import DiskTier, KVOffload, engine_fingerprint

PAGE = 4
SHAPE = (3, 8, 2, PAGE, 2, 4)  # layers, pages, K/V, page size, KV heads, head dim


def pool(dtype=torch.float32) -> torch.Tensor:
    values = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) / 7
    return values.to(dtype)


def disk_of(folder, cache: torch.Tensor, budget: int = 1 << 30) -> DiskTier:
    return DiskTier(folder, budget, cache.dtype, cache[:, 0].shape)


def test_an_evicted_page_comes_back_from_host_memory_into_another_page():
    cache = pool()
    tier = KVOffload(cache, host_bytes=1 << 20)
    original = cache[:, 3].clone()
    tier.offload(11, 3, (1, 2, 3, 4))
    cache[:, 3] = -1  # the page is reused
    assert not tier.load(11, 5, (9, 9, 9, 9))  # other token ids under the key: a miss
    assert tier.load(11, 5, (1, 2, 3, 4))
    assert torch.equal(cache[:, 5], original)
    assert tier.stats.host_hits == 1 and tier.host_pages == 0  # the pool holds it now
    assert not tier.load(11, 6, (1, 2, 3, 4))


def test_a_full_host_tier_spills_its_oldest_pages_to_disk_or_drops_them(tmp_path):
    cache = pool()
    page = cache[:, 0].numel() * cache.element_size()
    dropping = KVOffload(cache, host_bytes=2 * page)
    for key in (1, 2, 3):
        dropping.offload(key, key, (key,) * PAGE)
    assert list(dropping.host) == [2, 3] and dropping.stats.dropped == 1
    spilling = KVOffload(cache, host_bytes=2 * page, disk=disk_of(tmp_path, cache))
    for key in (1, 2, 3):
        spilling.offload(key, key, (key,) * PAGE)
    assert list(spilling.host) == [2, 3] and list(spilling.disk.files) == [1]
    expected = cache[:, 1].clone()
    cache[:, 6] = 0
    assert spilling.load(1, 6, (1,) * PAGE) and torch.equal(cache[:, 6], expected)
    assert spilling.stats.disk_hits == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_disk_tier_survives_a_restart_byte_for_byte(tmp_path, dtype):
    cache = pool(dtype)
    first = KVOffload(cache, host_bytes=0, disk=disk_of(tmp_path, cache))  # no host tier: straight to disk
    first.offload(42, 2, (5, 6, 7, 8))
    expected = cache[:, 2].view(torch.uint8).clone()
    again = pool(dtype)
    again[:, 4].view(torch.uint8).zero_()
    restarted = KVOffload(again, host_bytes=0, disk=disk_of(tmp_path, again))
    assert list(restarted.disk.files) == [42]  # found by scanning the folder
    assert restarted.load(42, 4, (5, 6, 7, 8))
    assert torch.equal(again[:, 4].view(torch.uint8), expected)


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    cache = pool()
    tier = KVOffload(cache, host_bytes=0, disk=disk_of(tmp_path, cache))
    tier.offload(7, 1, (1, 1, 1, 1))
    path = tier.disk.path(7)
    blob = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        blob[-3] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob = bytearray(b"\x05\x00\x00\x00not a page")
    path.write_bytes(bytes(blob))
    before = cache[:, 5].clone()
    assert not tier.load(7, 5, (1, 1, 1, 1))
    assert not path.exists() and tier.stats.rejected == 1 and 7 not in tier.disk.files
    assert torch.equal(cache[:, 5], before)  # nothing written


def test_a_file_of_another_page_layout_or_prefix_is_refused(tmp_path):
    cache = pool()
    tier = KVOffload(cache, host_bytes=0, disk=disk_of(tmp_path, cache))
    tier.offload(9, 1, (1, 2, 3, 4))
    assert not tier.load(9, 5, (1, 2, 3, 5))  # the key's file holds other token ids
    tier.offload(9, 1, (1, 2, 3, 4))
    other = pool(torch.bfloat16)
    reader = KVOffload(other, host_bytes=0, disk=disk_of(tmp_path, other))
    assert not reader.load(9, 5, (1, 2, 3, 4))  # written from an fp32 pool


def test_the_disk_budget_removes_the_least_recently_used_files(tmp_path):
    cache = pool()
    probe = KVOffload(cache, host_bytes=0, disk=disk_of(tmp_path / "probe", cache))
    probe.offload(1, 1, (1,) * PAGE)
    file_bytes = probe.disk.bytes
    tier = KVOffload(cache, host_bytes=0, disk=disk_of(tmp_path / "tier", cache, budget=2 * file_bytes))
    tier.offload(1, 1, (1,) * PAGE)
    tier.offload(2, 2, (2,) * PAGE)
    assert tier.load(1, 5, (1,) * PAGE)  # 1 is now the most recently used
    tier.offload(3, 3, (3,) * PAGE)
    assert set(tier.disk.files) == {1, 3} and not tier.disk.path(2).exists()
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == sorted(
        tier.disk.path(k).name for k in tier.disk.files
    )


def test_a_key_is_forgotten_only_when_no_tier_holds_it(tmp_path):
    cache = pool()
    page = cache[:, 0].numel() * cache.element_size()
    forgotten: list[int] = []
    dropping = KVOffload(cache, host_bytes=page)
    dropping.on_forget = forgotten.append
    assert dropping.offload(1, 1, (1,) * PAGE) and dropping.offload(2, 2, (2,) * PAGE)
    assert forgotten == [1]  # pushed out of host memory with no disk behind it
    assert dropping.load(2, 3, (2,) * PAGE) and forgotten == [1, 2]  # back in the pool: in no tier
    forgotten.clear()
    probe = disk_of(tmp_path / "probe", cache)
    probe.write(1, (1,) * PAGE, cache[:, 1])
    tiered = KVOffload(cache, host_bytes=page, disk=disk_of(tmp_path / "tier", cache, budget=probe.bytes))
    tiered.on_forget = forgotten.append
    tiered.offload(1, 1, (1,) * PAGE)
    tiered.offload(2, 2, (2,) * PAGE)  # 1 spills to disk
    tiered.load(1, 5, (1,) * PAGE)  # 1 back in the pool (its file stays)
    tiered.offload(1, 5, (1,) * PAGE)  # evicted again: host, and 2 spills, pushing 1's file out
    assert forgotten == [] and set(tiered.held_keys()) == {1, 2}
    tiered.clear()
    assert sorted(forgotten) == [1, 2] and tiered.held_keys() == []


def test_the_fingerprint_changes_with_the_model_file_and_the_layout(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    base = engine_fingerprint(model, ("torch.bfloat16", (30, 2, 16, 3, 64)))
    assert engine_fingerprint(model, ("torch.bfloat16", (30, 2, 16, 3, 64))) == base
    assert engine_fingerprint(model, ("torch.float32", (30, 2, 16, 3, 64))) != base
    model.write_bytes(b"other weights")
    assert engine_fingerprint(model, ("torch.bfloat16", (30, 2, 16, 3, 64))) != base


# ---- the block manager with a tier ------------------------------------------------------------
class DictTier:
    """A tier that keeps (key -> token ids) and records the calls, for the block manager's part."""

    def __init__(self, held: dict[int, tuple[int, ...]] | None = None):
        self.held: dict[int, tuple[int, ...]] = dict(held or {})
        self.loaded: list[tuple[int, int]] = []
        self.on_forget = None

    def offload(self, key, page_id, token_ids):
        self.held[key] = token_ids
        return True

    def load(self, key, page_id, token_ids):
        if self.held.get(key) != token_ids:
            return False
        del self.held[key]  # the pool holds it now (as the host tier does)
        self.loaded.append((key, page_id))
        self.on_forget(key)
        return True

    def held_keys(self):
        return list(self.held)

    def drop(self, key):
        del self.held[key]
        self.on_forget(key)

    def clear(self):
        for key in list(self.held):
            self.drop(key)


def run_prompt(bm: BlockManager, prompt: list[int]) -> list[int]:
    """A request's pages: its prefix hits, then new pages, published, then freed; the hits."""
    table = bm.match_prefix(prompt)
    hits = list(table)
    bm.grow(table, len(prompt))
    bm.cache_full_pages(table, prompt, len(hits), len(prompt))
    bm.check_invariants([table])
    bm.free_table(table)
    return hits


def test_a_prefix_evicted_from_the_pool_is_a_hit_again_through_the_tier():
    tier = DictTier()
    bm = BlockManager(num_pages=5, page_size=PAGE)  # 4 usable pages
    bm.attach_offload(tier)
    a = list(range(100, 113))  # 3 full pages and one token
    assert run_prompt(bm, a) == []
    assert run_prompt(bm, list(range(200, 213))) == []  # takes 4 pages: a's 3 evicted, into the tier
    assert len(tier.held) == 3
    hits = run_prompt(bm, a)
    assert len(hits) == 3 and [key for key, _ in tier.loaded] == prefix_page_hashes(a, PAGE)
    assert bm.offload_hits == 3 and bm.prefix_hits == 3
    bm.check_invariants([])


def test_loading_stops_where_the_tier_misses_or_no_page_is_left():
    tier = DictTier()
    bm = BlockManager(num_pages=5, page_size=PAGE)
    bm.attach_offload(tier)
    a = list(range(100, 113))
    run_prompt(bm, a)
    run_prompt(bm, list(range(200, 213)))
    second_key = next(iter(tier.held.keys() - {prefix_page_hashes(a, PAGE)[0]}))
    del tier.held[second_key]  # a hole in the chain: only pages before it can be hits
    held = bm.match_prefix(a)
    assert len(held) == 1
    bm.free_table(held)
    blocker: list[int] = []
    bm.grow(blocker, 4 * PAGE)  # every page in use
    assert bm.match_prefix(a) == []  # the tier holds page 0 but no page is free for it
    with pytest.raises(OutOfPages):
        bm.grow(blocker, 5 * PAGE)
    bm.check_invariants([blocker])


def test_a_reset_clears_the_tier_too():
    tier = DictTier()
    bm = BlockManager(num_pages=5, page_size=PAGE)
    bm.attach_offload(tier)
    run_prompt(bm, list(range(100, 113)))
    run_prompt(bm, list(range(200, 213)))
    assert tier.held and bm.reset_prefix_cache() and not tier.held


def test_the_tiers_keys_are_cpu_events_and_held_until_no_medium_holds_them():
    """What the scheduler's view (HeldPages) makes of the events: a key is held while the pool
    ("GPU") or the tier ("CPU") holds it."""
    tier = DictTier(held={77: (1,) * PAGE})  # a disk tier's file from an earlier life
    bm = BlockManager(num_pages=5, page_size=PAGE)
    bm.attach_offload(tier)
    bm.events = KVEventCollector(PAGE)
    assert bm.cached_keys() == ([], [77])  # what a snapshot lists
    view = HeldPages()
    view.apply([BlockStored([77], None, [], PAGE, None, "CPU")])
    a, b = list(range(100, 113)), list(range(200, 213))
    a_keys, b_keys = prefix_page_hashes(a, PAGE), prefix_page_hashes(b, PAGE)

    def held_now() -> set[int]:
        batch = bm.events.take_batch()
        view.apply(batch.events if batch else [])
        assert set(view) == set(bm.hash_to_page) | set(tier.held)
        return set(view)

    run_prompt(bm, a)
    assert held_now() == {77, *a_keys}
    run_prompt(bm, b)  # 4 usable pages: a's go to the tier, its tail first
    assert bm.events.pending[:6] == [
        BlockStored([a_keys[2]], None, [], PAGE, None, "CPU"),
        BlockRemoved([a_keys[2]], "GPU"),
        BlockStored([a_keys[1]], None, [], PAGE, None, "CPU"),
        BlockRemoved([a_keys[1]], "GPU"),
        BlockStored([a_keys[0]], None, [], PAGE, None, "CPU"),
        BlockRemoved([a_keys[0]], "GPU"),
    ]
    assert held_now() == {77, *a_keys, *b_keys}  # a's keys still held: in the tier
    tier.drop(a_keys[1])
    assert held_now() == {77, a_keys[0], a_keys[2], *b_keys}
    assert run_prompt(bm, a) == [bm.hash_to_page[a_keys[0]]]  # back from the tier as far as it goes
    assert a_keys[0] not in tier.held and a_keys[0] in held_now()  # left the tier for the pool: still held
    tier.drop(77)
    assert 77 not in held_now()
    assert bm.reset_prefix_cache() and bm.events.pending == [AllBlocksCleared()]  # one event, not one a key
    assert held_now() == set()


def test_the_engine_config_refuses_what_the_tier_cannot_serve():
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_offload_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="single-rank"):
        EngineConfig(kv_offload_dir="/tmp/x", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(kv_offload_gb=-1)
    assert EngineConfig(kv_offload_gb=0.5).kv_offload and not EngineConfig().kv_offload
