"""What goes into the diffusion engine (`ImageJob`), what comes out (`FinishedJob`), the refusal
of a full queue (`EngineFull`), and one request's state while it runs (`RunningJob`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine.cache_policy import NO_CACHE, CachePolicy
from pagemesh.workers.diffusion.engine.feature_cache import RequestCache
from pagemesh.workers.diffusion.engine.samplers import RequestSampler
from pagemesh.workers.diffusion.pipelines.base import Resolved


class EngineFull(RuntimeError):
    """The engine's waiting queue is at `max_waiting`: the request is refused (a 503; retry later)."""

    def __init__(self, max_waiting: int):
        super().__init__(f"the diffusion engine is full: {max_waiting} requests are already waiting; retry later")
        self.max_waiting = max_waiting


@dataclass(frozen=True, kw_only=True)
class ImageJob:
    """A request handed to the engine."""

    request_id: str
    params: ImageParams
    arrival: float  # monotonic seconds, the engine's clock: when the worker took it
    queued_s: float = 0.0  # time it spent in the mesh's scheduler before


@dataclass(frozen=True, kw_only=True)
class FinishedJob:
    """A request whose images are done; it has left the engine."""

    request_id: str
    images: torch.Tensor  # uint8 [n, H, W, C] on the CPU, at the model's native size
    resolved: Resolved
    steps: int
    sampler: str
    seed: int
    queued_s: float  # the scheduler's queue + the engine's (arrival to its first step)
    compute_s: float  # its first step's start to its images decoded
    batched_with: int  # the most other requests that shared one of its forwards
    cache: str = "none"  # the feature-cache policy it ran with
    cache_over_budget: bool = False  # it asked for a cache that did not fit the budget: it ran uncached
    blocks_computed: int = 0  # block evaluations over its rows and steps (pipelines with blocks)
    blocks_skipped: int = 0  # those its feature cache answered instead


@dataclass(kw_only=True)
class RunningJob:
    """One request's state in the engine: its latents, its sampler, its conditioning rows and its
    feature cache (allocated at its first step, when the budget allows; `policy` then says what
    it runs with).

    Its rows in a forward are its n images' cond rows, then (with guidance) their n uncond rows."""

    job: ImageJob
    resolved: Resolved
    sampler: RequestSampler
    latents: torch.Tensor  # float32 [n, *latent_shape]
    cond_rows: list[Any]  # n rows, or 2n with guidance (cond..., uncond...)
    policy: CachePolicy = NO_CACHE
    cache: RequestCache | None = None
    cache_over_budget: bool = False
    started: float | None = None  # clock at its first step
    batched_with: int = 0
    blocks_computed: int = 0
    blocks_skipped: int = 0

    @property
    def n(self) -> int:
        return self.latents.shape[0]

    @property
    def guided(self) -> bool:
        return self.resolved.guidance_scale > 1.0

    @property
    def rows(self) -> int:
        return len(self.cond_rows)
