"""Typed asyncio ZeroMQ sockets; with transport_curve.py, the only modules that import zmq.

    Router  bind,    ROUTER_MANDATORY   recv() -> (identity, msg)   send(identity, msg)
    Dealer  connect, fixed identity     recv() -> msg               send(msg)
    Push    connect (or bind)                                       send(msg)
    Pull    bind (or connect)           recv() -> msg
    ThreadDealer  connect, fixed identity, blocking context    send(msg) (never waits)
    FramePublisher, FrameReplier   raw frames for subscribers outside the mesh (vLLM's KV events)


Request channels are ROUTER/DEALER, streams PUSH/PULL; never PUB/SUB within the mesh. Each receive loop
decodes with `pagemesh.common.protocol.decode`; a malformed message is logged, counted in `dropped` and
skipped, so `recv()` only ever returns valid messages. Messages with tensor frames (KV pages)
are received with `recv_with_frames()`, which also returns those frames without copying them.

Sends use `copy=False`: frames of 64 KiB and more (KV pages) go to ZeroMQ without a copy, so a
caller must not modify a tensor it sent until the peer acknowledged it (KVPagesAck).

CurveZMQ: with the mesh's keys (`pagemesh keys DIR`, then `--zmq-keys DIR` or $PAGEMESH_ZMQ_KEYS
on every process) every socket is encrypted and authenticated: the keys and the gatekeeper that
checks them are in `common/transport_curve.py`, the one other module that imports zmq. Without
keys nothing changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from pagemesh.common.addresses import MAX_IPC_PATH, bindable, ipc_address, tcp_address, validate_address  # noqa: F401 - re-exported
from pagemesh.common.log_limit import LogLimiter
from pagemesh.common.protocol import Message, ProtocolError, decode, encode
from pagemesh.common.transport_curve import mesh_keys, secure, stop_gatekeepers

log = structlog.get_logger()

# a socket logs at most this many malformed messages in an interval (a flooding peer fills no disk)
MALFORMED_LOG_BURST = 20
MALFORMED_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class SocketOptions:
    """Limits every socket sets explicitly instead of inheriting libzmq's defaults.

    hwm: messages queued per peer in each direction (SNDHWM and RCVHWM). At the limit a send
      waits (backpressure) rather than queueing without bound.
    max_msg_bytes: MAXMSGSIZE, checked by libzmq per frame on receive; a peer that sends a
      larger frame is disconnected before its bytes are buffered.
    linger_ms: how long close() may keep unsent messages to flush them.
    """

    hwm: int
    max_msg_bytes: int
    linger_ms: int


# Control messages are small and many: a deep queue, a 64 MiB frame bound (a prompt of
# MAX_STR_LEN characters fits), and up to 1 s on close to flush the last replies.
CONTROL = SocketOptions(hwm=10_000, max_msg_bytes=64 << 20, linger_ms=1_000)
# KV transfers are few and large (one frame = one layer's pages): a shallow queue bounds the
# memory held in flight, and nothing lingers on close (the receiver's transfer deadline covers
# a lost transfer; flushing gigabytes would only delay shutdown).
KV = SocketOptions(hwm=8, max_msg_bytes=2 << 30, linger_ms=0)


class UnknownPeer(ConnectionError):
    """A Router send to an identity that is not connected (ROUTER_MANDATORY)."""


# --------------------------------------------------------------------------- sockets


def close_all(linger_ms: int = CONTROL.linger_ms) -> None:
    """Close every socket of the process's shared context, each flushing what it still holds for
    at most `linger_ms`, and end the context's I/O threads: what interpreter finalization would
    do, for a process that exits without it (common.process.exit_fast)."""
    stop_gatekeepers()  # their threads close their own sockets first: a socket is one thread's
    zmq.asyncio.Context.instance().destroy(linger=linger_ms)


class _Socket:
    """One zmq.asyncio socket with the options set, bound or connected, that decodes on receive."""

    def __init__(
        self,
        kind: int,
        address: str,
        *,
        bind: bool,
        options: SocketOptions,
        allow_wildcard: bool = False,
        identity: bytes | None = None,
        context: zmq.asyncio.Context | None = None,
    ):
        validate_address(address, allow_wildcard=allow_wildcard and bind)
        self.options = options
        self.dropped = 0  # malformed messages skipped
        self._drop_log = LogLimiter(MALFORMED_LOG_BURST, MALFORMED_LOG_INTERVAL_S)
        self._sock = (context or zmq.asyncio.Context.instance()).socket(kind)
        try:
            self._sock.setsockopt(zmq.LINGER, options.linger_ms)
            self._sock.setsockopt(zmq.MAXMSGSIZE, options.max_msg_bytes)
            self._sock.setsockopt(zmq.SNDHWM, options.hwm)
            self._sock.setsockopt(zmq.RCVHWM, options.hwm)
            if kind == zmq.ROUTER:
                self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # A worker restarted under the same id takes its identity over from the dead one.
                self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if identity is not None:
                self._sock.setsockopt(zmq.ROUTING_ID, identity)
            if (keys := mesh_keys()) is not None:
                secure(self._sock, keys, server=bind)
            if bind:
                self._sock.bind(bindable(address))
            else:
                self._sock.connect(address)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise OSError(f"cannot {'bind' if bind else 'connect'} {address}: {e}") from e
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else address

    async def _send(self, frames: Sequence[object]) -> None:
        await self._sock.send_multipart(frames, copy=False)

    async def _recv(self, routed: bool, want_frames: bool) -> tuple[bytes | None, Message, list]:
        """Next valid message: (identity or None, message, tensor frames)."""
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            identity = frames[0].bytes if routed else None
            body = frames[1:] if routed else frames
            try:
                msg = decode(body)
            except ProtocolError as e:
                self._drop(identity, str(e))
                continue
            tensor_frames = [f.buffer for f in body[2:]]
            if tensor_frames and not want_frames:
                self._drop(identity, f"{type(msg).__name__} carries tensor frames: use recv_with_frames()")
                continue
            return identity, msg, tensor_frames

    def _drop(self, identity: bytes | None, error: str) -> None:
        """Count a malformed message; log it unless this socket already logged
        MALFORMED_LOG_BURST of them in the last MALFORMED_LOG_INTERVAL_S (a flood: the next
        line written says how many were left out)."""
        self.dropped += 1
        left_out = self._drop_log.admit("malformed", time.monotonic())
        if left_out is not None:
            log.warning(
                "dropped malformed message",
                socket=type(self).__name__,
                address=self.address,
                peer=identity,
                error=error,
                dropped_so_far=self.dropped,
                **({"not_logged_since_last": left_out} if left_out else {}),
            )

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class Router(_Socket):
    """Binds; serves many DEALER peers addressed by their identity. Sending to an identity
    that is not connected raises UnknownPeer instead of dropping silently."""

    def __init__(
        self,
        address: str,
        *,
        options: SocketOptions = CONTROL,
        allow_wildcard: bool = False,
        context: zmq.asyncio.Context | None = None,
    ):
        super().__init__(
            zmq.ROUTER, address, bind=True, options=options, allow_wildcard=allow_wildcard, context=context
        )

    async def recv(self) -> tuple[bytes, Message]:
        identity, msg, _ = await self._recv(routed=True, want_frames=False)
        return identity, msg

    async def recv_with_frames(self) -> tuple[bytes, Message, list[memoryview]]:
        return await self._recv(routed=True, want_frames=True)

    async def send(self, identity: bytes, msg: Message) -> None:
        await self.send_frames(identity, encode(msg))

    async def send_frames(self, identity: bytes, frames: Sequence[object]) -> None:
        """Send pre-encoded frames (e.g. from encode_tensor_frames)."""
        try:
            await self._send([identity, *frames])
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise UnknownPeer(f"{self.address}: no connected peer with identity {identity!r}") from None
            raise


class Dealer(_Socket):
    """Connects to a Router under a fixed identity (the worker or service id)."""

    def __init__(
        self,
        address: str,
        identity: str,
        *,
        options: SocketOptions = CONTROL,
        context: zmq.asyncio.Context | None = None,
    ):
        raw = identity.encode()
        if not 1 <= len(raw) <= 255 or raw[0] == 0:
            raise ValueError(f"identity {identity!r}: 1 to 255 bytes, not starting with NUL")
        self.identity = raw
        super().__init__(zmq.DEALER, address, bind=False, options=options, identity=raw, context=context)

    async def recv(self) -> Message:
        return (await self._recv(routed=False, want_frames=False))[1]

    async def recv_with_frames(self) -> tuple[Message, list[memoryview]]:
        _, msg, frames = await self._recv(routed=False, want_frames=True)
        return msg, frames

    async def send(self, msg: Message) -> None:
        await self._send(encode(msg))

    async def send_frames(self, frames: Sequence[object]) -> None:
        await self._send(frames)


class Push(_Socket):
    """One-way stream sender; connects by default (the receiver binds)."""

    def __init__(
        self,
        address: str,
        *,
        bind: bool = False,
        options: SocketOptions = CONTROL,
        allow_wildcard: bool = False,
        context: zmq.asyncio.Context | None = None,
    ):
        super().__init__(zmq.PUSH, address, bind=bind, options=options, allow_wildcard=allow_wildcard, context=context)

    async def send(self, msg: Message) -> None:
        await self._send(encode(msg))

    async def send_frames(self, frames: Sequence[object]) -> None:
        await self._send(frames)


class Pull(_Socket):
    """One-way stream receiver; binds by default (many pushers fan in)."""

    def __init__(
        self,
        address: str,
        *,
        bind: bool = True,
        options: SocketOptions = CONTROL,
        allow_wildcard: bool = False,
        context: zmq.asyncio.Context | None = None,
    ):
        super().__init__(zmq.PULL, address, bind=bind, options=options, allow_wildcard=allow_wildcard, context=context)

    async def recv(self) -> Message:
        return (await self._recv(routed=False, want_frames=False))[1]

    async def recv_with_frames(self) -> tuple[Message, list[memoryview]]:
        _, msg, frames = await self._recv(routed=False, want_frames=True)
        return msg, frames


class ThreadDealer:
    """A send-only DEALER for one plain (non-asyncio) thread, e.g. a heartbeat sender that must
    go on while the event loop's thread computes. It has its own socket (zmq sockets are not
    thread-safe: use it from the thread that sends) on the process's blocking context. `send`
    never waits: with the queue full (the peer gone) the message is dropped and False returned."""

    def __init__(self, address: str, identity: str, *, options: SocketOptions = CONTROL):
        validate_address(address)
        self.address = address
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, options.linger_ms)
        self._sock.setsockopt(zmq.SNDHWM, options.hwm)
        self._sock.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: its peer sends it nothing
        self._sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        if (keys := mesh_keys()) is not None:
            secure(self._sock, keys, server=False)
        self._sock.connect(address)

    def send(self, msg: Message) -> bool:
        try:
            self._sock.send_multipart(encode(msg), flags=zmq.DONTWAIT, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._sock.close()


# --------------------------------------------------------------------------- outside subscribers


class FramePublisher:
    """A PUB socket of raw frames for subscribers outside the mesh, in their own format (vLLM's KV
    cache events: workers/llm/kv_events_publisher.py), on the process's blocking context, used by
    one thread. `send` never waits: a subscriber that falls `hwm` messages behind misses messages,
    as PUB does. As vLLM's publisher: binds a wildcard (`tcp://*:5557`), ipc:// or inproc://
    endpoint, connects to any other. Plain (no CurveZMQ): its subscribers have no mesh keys."""

    def __init__(self, endpoint: str, hwm: int):
        self.endpoint = endpoint
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self.binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        _bind_or_connect(self._sock, endpoint, self.binds)

    def send(self, frames: Sequence[bytes]) -> None:
        self._sock.send_multipart(frames)

    def close(self) -> None:
        self._sock.close(linger=0)


class FrameReplier:
    """A bound ROUTER socket answering REQ clients with raw frames, used by one thread (the one
    that calls `next_request` and `reply`) on the process's blocking context. Plain, as
    FramePublisher."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._sock, endpoint, bind=True)

    def next_request(self, timeout_ms: int) -> tuple[bytes, list[bytes]] | None:
        """(the client's identity, its request's frames after the empty delimiter), or None when
        none came within `timeout_ms`."""
        if not self._sock.poll(timeout_ms):
            return None
        identity, *rest = self._sock.recv_multipart()
        return identity, rest[1:] if rest and rest[0] == b"" else rest

    def reply(self, identity: bytes, frames: Sequence[bytes]) -> None:
        self._sock.send_multipart([identity, b"", *frames])

    def close(self) -> None:
        self._sock.close(linger=0)


def _bind_or_connect(sock: zmq.Socket, endpoint: str, bind: bool) -> None:
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise OSError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {e}") from e
