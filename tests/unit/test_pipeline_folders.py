"""The diffusers-folder pipelines (loader.py, unet.py, pixart.py) against diffusers' own pipelines.

Tiny randomly-initialised pipelines are built from configs and saved to a temporary folder
(nothing is downloaded). A whole sampling run (CFG, a diffusers scheduler, the same initial noise)
through our encode_prompt / stack / denoise / decode must equal the diffusers pipeline's run on
the same folder, as the LLM engine is checked against HF transformers.
"""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from diffusers import (  # noqa: E402
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    PixArtAlphaPipeline,
    PixArtSigmaPipeline,
    StableDiffusionPipeline,
)

from pagemesh.common.messages import ImageParams  # noqa: E402
from pagemesh.tests.diffusion_folders import (  # noqa: E402
    tiny_pixart_alpha_folder,
    tiny_pixart_sigma_folder,
    tiny_sd_folder,
)
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest  # noqa: E402
from pagemesh.workers.diffusion.pipelines.loader import LAYOUTS, ModelFolderError, load_pipeline  # noqa: E402

PROMPTS = ["a cat on a mat", "the dog", "A CAT sits on the red mat, looking left"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory) -> str:
    return tiny_sd_folder(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="module")
def alpha_folder(tmp_path_factory) -> str:
    return tiny_pixart_alpha_folder(tmp_path_factory.mktemp("tiny-pixart-alpha"))


@pytest.fixture(scope="module")
def sigma_folder(tmp_path_factory) -> str:
    return tiny_pixart_sigma_folder(tmp_path_factory.mktemp("tiny-pixart-sigma"))


@pytest.fixture(scope="module")
def models(sd_folder, alpha_folder, sigma_folder) -> dict:
    return {
        "sd": load_pipeline(sd_folder),
        "alpha": load_pipeline(alpha_folder, name="pixart"),
        "sigma": load_pipeline(sigma_folder),
    }


def _params(prompt="a cat", **overrides) -> ImageParams:
    fields = dict(
        prompt=prompt,
        negative_prompt=None,
        n=1,
        width=None,
        height=None,
        num_inference_steps=None,
        guidance_scale=None,
        sampler=None,
        seed=None,
    )
    return ImageParams(**{**fields, **overrides})


def _our_run(model, scheduler, *, prompt, negative_prompt, noise, steps, guidance):
    """The engine's loop for one request, plainly: CFG as two rows of one batch."""
    cond, uncond = model.encode_prompt(prompt, negative_prompt)
    rows = model.stack([uncond, cond])
    scheduler.set_timesteps(steps)
    x = noise * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        model_in = scheduler.scale_model_input(torch.cat([x, x]), t)
        out_uncond, out_cond = model.denoise(model_in, t.expand(2), rows).chunk(2)
        x = scheduler.step(out_uncond + guidance * (out_cond - out_uncond), t, x).prev_sample
    return x, model.decode(x)


CASES = [  # model, its diffusers pipeline, sampler, size, negative prompt
    ("sd", StableDiffusionPipeline, DDIMScheduler, (16, 16), "blurry"),
    ("sd", StableDiffusionPipeline, EulerDiscreteScheduler, (24, 16), None),
    ("alpha", PixArtAlphaPipeline, DDIMScheduler, (256, 256), None),
    ("alpha", PixArtAlphaPipeline, DPMSolverMultistepScheduler, (192, 256), "Blurry, dark"),
    ("sigma", PixArtSigmaPipeline, DPMSolverMultistepScheduler, (16, 16), None),
]


