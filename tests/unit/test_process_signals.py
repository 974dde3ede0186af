"""common/process.py over real processes and real signals: SIGTERM drains then exits 0, a second
SIGTERM stops at once, SIGINT stops at once, and a ProcessFailed exits with its code."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

HANG_S = 120.0  # bounds a hang only

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pagemesh.common.process import ProcessFailed, run_until_signalled

    mode = sys.argv[1]

    async def main():
        print("serving", flush=True)
        if mode == "fail":
            raise ProcessFailed("the engine failed")
        try:
            await asyncio.Event().wait()
        finally:
            print("main stopped", flush=True)

    async def drain():
        print("draining", flush=True)
        await asyncio.sleep(0.2 if mode == "drain" else 3600)  # "stuck": a drain that never ends
        print("drained", flush=True)

    run_until_signalled(main(), drain=drain)
    """
)


def start(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout.readline() == "serving\n"
    return proc


def finish(proc: subprocess.Popen) -> tuple[int, list[str]]:
    out, _ = proc.communicate(timeout=HANG_S)
    said = {"draining", "drained", "main stopped"}  # the script's words (structlog's lines aside)
    return proc.returncode, [line for line in out.splitlines() if line in said]


def test_sigterm_drains_then_stops_with_exit_code_0():
    proc = start("drain")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == (0, ["draining", "drained", "main stopped"])


def test_a_second_sigterm_stops_a_drain_at_once():
    proc = start("stuck")
    proc.send_signal(signal.SIGTERM)
    while proc.stdout.readline() != "draining\n":  # (structlog's line comes first)
        pass
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == (0, ["main stopped"])  # the hour-long drain did not hold it


@pytest.mark.parametrize("mode", ["drain", "stuck"])
def test_sigint_stops_at_once_without_draining(mode):
    proc = start(mode)
    proc.send_signal(signal.SIGINT)
    assert finish(proc) == (0, ["main stopped"])


def test_a_process_failure_exits_non_zero():
    proc = start("fail")
    code, _ = finish(proc)
    assert code == 1
