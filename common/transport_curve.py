"""CurveZMQ for the typed sockets of `common/transport.py`: the mesh's keys and the gatekeeper
that checks them. With transport.py, the only modules that import zmq.

With the mesh's keys (`pagemesh keys DIR`, then `--zmq-keys DIR` or $PAGEMESH_ZMQ_KEYS on every
process) every socket is encrypted and authenticated. The mesh has ONE keypair: every process
binds some socket (the gateway its replies, a decode worker its KV endpoint) and connects others,
so each would hold a server and a client secret anyway; what the keys stop is a peer that has
neither. The bind side is a CURVE server whose gatekeeper (a thread per context) lets in only
clients that present the mesh's public key: a peer without keys fails the handshake, one with
other keys is refused, and neither gets a byte to a receive loop. Without keys nothing changes.

    make_keys(DIR) / load_keys(DIR)   the keypair's files (`pagemesh keys`)
    mesh_keys()                       the keys $PAGEMESH_ZMQ_KEYS names, or None
    secure(sock, keys, server=...)    CURVE options on a socket before it binds or connects
    gatekeeper(context)               a context's gatekeeper (its `refused` count), once a server was made
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.monitor
from zmq.utils import z85

from pagemesh.common.log_limit import LogLimiter

log = structlog.get_logger()

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
        self._log_limit = LogLimiter(burst=1, interval_s=_REFUSAL_LOG_S)  # per kind of refusal
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
        if self._log_limit.admit(what, time.monotonic()) is not None:
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


def secure(sock: zmq.Socket, keys: MeshKeys, *, server: bool) -> None:
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


def stop_gatekeepers() -> None:
    """Stop every context's gatekeeper thread (each closes its own sockets): before the
    process's context is destroyed."""
    with _GATEKEEPERS_LOCK:
        for guard in _GATEKEEPERS.values():
            guard.stop()
        _GATEKEEPERS.clear()
