"""A whole `pagemesh up` mesh as a subprocess (or its processes started one by one, to kill or
restart one), and its /metrics: for tests, experiments and benchmarks that need a real mesh on
this machine.

Every wait here follows an event (the launcher's "pagemesh is up" line, a READY message, a
process exiting, a metric reaching a value). The limits only bound a hang: they are sized for a
machine that other work is loading (a 2-core machine at load 10 took 68 s to start a mesh that
starts in 17 s alone), and no passing run depends on them.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager

from pagemesh.common.python_command import python_module

HANG_S = 900.0  # the ceiling of any wait for an event: it bounds a hang, nothing else
LATE_S = 60.0  # how late an event that is due may come on a loaded machine (a test's "within")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_mesh(
    *flags: str,
    env: dict[str, str] | None = None,
    timeout: float = HANG_S,
    output: list[str] | None = None,
    launcher: list[subprocess.Popen] | None = None,
    cwd: str | os.PathLike | None = None,
):
    """Yields the base URL once `pagemesh up` says it is up; always stops the whole mesh.
    `env` adds environment variables (PAGEMESH_* flags reach every child process). `timeout`
    bounds a hang, and is also the launcher's own --ready-timeout (flags may override it).
    `output`, when given, receives the launcher's output lines (its children's logs too) as
    they come; `launcher`, the launcher's process (to signal it). No diffusion worker unless the
    flags ask for one (`--diffusion N`). `cwd`: the folder it starts in (this process's by default)."""
    port = free_port()
    flags = _no_diffusion_unless_asked(flags)
    proc = subprocess.Popen(
        [
            *python_module("pagemesh.services.cli"),
            "up",
            "--port",
            str(port),
            "--ready-timeout",
            str(timeout),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    if launcher is not None:
        launcher.append(proc)
    lines: list[str] = output if output is not None else []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "pagemesh is up" in line:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        started = time.monotonic()
        while not up.wait(0.2):  # the line, or the launcher exiting (it gives up on a failed start)
            if proc.poll() is not None or time.monotonic() - started > timeout:
                reader.join(timeout=LATE_S)  # its last words (why it gave up) come after it exited
                raise RuntimeError(
                    f"mesh did not start (after {time.monotonic() - started:.0f}s):\n" + "".join(lines[-40:])
                )
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=HANG_S)  # the launcher stops its children (SIGKILL after 10 s) and exits
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _no_diffusion_unless_asked(flags: tuple[str, ...]) -> tuple[str, ...]:
    """LLM tests and benchmarks run without the diffusion worker `pagemesh up` starts by default."""
    return flags if "--diffusion" in flags else ("--diffusion", "0", *flags)


class SeparateProcesses:
    """The processes `pagemesh up` would start, started one by one as compose starts them and
    then left alone (`pagemesh up` stops the whole mesh when one exits), so that one can be
    killed or restarted. `start()` returns once every process is ready, `restart()` once the new
    process is; `stop()` ends them."""

    def __init__(self, run_dir: str, *flags: str):
        from pagemesh.services import launcher

        self.args = launcher.parse(
            [
                "--ready-timeout",
                str(HANG_S),
                *_no_diffusion_unless_asked(flags),
                "--threads-per-worker",
                "1",
                "--port",
                str(free_port()),
                "--run-dir",
                run_dir,
            ]
        )
        self.argv = dict(launcher.plan(self.args, run_dir))
        self.mesh = launcher.Mesh(self.args)
        self.children = self.mesh.children
        self.url = f"http://127.0.0.1:{self.args.port}"

    def start(self) -> None:
        asyncio.run(self.mesh.start())

    def stop(self) -> None:
        self.mesh.stop()

    def __enter__(self) -> SeparateProcesses:
        """`start()`; what did start is stopped if it fails."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def kill(self, name: str) -> None:
        self.children[name].send_signal(signal.SIGKILL)
        self.children[name].wait()

    def restart(self, name: str, env: dict[str, str] | None = None) -> float:
        """SIGKILL the process and start it again with the same arguments (and `env` added to this
        process's environment); returns (the monotonic time) once the new process reports READY
        on the launcher's ready socket, bound here again for it."""
        from pagemesh.common.messages import Ready
        from pagemesh.common.transport import Pull, ipc_address

        self.kill(name)

        async def start_and_wait_ready() -> None:
            with Pull(ipc_address(self.mesh.run_dir, "ready")) as ready:
                proc = self.children[name] = subprocess.Popen(
                    [*python_module("pagemesh.services.cli"), *self.argv[name]], env={**os.environ, **(env or {})}
                )
                started = time.monotonic()
                while True:
                    try:
                        msg = await asyncio.wait_for(ready.recv(), timeout=0.5)
                    except TimeoutError:
                        if proc.poll() is not None or time.monotonic() - started > HANG_S:
                            raise RuntimeError(
                                f"restarted {name} never reported ready (exit code {proc.poll()})"
                            ) from None
                        continue
                    if isinstance(msg, Ready) and name in (msg.name, msg.service):
                        return

        asyncio.run(start_and_wait_ready())
        return time.monotonic()


def metrics(base_url: str) -> dict[str, float]:
    """Samples of /metrics as {'name{labels}': value}."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=HANG_S).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def per_worker(samples: dict[str, float], name: str) -> dict[str, float]:
    pattern = re.compile(re.escape(name) + r'\{worker="([^"]+)"\}')
    return {m.group(1): v for k, v in samples.items() if (m := pattern.fullmatch(k))}


def pages_free(samples: dict[str, float], workers: set[str]) -> bool:
    """Every one of `workers` reports, and none holds a KV page. (The gateway leaves the
    per-worker series out when the scheduler did not answer it in time: an empty answer is not
    "all free".)"""
    usage = per_worker(samples, "pagemesh_kv_cache_usage_ratio")
    return set(usage) == workers and all(v == 0 for v in usage.values())


def sample_until(sample, holds, timeout: float = HANG_S, interval: float = 0.05):
    """Takes `sample()` until `holds(it)`, and returns that sample; None once `timeout` passed.
    The timeout bounds a hang; a test that needs something *within* a time asserts that itself."""
    deadline = time.monotonic() + timeout
    while True:
        taken = sample()
        if holds(taken):
            return taken
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def wait_until(predicate, timeout: float = HANG_S, interval: float = 0.05) -> bool:
    """Polls `predicate` until it holds (True) or `timeout` passes (False)."""
    return sample_until(predicate, bool, timeout, interval) is not None
