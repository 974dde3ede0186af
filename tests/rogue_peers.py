"""Rogue ZeroMQ peers for the mesh's security tests: raw pyzmq sockets (not common.transport,
which would bring the mesh's own keys and checks) that connect to a mesh's internal sockets and
send what a careless or hostile peer might."""

from __future__ import annotations

import json
import pickle

import zmq

from pagemesh.common.protocol import Ready, encode


def connect(address: str, kind: int, *, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None):
    """A DEALER or PUSH to `address`; with `keys` (public, secret) and `server_key`, a CurveZMQ
    client. Nothing lingers when it closes."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.DEALER:
        sock.setsockopt(zmq.ROUTING_ID, b"rogue-" + str(id(sock)).encode())
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
    sock.connect(address)
    return sock


class Pickled:
    """What a pickle payload would rebuild if anyone unpickled it."""


# What a rogue sends to a socket of the mesh, each a list of frames; none is a valid message.
MALFORMED = {
    "malformed msgpack": [b"Ready", b"\xc1\xff\x00"],
    "unknown type": [b"Shutdown", encode(Ready(service="rogue", name="rogue"))[1]],
    "wrong fields": [b"Ready", b"\x92\x06\x81\xa4evil\xc3"],  # [6, {"evil": true}]
    "pickle payload": [pickle.dumps(Pickled())],
    "pickle body": [b"Ready", pickle.dumps({"service": "rogue", "name": "rogue"})],
    "json body": [b"Ready", json.dumps([6, {"service": "rogue", "name": "rogue"}]).encode()],
}


def logged(lines: list[str], process: str, event: str) -> int:
    """How many of a mesh's json log lines are `event` from `process` (its "name")."""
    count = 0
    for line in list(lines):
        if event in line and line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            count += record.get("name") == process and record.get("event") == event
    return count
