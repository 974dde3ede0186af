"""A real engine (the embedded model) publishes its KV cache events in vLLM's format to a real
ZMQ subscriber: stores that chain across two requests sharing a prefix, evictions from a tiny
pool, a reset, and a replay of every batch. The subscriber's structs are written here from
vLLM's documented layout, not imported from pagemesh."""

from __future__ import annotations

import socket
from dataclasses import dataclass, fields

import msgpack
import pytest
import zmq

from pagemesh.common.page_hash import prefix_page_hashes
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.kv_event_feed import KVEventFeed
from pagemesh.workers.engine.kv_events import KVEventsConfig
from pagemesh.workers.llm.kv_events_publisher import KVEventsPublisher

PAGE = 16
TOPIC = "kv-events"
WAIT_MS = 10_000  # a batch that has not come by then never will (a liveness bound, not a timing check)


# ---- a subscriber, as a router that follows vLLM's events would write it --------------------
@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None


@dataclass
class AllBlocksCleared:
    pass


EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def decode_batch(payload: bytes) -> list:
    """[ts, events, data_parallel_rank]; each event a map tagged by "type"."""
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    decoded = []
    for raw in events:
        cls = EVENT_TYPES[raw["type"]]
        names = [f.name for f in fields(cls)]
        assert list(raw) == ["type", *names]  # the tag, then every field in vLLM's order
        decoded.append(cls(**{name: raw[name] for name in names}))
    return decoded


class Subscriber:
    def __init__(self, port: int):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.payloads: dict[int, bytes] = {}  # by sequence number

    def receive(self, timeout_ms: int = WAIT_MS) -> tuple[int, list] | None:
        if not self.sock.poll(timeout_ms):
            return None
        topic, seq_bytes, payload = self.sock.recv_multipart()
        assert topic == TOPIC.encode() and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        assert seq not in self.payloads and seq == max(self.payloads, default=seq - 1) + 1, f"batch {seq} out of order"
        self.payloads[seq] = payload
        return seq, decode_batch(payload)

    def events_through(self, last_seq: int) -> list:
        """Every event of the batches up to `last_seq`, in order (none may be missing)."""
        events = []
        while True:
            received = self.receive()
            assert received is not None, f"batch {last_seq} never came"
            seq, batch = received
            events += batch
            if seq == last_seq:
                return events

    def close(self) -> None:
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StepPublisher:
    """What the LLM worker does between steps: the step's events encoded once (the feed), published."""

    def __init__(self, engine: Engine, config: KVEventsConfig):
        self.feed = KVEventFeed("w0", engine.blocks)
        self.publisher = KVEventsPublisher.for_config(config)

    @property
    def next_seq(self) -> int:
        return self.publisher.next_seq

    def flush(self) -> int | None:
        payload, _ = self.feed.take()  # the scheduler's messages are for the worker's DEALER
        return None if payload is None else self.publisher.send(payload)

    def close(self) -> None:
        self.publisher.close()


@pytest.fixture(scope="module")
def publishing_engine():
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC,
    )
    # 7 usable pages: a 68-token request takes 5, so the third prompt evicts the first ones' pages
    engine = Engine(
        EngineConfig(dtype="float32", page_size=PAGE, num_pages=8, max_model_len=96, kv_events_config=config)
    )
    publisher = StepPublisher(engine, config)
    try:
        yield engine, publisher, port, replay_port
    finally:
        publisher.close()
        engine.close()


