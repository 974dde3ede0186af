"""CurveZMQ for the typed sockets of `common/transport.py`: the mesh's keys and the gatekeeper
that checks them. With transport.py, the only modules that import zmq.

With the mesh's keys (`pagemesh keys DIR`, then `--zmq-keys DIR` or $PAGEMESH_ZMQ_KEYS on every
process) every socket is encrypted and authenticated. Every process binds some socket (the
gateway its replies, a decode worker its KV endpoint) and connects others. The bind side is a
CURVE server with the mesh's keypair (DIR/mesh.key*: a client must know the server's public key
before it connects, and a socket does not know which process is at an address); its gatekeeper (a
thread per context) lets in only clients whose public key is admitted. A peer without keys, or
with a public key but not its secret, fails the handshake; one with another key is refused;
neither gets a byte to a receive loop. Without keys nothing changes.

Which client keys are admitted:
- shared (`pagemesh keys DIR`): every process presents the mesh's pair, the one key admitted;
- per process (`pagemesh keys DIR --process NAME...`, then `--zmq-key-name NAME` or
  $PAGEMESH_ZMQ_KEY_NAME): a process presents its own pair (DIR/NAME.key*), and the binding sides
  admit the public keys in DIR/allowed/ (the allow-list, read as zmq.auth's `configure_curve`
  reads a folder) and no other: not the mesh's, whose secret every binding process holds. A
  process is shut out by taking its key off the allow-list (and restarting the others).

    make_keys(DIR) / make_process_keys(DIR, names) / load_keys(DIR, name)   the key files
    mesh_keys()                       the keys $PAGEMESH_ZMQ_KEYS (and $PAGEMESH_ZMQ_KEY_NAME) name, or None
    check_admitted(keys)              ValueError when the folder's allow-list leaves this process out
    secure(sock, keys, server=...)    CURVE options on a socket before it binds or connects
    gatekeeper(context)               a context's gatekeeper (its `refused` count), once a server was made
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterable
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
KEY_NAME_ENV = "PAGEMESH_ZMQ_KEY_NAME"  # this process's own pair in the folder; `--zmq-key-name NAME` sets it
KEY_NAME = "mesh"  # DIR/mesh.key holds the public key, DIR/mesh.key_secret both keys
ALLOWED = "allowed"  # DIR/allowed/NAME.key: the allow-list, the public keys binding sides admit
_PROCESS_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a file name, never a path
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
ZAP_DOMAIN = b"pagemesh"
_ZAP_POLL_MS = 200  # how often the gatekeeper's thread looks whether it should stop
# a peer without keys (mechanism NULL against CURVE): the server sees PROTOCOL, or NO_DETAIL
# when the peer's side gave up first; a refused key (AUTH) is logged where ZAP answers it
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_REFUSAL_LOG_S = 10.0  # a kind of refusal is logged at most this often (with the count so far)
NO_KEYS = "refused a peer: its handshake failed (no keys, or not CurveZMQ)"
# a box that does not open: a public key presented without its secret, or another server key
FORGED_KEY = "refused a peer: its keys do not match (a public key without its secret, or another mesh's)"
NOT_ADMITTED = "refused a peer: not the mesh's key"  # (in per-process mode: not on the allow-list)


@dataclass(frozen=True)
class MeshKeys:
    """The keys one process uses, read from `folder`, Z85-encoded (40 bytes each).

    public, secret: the mesh's pair, every binding side's server key (clients know its public half)
    client_public, client_secret: what this process presents when it connects: its own pair
      (`name`), or the mesh's (name "mesh")
    admitted: the client public keys its binding sides let in: DIR/allowed/'s, or the mesh's
      where the folder has no allow-list"""

    public: bytes
    secret: bytes
    folder: str
    name: str
    client_public: bytes
    client_secret: bytes
    admitted: frozenset[bytes]


def check_key_name(name: str) -> str:
    """A process's key name (a file name in the keys folder), or ValueError saying why not."""
    if not _PROCESS_KEY_NAME.fullmatch(name):
        raise ValueError(f"key name {name!r}: letters, digits, '.', '_' and '-' only (up to 64, no leading '.')")
    if name == KEY_NAME:
        raise ValueError(f"key name {name!r} is the shared mesh pair's: choose a process's name")
    return name


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


