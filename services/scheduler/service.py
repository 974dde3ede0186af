"""The scheduler process: one Router around a `SchedulerCore` (services/scheduler/core.py), which
holds every decision. Tokenizers, gateways and workers all connect to the Router.

    Router ──(identity, msg)──▶ core.handle(…, now) ──▶ [(destination, msg), …] ──▶ Router
    every heartbeat_timeout / 4 ──▶ core.tick(now) ──▶ failures of lost workers, refusals ──▶ Router
"""

from __future__ import annotations

import asyncio
import time

import structlog

from pagemesh.common.liveness import new_instance
from pagemesh.common.messages import Ready
from pagemesh.common.process import wait_until_idle
from pagemesh.common.transport import Push, Router, UnknownPeer
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.core import Outputs, SchedulerCore

log = structlog.get_logger()


class SchedulerService:
    """Binds the scheduler's Router, reports READY, and runs the receive loop and the expiry tick
    until cancelled. A peer that left before its reply is logged and skipped."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.router = Router(config.address, allow_wildcard=True)
        self.instance = new_instance()
        self.core = SchedulerCore(config, self.instance, time.monotonic())
        self.log = log.bind(service="scheduler")

    async def run(self) -> None:
        if self.config.ready_address:
            with Push(self.config.ready_address) as ready:
                await ready.send(Ready(service="scheduler", name="scheduler"))
        self.log.info("scheduler ready", address=self.config.address)
        await asyncio.gather(self._receive_loop(), self._expiry_loop())

    async def drain(self) -> None:
        """SIGTERM: go on until no request is queued or on a worker (or the drain timeout)."""
        core = self.core
        idle = await wait_until_idle(lambda: not core.placed and not core.queued, self.config.drain_timeout)
        self.log.info("drained" if idle else "drain timed out", placed=len(core.placed), queued=core.queued)

    def close(self) -> None:
        self.router.close()

    async def _receive_loop(self) -> None:
        while True:
            identity, msg = await self.router.recv()
            await self._send(self.core.handle(identity, msg, time.monotonic()))

    async def _expiry_loop(self) -> None:
        interval = self.config.heartbeat_timeout / 4
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            overslept = now - slept_from - interval
            if overslept > interval:  # this process did not run (SIGSTOP, starved of CPU) ...
                # ... and the heartbeats of that time wait in its socket, unread: not the workers' silence
                self.log.warning("scheduler was paused: workers' silence excused", seconds=round(overslept, 1))
                self.core.excuse_silence(overslept)
            await self._send(self.core.tick(now))

    async def _send(self, outputs: Outputs) -> None:
        for destination, msg in outputs:
            identity = destination.encode() if isinstance(destination, str) else destination
            try:
                await self.router.send(identity, msg)
            except UnknownPeer:  # the peer went away between messages
                self.log.warning("cannot reach peer", peer=identity.decode(errors="replace"), type=type(msg).__name__)
