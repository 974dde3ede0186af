"""The embedded consistency model (workers/diffusion/models/digits-dit-lcm, trained by
workers/diffusion/training/consistency_digits.py): it loads by name and serves its consistency
sampler ("lcm") alone; the engine's images at one step are the digits asked for (>= 95% by the
project's classifier), at 2 and 4 steps too; a request's image is the same alone and in a batch
(the noise LCM adds between steps comes from the request's own generators)."""

from __future__ import annotations

import json

import pytest
import torch

from pagemesh.bench.diffusion.classifier import digit_classifier
from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine.config import EngineConfig
from pagemesh.workers.diffusion.engine.engine import DiffusionEngine
from pagemesh.workers.diffusion.engine.jobs import ImageJob
from pagemesh.workers.diffusion.engine.samplers import CONSISTENCY_SAMPLERS, SAMPLERS, RequestSampler
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest
from pagemesh.workers.diffusion.pipelines.embedded import EMBEDDED_MODELS, LCM_NAME, LCM_PATH
from pagemesh.workers.diffusion.pipelines.loader import load_pipeline
from pagemesh.workers.diffusion.training.consistency_digits import Consistency
from pagemesh.workers.diffusion.training.distill_digits import Schedule

PER_DIGIT = 4  # 40 images a cell: one misjudged image is 2.5%
ONE_STEP_ACCURACY = 0.95  # what the consistency model must reach at one step (measured: 99.8-100%)
MORE_STEPS_ACCURACY = 0.90  # 2 and 4 steps (measured on 400 images: 98.5-100%; 40 images are noisy)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return load_pipeline(LCM_NAME)


@pytest.fixture
def served(model):
    """The model, as the engine serves it (it offers its one sampler, "lcm")."""
    assert model.samplers == ["lcm"]
    return model


def params(digit: int, *, n: int = 1, steps: int | None = None, sampler: str | None = None, seed: int = 0):
    return ImageParams(
        prompt=f"a handwritten {digit}",
        negative_prompt=None,
        n=n,
        width=None,
        height=None,
        num_inference_steps=steps,
        guidance_scale=None,
        sampler=sampler,
        seed=seed,
    )


def run(engine: DiffusionEngine) -> dict:
    finished = {}
    while engine.has_work():
        for done in engine.step():
            finished[done.request_id] = done
    return finished


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 8, 8, 1] -> [n, 1, 8, 8] in [-1, 1], as the classifier takes them."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1


def engine_accuracy(model, steps: int | None) -> tuple[float, set]:
    """The classifier's accuracy on PER_DIGIT images of each digit (one request per digit, seeded)."""
    engine = DiffusionEngine(model, EngineConfig(max_running=10, max_batch_rows=100))
    for digit in range(10):
        job = params(digit, n=PER_DIGIT, steps=steps, seed=500 + 10 * digit)
        engine.add(ImageJob(request_id=str(digit), params=job, arrival=0.0))
    finished = run(engine)
    images = torch.cat([to_unit(finished[str(d)].images) for d in range(10)])
    asked = torch.arange(10).repeat_interleave(PER_DIGIT)
    correct = int((digit_classifier().predict(images) == asked).sum())
    return correct / len(asked), {(f.steps, f.sampler) for f in finished.values()}


def test_the_folder_is_embedded_and_records_how_it_was_made():
    assert EMBEDDED_MODELS[LCM_NAME] == LCM_PATH and (LCM_PATH / "model_index.json").is_file()
    serving = json.loads((LCM_PATH / "pagemesh.json").read_text())
    assert (serving["samplers"], serving["default_sampler"], serving["max_steps"]) == (["lcm"], "lcm", 8)
    assert serving["default_guidance_scale"] == serving["max_guidance_scale"] == 1.0
    distilled = serving["distilled"]
    assert distilled["method"].startswith("consistency distillation") and distilled["teacher"] == "digits-dit"
    assert distilled["threads"] == 1 and distilled["accuracy"]["1"] >= ONE_STEP_ACCURACY
    # "lcm" is a consistency model's sampler, not one every diffusion model offers.
    assert "lcm" in CONSISTENCY_SAMPLERS and "lcm" not in SAMPLERS
    assert SAMPLERS == ("ddpm", "ddim", "dpmsolver++", "unipc", "euler")


