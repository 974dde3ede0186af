"""KV cache events in vLLM's wire format: what a worker's prefix cache stored, evicted or cleared.

Pure logic (msgpack only): the worker encodes (`encode_batch`, workers/engine/kv_events.py collects
the events), the scheduler decodes (`decode_batch`, services/scheduler/kv_event_index.py), and so
can any router that follows vLLM's events (Dynamo's, llm-d's, SGLang's gateway).

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
routers that read only it, and `decode_batch` reads both:

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

Media: "GPU" is the engine's own KV pool, "CPU" the offload tier behind it (host memory and its
disk, as one: see workers/engine/kv_events.py). A "CPU" BlockStored lists keys only (no parent,
no token ids), as vLLM's OffloadingConnector sends its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import msgpack

# vLLM says "GPU" for an engine's own KV pool on every platform (its CPU backend too): "CPU" names
# a host-memory tier pages are offloaded to, which routers rank below it. Our pool, on a CPU or a
# GPU, is the engine's own.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MAX_BLOCK_HASH = (1 << 64) - 1  # vLLM's int hashes are 64 bits (pagemesh's keys: 62)


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
    """Pages whose keys left the medium (evicted for reuse, or dropped by the offload tier)."""

    block_hashes: list[int]
    medium: str | None


@dataclass
class AllBlocksCleared:
    """Every key left every medium at once (a reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
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


class MalformedEvents(ValueError):
    """A payload that is not an EventBatch of vLLM's layout."""


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


def decode_batch(payload: bytes) -> EventBatch:
    """`encode_batch`'s payload (either layout) back; MalformedEvents for anything else: a field
    missing or of the wrong type, an unknown event, a hash that is not a 64-bit unsigned int.
    Fields vLLM added later with defaults (extra_keys, group_idx, ...) are accepted and dropped."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:  # ExtraData, FormatError, StackError are ValueErrors
        raise MalformedEvents(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise MalformedEvents("an EventBatch is [ts, events, data_parallel_rank]")
    ts, events, rank = (*raw, 0) if len(raw) == 2 else raw
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise MalformedEvents("EventBatch.ts: a number")
    if not (rank is None or type(rank) is int) or not isinstance(events, list):
        raise MalformedEvents("EventBatch: data_parallel_rank an int or None, events a list")
    return EventBatch(float(ts), [_decode_event(e) for e in events], rank)


def _decode_event(raw: object) -> KVCacheEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise MalformedEvents(f"unknown event {tag!r}")
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.name != "lora_name"]
        if missing := [name for name in required if name not in raw]:
            raise MalformedEvents(f"{cls.__name__}: missing {missing}")
        values = {name: raw.get(name) for name in names}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in EVENT_TYPES:
        cls = EVENT_TYPES[raw[0]]
        names = LEGACY_FIELDS[cls]
        if len(raw) - 1 < len(names):
            raise MalformedEvents(f"{cls.__name__}: {len(raw) - 1} fields, {len(names)} expected")
        values = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedEvents("an event is a map tagged by 'type' or an array tag first")
    event = cls(**values)
    _check_event(event)
    return event


def _is_hash(v: object) -> bool:
    return type(v) is int and 0 <= v <= MAX_BLOCK_HASH


def _check_event(event: KVCacheEvent) -> None:
    name = type(event).__name__
    if isinstance(event, AllBlocksCleared):
        return
    if not isinstance(event.block_hashes, list) or not all(_is_hash(k) for k in event.block_hashes):
        raise MalformedEvents(f"{name}.block_hashes: a list of ints in [0, 2**64)")
    if not (event.medium is None or isinstance(event.medium, str)):
        raise MalformedEvents(f"{name}.medium: a string or None")
    if isinstance(event, BlockStored):
        if not (event.parent_block_hash is None or _is_hash(event.parent_block_hash)):
            raise MalformedEvents(f"{name}.parent_block_hash: an int in [0, 2**64) or None")
        if not isinstance(event.token_ids, list) or not all(type(t) is int for t in event.token_ids):
            raise MalformedEvents(f"{name}.token_ids: a list of ints")
        if type(event.block_size) is not int or not (event.lora_id is None or type(event.lora_id) is int):
            raise MalformedEvents(f"{name}: block_size an int, lora_id an int or None")
        if not (event.lora_name is None or isinstance(event.lora_name, str)):
            raise MalformedEvents(f"{name}.lora_name: a string or None")
