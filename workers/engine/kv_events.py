"""KV cache events in vLLM's wire format: what the prefix cache stored, evicted or cleared.

Pure logic (msgpack, no torch, no zmq). The block manager reports to a `KVEventCollector`
(`BlockManager.events`); once per engine step the worker's publisher takes the collected events
as one batch (`take_batch`), encodes it (`encode_batch`) and sends it on its PUB socket
(workers/llm/kv_events_publisher.py). Routers that follow vLLM's events (Dynamo's, llm-d's,
SGLang's gateway) read them as they read vLLM's.

The payload, as vLLM's msgspec structs encode it (vllm/distributed/kv_events.py):

    EventBatch        [ts, events, data_parallel_rank]             an array (array_like)
    BlockStored       {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                       "block_size", "lora_id", "medium", "lora_name"}
    BlockRemoved      {"type": "BlockRemoved", "block_hashes", "medium"}
    AllBlocksCleared  {"type": "AllBlocksCleared"}

Each event is a map tagged by "type", its fields in declaration order; vLLM's later optional
fields (extra_keys, group_idx, kv_cache_spec_kind, ...) are left at their defaults, which
msgspec's omit_defaults leaves out. vLLM sent events as arrays with the tag first until it
changed to maps (vLLM PR 42892, mid 2026); `legacy_array_events` sends that older layout for
routers that read only it:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A block hash here is pagemesh's prefix-cache page key (`pagemesh.common.page_hash.chain_hash`):
blake2b over the parent page's key and the page's token ids, cut to 62 bits, so already a stable
non-negative int that fits 64 bits, the same in every process; it is sent as it is. A page's
parent is the previous page of its prefix; a prefix's first page has parent None. A LoRA
adapter's pages chain from the adapter's root key (`page_hash.root_hash` of its content digest):
that root is sent as `lora_id` (not a small user-given id as vLLM's; `lora_name` is None).
token_ids are the ids the key was computed over: an image's placeholder positions carry negative
ids drawn from the image's digest (`pagemesh.common.multimodal.hash_token_ids`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields

import msgpack

# vLLM says "GPU" for an engine's own KV pool on every platform (its CPU backend too): "CPU" names
# a host-memory tier pages are offloaded to, which routers rank below it. Our pool, on a CPU or a
# GPU, is the engine's own.
MEDIUM_GPU = "GPU"
PUBLISHERS = ("null", "zmq")


@dataclass
class BlockStored:
    """Consecutive pages of one prefix that got keys: `block_hashes[i]` holds
    `token_ids[i * block_size : (i + 1) * block_size]`; the first chains on `parent_block_hash`."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    """Pages whose keys left the prefix cache (evicted for reuse)."""

    block_hashes: list[int]
    medium: str | None


@dataclass
class AllBlocksCleared:
    """Every key left the prefix cache at once (a reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
LEGACY_FIELDS = {  # the array layout's fields, in order, after the tag
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    BlockRemoved: ("block_hashes", "medium"),
    AllBlocksCleared: (),
}


@dataclass
class EventBatch:
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = 0


def event_as_map(event: KVCacheEvent) -> dict:
    """vLLM's tagged map: "type" first, then every field in declaration order."""
    return {"type": type(event).__name__, **{f.name: getattr(event, f.name) for f in fields(event)}}


def event_as_array(event: KVCacheEvent) -> list:
    """vLLM's older tagged array: the tag, then the legacy fields in order."""
    return [type(event).__name__, *(getattr(event, name) for name in LEGACY_FIELDS[type(event)])]


def encode_batch(batch: EventBatch, *, legacy_array_events: bool = False) -> bytes:
    """The msgpack payload, byte for byte what vLLM's `msgspec.msgpack.Encoder` writes."""
    as_wire = event_as_array if legacy_array_events else event_as_map
    return msgpack.packb([batch.ts, [as_wire(e) for e in batch.events], batch.data_parallel_rank], use_bin_type=True)


class KVEventCollector:
    """Where `BlockManager.events` reports; `take_batch` hands the events since the last call
    over in order. Consecutive stores of one chain merge into one BlockStored (as vLLM sends a
    request's new pages), consecutive removals into one BlockRemoved."""

    def __init__(self, page_size: int, medium: str = MEDIUM_GPU):
        self.page_size, self.medium = page_size, medium
        self.pending: list[KVCacheEvent] = []

    def stored(self, key: int, parent: int | None, token_ids, lora_id: int | None) -> None:
        last = self.pending[-1] if self.pending else None
        if (
            isinstance(last, BlockStored)
            and parent is not None
            and last.block_hashes[-1] == parent
            and last.lora_id == lora_id
        ):
            last.block_hashes.append(key)
            last.token_ids.extend(token_ids)
            return
        self.pending.append(BlockStored([key], parent, list(token_ids), self.page_size, lora_id, self.medium))

    def removed(self, key: int) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(key)
        else:
            self.pending.append(BlockRemoved([key], self.medium))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

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
    is pagemesh's own key: the older array layout (see the module's docstring)."""

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
