"""`pagemesh up` in a terminal prints its children's logs as readable, coloured console lines; with
stdout not a terminal, or `--log-format json`, one JSON object a line."""

import json
import os
import pty
import re
import select
import signal
import subprocess
import time

import pytest

from pagemesh.bench.local_mesh import HANG_S, free_port
from pagemesh.common.python_command import python_module

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_up_until_ready(*flags: str, stdout_tty: bool) -> list[str]:
    """`pagemesh up` (no diffusion worker) with stderr on a pseudo-terminal, and stdout on it too
    when `stdout_tty` (else a pipe); the lines it wrote until it was up, then Ctrl-C."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEMESH_LOG_FORMAT", "PAGEMESH_LOG_COLOR", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        [*python_module("pagemesh.services.cli"), "up", "--port", str(free_port()), "--diffusion", "0", *flags],
        stdin=subprocess.DEVNULL,
        stdout=slave if stdout_tty else subprocess.PIPE,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    sources = [master] if stdout_tty else [master, proc.stdout.fileno()]
    out = b""
    deadline = time.monotonic() + HANG_S
    try:
        while b"pagemesh is up" not in out and time.monotonic() < deadline and sources:
            for fd in select.select(sources, [], [], 0.5)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the terminal's other side closed: the process exited
                    chunk = b""
                if not chunk:
                    sources.remove(fd)
                out += chunk
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=HANG_S)
        os.close(master)
    assert b"pagemesh is up" in out, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace").splitlines()


@pytest.mark.slow
def test_on_a_terminal_the_logs_are_coloured_console_lines():
    lines = run_up_until_ready(stdout_tty=True)
    logs = [line for line in lines if "service=" in ANSI.sub("", line)]
    assert logs, "\n".join(lines[-20:])
    assert all(ANSI.search(line) for line in logs)  # coloured
    assert not [line for line in lines if line.lstrip().startswith("{")]  # no JSON
    services = {m[1] for line in logs if (m := re.search(r"service=(\w+)", ANSI.sub("", line)))}
    assert {"gateway", "scheduler", "tokenizer"} <= services  # the children's lines, not only the launcher's


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stdout not a terminal", "--log-format json"])
def test_json_when_stdout_is_not_a_terminal_or_when_asked(how):
    flags = ("--log-format", "json") if how == "--log-format json" else ()
    lines = run_up_until_ready(*flags, stdout_tty=how != "stdout not a terminal")
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) >= 3 and {"gateway", "scheduler", "tokenizer"} <= {r.get("service") for r in records}
    assert not [line for line in lines if ANSI.search(line)]
