"""Log lines: console on a terminal, JSON elsewhere; one whole record per line even when structlog
and the standard library log from several threads at once; processes exit cleanly on SIGINT."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common.logging import log_colors, log_format
from pagemesh.common.python_command import python_module

CONCURRENT_LOGGING = textwrap.dedent(
    """
    import logging, sys, threading
    import structlog
    from pagemesh.common.logging import configure_logging

    configure_logging("test", "t0", fmt=sys.argv[1])
    payload = "x" * 3000  # long lines: the old two writes per line split them
    start = threading.Barrier(4)

    def with_structlog(k):
        start.wait()
        for i in range(300):
            structlog.get_logger().info("from structlog", thread=k, i=i, payload=payload)

    def with_stdlib(k):
        start.wait()
        for i in range(300):
            logging.getLogger("aiohttp.access").warning("from stdlib %s %s %s", k, i, payload)

    threads = [threading.Thread(target=f, args=(k,)) for k, f in enumerate([with_structlog, with_stdlib] * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    """
)


def run_logging(fmt: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", CONCURRENT_LOGGING, fmt], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr.splitlines()


def test_json_lines_hold_one_record_each_under_concurrent_writers():
    lines = run_logging("json")
    records = [json.loads(line) for line in lines]  # a line with two objects would not parse
    assert len(records) == 1200
    assert sum(r["event"] == "from structlog" for r in records) == 600
    assert sum(r["event"].startswith("from stdlib") for r in records) == 600
    assert {(r["service"], r["name"]) for r in records} == {("test", "t0")}


def test_console_lines_are_readable_and_whole():
    lines = run_logging("console")
    assert len(lines) == 1200
    assert all(not line.startswith("{") for line in lines)
    structlog_lines = [line for line in lines if "from structlog" in line]
    assert len(structlog_lines) == 600 and all("[info" in line and "service=test" in line for line in structlog_lines)


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_the_format_follows_the_terminal_unless_asked(monkeypatch):
    monkeypatch.delenv("PAGEMESH_LOG_FORMAT", raising=False)
    assert log_format(None, _Stream(tty=True)) == "console"
    assert log_format(None, _Stream(tty=False)) == "json"
    assert log_format("json", _Stream(tty=True)) == "json"
    monkeypatch.setenv("PAGEMESH_LOG_FORMAT", "json")
    assert log_format(None, _Stream(tty=True)) == "json"
    with pytest.raises(ValueError, match="log format"):
        log_format("xml")


def test_console_needs_stdout_and_stderr_on_a_terminal(monkeypatch):
    """`pagemesh up > file` (stdout redirected, stderr still the terminal) logs JSON."""
    monkeypatch.delenv("PAGEMESH_LOG_FORMAT", raising=False)
    for stdout_tty, stderr_tty, expected in [(True, True, "console"), (False, True, "json"), (True, False, "json")]:
        monkeypatch.setattr(sys, "stdout", _Stream(stdout_tty))
        monkeypatch.setattr(sys, "stderr", _Stream(stderr_tty))
        assert log_format() == expected


def test_colour_on_a_terminal_that_takes_it_or_as_the_launcher_says(monkeypatch):
    for name in ("PAGEMESH_LOG_COLOR", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert log_colors(_Stream(tty=True)) is True
    assert log_colors(_Stream(tty=False)) is False
    monkeypatch.setenv("TERM", "dumb")
    assert log_colors(_Stream(tty=True)) is False
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("NO_COLOR", "1")
    assert log_colors(_Stream(tty=True)) is False
    monkeypatch.setenv("PAGEMESH_LOG_COLOR", "1")  # a child of pagemesh up writes into a pipe
    assert log_colors(_Stream(tty=False)) is True
    monkeypatch.setenv("PAGEMESH_LOG_COLOR", "0")
    assert log_colors(_Stream(tty=True)) is False


def test_a_service_stops_on_sigint_with_its_last_line_and_exit_code_zero(tmp_path):
    """Processes end through common.process.exit_fast (no interpreter finalization): the
    "stopped" record still comes out whole, and the exit code is 0."""
    proc = subprocess.Popen(
        [
            *python_module("pagemesh.services.cli"),
            "scheduler",
            "--address",
            f"ipc://{tmp_path}/s",
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:  # until it is serving
            if json.loads(line)["event"] == "scheduler ready":
                break
        proc.send_signal(2)
        rest = proc.stderr.read()
        assert proc.wait(timeout=HANG_S) == 0
    finally:
        proc.kill()
    assert [json.loads(line)["event"] for line in rest.splitlines()] == ["stopped"]
