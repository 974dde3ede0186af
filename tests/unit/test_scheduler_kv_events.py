"""The scheduler's prefix index fed by the workers' KV cache events: a worker's block manager and
its KVEventFeed (workers/engine/kv_event_feed.py) on one side, the scheduler core on the other,
the messages carried by hand (no sockets, no clock). Snapshots, gaps, registrations, unreadable
payloads, and keys held in the pool ("GPU") or the offload tier ("CPU")."""

from __future__ import annotations

import pytest

from pagemesh.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from pagemesh.common.messages import KVEventBatch, KVEventsResync
from pagemesh.common.page_hash import prefix_page_hashes
from pagemesh.services.scheduler.prefix_index import PromptPages
from pagemesh.tests.scheduler_harness import PAGE, T0, new_core, register
from pagemesh.tests.unit.test_kv_offload import DictTier
from pagemesh.workers.engine import kv_event_feed
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.kv_event_feed import KVEventFeed

A = list(range(100, 100 + 3 * PAGE + 1))  # 3 full pages and one token
B = list(range(500, 500 + 3 * PAGE + 1))


class KeysTier(DictTier):
    """An offload tier holding keys only (the block manager's part of a tier): nothing loads back."""

    def __init__(self, keys=()):
        super().__init__({key: () for key in keys})

    def load(self, key, page_id, token_ids):
        return False


def cache(bm: BlockManager, tokens: list[int]) -> None:
    """A computed prompt's full pages published, then its table freed (the pages stay cached)."""
    table: list[int] = []
    bm.grow(table, len(tokens))
    bm.cache_full_pages(table, tokens, 0, len(tokens))
    bm.free_table(table)


class Mesh:
    """One worker ("w0": a block manager and its feed) registered with a scheduler core."""

    def __init__(self, num_pages: int = 20, tier: KeysTier | None = None):
        self.core = new_core()
        register(self.core, "w0")
        self.bm = BlockManager(num_pages=num_pages, page_size=PAGE)
        if tier is not None:
            self.bm.attach_offload(tier)
        self.feed = KVEventFeed("w0", self.bm)

    def take(self) -> list[KVEventBatch]:
        return self.feed.take()[1]

    def deliver(self, messages: list[KVEventBatch]) -> list:
        out = []
        for msg in messages:
            out += self.core.handle(b"w0", msg, T0)
        return out

    def step(self) -> list:
        """The worker's between_steps: its messages, delivered; what the scheduler answers."""
        return self.deliver(self.take())

    @property
    def view(self) -> set[int]:
        return set(self.core.registry.workers["w0"].page_hashes)

    def truth(self) -> set[int]:
        pool, tier = self.bm.cached_keys()
        return {*pool, *tier}


def test_the_scheduler_holds_what_the_worker_holds_and_places_by_it():
    mesh = Mesh(num_pages=8)  # 7 usable pages: the second prompt evicts part of the first
    [snapshot] = mesh.take()  # the first registration's: nothing held yet
    assert (snapshot.seq, decode_batch(snapshot.payload).events) == (0, [AllBlocksCleared()])
    assert mesh.deliver([snapshot]) == []
    cache(mesh.bm, A)
    [batch] = mesh.take()
    assert batch.seq == 1
    assert decode_batch(batch.payload).events == [
        BlockStored(prefix_page_hashes(A, PAGE), None, A[:12], PAGE, None, "GPU")
    ]
    assert mesh.deliver([batch]) == [] and mesh.view == set(prefix_page_hashes(A, PAGE))
    info = mesh.core.registry.workers["w0"]
    assert PromptPages(A[:8] + [7] * 9).cached_pages(info) == 2
    cache(mesh.bm, B)
    cache(mesh.bm, B + B)  # evicts
    assert mesh.step() == [] and mesh.view == mesh.truth() and mesh.feed.next_seq == 3
    assert mesh.step() == [] and mesh.feed.next_seq == 3  # nothing changed: nothing sent


def test_the_pub_socket_and_the_scheduler_get_the_same_bytes():
    mesh = Mesh()
    mesh.step()
    cache(mesh.bm, A)
    payload, [msg] = mesh.feed.take()
    assert msg.payload == payload and decode_batch(payload).events[0].medium == "GPU"
    payload, snapshot = mesh.feed.take()
    assert (payload, snapshot) == (None, [])