def make_process_keys(folder: str, names: Iterable[str]) -> list[str]:
    """A keypair per process name in `folder` (DIR/NAME.key, DIR/NAME.key_secret readable by its
    owner only), each public key on the allow-list (DIR/allowed/NAME.key), and the mesh's pair
    when the folder has none yet: the files written. Checks every name first and writes nothing
    when one is invalid or has files already (FileExistsError: a key is never overwritten)."""
    names = list(dict.fromkeys(check_key_name(name) for name in names))
    allowed = os.path.join(folder, ALLOWED)
    for name in names:
        for path in (os.path.join(folder, name + ".key"), os.path.join(folder, name + ".key_secret")):
            if os.path.exists(path):
                raise FileExistsError(f"{path} exists: a process's keys are made once (remove its files first)")
        if os.path.exists(path := os.path.join(allowed, name + ".key")):
            raise FileExistsError(f"{path} exists: {name!r} is on the allow-list already")
    written = [] if os.path.exists(os.path.join(folder, KEY_NAME + ".key_secret")) else list(make_keys(folder))
    os.makedirs(allowed, mode=0o700, exist_ok=True)
    for name in names:
        public, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
        written += [str(public), str(secret), shutil.copyfile(public, os.path.join(allowed, name + ".key"))]
    return written


