"""Typed sockets over real ZeroMQ (ipc:// in a tmp dir and tcp:// on loopback)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import numpy as np
import pytest
import torch

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common.protocol import (
    AbortRequest,
    Heartbeat,
    KVPagesAck,
    KVPagesHeader,
    KVPoolInfo,
    KVPoolLoad,
    Ready,
    Registered,
    RegisterWorker,
    TokenDelta,
    TokenDeltaBatch,
    decode_tensor_frames,
    encode,
    encode_tensor_frames,
)

TIMEOUT_S = HANG_S  # bounds a hang only; a loaded machine may take long to load the vocabulary


def address_of(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["ipc", "tcp"])
def address(request, tmp_path):
    if request.param == "ipc":
        return t.ipc_address(str(tmp_path), "sock")
    return t.tcp_address("127.0.0.1", free_tcp_port())


def test_router_dealer_request_reply(address):
    async def main():
        with t.Router(address) as router, t.Dealer(address, "p0") as p0, t.Dealer(address, "d0") as d0:
            await p0.send(
                RegisterWorker(
                    worker_id="p0",
                    kind="llm",
                    role="prefill",
                    model="m",
                    max_running=8,
                    kv=KVPoolInfo(page_size=16, num_pages=100, kv_endpoint="tcp://10.0.0.1:7000"),
                )
            )
            await d0.send(
                RegisterWorker(
                    worker_id="d0",
                    kind="llm",
                    role="decode",
                    model="m",
                    max_running=8,
                    kv=KVPoolInfo(page_size=16, num_pages=100, kv_endpoint="tcp://10.0.0.2:7000"),
                )
            )
            seen = {}
            for _ in range(2):
                identity, msg = await router.recv()
                seen[identity] = msg
                await router.send(identity, Registered(worker_id=msg.worker_id))
            assert {k: v.role for k, v in seen.items()} == {b"p0": "prefill", b"d0": "decode"}
            assert await p0.recv() == Registered(worker_id="p0")
            assert await d0.recv() == Registered(worker_id="d0")

    run(main())


def test_push_pull_stream_in_order(address):
    async def main():
        with t.Pull(address) as pull, t.Push(address) as push:
            sent = [
                TokenDeltaBatch(
                    worker_id="w0",
                    deltas=[
                        TokenDelta(
                            request_id=f"r{i}",
                            index=0,
                            token_ids=[i],
                            logprobs=None,
                            finish_reason=None,
                            num_prompt_tokens=3,
                        )
                    ],
                )
                for i in range(100)
            ]
            for msg in sent:
                await push.send(msg)
            assert [await pull.recv() for _ in sent] == sent

    run(main())


def test_push_may_bind_and_pull_connect(address):
    async def main():
        with t.Push(address, bind=True) as push, t.Pull(address, bind=False) as pull:
            await push.send(AbortRequest(request_id="r1", reason="client gone"))
            assert await pull.recv() == AbortRequest(request_id="r1", reason="client gone")

    run(main())


@pytest.mark.parametrize(
    "garbage",
    [
        [b"not a message"],
        [b"Ready", b"\xc1"],
        [b"Nope", encode(Ready(service="a", name="b"))[1]],
        [*encode(Ready(service="a", name="b")), b"extra"],
    ],
)
def test_malformed_frames_are_dropped_and_the_next_message_arrives(garbage, tmp_path):
    routed, stream = t.ipc_address(str(tmp_path), "routed"), t.ipc_address(str(tmp_path), "stream")

    async def main():
        with (
            t.Router(routed) as router,
            t.Dealer(routed, "w") as dealer,
            t.Pull(stream) as pull,
            t.Push(stream) as push,
        ):
            await dealer.send_frames(garbage)
            await dealer.send(Ready(service="worker", name="w"))
            assert await router.recv() == (b"w", Ready(service="worker", name="w"))
            assert router.dropped == 1
            await push.send_frames(garbage)
            await push.send(Ready(service="worker", name="w"))
            assert await pull.recv() == Ready(service="worker", name="w")
            assert pull.dropped == 1

    run(main())


def test_a_flood_of_malformed_messages_is_counted_whole_and_logged_at_a_bounded_rate(tmp_path):
    """A peer sending 500 malformed messages: every one is dropped and counted, the log gets at
    most MALFORMED_LOG_BURST lines in the interval, and the mesh's next message arrives."""
    from structlog.testing import capture_logs

    stream = t.ipc_address(str(tmp_path), "flood")
    flood = 500

    async def main():
        with t.Pull(stream) as pull, t.Push(stream) as push:
            for _ in range(flood):
                await push.send_frames([b"not a message"])
            await push.send(Ready(service="worker", name="w"))
            assert await pull.recv() == Ready(service="worker", name="w")
            return pull.dropped

    with capture_logs() as logs:
        assert run(main()) == flood
    lines = [e for e in logs if e["event"] == "dropped malformed message"]
    assert len(lines) == t.MALFORMED_LOG_BURST < flood  # (the flood takes far less than the interval)
    assert [e["dropped_so_far"] for e in lines] == list(range(1, t.MALFORMED_LOG_BURST + 1))


