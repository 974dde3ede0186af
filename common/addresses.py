"""Socket addresses of the mesh: `ipc://PATH` on one machine, `tcp://HOST:PORT` across machines.

Pure (no zmq): `pagemesh.common.transport` re-exports these; configs validate their addresses with them.
"""

from __future__ import annotations

import os
import re
import socket

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")
MAX_IPC_PATH = 107  # sun_path holds 108 bytes including the terminating NUL


def ipc_address(run_dir: str, name: str) -> str:
    """`ipc://<run_dir>/<name>` for processes on one machine; checks the socket path length."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"ipc socket name {name!r}: use letters, digits, '_', '.', '-'")
    return validate_address(f"ipc://{os.path.join(run_dir, name)}")


def tcp_address(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return validate_address(f"tcp://{host}:{port}")


def validate_address(address: str, *, allow_wildcard: bool = False) -> str:
    """Accept `ipc://PATH` or `tcp://HOST:PORT`; a wildcard host (`*`, 0.0.0.0, [::]) only
    with allow_wildcard. Returns the address unchanged; raises ValueError saying what is wrong."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if not path or "\0" in path:
            raise ValueError(f"{address!r}: empty or invalid ipc path")
        if len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"{address!r}: ipc path longer than {MAX_IPC_PATH} bytes; use a shorter run dir")
        return address
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{address!r}: expected tcp://HOST:PORT with a port in 1..65535")
        if host in _WILDCARD_HOSTS:
            if not allow_wildcard:
                raise ValueError(
                    f"{address!r}: binds every interface; configure one host (or allow the wildcard explicitly)"
                )
        elif not _HOST.fullmatch(host):
            raise ValueError(f"{address!r}: invalid host {host!r}")
        return address
    raise ValueError(f"{address!r}: expected ipc://PATH or tcp://HOST:PORT")


def bindable(address: str) -> str:
    """zmq binds to IPs and interface names, not DNS names: `tcp://gateway:5570` binds to the
    address `gateway` resolves to, so one address string serves both ends (compose services
    reach each other by name). Anything that does not resolve is left to zmq (e.g. `eth0`)."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://") :].rpartition(":")
    if host in _WILDCARD_HOSTS or host.startswith("[") or host.replace(".", "").isdigit():
        return address
    try:
        return f"tcp://{socket.gethostbyname(host)}:{port}"
    except OSError:
        return address
