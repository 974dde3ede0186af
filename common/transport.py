"""Typed asyncio ZeroMQ sockets; the only module that imports zmq.

    Router  bind,    ROUTER_MANDATORY   recv() -> (identity, msg)   send(identity, msg)
    Dealer  connect, fixed identity     recv() -> msg               send(msg)
    Push    connect (or bind)                                       send(msg)
    Pull    bind (or connect)           recv() -> msg
    ThreadDealer  connect, fixed identity, blocking context    send(msg) (never waits)


Request channels are ROUTER/DEALER, streams PUSH/PULL; never PUB/SUB. Each receive loop
decodes with `common.protocol.decode`; a malformed message is logged, counted in `dropped` and
skipped, so `recv()` only ever returns valid messages. Messages with tensor frames (KV pages)
are received with `recv_with_frames()`, which also returns those frames without copying them.

Sends use `copy=False`: frames of 64 KiB and more (KV pages) go to ZeroMQ without a copy, so a
caller must not modify a tensor it sent until the peer acknowledged it (KVPagesAck).

CurveZMQ: with the mesh's keys (`pagemesh keys DIR`, then `--zmq-keys DIR` or $PAGEMESH_ZMQ_KEYS
on every process) every socket is encrypted and authenticated. The mesh has ONE keypair: every
process binds some socket (the gateway its replies, a decode worker its KV endpoint) and connects
others, so each would hold a server and a client secret anyway; what the keys stop is a peer
that has neither. The bind side is a CURVE server whose gatekeeper (a thread per context) lets
in only clients that present the mesh's public key: a peer without keys fails the handshake, one
with other keys is refused, and neither gets a byte to a receive loop. Without keys nothing changes.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.monitor
from zmq.utils import z85

from common.addresses import MAX_IPC_PATH, bindable, ipc_address, tcp_address, validate_address  # noqa: F401 - re-exported
from common.protocol import Message, ProtocolError, decode, encode

log = structlog.get_logger()


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


# --------------------------------------------------------------------------- CurveZMQ

KEYS_ENV = "PAGEMESH_ZMQ_KEYS"  # the keys folder; `--zmq-keys DIR` sets it (children inherit it)
KEY_NAME = "mesh"  # DIR/mesh.key holds the public key, DIR/mesh.key_secret both keys
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
ZAP_DOMAIN = b"pagemesh"
_ZAP_POLL_MS = 200  # how often the gatekeeper's thread looks whether it should stop
# a peer without keys (mechanism NULL against CURVE): the server sees PROTOCOL, or NO_DETAIL
# when the peer's side gave up first; a refused key (AUTH) is logged where ZAP answers it
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_REFUSAL_LOG_S = 10.0  # a kind of refusal is logged at most this often (with the count so far)


@dataclass(frozen=True)
class MeshKeys:
    """The mesh's CurveZMQ keypair, Z85-encoded (40 bytes each); `folder` is where it was read."""

    public: bytes
    secret: bytes
    folder: str


