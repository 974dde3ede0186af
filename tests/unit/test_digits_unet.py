"""The embedded U-Net image model (workers/diffusion/models/digits-unet, pipelines/class_unet.py):
it loads by name and as a folder, serves pagemesh.json's defaults, treats every row on its own,
and the images the engine makes with its defaults are the digits asked for, as the project's
classifier judges them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import UNet2DModel

from pagemesh.bench.diffusion.classifier import digit_classifier
from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine.config import EngineConfig
from pagemesh.workers.diffusion.engine.engine import DiffusionEngine
from pagemesh.workers.diffusion.engine.jobs import ImageJob
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest
from pagemesh.workers.diffusion.pipelines.class_unet import LAYOUT, ClassUNetPipelineModel
from pagemesh.workers.diffusion.pipelines.embedded import EMBEDDED_MODELS, UNET_NAME, UNET_PATH
from pagemesh.workers.diffusion.pipelines.loader import LAYOUTS, load_pipeline

PER_DIGIT = 4  # 40 images
# Measured at the defaults (25 dpmsolver++ steps, guidance 1.5; torch 2.13.0+cpu): 40/40 on these
# seeds, 40/40 on two other seed sets, 299/300 on 300 more; digits-dit: 297/300 on those 300.
MIN_ACCURACY = 0.95

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def params(prompt: str = "a handwritten 7", **fields) -> ImageParams:
    base = dict(
        negative_prompt=None,
        n=1,
        width=None,
        height=None,
        num_inference_steps=None,
        guidance_scale=None,
        sampler=None,
        seed=None,
    )
    return ImageParams(prompt=prompt, **{**base, **fields})


def run(engine: DiffusionEngine, jobs: dict[str, ImageParams]) -> dict:
    for request_id, job_params in jobs.items():
        engine.add(ImageJob(request_id=request_id, params=job_params, arrival=0.0))
    finished = {}
    while engine.has_work():
        finished.update({f.request_id: f for f in engine.step()})
    return finished


@pytest.fixture(scope="module")
def unet_model() -> ClassUNetPipelineModel:
    return load_pipeline(UNET_NAME)


def test_the_embedded_name_and_a_folder_of_the_layout_load(unet_model, tmp_path):
    assert EMBEDDED_MODELS[UNET_NAME] == UNET_PATH and UNET_PATH.name == UNET_NAME
    index = json.loads((UNET_PATH / "model_index.json").read_text())
    assert index["_class_name"] == LAYOUT and LAYOUT in LAYOUTS
    assert isinstance(unet_model, ClassUNetPipelineModel) and unet_model.name == UNET_NAME
    # The diffusers module is `unet` (U-Net feature caches split it); no transformer-block split.
    assert isinstance(unet_model.unet, UNet2DModel) and unet_model.block_forward is None
    assert unet_model.null_class == 10 and unet_model.native_size == (8, 8) and unet_model.latent_shape == (1, 8, 8)
    assert load_pipeline(UNET_NAME, name="unet-digits").name == "unet-digits"
    copy = shutil.copytree(UNET_PATH, tmp_path / "my-unet")
    by_folder = load_pipeline(str(copy))
    assert by_folder.name == "my-unet"
    x, t, cond = torch.randn(2, 1, 8, 8), torch.tensor([900, 30]), by_folder.stack([4, 10])
    torch.testing.assert_close(by_folder.denoise(x, t, cond), unet_model.denoise(x, t, cond), rtol=0, atol=0)


def test_serving_defaults_are_pagemesh_json(unet_model):
    serving = json.loads((UNET_PATH / "pagemesh.json").read_text())
    info = unet_model.info
    assert info.sizes == serving["sizes"] and info.samplers == serving["samplers"]
    assert (info.default_steps, info.default_sampler, info.max_steps) == (
        serving["default_steps"],
        serving["default_sampler"],
        serving["max_steps"],
    )
    assert unet_model.default_guidance == serving["default_guidance_scale"]
    assert info.conditioning == serving["conditioning"]
    resolved = unet_model.resolve(params(seed=1))
    assert (resolved.width, resolved.height) == tuple(int(s) for s in serving["sizes"][0].split("x"))
    assert (resolved.steps, resolved.sampler) == (serving["default_steps"], serving["default_sampler"])
    assert resolved.guidance_scale == serving["default_guidance_scale"]
    assert serving["trained"]["parameters"] == sum(p.numel() for p in unet_model.unet.parameters())


def test_prompts_name_one_digit(unet_model):
    assert unet_model.encode_prompt("a handwritten seven", None) == (7, 10)
    assert unet_model.encode_prompt("3", "a 5") == (3, 5)  # a negative prompt's digit takes the null's place
    for prompt in ("a cat", "a 3 or a 4"):
        with pytest.raises(InvalidImageRequest) as refused:
            unet_model.resolve(params(prompt))
        assert refused.value.param == "prompt"
    with pytest.raises(InvalidImageRequest) as refused:
        unet_model.resolve(params(negative_prompt="1 and 2"))
    assert refused.value.param == "negative_prompt"


@pytest.mark.parametrize("timesteps", [[999, 500, 20, 1], [980.5, 3.25, 400.0, 0.0]])
def test_rows_are_independent_of_their_batch(unet_model, timesteps):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1, 8, 8, generator=gen)
    t = torch.tensor(timesteps)
    cond = unet_model.stack([3, 10, 7, 0])
    batch = unet_model.denoise(x, t, cond)
    for i in range(4):
        alone = unet_model.denoise(x[i : i + 1], t[i : i + 1], cond[i : i + 1])
        torch.testing.assert_close(alone[0], batch[i], rtol=1e-5, atol=1e-5)


def test_a_requests_image_does_not_depend_on_who_shares_its_batch(unet_model):
    mine = params("a 2", n=2, seed=5, num_inference_steps=8)
    alone = run(DiffusionEngine(unet_model), {"mine": mine})["mine"].images
    others = {
        "a": params("a 9", n=3, seed=6, num_inference_steps=5, sampler="ddim", guidance_scale=3.0),
        "b": params("a 0", n=1, seed=7, num_inference_steps=12, sampler="euler", guidance_scale=1.0),
    }
    shared = run(DiffusionEngine(unet_model, EngineConfig(max_running=8, max_batch_rows=64)), {"mine": mine, **others})
    assert shared["mine"].batched_with  # it did share its batches
    assert (shared["mine"].images.int() - alone.int()).abs().max() <= 1  # a rounding to bytes at most


def test_the_images_at_its_defaults_are_the_digits_asked_for(unet_model):
    engine = DiffusionEngine(unet_model, EngineConfig(max_running=10, max_batch_rows=200))
    jobs = {f"{digit}": params(f"a handwritten {digit}", n=PER_DIGIT, seed=1000 + 100 * digit) for digit in range(10)}
    finished = run(engine, jobs)
    serving = json.loads((UNET_PATH / "pagemesh.json").read_text())
    assert {(f.steps, f.sampler) for f in finished.values()} == {(serving["default_steps"], serving["default_sampler"])}
    images = torch.cat([finished[str(d)].images for d in range(10)]).permute(0, 3, 1, 2).float() / 127.5 - 1
    asked = torch.arange(10).repeat_interleave(PER_DIGIT)
    predicted = digit_classifier().predict(images)
    accuracy = float((predicted == asked).float().mean())
    assert accuracy >= MIN_ACCURACY, f"{accuracy:.1%} of {len(asked)} images classified as the digit asked for"
    for digit in range(10):  # and no digit is left out
        assert float((predicted[asked == digit] == digit).float().mean()) >= 0.75, digit


def test_deepcache_interval_1_is_the_uncached_image_and_interval_3_skips_blocks():
    """The embedded U-Net serves DeepCache (engine/deep_cache.py): interval 1 reproduces the
    uncached image exactly; interval 3 skips the deep branch on the steps between."""
    import dataclasses
    import time

    pipeline = load_pipeline("digits-unet")
    base = ImageParams(
        prompt="a 5",
        negative_prompt=None,
        n=2,
        width=8,
        height=8,
        num_inference_steps=12,
        guidance_scale=None,
        sampler="ddim",
        seed=4,
    )
    results = {}
    for cache in ("none", "interval:1", "interval:3"):
        engine = DiffusionEngine(pipeline, EngineConfig())
        engine.add(ImageJob(request_id=cache, params=dataclasses.replace(base, cache=cache), arrival=time.monotonic()))
        while engine.has_work():
            for finished in engine.step():
                results[cache] = finished
    assert torch.equal(results["interval:1"].images, results["none"].images)
    assert results["interval:3"].blocks_skipped > 0
    assert not torch.equal(results["interval:3"].images, results["none"].images)
