"""Driving a DiffusionEngine to the end in the feature-cache tests (DiT, U-Net, PixArt): one image
request, step until idle, a request alone. The pipeline records the float latents each finished
request decoded (`pipe.decoded`, in finishing order)."""

from __future__ import annotations

import torch

from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine import DiffusionEngine, FinishedJob, ImageJob


def image_job(
    request_id: str,
    cache: str | None,
    *,
    prompt: str,
    size: tuple[int, int] | None,
    n: int = 1,
    steps: int = 10,
    sampler: str = "ddim",
    guidance: float = 2.0,
    seed: int = 0,
) -> ImageJob:
    """`size` None: the model's native size."""
    width, height = size if size is not None else (None, None)
    params = ImageParams(
        prompt=prompt,
        negative_prompt=None,
        n=n,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        sampler=sampler,
        seed=seed,
        cache=cache,
    )
    return ImageJob(request_id=request_id, params=params, arrival=0.0)


def run_until_idle(
    pipe, engine: DiffusionEngine, done: list[FinishedJob] | None = None
) -> dict[str, tuple[FinishedJob, torch.Tensor]]:
    """Step until idle: request id -> (its result, the float latents it decoded). `done`: what
    finished in steps run before (their latents are in pipe.decoded); None: no step ran yet."""
    if done is None:
        pipe.decoded.clear()
    done = list(done or [])
    for _ in range(200):
        if not engine.has_work():
            break
        done += engine.step()
    assert not engine.has_work(), "the engine made no progress"
    return {d.request_id: (d, latents) for d, latents in zip(done, pipe.decoded, strict=True)}


def run_alone(pipe, job: ImageJob) -> tuple[FinishedJob, torch.Tensor]:
    """`job` alone in a fresh engine: its result and its decoded latents."""
    engine = DiffusionEngine(pipe)
    engine.add(job)
    return run_until_idle(pipe, engine)[job.request_id]
