"""A whole `pagemesh up` mesh as a subprocess (or its processes started one by one, to kill or
restart one), and its /metrics: for tests, experiments and benchmarks that need a real mesh on
this machine."""

from __future__ import annotations

import asyncio
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


class SeparateProcesses:
    """The processes `pagemesh up` would start, started one by one as compose starts them and
    then left alone (`pagemesh up` stops the whole mesh when one exits), so that one can be
    killed or restarted. `start()` returns once every process is ready; `stop()` ends them."""

    def __init__(self, run_dir: str, *flags: str):
        from services import launcher

        self.args = launcher.parse([*flags, "--threads-per-worker", "1", "--port", str(free_port()),
                                    "--run-dir", run_dir])
        self.argv = dict(launcher.plan(self.args, run_dir))
        self.mesh = launcher.Mesh(self.args)
        self.children = self.mesh.children
        self.url = f"http://127.0.0.1:{self.args.port}"

    def start(self) -> None:
        asyncio.run(self.mesh.start())

    def stop(self) -> None:
        self.mesh.stop()

    def kill(self, name: str) -> None:
        self.children[name].send_signal(signal.SIGKILL)
        self.children[name].wait()

    def restart(self, name: str) -> None:
        """SIGKILL the process and start it again with the same arguments (no start-up report:
        nobody listens on the launcher's ready socket any more)."""
        self.kill(name)
        argv = self.argv[name]
        at = argv.index("--ready-address")
        self.children[name] = subprocess.Popen([sys.executable, "-m", "services.cli", *argv[:at], *argv[at + 2:]])


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
