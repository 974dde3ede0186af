"""The diffusion engine's configuration (frozen; no torch, so the launcher can parse its flags)."""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.workers.diffusion.engine.cache_policy import CachePolicyError, parse_cache_policy

BATCHING_MODES = ("step", "request", "serial")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Limits and the batching policy of one diffusion engine (one worker).

    batching: "step" (every denoising step regroups the running requests: ORCA for diffusion),
    "request" (a batch starts together and runs until all its members finish; the baseline) or
    "serial" (one request at a time). `cache`: the feature-cache policy of a request that asks
    for none (engine/cache_policy.py); `cache_budget_bytes`: what the running requests' caches may
    hold together (a request whose cache does not fit runs uncached)."""

    batching: str = "step"
    max_running: int = 16  # requests in the running set (request mode: in one batch)
    max_batch_rows: int = 64  # rows per forward; a request's CFG uncond rows count
    max_waiting: int = 256  # requests waiting to run; more are refused (EngineFull)
    request_wait_s: float = 0.05  # request mode: how long a batch gathers from its first arrival
    cache: str = "none"  # "<policy>[:<value>]"
    cache_budget_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching: must be one of {', '.join(BATCHING_MODES)}")
        for name in ("max_running", "max_batch_rows", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.request_wait_s < 0:
            raise ValueError("request_wait_s: must be >= 0")
        if self.cache_budget_bytes < 0:
            raise ValueError("cache_budget_bytes: must be >= 0")
        try:
            parse_cache_policy(self.cache)
        except CachePolicyError as e:
            raise ValueError(str(e)) from None
