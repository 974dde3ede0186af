"""workers/diffusion/pipelines/dit.py: the class-conditional DiT pipeline, on the shipped digits
weights and on a tiny random DiT with a VAE saved by diffusers' DiTPipeline to a temporary folder."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

from pagemesh.bench.diffusion.classifier import digit_classifier
from pagemesh.bench.diffusion.sample import sample
from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest
from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel
from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_PATH, load_embedded


def params(prompt="a handwritten 7", **fields):
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


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def digits() -> DiTPipelineModel:
    return load_embedded()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random DiT with learned sigma and a 2x AutoencoderKL, saved as DiTPipeline saves itself
    (id2label added to model_index.json, as the hub's DiT folders have it)."""
    torch.manual_seed(0)
    transformer = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=4,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=4,
        patch_size=2,
        num_embeds_ada_norm=1000,  # DiTPipeline's null class is 1000, hard-coded
        norm_num_groups=1,
    )
    vae = AutoencoderKL(
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 8],
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
    )
    folder = tmp_path_factory.mktemp("tiny-dit")
    DiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler()).save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["id2label"] = {"0": "tench, Tinca tinca", "1": "goldfish", "2": "great white shark", "3": "tiger shark"}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


# -- prompt -> class ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, digit",
    [
        ("a handwritten 7", 7),
        ("the digit seven", 7),
        ("7", 7),
        ("SEVEN!", 7),
        ("a 7, a seven", 7),
        ("draw a zero.", 0),
        ("digit-3 please", 3),
    ],
)
def test_prompt_names_the_class(digits, prompt, digit):
    assert digits.encode_prompt(prompt, None) == (digit, 10)


@pytest.mark.parametrize("prompt", ["a cat", "17", "sevens", "the 7th", "3 and 4", "one or two", ""])
def test_prompt_without_exactly_one_digit_is_refused(digits, prompt):
    with pytest.raises(InvalidImageRequest) as err:
        digits.encode_prompt(prompt, None)
    assert err.value.param == "prompt"
    assert "one digit, 0-9 or zero-nine" in err.value.message


def test_negative_prompt_picks_the_uncond_class(digits):
    assert digits.encode_prompt("a 7", "a 1") == (7, 1)
    assert digits.encode_prompt("a 7", "blurry") == (7, 10)
    with pytest.raises(InvalidImageRequest) as err:
        digits.encode_prompt("a 7", "1 or 2")
    assert err.value.param == "negative_prompt"


def test_longest_label_wins_and_labels_are_whole_phrases(tiny_folder):
    model = DiTPipelineModel.from_folder(tiny_folder)
    assert model.class_of("a Tiger Shark at dawn") == 3
    assert model.class_of("tinca tinca") == 0
    with pytest.raises(InvalidImageRequest):
        model.class_of("a shark")  # no label is just "shark"
    assert model.encode_prompt("goldfish", None) == (1, 1000)


# -- resolve -----------------------------------------------------------------------------------


def test_resolve_fills_the_shipped_defaults(digits):
    r = digits.resolve(params())
    assert (r.width, r.height, r.latent_shape) == (256, 256, (1, 8, 8))
    assert (r.steps, r.sampler, r.guidance_scale) == (25, "dpmsolver++", 1.5)
    assert 0 <= r.seed < 2**31
    r = digits.resolve(params(width=8, height=8, num_inference_steps=1000, sampler="unipc", guidance_scale=0, seed=5))
    assert (r.width, r.height, r.steps, r.sampler, r.guidance_scale, r.seed) == (8, 8, 1000, "unipc", 0.0, 5)
    assert digits.info.sizes == ["256x256", "8x8", "64x64", "128x128", "512x512"]
    assert digits.info.samplers == ["ddpm", "ddim", "dpmsolver++", "unipc", "euler"]
    assert digits.native_size == (8, 8)


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"width": 100, "height": 100}, "size", "256x256, 8x8, 64x64, 128x128, 512x512"),
        ({"width": 256, "height": 8}, "size", "256x8"),
        ({"num_inference_steps": 1001}, "num_inference_steps", "[1, 1000]"),
        ({"sampler": "lms"}, "sampler", "ddpm, ddim, dpmsolver++, unipc, euler"),
        ({"guidance_scale": -1.0}, "guidance_scale", ">= 0"),
        ({"prompt": "a cat"}, "prompt", "e.g. 'a handwritten 7'"),
        ({"negative_prompt": "4 and 5"}, "negative_prompt", "at most one"),
    ],
)
def test_resolve_refuses(digits, fields, param, says):
    with pytest.raises(InvalidImageRequest) as err:
        digits.resolve(params(**fields))
    assert err.value.param == param
    assert says in err.value.message


