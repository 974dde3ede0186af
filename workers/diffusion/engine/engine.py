"""The diffusion engine: `step()` = plan (Batcher, pure) → one batched forward → each row's sampler.

    add(job) ── resolve, encode_prompt, seeded noise ──▶ waiting
    step():  Batcher.plan ─▶ group ─▶ pipeline.denoise(latents [B, ...], timesteps [B], cond)
                                      (or, when a row of the group caches: feature_cache.cached_forward
                                       over the pipeline's block_forward, or deep_cache.deep_cached_forward
                                       over a U-Net's deep_cache_forward, each row deciding for itself)
                                   ─▶ per request: CFG combine, its sampler's step (requests whose
                                      samplers are in one state: one call, cohorts.py)
                                   ─▶ finished requests decoded and returned (they leave at once)

A request's rows in a forward are its n images' cond rows then, with guidance, their uncond rows;
each row carries its own request's timestep. Its latents and sampler are its own (float32,
whatever the model's dtype), so its images do not depend on who shares its forwards; so is its
feature cache (allocated at its first step within `cache_budget_bytes`, freed when it leaves).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from pagemesh.workers.diffusion.engine.batcher import Batcher, Member
from pagemesh.workers.diffusion.engine.cache_policy import CachePolicy, CachePolicyError, parse_cache_policy
from pagemesh.workers.diffusion.engine.cohorts import step_all
from pagemesh.workers.diffusion.engine.config import EngineConfig
from pagemesh.workers.diffusion.engine.deep_cache import (
    DEEP_CACHE_KINDS,
    DEEP_CACHE_POLICIES,
    DeepRequestCache,
    deep_cached_forward,
)
from pagemesh.workers.diffusion.engine.feature_cache import CachePart, RequestCache, cached_forward
from pagemesh.workers.diffusion.engine.jobs import EngineFull, FinishedJob, ImageJob, RunningJob
from pagemesh.workers.diffusion.engine.samplers import RequestSampler
from pagemesh.workers.diffusion.engine.stats import DiffusionStats
from pagemesh.workers.diffusion.pipelines.base import ImagePipeline, InvalidImageRequest

SEED_MASK = 2**64 - 1  # torch generators take 64-bit seeds


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float, channels: int) -> torch.Tensor:
    """Classifier-free guidance on the first `channels` channels (the prediction); channels past
    them (a learned variance) are the cond rows' own."""
    guided = uncond[:, :channels] + scale * (cond[:, :channels] - uncond[:, :channels])
    return torch.cat([guided, cond[:, channels:]], dim=1)


