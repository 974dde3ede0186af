"""Running a process's main coroutine until a signal, then stopping cleanly.

SIGINT               stop at once: cancel `main` (its `finally` blocks run), exit 0
SIGTERM              drain: run `drain()` (the process finishes what it holds, within its
                     --drain-timeout), then cancel `main`, exit 0
SIGTERM again        stop at once, drain or not
ProcessFailed        out of `main`: exit with its code (a worker whose engine failed)
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

import structlog
import uvloop

DRAIN_POLL_S = 0.05
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # every process's --drain-timeout
DRAIN_TIMEOUT_HELP = "seconds a SIGTERM lets requests in flight finish before stopping (0: stop at once)"


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
    if code:
        raise SystemExit(code)


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