def test_a_gap_drops_the_keys_asks_once_and_the_snapshot_restores_them():
    mesh = Mesh()
    mesh.step()
    cache(mesh.bm, A)
    mesh.step()
    cache(mesh.bm, B)
    mesh.take()  # lost on the way (seq 2)
    mesh.bm.reset_prefix_cache()
    cache(mesh.bm, B)
    assert mesh.step() == [("w0", KVEventsResync(worker_id="w0"))]  # seq 3 after 1
    assert mesh.view == set()  # placed as holding nothing, never on keys it may have lost
    cache(mesh.bm, A)
    assert mesh.step() == []  # seq 4: ignored, not asked again
    assert mesh.view == set() and mesh.core.kv_events.resyncs == 1
    mesh.feed.resync()  # what the LLM worker does with the KVEventsResync
    assert mesh.step() == [] and mesh.view == mesh.truth() == set(
        prefix_page_hashes(A, PAGE) + prefix_page_hashes(B, PAGE)
    )
    cache(mesh.bm, A + B)
    assert mesh.step() == [] and mesh.view == mesh.truth()  # numbered on from the snapshot


def test_an_unreadable_payload_is_dropped_and_resyncs_without_harm():
    mesh = Mesh()
    mesh.step()
    cache(mesh.bm, A)
    mesh.step()
    bad = KVEventBatch(worker_id="w0", seq=2, payload=b"\xc1 not msgpack")
    assert mesh.deliver([bad]) == [("w0", KVEventsResync(worker_id="w0"))]
    assert mesh.core.kv_events.malformed == 1 and mesh.view == set()
    wrong = encode_batch(EventBatch(1.0, [BlockStored([-1], None, [], PAGE, None, "GPU")]))  # a negative hash
    assert mesh.deliver([KVEventBatch(worker_id="w0", seq=0, payload=wrong)]) == [
        ("w0", KVEventsResync(worker_id="w0"))
    ]
    assert mesh.core.kv_events.malformed == 2
    status = mesh.core.status(T0)  # what the gateway's /metrics exports
    assert (status.kv_event_batches, status.kv_event_malformed, status.kv_event_resyncs) == (2, 2, 2)
    mesh.feed.resync()
    assert mesh.step() == [] and mesh.view == mesh.truth() == set(prefix_page_hashes(A, PAGE))


def test_a_registration_drops_the_keys_until_the_snapshot_that_follows_it():
    mesh = Mesh()
    mesh.step()
    cache(mesh.bm, A)
    mesh.step()
    assert mesh.view
    register(mesh.core, "w0")  # the same process again (a scheduler that had dropped it)
    assert mesh.view == set()
    cache(mesh.bm, B)
    assert mesh.step() == []  # sent before the worker learnt of it: ignored, no resync asked
    assert mesh.view == set()
    mesh.feed.resync()  # LLMWorker.registered_again
    assert mesh.step() == [] and mesh.view == mesh.truth()


def test_a_batch_from_a_worker_the_scheduler_does_not_know_is_ignored():
    mesh = Mesh()
    msg = mesh.take()[0]
    stranger = KVEventBatch(worker_id="ghost", seq=msg.seq, payload=msg.payload)
    assert mesh.deliver([stranger]) == [] and "ghost" not in mesh.core.registry.workers


def test_the_tiers_keys_found_at_start_open_the_first_published_batch_once():
    mesh = Mesh(tier=KeysTier(keys=[71, 72]))  # a disk tier's files from an earlier life
    cache(mesh.bm, A)
    payload, _ = mesh.feed.take()  # the first step: what a router on the PUB socket sees
    found, *stored = decode_batch(payload).events
    assert (found.block_hashes, found.medium, found.token_ids) == ([71, 72], "CPU", [])
    assert [e.medium for e in stored] == ["GPU"] * len(stored) and stored
    assert mesh.feed.take() == (None, [])  # announced once
    quiet = Mesh(tier=KeysTier(keys=[71]))
    assert decode_batch(quiet.feed.take()[0]).events[0].block_hashes == [71]  # with no event of its own too
    assert Mesh().feed.take()[0] is None  # no tier: nothing to announce