@pytest.mark.parametrize(("key", "pipeline_cls", "scheduler_cls", "size", "negative"), CASES)
def test_sampling_run_equals_diffusers_pipeline(request, models, key, pipeline_cls, scheduler_cls, size, negative):
    model = models[key]
    folder = request.getfixturevalue(f"{key}_folder")
    resolved = model.resolve(_params(PROMPTS[2], width=size[0], height=size[1], num_inference_steps=4))
    noise = torch.randn((1, *resolved.latent_shape), generator=torch.Generator().manual_seed(7))
    guidance = 6.0
    latents, images = _our_run(
        model,
        scheduler_cls.from_config(model.scheduler_config),
        prompt=PROMPTS[2],
        negative_prompt=negative,
        noise=noise,
        steps=4,
        guidance=guidance,
    )

    reference = pipeline_cls.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    reference.scheduler = scheduler_cls.from_config(reference.scheduler.config)
    kwargs = dict(
        prompt=PROMPTS[2],
        num_inference_steps=4,
        guidance_scale=guidance,
        width=size[0],
        height=size[1],
        latents=noise.clone(),
    )
    if negative is not None:
        kwargs["negative_prompt"] = negative
    final = []  # the latents after the last step, from the pipeline's callback
    if key == "sd":
        kwargs["callback_on_step_end"] = lambda pipe, i, t, tensors: final.append(tensors["latents"]) or tensors
    else:
        kwargs.update(use_resolution_binning=False, clean_caption=False, callback=lambda i, t, x: final.append(x))
    expected_images = reference(**kwargs, output_type="np").images
    expected_latents = final[-1]

    assert latents.shape == (1, *resolved.latent_shape)
    torch.testing.assert_close(latents, expected_latents, atol=1e-5, rtol=1e-5)
    assert images.dtype == torch.uint8 and images.shape == (1, size[1], size[0], 3)
    expected_uint8 = torch.from_numpy(expected_images * 255).round()
    assert (images.float() - expected_uint8).abs().max() <= 1


