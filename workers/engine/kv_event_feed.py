"""A worker's KV cache events for the mesh scheduler, once per step, on its reliable channel.

    block manager ──▶ KVEventCollector ──take() once per step──▶ the step's EventBatch, encoded once
        ├──▶ KVEventBatch(seq n, payload) ──▶ scheduler (the worker's DEALER: ordered, not dropped)
        └──▶ the same payload ──▶ PUB socket, with --kv-events-config (workers/llm/kv_events_publisher.py)

The scheduler's view of the keys is rebuilt from a snapshot: seq 0 opens one, an AllBlocksCleared
followed by key-only BlockStored events of every key held ("GPU": the pool, "CPU": the offload
tier), in messages of at most SNAPSHOT_KEYS keys, numbered on from 0. The step's own events are
then not sent to the scheduler (the snapshot holds their outcome), only published. A snapshot is
due after every registration (the first one: a disk tier's keys found at start; again: a
restarted scheduler knows nothing), when the scheduler asks (KVEventsResync: it saw a gap in
the numbers, or a payload it could not read) and in place of a step's payload over
MAX_KV_EVENT_BYTES. A snapshot goes to the scheduler only: a router on the PUB socket follows
the steps' batches (and its replay socket), as vLLM's do. The one exception: the keys an offload
tier held before the first step (a disk tier found at start) open the first published batch, as
key-only "CPU" BlockStored events, so that a router knows them without a snapshot.

Pure logic: no torch, no sockets (the LLM worker and the simulator's worker send what `take`
returns).
"""

from __future__ import annotations

import time

from pagemesh.common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    encode_batch,
)
from pagemesh.common.messages import MAX_KV_EVENT_BYTES, KVEventBatch
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.kv_events import KVEventCollector

SNAPSHOT_KEYS = 1 << 16  # keys per snapshot message: at most 9 bytes each in msgpack, ~0.6 MiB


class KVEventFeed:
    """Collects `blocks`' events (it sets `blocks.events`) and hands them out once per step."""

    def __init__(self, worker_id: str, blocks: BlockManager, legacy_array_events: bool = False):
        self.worker_id, self.blocks, self.legacy_array_events = worker_id, blocks, legacy_array_events
        self.collector = blocks.events = KVEventCollector(blocks.page_size)
        self.next_seq = 0
        self.snapshot_due = True  # the first registration's
        self.announce_tier = True  # the first published batch opens with the tier's keys found at start

    def resync(self) -> None:
        """The scheduler's view is lost (it registered this worker again, or asked): the next
        `take` sends a snapshot."""
        self.snapshot_due = True

    def take(self) -> tuple[bytes | None, list[KVEventBatch]]:
        """The step's events encoded once (for the PUB socket; None: none happened), and the
        messages for the scheduler, in order (none when nothing changed)."""
        batch = self.collector.take_batch()
        if self.announce_tier:
            self.announce_tier = False
            batch = self._with_tier_keys(batch)
        payload = None if batch is None else encode_batch(batch, legacy_array_events=self.legacy_array_events)
        if payload is not None and len(payload) > MAX_KV_EVENT_BYTES:
            self.snapshot_due = True  # a step of millions of tokens loaded at once: keys only
        if self.snapshot_due:
            self.snapshot_due = False
            return payload, self._snapshot()
        return payload, [] if payload is None else [self._message(payload)]

    def _message(self, payload: bytes) -> KVEventBatch:
        msg = KVEventBatch(worker_id=self.worker_id, seq=self.next_seq, payload=payload)
        self.next_seq += 1
        return msg

    def _with_tier_keys(self, batch: EventBatch | None) -> EventBatch | None:
        _, tier = self.blocks.cached_keys()
        if not tier:
            return batch
        found = self._key_only(tier, MEDIUM_CPU)
        if batch is None:
            return EventBatch(time.time(), found)
        return EventBatch(batch.ts, [*found, *batch.events], batch.data_parallel_rank)

    def _snapshot(self) -> list[KVEventBatch]:
        self.next_seq = 0
        pool, tier = self.blocks.cached_keys()
        chunks: list[list[KVCacheEvent]] = [[AllBlocksCleared()]]
        for stored in [*self._key_only(pool, MEDIUM_GPU), *self._key_only(tier, MEDIUM_CPU)]:
            if len(chunks) == 1 and len(chunks[0]) == 1:  # the first keys go with the AllBlocksCleared
                chunks[0].append(stored)
            else:
                chunks.append([stored])
        return [self._message(encode_batch(EventBatch(time.time(), events))) for events in chunks]

    def _key_only(self, keys: list[int], medium: str) -> list[BlockStored]:
        """Key-only BlockStored events of `keys` in `medium`, SNAPSHOT_KEYS keys each."""
        size = self.blocks.page_size
        return [
            BlockStored(keys[i : i + SNAPSHOT_KEYS], None, [], size, None, medium)
            for i in range(0, len(keys), SNAPSHOT_KEYS)
        ]