def run(engine: Engine, publisher: StepPublisher, rid: str, prompt: list[int]):
    """One request to its end, the publisher flushed after every step (as the worker's loop
    does between steps); the last batch's sequence number and the request's cached tokens."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    last, cached = None, None
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens if cached is None else cached
        seq = publisher.flush()
        last = seq if seq is not None else last
    assert last is not None, "the request changed the prefix cache: some batch was due"
    return last, cached


@pytest.fixture
def subscriber(publishing_engine):
    sub = Subscriber(publishing_engine[2])
    yield sub
    sub.close()


def test_a_subscriber_sees_the_prefix_cache_as_the_engine_holds_it(publishing_engine, subscriber):
    engine, publisher, _, replay_port = publishing_engine
    sub = subscriber
    # a PUB socket drops what it sends before the subscription reaches it: reset the (empty)
    # cache until the subscriber sees the AllBlocksCleared that reports it
    for _ in range(100):
        assert engine.blocks.reset_prefix_cache()
        publisher.flush()
        if (first := sub.receive(timeout_ms=100)) is not None:
            break
    else:
        pytest.fail("the subscriber never got a batch")
    first_seq, batch = first
    assert batch == [AllBlocksCleared()]
    if publisher.next_seq - 1 > first_seq:  # later handshake batches are on their way
        assert sub.events_through(publisher.next_seq - 1) == [AllBlocksCleared()] * (publisher.next_seq - 1 - first_seq)
    view: set[int] = set()

    prefix = [(1000 + 37 * i) % 20000 for i in range(3 * PAGE)]
    a = prefix + [(5000 + 11 * i) % 20000 for i in range(20)]  # 68 tokens: 4 full pages
    b = prefix + [(9000 + 13 * i) % 20000 for i in range(20)]
    a_keys, b_keys = prefix_page_hashes(a, PAGE), prefix_page_hashes(b, PAGE)
    assert a_keys[:3] == b_keys[:3] and a_keys[3] != b_keys[3]

    last, _ = run(engine, publisher, "a", a)
    stored = sub.events_through(last)
    assert all(isinstance(e, BlockStored) for e in stored)
    assert [k for e in stored for k in e.block_hashes] == a_keys
    assert [t for e in stored for t in e.token_ids] == a[: 4 * PAGE]
    assert stored[0].parent_block_hash is None
    for before, after in zip(stored, stored[1:]):  # a chain, whatever the batching
        assert after.parent_block_hash == before.block_hashes[-1]
    assert {(e.block_size, e.lora_id, e.medium, e.lora_name) for e in stored} == {(PAGE, None, "GPU", None)}
    view.update(a_keys)

    last, cached = run(engine, publisher, "b", b)
    assert cached == 3 * PAGE  # the shared prefix was a hit: only b's own page is new
    assert sub.events_through(last) == [
        BlockStored([b_keys[3]], a_keys[2], b[3 * PAGE : 4 * PAGE], PAGE, None, "GPU", None)
    ]
    view.add(b_keys[3])

    c = [(15000 + 7 * i) % 20000 for i in range(68)]  # nothing shared: the pool must evict
    last, _ = run(engine, publisher, "c", c)
    events = sub.events_through(last)
    removed = [k for e in events if isinstance(e, BlockRemoved) for k in e.block_hashes]
    assert removed and set(removed) <= view
    assert {e.medium for e in events if isinstance(e, BlockRemoved)} == {"GPU"}
    for e in events:
        if isinstance(e, BlockStored):
            view.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            view.difference_update(e.block_hashes)
    assert view == set(engine.blocks.hash_to_page)
    assert set(prefix_page_hashes(c, PAGE)) <= view and not set(removed) & view

    assert engine.blocks.reset_prefix_cache()
    assert sub.events_through(publisher.flush()) == [AllBlocksCleared()]
    assert engine.blocks.hash_to_page == {}

    # a late subscriber asks the replay socket for every batch from 0 on (a DEALER that frames its
    # request as a REQ socket does: the replies are many messages, which a REQ socket would drop)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        client.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = {}
        while True:
            assert client.poll(WAIT_MS), "the replay socket did not answer"
            empty, seq, payload = client.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed[int.from_bytes(seq, "big")] = payload
    finally:
        client.close()
    assert sorted(replayed) == list(range(publisher.next_seq))
    assert all(replayed[seq] == payload for seq, payload in sub.payloads.items())
