"""engine/cohorts.py: requests whose samplers are in the same state take one scheduler call over
their stacked rows, and each gets exactly (bit for bit) what its own call gives."""

from __future__ import annotations

import pytest
import torch

from pagemesh.workers.diffusion.engine.cohorts import COHORT_SAMPLERS, cohort_key, step_all
from pagemesh.workers.diffusion.engine.samplers import RequestSampler

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONFIG = {  # the embedded digits DiT's (DDPM's linear schedule)
    "_class_name": "DDPMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "prediction_type": "epsilon",
}
SHAPE = (1, 8, 8)


def samplers(name: str, images: list[int], steps: int = 12) -> list[RequestSampler]:
    return [
        RequestSampler(name, CONFIG, steps, [torch.Generator().manual_seed(100 * r + i) for i in range(n)])
        for r, n in enumerate(images)
    ]


def fake_model(latents: torch.Tensor, step: int, request: int) -> torch.Tensor:
    """A model output that depends on the latents, the step and the request (and has 2 channels,
    as a learned-variance model's, of which the sampler drops the second)."""
    g = torch.Generator().manual_seed(1000 * step + request)
    mean = torch.tanh(latents * 0.7) + 0.1 * torch.randn(latents.shape, generator=g)
    return torch.cat([mean, torch.randn(latents.shape, generator=g)], dim=1)


def run(name: str, images: list[int], together: bool) -> list[torch.Tensor]:
    group = samplers(name, images)
    latents = [s.initial_latents(SHAPE, torch.device("cpu")) for s in group]
    while not group[0].done:
        outputs = [fake_model(s.model_input(x), s.index, r) for r, (s, x) in enumerate(zip(group, latents))]
        if together:
            latents = step_all(list(zip(group, outputs, latents)))
        else:
            latents = [s.step(o, x) for s, o, x in zip(group, outputs, latents)]
    return latents


@pytest.mark.parametrize("name", sorted(COHORT_SAMPLERS))
def test_a_cohort_step_gives_each_request_its_own_steps_numbers(name, monkeypatch):
    calls = []
    step = RequestSampler.step
    monkeypatch.setattr(RequestSampler, "step", lambda self, *a: calls.append(1) or step(self, *a))
    alone = run(name, [1, 2, 1, 3], together=False)
    assert len(calls) == 4 * 12
    calls.clear()
    together = run(name, [1, 2, 1, 3], together=True)
    assert len(calls) == 12  # one scheduler call a step for the four requests
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


def test_who_steps_together():
    ddim = samplers("ddim", [1, 2])
    assert cohort_key(ddim[0]) == cohort_key(ddim[1])
    assert cohort_key(samplers("ddim", [1], steps=13)[0]) != cohort_key(ddim[0])  # another step count
    assert cohort_key(samplers("euler", [1])[0]) != cohort_key(ddim[0])
    ddim[1].index = 1
    assert cohort_key(ddim[1]) != cohort_key(ddim[0])  # another step
    assert cohort_key(samplers("ddpm", [1])[0]) is None  # draws noise from each request's generators


def test_members_keep_no_shared_mutable_state():
    group = samplers("unipc", [1, 1, 1])
    latents = [s.initial_latents(SHAPE, torch.device("cpu")) for s in group]
    for _ in range(3):
        outputs = [fake_model(s.model_input(x), s.index, r) for r, (s, x) in enumerate(zip(group, latents))]
        latents = step_all(list(zip(group, outputs, latents)))
    a, b = group[0].scheduler, group[1].scheduler
    for name, value in vars(a).items():
        if isinstance(value, list):
            assert value is not getattr(b, name), name
    assert [s.index for s in group] == [3, 3, 3]
    # one member going on alone (the others left) still gives its own numbers
    alone = samplers("unipc", [1])[0]
    x = alone.initial_latents(SHAPE, torch.device("cpu"))
    for step in range(4):
        x = alone.step(fake_model(alone.model_input(x), step, 0), x)
    y = latents[0]
    y = group[0].step(fake_model(group[0].model_input(y), 3, 0), y)
    assert torch.equal(x, y)


@pytest.mark.parametrize("name", sorted(COHORT_SAMPLERS | {"ddpm"}))
def test_requests_samplers_share_only_what_no_step_writes(name):
    """Each request's scheduler is a copy of one template: they share the noise schedule's tensors
    and the frozen config, never a container a step changes; a request that runs to its end
    leaves one copied before it with the numbers it has alone."""
    a, b = samplers(name, [1, 1])
    for attr, value in vars(a.scheduler).items():
        if type(value) in (list, dict):  # (the config is a FrozenDict, shared)
            assert value is not getattr(b.scheduler, attr), attr
    waiting = samplers(name, [1])[0]  # copied before the other request's steps
    other = run(name, [1], together=False)[0]  # the same request (seeds), run first to its end
    x = waiting.initial_latents(SHAPE, torch.device("cpu"))
    while not waiting.done:
        x = waiting.step(fake_model(waiting.model_input(x), waiting.index, 0), x)
    assert torch.equal(x, other)
