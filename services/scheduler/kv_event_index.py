"""Which prefix-cache keys each LLM worker holds, as its KV cache events say (the prefix index's
input: services/scheduler/prefix_index.py). Pure: no sockets, no clock.

    KVEventBatch(seq, payload) ──decode_batch──▶ BlockStored      keys into the event's medium
    (vLLM's EventBatch: pagemesh.common.kv_events)  BlockRemoved     keys out of the event's medium
                                                    AllBlocksCleared every key out of every medium
    HeldPages   "GPU" {k0, k1, k2}   "CPU" {k2, k7}    ──▶  held: k0 k1 k2 k7 (a key in any medium)

The worker sends the same events it publishes with --kv-events-config, on its reliable scheduler
socket, numbered (workers/engine/kv_event_feed.py). Sequence numbers keep the view exact:

- seq 0 opens a snapshot (AllBlocksCleared, then every key the worker holds): the view restarts
  from it. The worker sends one after each registration and when asked.
- A batch applies when its seq follows the last one applied.
- Anything else is a gap: so is a payload that does not decode (logged, at a bounded rate). The
  worker's keys are dropped (it is placed as if it held none, never on keys it may have lost),
  it is asked once for a snapshot (KVEventsResync), and its batches are ignored until seq 0.
- A registration (RegisterWorker; the same process again too) drops the keys and waits for seq 0
  likewise, without asking: the worker sends a snapshot after registering (Registry.register).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagemesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, MalformedEvents
from pagemesh.common.kv_events import decode_batch as decode_events
from pagemesh.common.log_limit import LogLimiter
from pagemesh.common.messages import KVEventBatch, KVEventsResync

MALFORMED_LOG_BURST = 5  # unreadable batches logged per interval (each one still resyncs its worker)
MALFORMED_LOG_INTERVAL_S = 60.0


@dataclass
class HeldPages:
    """One worker's prefix-cache keys by medium; `key in pages` when any medium holds it.
    `last_seq`: the last batch applied (None: it waits for a snapshot, seq 0)."""

    by_medium: dict[str | None, set[int]] = field(default_factory=dict)
    media_holding: dict[int, int] = field(default_factory=dict)  # key -> how many media hold it
    last_seq: int | None = None

    def __contains__(self, key: int) -> bool:
        return key in self.media_holding

    def __bool__(self) -> bool:
        return bool(self.media_holding)

    def __iter__(self):
        return iter(self.media_holding)

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self._remove(event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.by_medium.clear()
                self.media_holding.clear()

    def start_over(self) -> None:
        """Forget every key, and wait for a snapshot."""
        self.apply([AllBlocksCleared()])
        self.last_seq = None

    def _store(self, keys: list[int], medium: str | None) -> None:
        held = self.by_medium.setdefault(medium, set())
        for key in keys:
            if key not in held:
                held.add(key)
                self.media_holding[key] = self.media_holding.get(key, 0) + 1

    def _remove(self, keys: list[int], medium: str | None) -> None:
        held = self.by_medium.get(medium, set())
        for key in keys:
            if key in held:
                held.discard(key)
                if self.media_holding[key] == 1:
                    del self.media_holding[key]
                else:
                    self.media_holding[key] -= 1


class KVEventIndex:
    """Applies the workers' KVEventBatch messages to the registry's `WorkerInfo.page_hashes`;
    `receive` is the scheduler core's handler (it appends a KVEventsResync to `out` on a gap)."""

    def __init__(self, registry, log):
        self.registry, self.log = registry, log
        self.log_limit = LogLimiter(MALFORMED_LOG_BURST, MALFORMED_LOG_INTERVAL_S)
        self.applied = 0  # batches applied, ever
        self.malformed = 0  # unreadable batches, ever
        self.resyncs = 0  # snapshots asked for, ever

    def counts(self) -> dict[str, int]:
        """ClusterStatus's counters of the index (exported by the gateway's /metrics)."""
        return {
            "kv_event_batches": self.applied,
            "kv_event_malformed": self.malformed,
            "kv_event_resyncs": self.resyncs,
        }

    def receive(self, identity: bytes, msg: KVEventBatch, now: float, out: list) -> None:
        info = self.registry.workers.get(msg.worker_id)
        if info is None:  # not registered here (a restarted scheduler): its registration brings a snapshot
            return
        pages: HeldPages = info.page_hashes
        if msg.seq != 0 and (pages.last_seq is None or msg.seq != pages.last_seq + 1):
            if pages.last_seq is not None:  # else: already waiting for a snapshot
                self._resync(msg.worker_id, pages, out)
            return
        try:
            events = decode_events(msg.payload).events
        except MalformedEvents as e:
            self.malformed += 1
            if (left_out := self.log_limit.admit("malformed", now)) is not None:
                self.log.warning("unreadable kv events dropped", worker=msg.worker_id, error=str(e), left_out=left_out)
            return self._resync(msg.worker_id, pages, out)
        if msg.seq == 0:
            pages.start_over()
        pages.apply(events)
        pages.last_seq = msg.seq
        self.applied += 1

    def _resync(self, worker_id: str, pages: HeldPages, out: list) -> None:
        pages.start_over()
        self.resyncs += 1
        out.append((worker_id, KVEventsResync(worker_id=worker_id)))
