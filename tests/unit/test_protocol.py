"""Wire codec: exact round trips, rejection of every malformed shape, fuzzing, tensor frames."""

from __future__ import annotations

import random
import subprocess
import sys

import msgpack
import pytest

from pagemesh.common import protocol as p
from pagemesh.common.protocol import (
    AbortRequest,
    DecodeTask,
    GenerateTask,
    Heartbeat,
    KVEventBatch,
    KVPagesAck,
    KVPoolInfo,
    KVPoolLoad,
    ProtocolError,
    Ready,
    Registered,
    RegisterWorker,
    TextDeltaBatch,
    TokenDeltaBatch,
    decode,
    encode,
)
from pagemesh.tests.protocol_samples import HEADER, SAMPLES, SP, TEXT_DELTA, TOKEN_DELTA


def frames_of(msg) -> list:
    """encode(), plus empty tensor frames where the message declares some."""
    frames = encode(msg)
    return frames + [b""] * msg.num_frames if getattr(type(msg), "TENSOR_FRAMES", False) else frames


def body_of(msg) -> list:
    return msgpack.unpackb(encode(msg)[1])


def token_delta_body() -> dict:
    """TOKEN_DELTA's field map as it travels inside a TokenDeltaBatch (a record has no tag)."""
    return body_of(TokenDeltaBatch(worker_id="w", deltas=[TOKEN_DELTA]))[1]["deltas"][0]


def with_fields(msg, **changes) -> list:
    """Frames of `msg` whose field map is edited raw (None deletes a field)."""
    version, fields = body_of(msg)
    for name, value in changes.items():
        if value is _DELETE:
            del fields[name]
        else:
            fields[name] = value
    return [p.TAGS[type(msg)], msgpack.packb([version, fields])]


_DELETE = object()


def sample_of(cls: type):
    """The first sample of a message class."""
    return next(m for m in SAMPLES if type(m) is cls)