class DiffusionEngine:
    """One image pipeline and the requests it works on.

    Its contract with the worker: `add` takes a request (InvalidImageRequest for input the model
    cannot serve, EngineFull when `max_waiting` requests wait), `abort` drops one at once,
    `step` runs one forward and returns the requests that finished in it, and `stalled` says the
    last step ran nothing though work is held (request mode's gathering window is open)."""

    def __init__(
        self,
        pipeline: ImagePipeline,
        config: EngineConfig = EngineConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        self.clock = clock
        self.batcher = Batcher(config)
        self.jobs: dict[str, RunningJob] = {}
        self._order = itertools.count()
        self._stats = DiffusionStats(cache_budget_bytes=config.cache_budget_bytes)
        self._stalled = False
        self.block_forward = getattr(pipeline, "block_forward", None)
        # a U-Net's DeepCache split (used when the pipeline has no block forward)
        self.deep_cache_forward = getattr(pipeline, "deep_cache_forward", None) if self.block_forward is None else None
        split = self.block_forward if self.block_forward is not None else self.deep_cache_forward
        self.num_blocks = split.num_blocks if split is not None else 0
        self.default_policy = parse_cache_policy(config.cache)
        if (unserved := self._unserved(self.default_policy)) is not None:
            raise ValueError(f"cache {config.cache!r}: {unserved}")

    # ---- membership -----------------------------------------------------------------------
    def add(self, job: ImageJob) -> None:
        if self.batcher.num_waiting >= self.config.max_waiting:
            raise EngineFull(self.config.max_waiting)
        if job.request_id in self.jobs:
            raise ValueError(f"request {job.request_id!r} is already in the engine")
        resolved = self.pipeline.resolve(job.params)
        policy = self._policy(job.params.cache)
        cond, uncond = self.pipeline.encode_prompt(job.params.prompt, job.params.negative_prompt)
        n = job.params.n
        rows = [cond] * n + ([uncond] * n if resolved.guidance_scale > 1.0 else [])
        generators = [torch.Generator().manual_seed((resolved.seed + i) & SEED_MASK) for i in range(n)]
        sampler = RequestSampler(resolved.sampler, self.pipeline.scheduler_config, resolved.steps, generators)
        latents = sampler.initial_latents(resolved.latent_shape, self.pipeline.device)
        self.jobs[job.request_id] = RunningJob(
            job=job, resolved=resolved, sampler=sampler, latents=latents, cond_rows=rows, policy=policy
        )
        self.batcher.add(
            Member(
                request_id=job.request_id,
                order=next(self._order),
                shape=resolved.latent_shape,
                rows=len(rows),
                arrival=job.arrival,
            )
        )

    def abort(self, request_id: str) -> bool:
        """Drop a request and its state now (between steps); False if it is not here."""
        if not self.batcher.remove(request_id):
            return False
        self._free_cache(self.jobs.pop(request_id))
        self._stats.requests_aborted += 1
        return True

    def has_work(self) -> bool:
        return bool(self.jobs)

    def stalled(self) -> bool:
        return self._stalled

    @property
    def num_running(self) -> int:
        return self.batcher.num_running

    @property
    def num_waiting(self) -> int:
        return self.batcher.num_waiting

    def stats(self) -> DiffusionStats:
        """The live totals (steps, rows per forward, images finished, blocks, cache memory)."""
        return self._stats

    # ---- feature caches -------------------------------------------------------------------
    def _policy(self, spec: str | None) -> CachePolicy:
        if spec is None:
            return self.default_policy
        try:
            policy = parse_cache_policy(spec)
        except CachePolicyError as e:
            raise InvalidImageRequest(str(e), param="cache") from None
        if (unserved := self._unserved(policy)) is not None:
            raise InvalidImageRequest(f"cache: {unserved}", param="cache")
        return policy

    def _unserved(self, policy: CachePolicy) -> str | None:
        """Why this pipeline cannot run `policy` (None: it can)."""
        if not policy.enabled or self.block_forward is not None:
            return None
        if self.deep_cache_forward is None:
            return f"{self.pipeline.name} has no block-level forward; it serves only 'none'"
        if policy.kind not in DEEP_CACHE_KINDS:
            return f"{self.pipeline.name} is a U-Net: it serves {DEEP_CACHE_POLICIES}, not {policy.kind}"
        return None

    def _allocate_cache(self, running: RunningJob) -> None:
        """At a request's first step: its cache, if the budget holds it; else it runs uncached."""
        if not running.policy.enabled:
            return
        if self.deep_cache_forward is not None:
            cache_cls, dtype = DeepRequestCache, self.deep_cache_forward.dtype
            shape = self.deep_cache_forward.feature_shape(running.resolved.latent_shape)
            need = DeepRequestCache.bytes_needed(running.rows, shape, dtype)
        else:
            cache_cls, dtype = RequestCache, self.block_forward.dtype
            shape = self.block_forward.hidden_shape(running.resolved.latent_shape)
            need = RequestCache.bytes_needed(running.policy, running.rows, shape, dtype)
        if self._stats.cache_bytes + need > self.config.cache_budget_bytes:
            running.cache_over_budget = True
            self._stats.requests_over_cache_budget += 1
            return
        running.cache = cache_cls(running.policy, running.rows, shape, dtype, self.pipeline.device)
        self._stats.reserve_cache(running.cache.nbytes)
        self._stats.requests_cached += 1

    def _free_cache(self, running: RunningJob) -> None:
        if running.cache is not None:
            self._stats.release_cache(running.cache.nbytes)
            running.cache = None

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[FinishedJob]:
        now = self.clock()
        group = [self.jobs[m.request_id] for m in self.batcher.plan(now)]
        self._stalled = not group and self.has_work()
        if not group:
            return []
        for running in group:
            if running.started is None:
                running.started = now
                self._allocate_cache(running)
        self._forward(group)
        return [self._finish(running) for running in group if running.sampler.done]

    def _forward(self, group: list[RunningJob]) -> None:
        began = time.perf_counter()
        inputs, timesteps, rows = [], [], []
        for running in group:
            x = running.sampler.model_input(running.latents)
            inputs.append(torch.cat([x, x]) if running.guided else x)
            timesteps.append(running.sampler.timestep.to(torch.float32).expand(running.rows))
            rows.extend(running.cond_rows)
        out = self._model_output(
            group,
            torch.cat(inputs).to(self.pipeline.dtype),
            torch.cat(timesteps).to(self.pipeline.device),
            self.pipeline.stack(rows),
        )
        members = [
            (running.sampler, part, running.latents) for running, part in zip(group, self._guided_parts(group, out))
        ]
        for running in group:
            running.batched_with = max(running.batched_with, len(group) - 1)
        for running, latents in zip(group, step_all(members)):  # samplers in one state: one call
            running.latents = latents
        self._stats.record_forward(len(rows), len(group), time.perf_counter() - began)

    @staticmethod
    def _guided_parts(group: list[RunningJob], out: torch.Tensor) -> list[torch.Tensor]:
        """Each request's model output for its n images: its rows of `out`, with guidance applied
        (`guide`), one call for all the requests of a guidance scale (each element is computed as
        in a call of its own, so a request's numbers do not depend on the others)."""
        starts = list(itertools.accumulate((r.rows for r in group), initial=0))  # each request's first row
        parts: list[torch.Tensor | None] = []
        by_scale: dict[float, list[int]] = {}  # guidance scale -> the requests' places in `group`
        for i, running in enumerate(group):
            parts.append(None if running.guided else out[starts[i] : starts[i + 1]])
            if running.guided:
                by_scale.setdefault(running.resolved.guidance_scale, []).append(i)
        if not by_scale:
            return parts
        channels = group[0].latents.shape[1]
        for scale, members in by_scale.items():
            if len(members) == 1:
                i, running = members[0], group[members[0]]
                part = out[starts[i] : starts[i] + running.rows]
                parts[i] = guide(part[: running.n], part[running.n :], scale, channels)
                continue
            cond = [starts[i] + j for i in members for j in range(group[i].n)]
            uncond = [starts[i] + group[i].n + j for i in members for j in range(group[i].n)]
            index = torch.tensor(cond + uncond, device=out.device)
            both = out.index_select(0, index)
            guided = guide(both[: len(cond)], both[len(cond) :], scale, channels)
            for i, piece in zip(members, guided.split([group[i].n for i in members])):
                parts[i] = piece
        return parts

    def _model_output(self, group: list[RunningJob], latents, timesteps, cond) -> torch.Tensor:
        """The forward's output (float32), through the feature caches when a row of the group has
        one; counts each request's blocks computed and skipped."""
        if any(running.cache is not None for running in group):
            parts, offset = [], 0
            for running in group:
                step, steps = running.sampler.index, len(running.sampler.timesteps)
                parts.append(CachePart(cache=running.cache, offset=offset, rows=running.rows, step=step, steps=steps))
                offset += running.rows
            if self.deep_cache_forward is not None:
                out, computed = deep_cached_forward(self.deep_cache_forward, latents, timesteps, cond, parts)
            else:
                out, computed = cached_forward(self.block_forward, latents, timesteps, cond, parts)
        else:
            out = self.pipeline.denoise(latents, timesteps, cond)
            computed = [running.rows * self.num_blocks for running in group]
        for running, blocks in zip(group, computed):
            skipped = running.rows * self.num_blocks - blocks
            running.blocks_computed += blocks
            running.blocks_skipped += skipped
            self._stats.blocks_computed += blocks
            self._stats.blocks_skipped += skipped
        return out.float()

    def _finish(self, running: RunningJob) -> FinishedJob:
        images = self.pipeline.decode(running.latents.to(self.pipeline.dtype)).cpu()
        done = self.clock()
        job, resolved = running.job, running.resolved
        cache = running.policy.spec if running.cache is not None else "none"
        self.batcher.remove(job.request_id)
        self._free_cache(self.jobs.pop(job.request_id))
        self._stats.requests_finished += 1
        self._stats.images_finished += running.n
        return FinishedJob(
            request_id=job.request_id,
            images=images,
            resolved=resolved,
            steps=resolved.steps,
            sampler=resolved.sampler,
            seed=resolved.seed,
            queued_s=job.queued_s + max(0.0, running.started - job.arrival),
            compute_s=done - running.started,
            batched_with=running.batched_with,
            cache=cache,
            cache_over_budget=running.cache_over_budget,
            blocks_computed=running.blocks_computed,
            blocks_skipped=running.blocks_skipped,
        )
