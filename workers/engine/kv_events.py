"""KV cache events collected in the worker: what the prefix cache stored, evicted or cleared, in
vLLM's format (pagemesh.common.kv_events: the events, their encoding and decoding).

    block manager ──stored / removed / offloaded / cleared──▶ KVEventCollector
        ──once per step──▶ KVEventFeed (workers/engine/kv_event_feed.py): encoded once, sent to the
        scheduler (KVEventBatch) and, with --kv-events-config, published on a PUB socket
        (workers/llm/kv_events_publisher.py)

Media: "GPU" is the engine's own pool (vLLM's name for it on every platform). The offload tier
(workers/engine/kv_offload.py) reports as "CPU", vLLM's OffloadingConnector's name for its host
tier: a key is stored there when the tier keeps an evicted page, and removed once neither host
memory nor the disk holds it. The disk is part of "CPU", not a medium of its own: vLLM has no
disk medium (a router would not know the name), and moving a page from host memory to disk
inside the tier changes nothing a router acts on (the worker loads it back either way), so it
is not an event.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields

from pagemesh.common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

PUBLISHERS = ("null", "zmq")


class KVEventCollector:
    """Where `BlockManager.events` reports; `take_batch` hands the events since the last call
    over in order. Consecutive stores of one chain merge into one BlockStored (as vLLM sends a
    request's new pages), consecutive tier stores into one key-only "CPU" BlockStored, and
    consecutive removals of one medium into one BlockRemoved."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pending: list[KVCacheEvent] = []

    def stored(self, key: int, parent: int | None, token_ids, lora_id: int | None) -> None:
        """A pool page got `key` ("GPU")."""
        last = self.pending[-1] if self.pending else None
        if (
            isinstance(last, BlockStored)
            and last.medium == MEDIUM_GPU
            and parent is not None
            and last.block_hashes[-1] == parent
            and last.lora_id == lora_id
        ):
            last.block_hashes.append(key)
            last.token_ids.extend(token_ids)
            return
        self.pending.append(BlockStored([key], parent, list(token_ids), self.page_size, lora_id, MEDIUM_GPU))

    def offloaded(self, key: int) -> None:
        """The offload tier keeps `key`'s page ("CPU"; keys only, as vLLM's offloading events)."""
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and last.medium == MEDIUM_CPU:
            last.block_hashes.append(key)
        else:
            self.pending.append(BlockStored([key], None, [], self.page_size, None, MEDIUM_CPU))

    def removed(self, key: int, medium: str = MEDIUM_GPU) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(key)
        else:
            self.pending.append(BlockRemoved([key], medium))

    def cleared(self) -> None:
        """Every medium was emptied: the events before it change nothing a reader ends up with,
        and are dropped (a reset of a large tier is one event, not one per key)."""
        self.pending = [AllBlocksCleared()]

    def take_batch(self, data_parallel_rank: int | None = 0) -> EventBatch | None:
        """The events since the last call as one batch (None when there are none)."""
        if not self.pending:
            return None
        events, self.pending = self.pending, []
        return EventBatch(time.time(), events, data_parallel_rank)


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config, with vLLM's keys and defaults (vllm/config/kv_events.py). `publisher`
    defaults to "zmq" when events are enabled, else "null". `max_queue_size` is accepted and
    unused: batches are sent from the step loop, with no queue in between. `legacy_array_events`
    is pagemesh's own key: the older array layout (pagemesh.common.kv_events)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    legacy_array_events: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value, kinds = getattr(self, f.name), _KEY_TYPES.get(f.name)
            if kinds is not None and (not isinstance(value, kinds) or (bool in kinds) != isinstance(value, bool)):
                raise ValueError(f"--kv-events-config: {f.name} must be {' or '.join(k.__name__ for k in kinds)}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            known = ", ".join(PUBLISHERS)
            raise ValueError(f"--kv-events-config: unknown publisher {self.publisher!r} (one of {known})")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be >= 1")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig | None:
        """The flag's JSON object (None: no flag). ValueError for bad JSON, an unknown key or
        publisher, or a value of the wrong type."""
        if text is None:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config: not JSON ({e}): {text!r}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-events-config: a JSON object, not {text!r}")
        if unknown := set(raw) - set(_KEY_TYPES):
            raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)} (known: {', '.join(_KEY_TYPES)})")
        return cls(**raw)


_KEY_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
    "legacy_array_events": (bool,),
}


def offset_endpoint(endpoint: str, k: int) -> str:
    """`endpoint` for the k-th LLM worker of one host (each needs its own socket): a tcp port
    moved up k, as vLLM moves it by data-parallel rank; any other address gets "-k" appended;
    k = 0 is the endpoint as given."""
    if k == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + k}"
    return f"{endpoint}-{k}"


def kv_events_argv_for_worker(argv: list[str], k: int) -> list[str]:
    """A worker command line with its `--kv-events-config` endpoints moved for the k-th LLM worker
    (`offset_endpoint`); argv unchanged when it has no such flag."""
    if "--kv-events-config" not in argv:
        return argv
    i = argv.index("--kv-events-config") + 1
    raw = json.loads(argv[i])
    for key in ("endpoint", "replay_endpoint"):
        if raw.get(key):
            raw[key] = offset_endpoint(raw[key], k)
    if "endpoint" not in raw:
        raw["endpoint"] = offset_endpoint(KVEventsConfig.endpoint, k)
    return [*argv[:i], json.dumps(raw), *argv[i + 1 :]]
