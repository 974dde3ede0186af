"""KV cache events in vLLM's format: the payload byte for byte as vLLM's msgspec encoder writes
it, its layout read back with plain msgpack and with pagemesh's decoder (which refuses anything
else), the collector's batches, the block manager's hooks, and --kv-events-config."""

import argparse
import json
import random

import msgpack
import pytest

from pagemesh.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedEvents,
    decode_batch,
    encode_batch,
)
from pagemesh.common.page_hash import chain_hash, prefix_page_hashes
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.config import add_engine_arguments, engine_args_to_argv, engine_config_from_args
from pagemesh.workers.engine.kv_events import KVEventCollector, KVEventsConfig
from pagemesh.workers.llm.main import parse as parse_worker

TOP = 2**62 - 1  # the largest page key (62 bits): msgpack's uint64 form
TOKENS = [0, 1, 127, 128, 255, 256, 65535, 65536, 128255, -5, 42, 2, 3, 4, 5, 6]  # every int width, a negative
ROOT = 3141592653589793  # a LoRA adapter's root key, sent as lora_id
BATCH = EventBatch(
    1757500000.25,
    [
        BlockStored([TOP, 7], None, TOKENS + TOKENS[::-1], 16, None, "GPU"),
        BlockStored([9], TOP, TOKENS, 16, ROOT, "GPU"),
        BlockRemoved([7, TOP], "GPU"),
        AllBlocksCleared(),
    ],
    0,
)
# BATCH as msgspec 0.22.0's msgspec.msgpack.encode writes it from vLLM's structs, declared as in
# vllm/distributed/kv_events.py: EventBatch array_like; the events tagged maps (omit_defaults, so
# extra_keys, group_idx and the spec fields at their None defaults are left out). Generated once
# outside the suite (msgspec is no dependency of pagemesh).
VLLM_MAP_BYTES = bytes.fromhex(
    "93cb41da3054981000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf3fffffffffff"
    "ffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc002000017fcc80ccffcd0100cdffffce00"
    "010000ce0001f4fffb2a020304050606050403022afbce0001f4ffce00010000cdffffcd0100ccffcc807f0100aa626c6f63"
    "6b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b"
    "53746f726564ac626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f68617368cf3fffffffffffffffa974"
    "6f6b656e5f696473dc001000017fcc80ccffcd0100cdffffce00010000ce0001f4fffb2a0203040506aa626c6f636b5f7369"
    "7a6510a76c6f72615f6964cf000b29430a256d21a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac42"
    "6c6f636b52656d6f766564ac626c6f636b5f6861736865739207cf3fffffffffffffffa66d656469756da347505581a47479"
    "7065b0416c6c426c6f636b73436c656172656400"
)
# the same from the structs as vLLM declared them before its PR 42892: array_like events, tag first
VLLM_ARRAY_BYTES = bytes.fromhex(
    "93cb41da3054981000009497ab426c6f636b53746f72656492cf3fffffffffffffff07c0dc002000017fcc80ccffcd0100cd"
    "ffffce00010000ce0001f4fffb2a020304050606050403022afbce0001f4ffce00010000cdffffcd0100ccffcc807f010010"
    "c0a347505597ab426c6f636b53746f7265649109cf3fffffffffffffffdc001000017fcc80ccffcd0100cdffffce00010000"
    "ce0001f4fffb2a020304050610cf000b29430a256d21a347505593ac426c6f636b52656d6f7665649207cf3fffffffffffff"
    "ffa347505591b0416c6c426c6f636b73436c656172656400"
)


def test_the_payload_is_byte_for_byte_what_vllms_encoder_writes():
    assert encode_batch(BATCH) == VLLM_MAP_BYTES
    assert encode_batch(BATCH, legacy_array_events=True) == VLLM_ARRAY_BYTES


