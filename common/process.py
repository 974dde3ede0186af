"""Running a process's main coroutine until SIGINT/SIGTERM, then stopping cleanly."""

from __future__ import annotations

import asyncio
import signal

import structlog
import uvloop


class ProcessFailed(Exception):
    """Raised out of a process's main coroutine: it cannot serve on (a worker's engine failed).
    The process exits with `exit_code` after its `finally` blocks ran; supervisors restart it."""

    exit_code = 1


def run_until_signalled(main) -> None:
    """uvloop.run(main) where SIGINT and SIGTERM cancel `main` (its `finally` blocks run). A
    ProcessFailed out of `main` exits the process with its code (SystemExit, after the loop)."""

    async def runner() -> int:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            structlog.get_logger().info("stopped")
        except ProcessFailed as e:
            structlog.get_logger().error("process failed", error=str(e), exit_code=e.exit_code)
            return e.exit_code
        return 0

    code = uvloop.run(runner())
    if code:
        raise SystemExit(code)