def test_router_send_to_unknown_identity_raises():
    async def main(address):
        with t.Router(address) as router:
            with pytest.raises(t.UnknownPeer, match="ghost"):
                await router.send(b"ghost", Registered(worker_id="ghost"))

    run(main(t.tcp_address("127.0.0.1", free_tcp_port())))


def test_kv_pages_travel_intact_without_copy_on_receive(address):
    header = KVPagesHeader(
        request_id="r1",
        seq_index=0,
        num_tokens=40,
        layer_start=0,
        layer_end=3,
        num_pages=2,
        dtype="bfloat16",
        page_shape=[2, 16, 2, 64],
        checksum=0,
        first_token_ids=[7],
        last=True,
        page_indices=[0, 1],
    )
    pages = [torch.randn(2, 2, 16, 2, 64).to(torch.bfloat16) for _ in range(3)]  # 64 KiB a layer

    async def main():
        with t.Router(address, options=t.KV) as decode_side, t.Dealer(address, "p0", options=t.KV) as prefill_side:
            await prefill_side.send_frames(encode_tensor_frames(header, pages))
            identity, got, frames = await decode_side.recv_with_frames()
            assert got == dataclasses.replace(header, checksum=got.checksum)
            received = decode_tensor_frames(got, frames)
            assert all(torch.equal(a, b) for a, b in zip(pages, received, strict=True))
            assert [r.data_ptr() for r in received] == [address_of(f) for f in frames]  # no copy
            await decode_side.send(identity, KVPagesAck(request_id="r1", ok=True, error=None))
            assert await prefill_side.recv() == KVPagesAck(request_id="r1", ok=True, error=None)

    run(main())


def test_tensor_message_on_plain_recv_is_dropped():
    header = KVPagesHeader(
        request_id="r1",
        seq_index=0,
        num_tokens=16,
        layer_start=0,
        layer_end=1,
        num_pages=1,
        dtype="float32",
        page_shape=[4],
        checksum=0,
        first_token_ids=[],
        last=True,
        page_indices=[0],
    )

    async def main(address):
        with t.Pull(address, options=t.KV) as pull, t.Push(address, options=t.KV) as push:
            await push.send_frames(encode_tensor_frames(header, [torch.ones(1, 4)]))
            await push.send(
                Heartbeat(
                    worker_id="w",
                    running=0,
                    waiting=0,
                    time=1.0,
                    requests_finished=0,
                    kv=KVPoolLoad(free_pages=1, used_pages=0, total_pages=1, bytes_sent=0, bytes_received=0),
                )
            )
            assert await pull.recv() == Heartbeat(
                worker_id="w",
                running=0,
                waiting=0,
                time=1.0,
                requests_finished=0,
                kv=KVPoolLoad(free_pages=1, used_pages=0, total_pages=1, bytes_sent=0, bytes_received=0),
            )
            assert pull.dropped == 1

    run(main(t.tcp_address("127.0.0.1", free_tcp_port())))


def test_every_socket_sets_its_limits():
    async def main(address):
        with t.Router(address, options=t.KV) as router, t.Dealer(address, "x") as dealer:
            for sock, opts in ((router, t.KV), (dealer, t.CONTROL)):
                z = sock._sock
                assert (z.getsockopt(t.zmq.LINGER), z.getsockopt(t.zmq.MAXMSGSIZE)) == (
                    opts.linger_ms,
                    opts.max_msg_bytes,
                )
                assert z.getsockopt(t.zmq.SNDHWM) == z.getsockopt(t.zmq.RCVHWM) == opts.hwm

    run(main(t.tcp_address("127.0.0.1", free_tcp_port())))


def test_address_validation(tmp_path):
    assert t.validate_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert t.validate_address("tcp://scheduler:5555") == "tcp://scheduler:5555"
    assert t.tcp_address("::1", 5555) == "tcp://[::1]:5555"
    assert t.validate_address("tcp://*:5555", allow_wildcard=True) == "tcp://*:5555"
    assert t.ipc_address(str(tmp_path), "sched") == f"ipc://{tmp_path}/sched"
    for bad in [
        "tcp://*:5555",
        "tcp://0.0.0.0:5555",
        "tcp://[::]:1",
        "tcp://host",
        "tcp://host:0",
        "tcp://host:99999",
        "tcp://ho st:1",
        "udp://h:1",
        "ipc://",
        "inproc://x",
        "h:1",
    ]:
        with pytest.raises(ValueError):
            t.validate_address(bad)
    with pytest.raises(ValueError, match="shorter run dir"):
        t.ipc_address("/" + "d" * 120, "x")
    with pytest.raises(ValueError, match="letters"):
        t.ipc_address(str(tmp_path), "../escape")
    with pytest.raises(ValueError, match="every interface"):
        t.Router("tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="identity"):
        t.Dealer("tcp://127.0.0.1:5555", "")


def test_bind_conflict_is_a_clear_error():
    address = t.tcp_address("127.0.0.1", free_tcp_port())

    async def main():
        with t.Router(address):
            with pytest.raises(OSError, match="cannot bind"):
                t.Pull(address)

    run(main())
