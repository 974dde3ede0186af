"""Per-request samplers: one diffusers scheduler instance per request, built from the pipeline's
scheduler config, with its own timesteps, step index, solver history and random generators.

A request's rows ride in batches with any other request's; nothing here is shared, so its
trajectory is the same whoever it rides with.

`SAMPLERS` are the solvers of a diffusion model's ODE/SDE, which any diffusion model may offer.
`CONSISTENCY_SAMPLERS` only make sense for a consistency model (Song et al. 2023), whose output
is f(x_t, t) ≈ x0 on the trajectory of x_t: "lcm" is latent consistency models' multistep
sampling (Luo et al. 2023, diffusers' `LCMScheduler`): at each step x0 = c_skip(t) x_t +
c_out(t) x0_pred(x_t, t), then x0 is noised afresh to the next timestep of its grid, with noise
from the request's own generators; the last step returns x0. A model offers it by listing it in
its pagemesh.json (models/digits-dit-lcm, training/consistency_digits.py).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    LCMScheduler,
    UniPCMultistepScheduler,
)
from diffusers.configuration_utils import FrozenDict

# name -> (scheduler class, what the name fixes over the pipeline's config). Only DDPM uses a
# learned variance; the others get the prediction alone, and DPM-Solver's variance_type is None
# so that it does not cut that prediction to 3 channels (its pixel-space IF case).
_SCHEDULERS: dict[str, tuple[type, dict[str, Any]]] = {
    "ddpm": (DDPMScheduler, {}),
    "ddim": (DDIMScheduler, {}),  # eta = 0 (step's default): deterministic
    "dpmsolver++": (
        DPMSolverMultistepScheduler,
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "variance_type": None},
    ),
    "unipc": (UniPCMultistepScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    # A consistency model's sampler: the folder's scheduler config (an LCMScheduler's) gives its
    # parametrization (prediction_type, timestep_scaling) and its grid (original_inference_steps).
    "lcm": (LCMScheduler, {}),
}
CONSISTENCY_SAMPLERS: tuple[str, ...] = ("lcm",)
SAMPLERS: tuple[str, ...] = tuple(name for name in _SCHEDULERS if name not in CONSISTENCY_SAMPLERS)
_LEARNED_VARIANCE = ("learned", "learned_range")


def build_scheduler(name: str, scheduler_config: dict[str, Any]):
    """A fresh scheduler of sampler `name` from the pipeline's scheduler config, the way diffusers
    switches schedulers (`from_config`: keys the class does not take are dropped, and keys the
    config marks as defaults take the new class's defaults), with what the name fixes on top.

    `from_config` inspects signatures and rebuilds the noise schedule (2-3 ms, as much as a
    request's share of 25 steps in a full batch): it runs once per (sampler, config object), and
    each request gets a deep copy of that scheduler, the same state. The copy shares the
    template's tensors (the noise schedule) and its frozen config: diffusers' schedulers assign
    new tensors, they never write into these (0.2 ms against 0.8 ms for a full deep copy)."""
    key = (name, id(scheduler_config))
    cached = _TEMPLATES.get(key)
    if cached is None or cached[0] is not scheduler_config:  # (an id reused by another config)
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.clear()
        cls, fixed = _SCHEDULERS[name]
        cached = _TEMPLATES[key] = (scheduler_config, cls.from_config(scheduler_config, **fixed))
    template = cached[1]
    shared = [v for v in vars(template).values() if isinstance(v, (torch.Tensor, FrozenDict))]
    return copy.deepcopy(template, {id(v): v for v in shared})


_TEMPLATES: dict[tuple[str, int], tuple[dict[str, Any], Any]] = {}  # (name, id(config)) -> (config, scheduler)
_MAX_TEMPLATES = 64


@functools.cache
def _takes_generator(scheduler_cls: type) -> bool:
    return "generator" in inspect.signature(scheduler_cls.step).parameters


class RequestSampler:
    """One request's sampler over its n images' latents [n, C, ...].

    `generators` holds one CPU generator per image (image i seeded from the request's seed + i),
    used for the initial noise and for the noise a stochastic sampler (DDPM, LCM) adds at each step."""

    def __init__(self, name: str, scheduler_config: dict[str, Any], steps: int, generators: list[torch.Generator]):
        self.name = name
        self.scheduler = build_scheduler(name, scheduler_config)
        self.scheduler.set_timesteps(steps)
        self.timesteps = self.scheduler.timesteps
        self.index = 0
        self.generators = generators
        self._step_kwargs = {"generator": generators} if _takes_generator(type(self.scheduler)) else {}
        self._keeps_variance = name == "ddpm" and self.scheduler.config.variance_type in _LEARNED_VARIANCE

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        """This step's timestep (0-d), what the model is conditioned on."""
        return self.timesteps[self.index]

    def initial_latents(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Float32 noise [n, *shape], image i drawn from its own generator, at the sampler's scale."""
        noise = torch.cat([torch.randn((1, *shape), generator=g, dtype=torch.float32) for g in self.generators])
        return noise.to(device) * self.scheduler.init_noise_sigma

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The latents as the model sees them this step (Euler scales by its sigma; others don't)."""
        return self.scheduler.scale_model_input(latents, self.timestep)

    def step(self, model_output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Advance one step. `model_output` may carry extra channels after the latents' (a learned
        variance, as DiT predicts): DDPM with a learned variance type uses them, others drop them."""
        channels = latents.shape[1]
        if model_output.shape[1] != channels and not self._keeps_variance:
            model_output = model_output[:, :channels]
        out = self.scheduler.step(model_output, self.timestep, latents, **self._step_kwargs).prev_sample
        self.index += 1
        return out