def test_plain_msgpack_reads_vllms_map_layout():
    ts, events, rank = msgpack.unpackb(encode_batch(BATCH))
    assert (ts, rank) == (1757500000.25, 0)
    stored, child, removed, cleared = events
    assert list(stored) == [  # the tag first, then vLLM's fields in declaration order
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [TOP, 7],
        "parent_block_hash": None,
        "token_ids": TOKENS + TOKENS[::-1],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert (child["parent_block_hash"], child["lora_id"]) == (TOP, ROOT)
    assert removed == {"type": "BlockRemoved", "block_hashes": [7, TOP], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_plain_msgpack_reads_vllms_older_array_layout():
    _, events, _ = msgpack.unpackb(encode_batch(BATCH, legacy_array_events=True))
    assert events == [
        ["BlockStored", [TOP, 7], None, TOKENS + TOKENS[::-1], 16, None, "GPU"],
        ["BlockStored", [9], TOP, TOKENS, 16, ROOT, "GPU"],
        ["BlockRemoved", [7, TOP], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_the_decoder_reads_vllms_bytes_in_both_layouts():
    assert decode_batch(VLLM_MAP_BYTES) == BATCH
    assert decode_batch(VLLM_ARRAY_BYTES) == BATCH


def test_the_decoder_round_trips_what_the_encoder_writes():
    batch = EventBatch(
        12.5,
        [
            BlockStored([1, 2], None, [5, 6, -7, 8], 2, None, "GPU", None),
            BlockStored([3, TOP], None, [], 2, None, "CPU"),  # a tier's keys: no parent, no token ids
            BlockRemoved([3], "CPU"),
            AllBlocksCleared(),
            BlockStored([2**64 - 1], 2, [1, 1], 2, ROOT, None),
        ],
        None,
    )
    for legacy in (False, True):
        assert decode_batch(encode_batch(batch, legacy_array_events=legacy)) == batch
    assert decode_batch(encode_batch(EventBatch(1.0, []))) == EventBatch(1.0, [])


def test_the_decoder_takes_fields_vllm_added_later_and_drops_them():
    later = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU", "group_idx": 0}], 0])
    assert decode_batch(later) == EventBatch(1.0, [BlockRemoved([4], "GPU")], 0)


def _removed(**fields) -> bytes:
    return msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", **fields}], 0])


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # nothing
        b"\xc1",  # not msgpack
        VLLM_MAP_BYTES + b"\x00",  # trailing bytes
        msgpack.packb({"ts": 1.0}),  # not an array
        msgpack.packb([1.0]),  # too short
        msgpack.packb(["now", [], 0]),  # ts not a number
        msgpack.packb([float("nan"), [], 0]),
        msgpack.packb([1.0, {}, 0]),  # events not a list
        msgpack.packb([1.0, [], "zero"]),  # rank not an int
        msgpack.packb([1.0, [{"type": "BlockMoved"}], 0]),  # unknown event
        msgpack.packb([1.0, [{"type": [1]}], 0]),
        msgpack.packb([1.0, [{"block_hashes": [1]}], 0]),  # no tag
        msgpack.packb([1.0, [["BlockMoved"]], 0]),
        msgpack.packb([1.0, [7], 0]),  # an event neither map nor array
        msgpack.packb([1.0, [{"type": "BlockRemoved", "medium": "GPU"}], 0]),  # a field missing
        msgpack.packb([1.0, [["BlockRemoved", [1]]], 0]),  # an array one field short
        _removed(block_hashes=[-1]),  # hashes out of range or of the wrong type
        _removed(block_hashes=[1.0]),
        _removed(block_hashes=[True]),
        _removed(block_hashes=[b"\x01" * 32]),
        _removed(block_hashes=7),
        _removed(medium=3),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1.5], 2, None, "GPU"]], 0]),  # token ids
        msgpack.packb([1.0, [["BlockStored", [1], "parent", [1], 2, None, "GPU"]], 0]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], "2", None, "GPU"]], 0]),
    ],
)
def test_the_decoder_refuses_what_is_not_an_event_batch(payload):
    with pytest.raises(MalformedEvents):
        decode_batch(payload)