def test_the_lcm_sampler_computes_the_trained_consistency_function(model):
    """One "lcm" step from t = 999 is f(x, 999) as consistency_digits.py trained it: the served
    parametrization (v-prediction, LCMScheduler's c_skip / c_out) is the trained one."""
    assert model.scheduler_config["_class_name"] == "LCMScheduler"
    assert model.scheduler_config["prediction_type"] == "v_prediction"
    generators = [torch.Generator().manual_seed(3 + i) for i in range(5)]
    sampler = RequestSampler("lcm", model.scheduler_config, 1, generators)
    assert sampler.timesteps.tolist() == [999]
    z = sampler.initial_latents(model.latent_shape, model.device)
    labels = torch.tensor([0, 3, 5, 7, 9])
    t = sampler.timestep.expand(5)
    served = sampler.step(model.denoise(sampler.model_input(z), t, labels), z)
    assert sampler.done
    with torch.no_grad():
        trained = Consistency(Schedule(model.scheduler_config), sampler.scheduler)(model.transformer, z, t, labels)
    torch.testing.assert_close(served, trained, rtol=1e-5, atol=1e-5)
    # 2, 4 and 8 steps visit points of the trained grid (19, 39, ..., 999).
    for steps, grid in ((2, [999, 499]), (4, [999, 759, 499, 259])):
        assert RequestSampler("lcm", model.scheduler_config, steps, generators).timesteps.tolist() == grid
    eight = RequestSampler("lcm", model.scheduler_config, 8, generators).timesteps
    assert all((t + 1) % 20 == 0 for t in eight.tolist())


def test_one_lcm_step_by_the_request_sampler_makes_the_digits_asked_for(model):
    """The engine's per-request sampler at one step, without the pipeline's request checks."""
    labels = torch.arange(10).repeat_interleave(PER_DIGIT)
    generators = [torch.Generator().manual_seed(700 + i) for i in range(len(labels))]
    sampler = RequestSampler("lcm", model.scheduler_config, 1, generators)
    z = sampler.initial_latents(model.latent_shape, model.device)
    z = sampler.step(model.denoise(sampler.model_input(z), sampler.timestep.expand(len(z)), labels), z)
    accuracy = int((digit_classifier().predict(to_unit(model.decode(z))) == labels).sum()) / len(labels)
    assert accuracy >= ONE_STEP_ACCURACY, f"{accuracy:.1%} of {len(labels)} images"


def test_it_loads_by_name_and_serves_only_its_sampler(served):
    model = served
    assert model.name == LCM_NAME and load_pipeline(LCM_NAME, name="fast").name == "fast"
    info = model.info
    assert (info.samplers, info.default_sampler, info.default_steps, info.max_steps) == (["lcm"], "lcm", 1, 8)
    assert model.default_guidance == 1.0 and model.max_guidance == 1.0
    engine = DiffusionEngine(model)
    for sampler in ("ddim", "euler", "nope"):
        with pytest.raises(InvalidImageRequest) as refused:
            engine.add(ImageJob(request_id=sampler, params=params(7, sampler=sampler), arrival=0.0))
        assert refused.value.param == "sampler" and "lcm" in refused.value.message
    with pytest.raises(InvalidImageRequest) as refused:
        engine.add(ImageJob(request_id="nine", params=params(7, steps=9), arrival=0.0))
    assert refused.value.param == "num_inference_steps"
    assert not engine.has_work()


def test_one_step_through_the_engine_makes_the_digits_asked_for(served):
    accuracy, ran = engine_accuracy(served, None)  # its default: one step
    assert ran == {(1, "lcm")}
    assert accuracy >= ONE_STEP_ACCURACY, f"{accuracy:.1%} of {10 * PER_DIGIT} images"


@pytest.mark.parametrize("steps", [2, 4])
def test_two_and_four_steps_make_the_digits_asked_for_too(served, steps):
    accuracy, ran = engine_accuracy(served, steps)
    assert ran == {(steps, "lcm")}
    assert accuracy >= MORE_STEPS_ACCURACY, f"{accuracy:.1%} of {10 * PER_DIGIT} images at {steps} steps"


@pytest.mark.parametrize("steps", [1, 4])
def test_the_same_seed_gives_the_same_image_alone_and_in_a_batch(served, steps):
    model = served
    alone = DiffusionEngine(model)
    alone.add(ImageJob(request_id="me", params=params(3, n=2, steps=steps, seed=42), arrival=0.0))
    expected = run(alone)["me"].images

    mixed = DiffusionEngine(model, EngineConfig(max_running=10, max_batch_rows=100))
    mixed.add(ImageJob(request_id="a", params=params(5, n=3, steps=4, seed=42), arrival=0.0))  # same seed
    mixed.add(ImageJob(request_id="b", params=params(8, n=2, steps=2, seed=1), arrival=0.0))
    mixed.step()  # "me" joins a step late: it rides with others at other timesteps
    mixed.add(ImageJob(request_id="me", params=params(3, n=2, steps=steps, seed=42), arrival=0.0))
    finished = run(mixed)
    assert torch.equal(finished["me"].images, expected)
    assert finished["me"].batched_with > 0 or steps == 1
    assert not torch.equal(finished["me"].images[0], finished["me"].images[1])  # image i: seed + i