# --------------------------------------------------------------------------- round trips


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(p.MESSAGE_CLASSES)
    assert set(p.MESSAGE_TYPES.values()) == set(p.MESSAGE_CLASSES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(msg):
    frames = frames_of(msg)
    assert frames[0] == type(msg).__name__.encode()
    out = decode(frames)
    assert type(out) is type(msg)
    assert out == msg


def test_decode_accepts_memoryviews_and_converts_int_to_float():
    frames = with_fields(
        Heartbeat(
            worker_id="w",
            running=0,
            waiting=0,
            time=1.0,
            requests_finished=0,
            kv=KVPoolLoad(free_pages=0, used_pages=0, total_pages=0, bytes_sent=0, bytes_received=0),
        ),
        time=3,
    )
    out = decode([memoryview(f) for f in frames])
    assert out.time == 3.0 and type(out.time) is float


# --------------------------------------------------------------------------- malformed input

GOOD = encode(Ready(service="worker", name="p0"))

MALFORMED = {
    "no frames": [],
    "one frame": GOOD[:1],
    "unknown tag": [b"Nope", GOOD[1]],
    "tag of another type": [b"Registered", GOOD[1]],
    "huge tag": [b"R" * 1000, GOOD[1]],
    "frame not a buffer": [GOOD[0], 12],
    "wrong version": [GOOD[0], msgpack.packb([p.PROTOCOL_VERSION + 1, {"service": "w", "name": "n"}])],
    "bool version": [GOOD[0], msgpack.packb([True, {"service": "w", "name": "n"}])],
    "body not a list": [GOOD[0], msgpack.packb({"service": "w", "name": "n"})],
    "body of three": [GOOD[0], msgpack.packb([p.PROTOCOL_VERSION, {}, 1])],
    "fields not a map": [GOOD[0], msgpack.packb([p.PROTOCOL_VERSION, ["w", "n"]])],
    "garbage body": [GOOD[0], b"\xc1\xc1\xc1"],
    "empty body": [GOOD[0], b""],
    "truncated body": [GOOD[0], GOOD[1][:-1]],
    "trailing bytes": [GOOD[0], GOOD[1] + b"\x00"],
    "extra frame": [*GOOD, b"x"],
    "bin value": [GOOD[0], msgpack.packb([p.PROTOCOL_VERSION, {"service": b"w", "name": "n"}], use_bin_type=True)],
    "invalid utf-8": [GOOD[0], GOOD[1].replace(b"worker", b"\xff\xfe\xfd\xfc\xfb\xfa")],
    "int map key": [GOOD[0], msgpack.packb([p.PROTOCOL_VERSION, {1: "w", "name": "n"}])],
    "missing field": with_fields(Ready(service="w", name="n"), name=_DELETE),
    "unexpected field": with_fields(Ready(service="w", name="n"), extra=1),
    "str for int": with_fields(Registered(worker_id="w"), worker_id=5),
    "bool for int": with_fields(
        RegisterWorker(
            worker_id="p0",
            kind="llm",
            role="mixed",
            model="m",
            max_running=4,
            kv=KVPoolInfo(page_size=16, num_pages=10, kv_endpoint="e"),
        ),
        max_running=True,
    ),
    "float for int": with_fields(
        RegisterWorker(
            worker_id="p0",
            kind="llm",
            role="mixed",
            model="m",
            max_running=4,
            kv=KVPoolInfo(page_size=16, num_pages=10, kv_endpoint="e"),
        ),
        max_running=1.5,
    ),
    "int for bool": with_fields(KVPagesAck(request_id="r", ok=True, error=None), ok=1),
    "bool for float": with_fields(
        Heartbeat(
            worker_id="w",
            running=0,
            waiting=0,
            time=1.0,
            requests_finished=0,
            kv=KVPoolLoad(free_pages=0, used_pages=0, total_pages=0, bytes_sent=0, bytes_received=0),
        ),
        time=False,
    ),
    "None for str": with_fields(AbortRequest(request_id="r", reason="x"), reason=None),
    "str for optional str": with_fields(KVPagesAck(request_id="r", ok=False, error=None), error=3),
    "token id not int": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), prompt_token_ids=[1, "2"]
    ),
    "negative token id": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), prompt_token_ids=[1, -2]
    ),
    "token id too big": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), prompt_token_ids=[1 << 40]
    ),
    "token ids not a list": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), prompt_token_ids={"a": 1}
    ),
    "oversize token ids": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"),
        prompt_token_ids=[0] * (p.MAX_TOKEN_IDS + 1),
    ),
    "sampling not a map": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), sampling=[1]
    ),
    "invalid sampling": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), sampling={"temperature": -1.0}
    ),
    "unknown sampling key": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), sampling={"temp": 1.0}
    ),
    "sampling wrong type": with_fields(
        GenerateTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t"), sampling={"stop": "x"}
    ),
    "nested wrong type": with_fields(
        TokenDeltaBatch(worker_id="w", deltas=[TOKEN_DELTA]), deltas=[{**token_delta_body(), "index": "0"}]
    ),
    "nested not a map": with_fields(TokenDeltaBatch(worker_id="w", deltas=[TOKEN_DELTA]), deltas=[[1, 2]]),
    "nested missing field": with_fields(TextDeltaBatch(deltas=[TEXT_DELTA]), deltas=[{"request_id": "r"}]),
    "chat message not str": with_fields(SAMPLES[2], messages=[{"role": 1}]),
    "logprob lengths differ": with_fields(
        TokenDeltaBatch(worker_id="w", deltas=[TOKEN_DELTA]),
        deltas=[
            {**token_delta_body(), "logprobs": [{"token_id": 1, "logprob": 0.0, "top_ids": [1], "top_logprobs": []}]}
        ],
    ),
    "two prompts": with_fields(SAMPLES[0], prompt_token_ids=[1]),
    "tools not JSON": with_fields(SAMPLES[3], tools="[{"),
    "tools not a list": with_fields(SAMPLES[3], tools='{"type": "function"}'),
    "a tool not an object": with_fields(SAMPLES[3], tools='["w"]'),
    "template kwargs not an object": with_fields(SAMPLES[3], chat_template_kwargs="[1]"),
    "tool calls not a list": with_fields(SAMPLES[3], messages=[{"role": "assistant", "tool_calls": "{}"}]),
    "tools without messages": with_fields(SAMPLES[0], tools="[]"),
    "skip_special_tokens not bool": with_fields(SAMPLES[3], skip_special_tokens=0),
    "an embedding of two prompts": with_fields(sample_of(p.EmbedRequest), prompt_token_ids=[1]),
    "an unknown pooling": with_fields(sample_of(p.EmbedRequest), pooling="max"),
    "a pooled task with output tokens": with_fields(
        GenerateTask(request_id="e", prompt_token_ids=[1], sampling=SP, reply_to="t", pooling=p.Pooling.LAST),
        output_token_ids=[2],
    ),
    "an embedding value not a number": with_fields(
        sample_of(p.EmbeddingBatch), embeddings=[{"request_id": "e", "values": [0.5, "1"], "prompt_tokens": 1}]
    ),
    "tokenize neither prompt nor messages": with_fields(sample_of(p.TokenizeRequest), prompt_text=None),
    "token strings not one per id": with_fields(sample_of(p.TokenizeResult), token_strs=["a"]),
    "no prompt": with_fields(SAMPLES[0], prompt_text=None),
    "bad worker role": with_fields(
        RegisterWorker(
            worker_id="p0",
            kind="llm",
            role="mixed",
            model="m",
            max_running=4,
            kv=KVPoolInfo(page_size=16, num_pages=10, kv_endpoint="e"),
        ),
        role="boss",
    ),
    "negative skip_pages": with_fields(
        DecodeTask(request_id="r", prompt_token_ids=[1], sampling=SP, reply_to="t", prefill_worker_id="p0"),
        skip_pages=-1,
    ),
    "negative busy_s": with_fields(
        Heartbeat(worker_id="w", running=0, waiting=0, time=1.0, requests_finished=0, kv=None), busy_s=-1.0
    ),
    "kv events seq negative": with_fields(KVEventBatch(worker_id="w", seq=0, payload=b""), seq=-1),
    "kv events payload too large": with_fields(
        KVEventBatch(worker_id="w", seq=0, payload=b""), payload=bytes(p.MAX_KV_EVENT_BYTES + 1)
    ),
    "kv pages != page ids": with_fields(HEADER, num_pages=2) + [b""] * 2,
    "kv unknown dtype": with_fields(HEADER, dtype="complex64") + [b""] * 2,
    "kv layer range reversed": with_fields(HEADER, layer_start=3, layer_end=1),
    "kv missing tensor frames": encode(HEADER),
    "kv one tensor frame too many": encode(HEADER) + [b""] * 3,
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_raises_protocol_error(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


@pytest.mark.parametrize(
    "limit, field_value, msg",
    [
        ("MAX_LIST_LEN", {"deltas": [token_delta_body()] * 5}, TokenDeltaBatch(worker_id="w", deltas=[])),
        ("MAX_STR_LEN", {"reason": "x" * 5}, AbortRequest(request_id="r", reason="")),
        ("MAX_DICT_LEN", {"messages": [{str(i): "v" for i in range(5)}]}, SAMPLES[2]),
    ],
)
def test_size_bounds(monkeypatch, limit, field_value, msg):
    monkeypatch.setattr(p, limit, 4)
    with pytest.raises(ProtocolError, match="more than 4|longer than 4"):
        decode(with_fields(msg, **field_value))


def test_error_names_the_field_path():
    bad = with_fields(
        TokenDeltaBatch(worker_id="w", deltas=[TOKEN_DELTA]),
        deltas=[token_delta_body(), {**token_delta_body(), "token_ids": ["x"]}],
    )
    with pytest.raises(ProtocolError, match=r"TokenDeltaBatch\.deltas\[1\]\.token_ids: expected integers"):
        decode(bad)


def test_fuzz_only_protocol_error():
    rng = random.Random(1234)
    valid = [frames_of(m) for m in SAMPLES]
    values = [None, True, 0, -1, 1 << 62, 1.5, float("nan"), "", "x" * 3, [], [1, "a"], {}, {"a": 1}, [[[]]], b"b"]
    accepted = 0
    for _ in range(4000):
        frames = [bytes(f) for f in rng.choice(valid)]
        kind = rng.randrange(4)
        if kind == 0:  # random bytes as the body
            frames[1] = rng.randbytes(rng.randrange(64))
        elif kind == 1:  # flip, cut or grow the body
            body = bytearray(frames[1])
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(body))
                body[i] = rng.randrange(256)
            frames[1] = bytes(body[: rng.randrange(len(body) + 1)]) if rng.random() < 0.3 else bytes(body)
        elif kind == 2:  # a well-formed body with one field replaced by a random value
            version, fields = msgpack.unpackb(frames[1])
            fields[rng.choice(list(fields))] = rng.choice(values)
            frames[1] = msgpack.packb([version, fields], use_bin_type=True)
        else:  # frames added or removed
            frames = frames[: rng.randrange(len(frames) + 1)] + [rng.randbytes(3)] * rng.randrange(3)
        try:
            decode(frames)
            accepted += 1
        except ProtocolError:
            pass
    assert accepted < 4000  # the mutations were mostly rejected, and nothing else was raised


def test_protocol_does_not_import_torch_or_zmq():
    code = "import sys, pagemesh.common.protocol; assert 'torch' not in sys.modules and 'zmq' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
