"""A whole `pagemesh up` mesh as a subprocess, and its /metrics: for tests, experiments and
benchmarks that need a real mesh on this machine."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_mesh(*flags: str, env: dict[str, str] | None = None, timeout: float = 300.0):
    """Yields the base URL once `pagemesh up` says it is up; always stops the whole mesh.
    `env` adds environment variables (PAGEMESH_* flags reach every child process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "pagemesh is up" in line:
                up.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while not up.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mesh did not start:\n" + "".join(lines[-40:]))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def metrics(base_url: str) -> dict[str, float]:
    """Samples of /metrics as {'name{labels}': value}."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def per_worker(samples: dict[str, float], name: str) -> dict[str, float]:
    pattern = re.compile(re.escape(name) + r'\{worker="([^"]+)"\}')
    return {m.group(1): v for k, v in samples.items() if (m := pattern.fullmatch(k))}


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