def make_keys(folder: str) -> tuple[str, str]:
    """A new keypair in `folder` (made if missing): (public file, secret file). The secret file
    is readable by its owner only. Never overwrites: a folder that has keys raises FileExistsError."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if os.path.exists(path := os.path.join(folder, KEY_NAME + suffix)):
            raise FileExistsError(f"{path} exists: the mesh's keys are made once (remove the folder to replace them)")
    public, secret = zmq.auth.create_certificates(folder, KEY_NAME)
    os.chmod(secret, 0o600)
    return str(public), str(secret)


def load_keys(folder: str) -> MeshKeys:
    """The keypair `make_keys` wrote; ValueError saying what is wrong (missing, not a keypair)."""
    path = os.path.join(folder, KEY_NAME + ".key_secret")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"zmq keys {folder}: {e} (make them with `pagemesh keys {folder}`)") from None
    if secret is None or len(public) != 40 or len(secret) != 40:
        raise ValueError(f"zmq keys {path}: not a CurveZMQ keypair (make them with `pagemesh keys {folder}`)")
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as e:
        raise ValueError(f"zmq keys {path}: invalid secret key ({e})") from None
    if derived != public:
        raise ValueError(f"zmq keys {path}: the public key is not the secret key's")
    return MeshKeys(public=public, secret=secret, folder=folder)


class _Keys:
    """The keys of the folder $PAGEMESH_ZMQ_KEYS names, read when a socket is made after the
    variable changed (in a process: once); None without it (plain ZeroMQ)."""

    keys: MeshKeys | None = None
    loaded_from: str | None = None

    def get(self) -> MeshKeys | None:
        folder = os.environ.get(KEYS_ENV) or None
        if folder != self.loaded_from:
            self.keys, self.loaded_from = (load_keys(folder) if folder else None), folder
        return self.keys


_KEYS = _Keys()


def mesh_keys() -> MeshKeys | None:
    """The keys every socket this process makes uses (see _Keys); ValueError for a bad folder."""
    return _KEYS.get()


class Gatekeeper:
    """The CURVE servers' guard for one context, in its own thread (a long step on the event
    loop's thread delays no handshake):

    - answers libzmq's authentication requests (ZAP): a client whose public key is in `allowed`
      (the mesh's) is let in; any other is refused;
    - watches each server socket's handshakes (a monitor): a peer without keys fails there.

    Both are logged and counted in `refused`."""

    def __init__(self, context: zmq.Context):
        self.allowed: set[bytes] = set()  # Z85 public keys; a process has one (a test may use more)
        self.refused = 0
        self._logged_at: dict[str, float] = {}  # kind of refusal -> when last logged
        self._context = context
        self._stop = threading.Event()
        self._monitor_ids = itertools.count()
        self._new_monitors: list[zmq.Socket] = []  # handed to the thread (under _lock)
        self._lock = threading.Lock()
        # blocking sockets on the same context (ZAP is per context); from here on only the thread
        # uses them (starting the thread, and the lock, are the memory barriers zmq asks for)
        self._zap = context.socket(zmq.REP, socket_class=zmq.Socket)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="zmq-gatekeeper", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        """Log the failed handshakes of a server socket (until it closes)."""
        endpoint = f"inproc://pagemesh.monitor.{next(self._monitor_ids)}"  # never reused
        sock.monitor(endpoint, _HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
        monitor = self._context.socket(zmq.PAIR, socket_class=zmq.Socket)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(endpoint)
        with self._lock:
            self._new_monitors.append(monitor)

    def _serve(self) -> None:
        poller, monitors = zmq.Poller(), []
        poller.register(self._zap, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    for monitor in self._new_monitors:
                        poller.register(monitor, zmq.POLLIN)
                    monitors += self._new_monitors
                    self._new_monitors.clear()
                for sock, _ in poller.poll(_ZAP_POLL_MS):
                    if sock is self._zap:
                        self._zap.send_multipart(self.answer(self._zap.recv_multipart()))
                    elif not self._handshake_event(sock.recv_multipart()):  # its socket closed
                        poller.unregister(sock)
                        monitors.remove(sock)
                        sock.close(linger=0)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in [self._zap, *monitors]:
                sock.close(linger=0)

    def _handshake_event(self, frames: list[bytes]) -> bool:
        """Log one monitor event; False once the watched socket closed."""
        event = zmq.utils.monitor.parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return False
        self._refuse(
            "refused a peer: its handshake failed (no keys, or not CurveZMQ)",
            address=event["endpoint"].decode(errors="replace"),
            error=hex(event["value"]),
        )
        return True

    def _refuse(self, what: str, **fields) -> None:
        """Count a refusal; log it unless the same kind was logged less than _REFUSAL_LOG_S ago (a
        peer without keys reconnects, and is refused, ten times a second)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at.get(what, -_REFUSAL_LOG_S) >= _REFUSAL_LOG_S:
            self._logged_at[what] = now
            log.warning(what, refused_so_far=self.refused, **fields)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """ZAP request [version, id, domain, address, identity, mechanism, credentials...] ->
        reply [version, id, status code, status text, user id, metadata]."""
        version, request_id = (request + [b"", b""])[:2]
        if len(request) >= 6 and request[5] == b"NULL":  # a socket of this context without keys:
            return [version, request_id, b"200", b"OK", b"", b""]  # (a CURVE server never asks)
        if len(request) >= 7 and request[5] == b"CURVE" and len(request[6]) == 32:
            if z85.encode(request[6]) in self.allowed:
                return [version, request_id, b"200", b"OK", b"mesh", b""]
        mechanism = request[5].decode(errors="replace") if len(request) > 5 else "?"
        peer = request[3].decode(errors="replace") if len(request) > 3 else "?"
        self._refuse("refused a peer: not the mesh's key", peer_address=peer, mechanism=mechanism)
        return [version, request_id, b"400", b"not the mesh's key", b"", b""]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _ZAP_POLL_MS / 1000 + 1)


_GATEKEEPERS: dict[int, Gatekeeper] = {}  # context address -> its gatekeeper
_GATEKEEPERS_LOCK = threading.Lock()


def gatekeeper(context: zmq.Context | None = None) -> Gatekeeper | None:
    """The gatekeeper of `context` (default: the process's), or None when no CURVE server was
    made on it."""
    return _GATEKEEPERS.get((context or zmq.asyncio.Context.instance()).underlying)


def _secure(sock: zmq.Socket, keys: MeshKeys, *, server: bool) -> None:
    """CurveZMQ options on a socket before it binds or connects: the bind side is the server."""
    if server:
        with _GATEKEEPERS_LOCK:  # started before the first server socket: no handshake goes unchecked
            guard = _GATEKEEPERS.get(sock.context.underlying)
            if guard is None:
                guard = _GATEKEEPERS[sock.context.underlying] = Gatekeeper(sock.context)
            guard.allowed.add(keys.public)
        guard.watch(sock)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


# --------------------------------------------------------------------------- sockets


def close_all(linger_ms: int = CONTROL.linger_ms) -> None:
    """Close every socket of the process's shared context, each flushing what it still holds for
    at most `linger_ms`, and end the context's I/O threads: what interpreter finalization would
    do, for a process that exits without it (common.process.exit_fast)."""
    with _GATEKEEPERS_LOCK:  # their threads close their own sockets first: a socket is one thread's
        for guard in _GATEKEEPERS.values():
            guard.stop()
        _GATEKEEPERS.clear()
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
                _secure(self._sock, keys, server=bind)
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
        self.dropped += 1
        log.warning(
            "dropped malformed message", socket=type(self).__name__, address=self.address, peer=identity, error=error
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
            _secure(self._sock, keys, server=False)
        self._sock.connect(address)

    def send(self, msg: Message) -> bool:
        try:
            self._sock.send_multipart(encode(msg), flags=zmq.DONTWAIT, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._sock.close()