def test_damaged_payloads_decode_or_are_refused_and_nothing_else():
    """What the scheduler relies on to never crash on a payload: MalformedEvents or a batch."""
    rng = random.Random(7)
    for _ in range(3000):
        payload = bytearray(rng.choice([VLLM_MAP_BYTES, VLLM_ARRAY_BYTES]))
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        try:
            batch = decode_batch(bytes(payload[: rng.randint(1, len(payload))]))
        except MalformedEvents:
            continue
        assert isinstance(batch, EventBatch)


def test_the_collector_merges_a_chain_and_hands_each_event_over_once():
    events = KVEventCollector(page_size=2)
    assert events.take_batch() is None
    events.stored(11, None, (1, 2), None)
    events.stored(12, 11, (3, 4), None)  # chains on the last: the same event
    events.stored(21, 5, (9, 9), None)  # another parent: a new event
    events.stored(22, 21, (8, 8), ROOT)  # another adapter: a new event
    events.offloaded(21)  # the tier's keys: one key-only event
    events.offloaded(22)
    events.removed(21)
    events.removed(22)
    events.removed(11, "CPU")  # another medium: a new event
    batch = events.take_batch(data_parallel_rank=0)
    assert batch.events == [
        BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU"),
        BlockStored([21], 5, [9, 9], 2, None, "GPU"),
        BlockStored([22], 21, [8, 8], 2, ROOT, "GPU"),
        BlockStored([21, 22], None, [], 2, None, "CPU"),
        BlockRemoved([21, 22], "GPU"),
        BlockRemoved([11], "CPU"),
    ]
    assert events.take_batch() is None
    events.stored(11, None, (1, 2), None)
    events.cleared()  # what came before it changes nothing a reader ends up with
    events.stored(12, 11, (3, 4), None)
    assert events.take_batch().events == [AllBlocksCleared(), BlockStored([12], 11, [3, 4], 2, None, "GPU")]