def _load_pair(folder: str, name: str) -> tuple[bytes, bytes]:
    """The keypair DIR/NAME.key_secret holds, checked; ValueError saying what is wrong."""
    path = os.path.join(folder, name + ".key_secret")
    make = f"pagemesh keys {folder}" + ("" if name == KEY_NAME else f" --process {name}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"zmq keys {folder}: {e} (make them with `{make}`)") from None
    if secret is None or len(public) != 40 or len(secret) != 40:
        raise ValueError(f"zmq keys {path}: not a CurveZMQ keypair (make them with `{make}`)")
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as e:
        raise ValueError(f"zmq keys {path}: invalid secret key ({e})") from None
    if derived != public:
        raise ValueError(f"zmq keys {path}: the public key is not the secret key's")
    return public, secret


def allow_list(folder: str) -> frozenset[bytes] | None:
    """The public keys of DIR/allowed/*.key (what zmq.auth's `configure_curve` would read), or
    None where the folder has no allow-list; ValueError for a file that holds no public key."""
    allowed = os.path.join(folder, ALLOWED)
    if not os.path.isdir(allowed):
        return None
    try:
        return frozenset(zmq.auth.load_certificates(allowed))
    except (OSError, ValueError) as e:
        raise ValueError(f"zmq keys {allowed}: {e}") from None


def load_keys(folder: str, name: str | None = None) -> MeshKeys:
    """The keys a process uses (see MeshKeys): the mesh's pair, its own pair `name` (default:
    the mesh's), and the admitted keys; ValueError saying what is wrong (missing, not a keypair,
    an invalid name)."""
    public, secret = _load_pair(folder, KEY_NAME)
    name = check_key_name(name) if name else KEY_NAME
    client_public, client_secret = (public, secret) if name == KEY_NAME else _load_pair(folder, name)
    allowed = allow_list(folder)
    return MeshKeys(
        public=public,
        secret=secret,
        folder=folder,
        name=name,
        client_public=client_public,
        client_secret=client_secret,
        admitted=frozenset({public}) if allowed is None else allowed,
    )


def check_admitted(keys: MeshKeys) -> None:
    """ValueError when the folder's binding sides would refuse this process's own key: a process
    left off the allow-list, or one without a name where the folder has one (a process's start
    says so, rather than its peers refusing it)."""
    if keys.client_public in keys.admitted:
        return
    allowed = os.path.join(keys.folder, ALLOWED)
    if keys.name == KEY_NAME:
        raise ValueError(
            f"{allowed} is an allow-list of process keys: start the process with --zmq-key-name NAME "
            f"(its pair from `pagemesh keys {keys.folder} --process NAME`)"
        )
    raise ValueError(f"the key {keys.name!r} is not on the allow-list {allowed}: the mesh would refuse it")


class _Keys:
    """The keys of the folder $PAGEMESH_ZMQ_KEYS names (the pair $PAGEMESH_ZMQ_KEY_NAME names in
    it), read when a socket is made after either variable changed (in a process: once); None
    without a folder (plain ZeroMQ)."""

    keys: MeshKeys | None = None
    loaded_from: tuple[str | None, str | None] = (None, None)

    def get(self) -> MeshKeys | None:
        source = (os.environ.get(KEYS_ENV) or None, os.environ.get(KEY_NAME_ENV) or None)
        if source != self.loaded_from:
            folder, name = source
            self.keys, self.loaded_from = (load_keys(folder, name) if folder else None), source
        return self.keys


_KEYS = _Keys()


def mesh_keys() -> MeshKeys | None:
    """The keys every socket this process makes uses (see _Keys); ValueError for a bad folder."""
    return _KEYS.get()


class Gatekeeper:
    """The CURVE servers' guard for one context, in its own thread (a long step on the event
    loop's thread delays no handshake):

    - answers libzmq's authentication requests (ZAP): a client whose public key is in `allowed`
      (the admitted keys: the mesh's, or the allow-list's) is let in; any other is refused;
    - watches each server socket's handshakes (a monitor): a peer without keys fails there, and
      so does one that presents a public key without its secret (CurveZMQ checks that before ZAP).

    Both are logged and counted: in all (`refused`) and by kind (`refusals`, NO_KEYS, FORGED_KEY, NOT_ADMITTED)."""

    def __init__(self, context: zmq.Context):
        self.allowed: set[bytes] = set()  # Z85 public keys: a process's folder's (a test may add more)
        self.refused = 0
        self.refusals: Counter[str] = Counter()  # by kind (the log line's event)
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
            FORGED_KEY if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC else NO_KEYS,
            address=event["endpoint"].decode(errors="replace"),
            error=hex(event["value"]),
        )
        return True

    def _refuse(self, what: str, **fields) -> None:
        """Count a refusal; log it unless the same kind was logged less than _REFUSAL_LOG_S ago (a
        peer without keys reconnects, and is refused, ten times a second)."""
        self.refused += 1
        self.refusals[what] += 1
        if self._log_limit.admit(what, time.monotonic()) is not None:
            log.warning(what, refused_so_far=self.refused, **fields)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """ZAP request [version, id, domain, address, identity, mechanism, credentials...] ->
        reply [version, id, status code, status text, user id, metadata]."""
        version, request_id = (request + [b"", b""])[:2]
        mechanism = request[5] if len(request) > 5 else b"?"
        if mechanism == b"NULL":  # a socket of this context without keys (a CURVE server never asks)
            return [version, request_id, b"200", b"OK", b"", b""]
        public_key = request[6] if mechanism == b"CURVE" and len(request) > 6 and len(request[6]) == 32 else None
        if public_key is not None and z85.encode(public_key) in self.allowed:
            return [version, request_id, b"200", b"OK", b"mesh", b""]
        peer = request[3].decode(errors="replace") if len(request) > 3 else "?"
        shown = {"public_key": z85.encode(public_key).decode()} if public_key else {}  # to put on the allow-list
        self._refuse(NOT_ADMITTED, peer_address=peer, mechanism=mechanism.decode(errors="replace"), **shown)
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
    """CurveZMQ options on a socket before it binds or connects: the bind side is the server (the
    mesh's pair), the connecting side presents this process's pair."""
    if server:
        with _GATEKEEPERS_LOCK:  # started before the first server socket: no handshake goes unchecked
            guard = _GATEKEEPERS.get(sock.context.underlying)
            if guard is None:
                guard = _GATEKEEPERS[sock.context.underlying] = Gatekeeper(sock.context)
            guard.allowed.update(keys.admitted)
        guard.watch(sock)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def stop_gatekeepers(context: zmq.Context | None = None) -> None:
    """Stop every context's gatekeeper thread (each closes its own sockets), or only that of
    `context`: before the context is destroyed."""
    with _GATEKEEPERS_LOCK:
        for underlying in [context.underlying] if context is not None else list(_GATEKEEPERS):
            if (guard := _GATEKEEPERS.pop(underlying, None)) is not None:
                guard.stop()
