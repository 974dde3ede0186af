"""Running a process's main coroutine until a signal, then stopping cleanly and fast.

SIGINT               stop at once: cancel `main` (its `finally` blocks run), exit 0
SIGTERM              drain: run `drain()` (the process finishes what it holds, within its
                     --drain-timeout), then cancel `main`, exit 0
SIGTERM again        stop at once, drain or not
ProcessFailed        out of `main`: exit with its code (a worker whose engine failed)

After `main` ended, the process leaves through `exit_fast`: no interpreter finalization.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable

import structlog
import uvloop

from pagemesh.common import transport
from pagemesh.common.cli_args import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP  # noqa: F401 - re-exported

DRAIN_POLL_S = 0.05


class ProcessFailed(Exception):
    """Raised out of a process's main coroutine: it cannot serve on (a worker's engine failed).
    The process exits with `exit_code` after its `finally` blocks ran; supervisors restart it."""

    exit_code = 1


def run_until_signalled(main, drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """uvloop.run(main) until a signal (see the module's table). Without `drain`, SIGTERM stops
    at once as SIGINT does."""

    async def runner() -> int:
        log = structlog.get_logger()
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        draining: list[asyncio.Task] = []

        def on_sigterm() -> None:
            if drain is None or draining or task.done():
                task.cancel()  # a second SIGTERM: at once
                return
            log.info("draining: SIGTERM received")

            async def drain_then_stop() -> None:
                try:
                    await drain()
                finally:
                    task.cancel()

            draining.append(asyncio.ensure_future(drain_then_stop()))

        loop.add_signal_handler(signal.SIGINT, task.cancel)
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped")
        except ProcessFailed as e:
            log.error("process failed", error=str(e), exit_code=e.exit_code)
            return e.exit_code
        finally:
            for t in draining:
                t.cancel()
        return 0

    code = uvloop.run(runner())
    # stopping: the `finally` blocks after us close sockets and flush; a signal now (the
    # launcher's SIGINT after the terminal's) would cut them short with a traceback
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    exit_fast(code)


async def wait_until_idle(idle: Callable[[], bool], timeout: float) -> bool:
    """Wait until `idle()` holds (True) or `timeout` seconds passed (False); checked every
    DRAIN_POLL_S (draining is rare and short: a poll is simpler than an event in every path)."""
    deadline = time.monotonic() + timeout
    while not idle():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(DRAIN_POLL_S)
    return True


class Idleness:
    """Whether a process is idle, for its drain: the process sets `check` once its state exists
    (before that, nothing is in flight)."""

    def __init__(self) -> None:
        self.check: Callable[[], bool] = lambda: True

    def __call__(self) -> bool:
        return self.check()


def exit_fast(code: int) -> None:
    """End the process once its work is done, without interpreter finalization.

    Measured on `pagemesh up` (issue 20): every process logged "stopped" within 0.1 s of Ctrl-C,
    and an LLM worker then spent 3-13 s (2 cores, loaded) in Py_FinalizeEx: the final garbage
    collection and module teardown of a heap holding torch, the model and the vocabulary. Nothing
    there is needed: atexit hooks still run, logs are flushed, and every ZeroMQ socket gets its
    linger to send what it holds; then os._exit."""
    logging.shutdown()
    atexit._run_exitfuncs()
    transport.close_all()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