@pytest.mark.parametrize("key", ["sd", "alpha"])
def test_a_rows_output_does_not_depend_on_its_batch(models, key):
    model = models[key]
    shape = model.resolve(_params()).latent_shape
    rows = [model.encode_prompt(p, "ugly")[i % 2] for i, p in enumerate(PROMPTS)]
    latents = torch.randn((len(rows), *shape), generator=torch.Generator().manual_seed(3))
    timesteps = torch.tensor([981, 500, 21])

    together = model.denoise(latents, timesteps, model.stack(rows))
    for i, row in enumerate(rows):
        alone = model.denoise(latents[i : i + 1], timesteps[i : i + 1], model.stack([row]))
        torch.testing.assert_close(together[i : i + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("key", "limit"), [("sd", 77), ("alpha", 120), ("sigma", 300)])
def test_prompt_over_the_text_encoders_length_is_refused(models, key, limit):
    model = models[key]
    too_long = "a " * limit  # the tiny tokenizers make a token of each character or word
    for call in (lambda: model.resolve(_params(too_long)), lambda: model.encode_prompt(too_long, None)):
        with pytest.raises(InvalidImageRequest) as refused:
            call()
        assert refused.value.param == "prompt" and f"at most {limit}" in refused.value.message
    with pytest.raises(InvalidImageRequest) as refused:
        model.resolve(_params("a cat", negative_prompt=too_long))
    assert refused.value.param == "negative_prompt"
    with pytest.raises(InvalidImageRequest) as refused:
        model.encode_prompt("  ", None)
    assert refused.value.param == "prompt" and "empty" in refused.value.message


def test_serving_defaults_from_pagemesh_json(models):
    model = models["sd"]
    assert model.name == "tiny-sd0"  # the folder's name
    assert model.native_size == (16, 16)
    assert model.info.sizes == ["16x16", "24x16"]
    assert (model.info.default_sampler, model.info.default_steps, model.info.max_steps) == ("euler", 30, 30)
    resolved = model.resolve(_params(seed=5))
    assert (resolved.width, resolved.height, resolved.latent_shape) == (16, 16, (4, 8, 8))
    assert (resolved.steps, resolved.sampler, resolved.guidance_scale, resolved.seed) == (30, "euler", 7.5, 5)
    assert model.resolve(_params(width=24, height=16)).latent_shape == (4, 8, 12)
    with pytest.raises(InvalidImageRequest) as refused:
        model.resolve(_params(width=32, height=32))
    assert refused.value.param == "size" and "16x16, 24x16" in refused.value.message
    with pytest.raises(InvalidImageRequest) as refused:
        model.resolve(_params(num_inference_steps=31))
    assert refused.value.param == "num_inference_steps"


def test_serving_defaults_from_the_model(models):
    alpha, sigma = models["alpha"], models["sigma"]
    assert alpha.name == "pixart"
    assert alpha.info.sizes == ["256x256", "256x192", "192x256"]  # 128 latents x VAE scale 2, and 4:3
    assert sigma.info.sizes == ["16x16"]
    assert alpha.info.samplers == ["ddpm", "ddim", "dpmsolver++", "unipc", "euler"]
    assert (alpha.info.default_sampler, alpha.info.default_steps, alpha.info.max_steps) == ("dpmsolver++", 20, 200)
    resolved = alpha.resolve(_params(sampler="unipc", guidance_scale=1.0))
    assert (resolved.sampler, resolved.guidance_scale, resolved.latent_shape) == ("unipc", 1.0, (4, 128, 128))
    assert alpha.resolve(_params()).guidance_scale == 4.5
    with pytest.raises(InvalidImageRequest) as refused:
        alpha.resolve(_params(sampler="lms"))
    assert refused.value.param == "sampler" and "dpmsolver++" in refused.value.message


def test_unknown_layout_names_what_is_supported(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ModelFolderError) as refused:
        load_pipeline(str(tmp_path))
    assert "StableDiffusionXLPipeline" in str(refused.value)
    assert all(layout in str(refused.value) for layout in LAYOUTS)
    (tmp_path / "model_index.json").unlink()
    with pytest.raises(ModelFolderError, match="no model_index.json"):
        load_pipeline(str(tmp_path))
    with pytest.raises(ModelFolderError, match="not a folder"):
        load_pipeline(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("serving", "says"),
    [({"steps": 4}, "keys among"), ({"sizes": ["18x16"]}, "multiples of 4"), ({"samplers": ["lms"]}, "samplers")],
)
def test_a_bad_pagemesh_json_is_a_load_error(sd_folder, tmp_path, serving, says):
    folder = shutil.copytree(sd_folder, tmp_path / "sd")
    (folder / "pagemesh.json").write_text(json.dumps(serving))
    with pytest.raises(ModelFolderError, match=says):
        load_pipeline(str(folder))


def test_a_folder_missing_a_component_is_a_load_error(sd_folder, tmp_path):
    folder = shutil.copytree(sd_folder, tmp_path / "sd")
    shutil.rmtree(folder / "unet")
    with pytest.raises(ModelFolderError, match="cannot load"):
        load_pipeline(str(folder))


def test_dispatch_to_the_embedded_and_dit_models(monkeypatch, tmp_path):
    calls = []
    embedded = types.ModuleType("embedded")
    embedded.load_embedded = lambda device, dtype: calls.append(("embedded", device, dtype)) or "digits"
    dit = types.ModuleType("dit")
    dit.DiTPipelineModel = types.SimpleNamespace(
        from_folder=lambda path, **kw: calls.append(("dit", path, kw)) or "dit-model"
    )
    monkeypatch.setitem(sys.modules, "pagemesh.workers.diffusion.pipelines.embedded", embedded)
    monkeypatch.setitem(sys.modules, "pagemesh.workers.diffusion.pipelines.dit", dit)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))

    assert load_pipeline(None, dtype=torch.bfloat16) == "digits"
    assert load_pipeline(str(tmp_path), name="dit", device="cpu") == "dit-model"
    assert calls == [
        ("embedded", torch.device("cpu"), torch.bfloat16),
        ("dit", str(tmp_path), {"name": "dit", "device": "cpu", "dtype": torch.float32}),
    ]


@pytest.mark.parametrize("key", ["sd", "alpha"])
def test_a_bfloat16_load_serves_close_to_float32(request, models, key):
    model = models[key]
    half = load_pipeline(request.getfixturevalue(f"{key}_folder"), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.info == model.info
    shape = model.resolve(_params()).latent_shape
    latents = torch.randn((2, *shape), generator=torch.Generator().manual_seed(4))
    timesteps = torch.tensor([700, 300])
    expected = model.denoise(latents, timesteps, model.stack(list(model.encode_prompt(PROMPTS[0], None))))
    out = half.denoise(latents, timesteps, half.stack(list(half.encode_prompt(PROMPTS[0], None))))
    assert out.dtype == torch.float32  # the engine's latents keep their dtype
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.05)
    images = half.decode(latents[:1])
    assert images.dtype == torch.uint8 and images.shape == (1, *reversed(model.native_size), 3)
