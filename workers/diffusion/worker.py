"""The diffusion worker: a `DiffusionEngine` behind the worker shell.

ImageTask ─▶ engine.add (the model's checks: a bad request is a 400 sent to the gateway)
         ─▶ one denoising step per shell step, requests of compatible shapes batched
         ─▶ finished requests: PNG, ImageResult to the gateway (`reply_to`), RequestDone
AbortRequest ─▶ engine.abort at the next step boundary (the slot is free for the next step)
"""

from __future__ import annotations

import asyncio
import time

from pagemesh.common.messages import (
    DoneReason,
    FeatureCacheLoad,
    HeldRequest,
    ImageResult,
    ImageTask,
    RequestFailed,
    WorkerKind,
    WorkerRole,
)
from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineFull, FinishedJob, ImageJob, InvalidImageRequest
from pagemesh.workers.diffusion.png import to_png_b64
from pagemesh.workers.shell.backend import Load, Registration, WorkerContext
from pagemesh.workers.shell.step_threads import StepThreads


class DiffusionWorker:
    """A `WorkerBackend` around one diffusion engine."""

    task_types = (ImageTask,)

    def __init__(self, engine: DiffusionEngine, ctx: WorkerContext, threads: StepThreads | None = None):
        self.engine, self.ctx = engine, ctx
        self.threads = threads  # a CPU worker's adaptive thread count (workers/shell/thread_policy.py)
        self.step_inline = engine.pipeline.device.type == "cpu"
        self.reply_to: dict[str, str] = {}  # request -> the gateway's reply address
        self.produced = 0  # images made, ever (heartbeats carry it: the status page's images/s)

    # ---- WorkerBackend ----------------------------------------------------------------------
    def registration(self) -> Registration:
        pipeline = self.engine.pipeline
        return Registration(
            kind=WorkerKind.DIFFUSION,
            role=WorkerRole.MIXED,
            model=pipeline.name,
            max_running=self.engine.config.max_running,
            images=pipeline.info,
        )

    def add(self, task: ImageTask) -> None:
        rid = task.request_id
        job = ImageJob(request_id=rid, params=task.params, arrival=time.monotonic(), queued_s=task.queued_s)
        try:
            self.engine.add(job)
        except InvalidImageRequest as e:  # the client's fault: a 400 from here, nothing else to do
            self.ctx.log.info("image request invalid", request_id=rid, error=e.message)
            failed = RequestFailed(
                request_id=rid,
                status=400,
                error_type="invalid_request_error",
                message=e.message,
                param=e.param,
                code=None,
            )
            self._send(task.reply_to, failed)
            self.ctx.done(rid, DoneReason.INVALID, e.message)
            return
        except EngineFull as e:  # the scheduler fails it with a 503 (and places less here)
            self.ctx.done(rid, DoneReason.REJECTED, str(e))
            return
        self.reply_to[rid] = task.reply_to

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.reply_to.pop(request_id, None)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[FinishedJob]:
        if self.threads is None:
            return self.engine.step()
        return self.threads.run(self.engine.step, lambda: self.engine.stats().rows)  # a row: one image-step

    def stalled(self) -> bool:
        return self.engine.stalled()

    async def publish(self, finished: list[FinishedJob]) -> None:
        for job in finished:
            reply_to = self.reply_to.pop(job.request_id, None)
            if reply_to is None:  # aborted meanwhile
                continue
            result = self._result(job)
            self.produced += len(result.images)
            await self.ctx.push(reply_to, result)
            self.ctx.done(job.request_id, DoneReason.FINISHED)

    async def between_steps(self) -> None:
        return None

    def load(self) -> Load:
        stats = self.engine.stats()
        cache = FeatureCacheLoad(
            bytes=stats.cache_bytes, peak_bytes=stats.cache_peak_bytes, budget_bytes=stats.cache_budget_bytes
        )
        return Load(
            running=self.engine.num_running,
            waiting=self.engine.num_waiting,
            produced=self.produced,
            feature_cache=cache,
        )

    def held(self) -> list[HeldRequest]:
        return [HeldRequest(request_id=rid, reply_to=reply_to) for rid, reply_to in self.reply_to.items()]

    def registered_again(self) -> None:
        return None

    def background(self) -> list:
        return []

    def close(self) -> None:
        return None

    # ---- inside -----------------------------------------------------------------------------
    def _result(self, job: FinishedJob) -> ImageResult:
        started = time.monotonic()
        width, height = job.resolved.width, job.resolved.height
        images = [to_png_b64(image, width, height) for image in _as_numpy(job.images)]
        native_w, native_h = self.engine.pipeline.native_size
        return ImageResult(
            request_id=job.request_id,
            images=images,
            width=width,
            height=height,
            native_width=native_w,
            native_height=native_h,
            steps=job.steps,
            sampler=job.sampler,
            seed=job.seed,
            queued_s=job.queued_s,
            compute_s=job.compute_s + (time.monotonic() - started),
            batched_with=job.batched_with,
            cache=job.cache,
            cache_over_budget=job.cache_over_budget,
            blocks_computed=job.blocks_computed,
            blocks_skipped=job.blocks_skipped,
        )

    def _send(self, reply_to: str, msg: RequestFailed) -> None:
        """From `add` (not a coroutine): the push goes out as the loop runs on."""
        asyncio.ensure_future(self.ctx.push(reply_to, msg))


def _as_numpy(images):
    return images.cpu().numpy() if hasattr(images, "cpu") else images
