"""Running a process's main coroutine until SIGINT/SIGTERM, then stopping cleanly."""

from __future__ import annotations

import asyncio
import signal

import structlog
import uvloop


def run_until_signalled(main) -> None:
    """uvloop.run(main) where SIGINT and SIGTERM cancel `main` (its `finally` blocks run)."""

    async def runner() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            structlog.get_logger().info("stopped")

    uvloop.run(runner())
