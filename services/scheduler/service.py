"""The scheduler process: one Router around a `SchedulerCore` (services/scheduler/core.py), which
holds every decision. Tokenizers, gateways and workers all connect to the Router.

    Router ──(identity, msg)──▶ core.handle(…, now) ──▶ [(destination, msg), …] ──▶ Router
    every heartbeat_timeout / 4 ──▶ core.tick(now) ──▶ failures of lost workers, refusals ──▶ Router
    a pause of this process (pause.py) ──▶ core.excuse_silence, before the tick or message after it
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
from pagemesh.services.scheduler.pause import PauseClock

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
        self.pause = PauseClock(config.heartbeat_timeout / 4, time.monotonic())  # the expiry tick's

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
            now = time.monotonic()
            self._excuse_a_pause(now)  # a message read before the tick judges no worker by the pause
            await self._send(self.core.handle(identity, msg, now))

    async def _expiry_loop(self) -> None:
        while True:
            self.pause.sleeping(time.monotonic())
            await asyncio.sleep(self.pause.interval)
            now = time.monotonic()
            self._excuse_a_pause(now)
            await self._send(self.core.tick(now))

    def _excuse_a_pause(self, now: float) -> None:
        if overslept := self.pause.overslept(now):
            self.log.warning("scheduler was paused: workers' silence excused", seconds=round(overslept, 1))
            self.core.excuse_silence(overslept)

    async def _send(self, outputs: Outputs) -> None:
        for destination, msg in outputs:
            identity = destination.encode() if isinstance(destination, str) else destination
            try:
                await self.router.send(identity, msg)
            except UnknownPeer:  # the peer went away between messages
                self.log.warning("cannot reach peer", peer=identity.decode(errors="replace"), type=type(msg).__name__)