def test_a_key_in_the_tier_or_the_pool_is_held_until_no_medium_holds_it():
    tier = KeysTier(keys=[77])  # a disk tier's file from an earlier life
    mesh = Mesh(num_pages=5, tier=tier)  # 4 usable pages
    assert mesh.step() == [] and mesh.view == {77}  # the snapshot lists the tier's keys
    a_keys = prefix_page_hashes(A, PAGE)
    cache(mesh.bm, A)
    cache(mesh.bm, B)  # A's pages go to the tier ("CPU"), B's take the pool ("GPU")
    mesh.step()
    pages = mesh.core.registry.workers["w0"].page_hashes
    assert pages.by_medium == {"GPU": set(prefix_page_hashes(B, PAGE)), "CPU": {77, *a_keys}}
    assert PromptPages(A).cached_pages(mesh.core.registry.workers["w0"]) == 3  # loadable: counts as held
    tier.drop(a_keys[0])
    mesh.step()
    assert a_keys[0] not in mesh.view and a_keys[1] in mesh.view
    assert PromptPages(A).cached_pages(mesh.core.registry.workers["w0"]) == 0  # the chain's head is gone


def test_the_same_key_in_two_media_leaves_the_held_set_with_the_last():
    mesh = Mesh()
    mesh.step()

    def send(*events) -> None:
        msg = KVEventBatch(worker_id="w0", seq=mesh.feed.next_seq, payload=encode_batch(EventBatch(1.0, list(events))))
        mesh.feed.next_seq += 1
        assert mesh.deliver([msg]) == []

    send(BlockStored([5, 6], None, [], PAGE, None, "GPU"), BlockStored([5], None, [], PAGE, None, "CPU"))
    send(BlockRemoved([5, 6], "GPU"))
    assert mesh.view == {5}
    send(BlockRemoved([5], "GPU"))  # not there: nothing changes
    assert mesh.view == {5}
    send(BlockRemoved([5], "CPU"))
    assert mesh.view == set()
    send(
        BlockStored([1], None, [], PAGE, None, "CPU"), BlockStored([2], None, [], PAGE, None, "GPU"), AllBlocksCleared()
    )
    assert mesh.view == set()


def test_a_snapshot_comes_in_bounded_messages_numbered_from_zero(monkeypatch):
    monkeypatch.setattr(kv_event_feed, "SNAPSHOT_KEYS", 2)
    tier = KeysTier(keys=[71, 72, 73])
    mesh = Mesh(tier=tier)
    cache(mesh.bm, A)  # 3 keys in the pool
    messages = mesh.take()
    assert [m.seq for m in messages] == [0, 1, 2, 3]
    a_keys = prefix_page_hashes(A, PAGE)
    assert [decode_batch(m.payload).events for m in messages] == [
        [AllBlocksCleared(), BlockStored(a_keys[:2], None, [], PAGE, None, "GPU")],
        [BlockStored(a_keys[2:], None, [], PAGE, None, "GPU")],
        [BlockStored([71, 72], None, [], PAGE, None, "CPU")],
        [BlockStored([73], None, [], PAGE, None, "CPU")],
    ]
    assert mesh.deliver(messages) == [] and mesh.view == {*a_keys, 71, 72, 73}


def test_a_step_over_the_size_limit_goes_to_the_scheduler_as_a_snapshot(monkeypatch):
    mesh = Mesh()
    mesh.step()
    monkeypatch.setattr(kv_event_feed, "MAX_KV_EVENT_BYTES", 40)  # A's stored event is over it
    cache(mesh.bm, A)
    payload, messages = mesh.feed.take()
    assert decode_batch(payload).events[0].token_ids == A[:12]  # published whole
    assert [m.seq for m in messages] == [0]
    assert decode_batch(messages[0].payload).events == [  # keys only
        AllBlocksCleared(),
        BlockStored(prefix_page_hashes(A, PAGE), None, [], PAGE, None, "GPU"),
    ]
    assert mesh.deliver(messages) == [] and mesh.view == set(prefix_page_hashes(A, PAGE))


@pytest.mark.parametrize("legacy", [False, True])
def test_the_scheduler_reads_either_layout(legacy):
    mesh = Mesh()
    mesh.feed.legacy_array_events = legacy  # what --kv-events-config's legacy_array_events sets
    mesh.step()
    cache(mesh.bm, A)
    assert mesh.step() == [] and mesh.view == set(prefix_page_hashes(A, PAGE))