def apply(view: set[int], batch: EventBatch) -> None:
    """A subscriber's set of the keys an engine holds."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            view.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            view.difference_update(event.block_hashes)
        else:
            view.clear()


def test_the_block_manager_reports_stores_evictions_and_a_reset():
    bm = BlockManager(num_pages=5, page_size=4)  # 4 usable pages
    bm.events = KVEventCollector(bm.page_size)
    view: set[int] = set()
    prompt = list(range(100, 113))  # 3 full pages and one token
    table: list[int] = []
    bm.grow(table, len(prompt))
    assert bm.cache_full_pages(table, prompt, 0, 8) == 2  # two pages written, then the third
    assert bm.cache_full_pages(table, prompt, 2, 12) == 3
    batch = bm.events.take_batch()
    keys = prefix_page_hashes(prompt, 4)
    assert batch.events == [BlockStored(keys, None, prompt[:12], 4, None, "GPU")]  # one chain, merged
    apply(view, batch)
    bm.free_table(table)  # cached pages stay (evictable): nothing to report
    assert bm.events.take_batch() is None
    other: list[int] = []
    bm.grow(other, 12)  # 1 free page, then the two least recently used: the prompt's tail first
    batch = bm.events.take_batch()
    assert batch.events == [BlockRemoved([keys[2], keys[1]], "GPU")]
    apply(view, batch)
    assert view == set(bm.hash_to_page) == {keys[0]}
    assert bm.reset_prefix_cache() is False  # pages in use: refused, nothing reported
    assert bm.events.take_batch() is None
    bm.free_table(other)
    assert bm.reset_prefix_cache() is True
    batch = bm.events.take_batch()
    assert batch.events == [AllBlocksCleared()]
    apply(view, batch)
    assert view == set(bm.hash_to_page) == set()
    bm.check_invariants([])


def test_an_adapters_pages_report_its_root_as_lora_id_and_no_parent_for_the_first():
    bm = BlockManager(num_pages=4, page_size=2)
    bm.events = KVEventCollector(bm.page_size)
    table: list[int] = []
    bm.grow(table, 5)
    bm.cache_full_pages(table, [1, 2, 3, 4, 5], 0, 5, root=ROOT)
    first = chain_hash(ROOT, [1, 2])
    assert bm.events.take_batch().events == [
        BlockStored([first, chain_hash(first, [3, 4])], None, [1, 2, 3, 4], 2, ROOT, "GPU")
    ]


def test_events_off_change_nothing_else():
    on, off = BlockManager(num_pages=5, page_size=4), BlockManager(num_pages=5, page_size=4)
    on.events = KVEventCollector(4)
    for bm in (on, off):
        table: list[int] = []
        bm.grow(table, 9)
        bm.cache_full_pages(table, list(range(9)), 0, 9)
        bm.free_table(table)
        bm.grow(table, 16)
    assert on.hash_to_page == off.hash_to_page and on.cached_keys() == off.cached_keys()
    assert off.events is None


def parse_engine(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_the_flag_takes_vllms_keys_and_defaults():
    flag = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5600", "topic": "kv-events"}'
    config = engine_config_from_args(parse_engine(["--kv-events-config", flag])).kv_events_config
    assert config == KVEventsConfig(True, "zmq", "tcp://*:5600", topic="kv-events")
    assert (config.replay_endpoint, config.buffer_steps, config.hwm, config.publishes) == (None, 10_000, 100_000, True)
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"  # vLLM's default
    disabled = KVEventsConfig.from_json('{"endpoint": "tcp://*:1"}')
    assert (disabled.publisher, disabled.publishes) == ("null", False)
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert engine_config_from_args(parse_engine([])).kv_events_config is None


def test_pagemesh_up_hands_the_flag_to_a_worker_unchanged():
    flag = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5601", "buffer_steps": 5}'
    args = parse_engine(["--kv-events-config", flag])
    forwarded = engine_args_to_argv(args)
    assert forwarded[forwarded.index("--kv-events-config") + 1] == flag
    assert engine_config_from_args(parse_engine(forwarded)) == engine_config_from_args(args)


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        ("{enable_kv_cache_events: true}", "not JSON"),
        ("[1]", "a JSON object"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "unknown publisher 'kafka'"),
        ('{"enable_kv_cache_event": true}', "unknown keys ['enable_kv_cache_event']"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
        ('{"hwm": true}', "hwm must be int"),
        ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
    ],
)
def test_a_bad_flag_is_a_clear_error_at_start(flag, error):
    with pytest.raises(ValueError) as raised:
        KVEventsConfig.from_json(flag)
    assert error in str(raised.value)


def test_the_worker_refuses_a_bad_flag_before_it_starts(capsys):
    with pytest.raises(SystemExit):
        parse_worker(["--kv-events-config", '{"publisher": "kafka"}'])
    assert "unknown publisher 'kafka'" in capsys.readouterr().err


def test_pagemesh_up_gives_each_llm_worker_its_own_events_socket(tmp_path):
    """As vLLM moves the port by data-parallel rank: the k-th LLM worker of `pagemesh up` binds
    port + k (replays too); an ipc address gets -k."""
    from pagemesh.services import launcher
    from pagemesh.workers.engine.kv_events import offset_endpoint

    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:7000"}'
    args = launcher.parse(["--prefill", "1", "--decode", "2", "--diffusion", "0", "--kv-events-config", config])
    workers = [argv for name, argv in launcher.plan(args, str(tmp_path)) if argv[0] == "worker"]
    configs = [json.loads(argv[argv.index("--kv-events-config") + 1]) for argv in workers]
    assert [(c["endpoint"], c["replay_endpoint"]) for c in configs] == [
        ("tcp://*:6000", "tcp://*:7000"),
        ("tcp://*:6001", "tcp://*:7001"),
        ("tcp://*:6002", "tcp://*:7002"),
    ]
    assert all(c["enable_kv_cache_events"] for c in configs)
    assert offset_endpoint("ipc:///run/kv-events", 2) == "ipc:///run/kv-events-2"
