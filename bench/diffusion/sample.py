"""A plain sampling loop over a DiTPipelineModel with diffusers' schedulers: one scheduler for a
batch of images that share sampler, steps and guidance. The quality bench's and the tests'
reference; the serving engine keeps one scheduler per request instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel

SCHEDULERS: dict[str, tuple[type, dict[str, Any]]] = {
    "ddpm": (DDPMScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "dpmsolver++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++"}),
    "unipc": (UniPCMultistepScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
}


def step_kwargs(scheduler, generator: torch.Generator) -> dict[str, Any]:
    """What this scheduler's `step` takes beyond (output, t, sample): the generator of the
    stochastic ones (UniPC's step takes none)."""
    return {"generator": generator} if "generator" in inspect.signature(scheduler.step).parameters else {}


def make_scheduler(sampler: str, config: dict[str, Any], **overrides: Any):
    """A fresh diffusers scheduler for `sampler` from the model's scheduler config, given only the
    keys its class takes (from_config would log a warning for every other key)."""
    cls, fixed = SCHEDULERS[sampler]
    accepted = set(inspect.signature(cls.__init__).parameters)
    merged = {**config, **fixed, **overrides}
    return cls(**{k: v for k, v in merged.items() if k in accepted})


@torch.no_grad()
def sample(
    pipeline: DiTPipelineModel,
    classes: list[int],
    *,
    sampler: str,
    steps: int,
    guidance_scale: float,
    seed: int,
    uncond_class: int | None = None,
    scheduler_overrides: dict[str, Any] | None = None,
    step_overrides: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Final latents [n, *latent_shape] for one image per class id, classifier-free guided
    against `uncond_class` (the pipeline's null class when None)."""
    scheduler = make_scheduler(sampler, pipeline.scheduler_config, **(scheduler_overrides or {}))
    scheduler.set_timesteps(steps)
    gen = torch.Generator().manual_seed(seed)
    n = len(classes)
    x = torch.randn((n, *pipeline.latent_shape), generator=gen) * scheduler.init_noise_sigma
    cond = pipeline.stack(classes)
    guided = guidance_scale > 1
    if guided:
        null = pipeline.null_class if uncond_class is None else uncond_class
        cond = torch.cat([cond, pipeline.stack([null] * n)])
    extra = {**step_kwargs(scheduler, gen), **(step_overrides or {})}
    for t in scheduler.timesteps:
        model_in = scheduler.scale_model_input(x, t)
        if guided:
            out = pipeline.denoise(torch.cat([model_in, model_in]), t.expand(2 * n), cond)
            eps_cond, eps_uncond = out.float().chunk(2)
            eps = eps_uncond + guidance_scale * (eps_cond - eps_uncond)
        else:
            eps = pipeline.denoise(model_in, t.expand(n), cond).float()
        x = scheduler.step(eps, t, x, **extra).prev_sample
    return x
