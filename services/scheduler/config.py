"""Scheduler process configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.placement import PlacementPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    address: str  # Router bind: tokenizers, gateways and workers connect here
    ready_address: str | None = None
    heartbeat_timeout: float = 5.0  # a worker silent this long leaves placement
    max_queue: int = 256  # requests waiting for a worker; more are refused with 503
    placement: PlacementPolicy = PlacementPolicy()