def test_a_folder_without_pagemesh_json_serves_its_native_size(tiny_folder):
    model = DiTPipelineModel.from_folder(tiny_folder, name="tiny")
    assert model.name == "tiny" and model.native_size == (8, 8)  # 4x4 latents, a 2x VAE
    r = model.resolve(params(prompt="goldfish"))
    assert (r.width, r.height, r.latent_shape) == (8, 8, (4, 4, 4))
    assert (r.steps, r.sampler, r.guidance_scale) == (50, "ddim", 4.0)
    assert model.info.sizes == ["8x8"] and model.info.max_steps == 1000


# -- the model ---------------------------------------------------------------------------------


def test_shipped_folder_is_diffusers_dit_layout():
    pipe = DiTPipeline.from_pretrained(DIGITS_PATH, vae=None)
    assert pipe.labels["seven"] == 7 and pipe.labels["0"] == 0
    assert pipe.transformer.config.num_embeds_ada_norm == 10
    assert pipe.scheduler.config.beta_schedule == "linear" and pipe.scheduler.config.thresholding is False


def test_denoise_is_the_transformer_call_with_eps_channels(tiny_folder):
    model = DiTPipelineModel.from_folder(tiny_folder)
    x = torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([999, 500, 3])
    cond = torch.tensor([0, 2, 1000])
    ref = model.transformer(x, timestep=t, class_labels=cond).sample
    assert ref.shape == (3, 8, 4, 4)  # learned sigma: eps and variance channels
    torch.testing.assert_close(model.denoise(x, t, cond), ref[:, :4], rtol=0, atol=0)


def test_guided_ddim_matches_diffusers_dit_pipeline(tiny_folder):
    """The same weights and initial noise: our loop over denoise/decode gives DiTPipeline's images."""
    pipe = DiTPipeline.from_pretrained(tiny_folder)
    ref = pipe([0, 3], guidance_scale=3.0, num_inference_steps=6, generator=torch.manual_seed(7), output_type="pt")
    model = DiTPipelineModel.from_folder(tiny_folder)
    latents = sample(model, [0, 3], sampler="ddim", steps=6, guidance_scale=3.0, seed=7)
    ours = model.decode(latents)  # uint8 [2, 8, 8, 3]
    assert ours.shape == (2, 8, 8, 3) and ours.dtype == torch.uint8
    expected = (ref.images.permute(0, 2, 3, 1) * 255).round().to(torch.int32)
    assert (ours.to(torch.int32) - expected).abs().max() <= 1


@pytest.mark.parametrize("timesteps", [[999, 500, 20, 1], [980.5, 3.25, 400.0, 0.0]])
def test_rows_are_independent_of_their_batch(digits, timesteps):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1, 8, 8, generator=gen)
    t = torch.tensor(timesteps)
    cond = digits.stack([3, 10, 7, 0])
    batch = digits.denoise(x, t, cond)
    for i in range(4):
        alone = digits.denoise(x[i : i + 1], t[i : i + 1], cond[i : i + 1])
        torch.testing.assert_close(alone[0], batch[i], rtol=1e-5, atol=1e-5)


def test_decode_maps_unit_range_to_bytes(digits):
    latents = torch.tensor([-1.5, -1.0, 0.0, 1.0]).repeat(16).view(1, 1, 8, 8)
    pixels = digits.decode(latents)
    assert pixels.shape == (1, 8, 8, 1) and pixels.dtype == torch.uint8
    assert pixels[0, 0, :4, 0].tolist() == [0, 0, 128, 255]


def test_shipped_model_draws_recognisable_digits(digits):
    classes = [c for c in range(10) for _ in range(2)]
    latents = sample(digits, classes, sampler="ddim", steps=25, guidance_scale=digits.default_guidance, seed=0)
    images = digits.decode(latents).permute(0, 3, 1, 2).float() / 127.5 - 1
    recognised = (digit_classifier().predict(images) == torch.tensor(classes)).sum().item()
    assert recognised >= 17, f"{recognised}/20 recognised"
