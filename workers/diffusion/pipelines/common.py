"""What the diffusers-folder pipelines (`unet.py`, `pixart.py`) share: the folder's files, the
serving defaults (`pagemesh.json`), request resolution, text-prompt conditioning rows and the
VAE decode.

    folder/
      model_index.json        diffusers' layout: `_class_name` picks the pipeline (loader.py)
      scheduler/ vae/ unet|transformer/ text_encoder/ tokenizer/
      pagemesh.json           optional serving defaults, every key optional:
        {"sizes": ["512x512", "512x384"], "default_steps": 30, "max_steps": 100,
         "samplers": ["ddim", "dpmsolver++"], "default_sampler": "dpmsolver++", "guidance_scale": 7.5,
         "teacache_coefficients": [...], "teacache_fit": {...}}    (training/fit_teacache.py)
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagemesh.common.messages import ImageModelInfo, ImageParams
from pagemesh.common.messages.images import MAX_SIDE
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest, Resolved

SAMPLERS = ("ddpm", "ddim", "dpmsolver++", "unipc", "euler")  # any diffusion model's (the default list)
# A consistency model's sampler (engine/samplers.py), offered only by a folder whose pagemesh.json lists it.
KNOWN_SAMPLERS = (*SAMPLERS, "lcm")
# The sampler a folder's own scheduler is (its default); a scheduler not here defaults to ddim.
SAMPLER_OF_SCHEDULER = {
    "DDPMScheduler": "ddpm",
    "DDIMScheduler": "ddim",
    "DPMSolverMultistepScheduler": "dpmsolver++",
    "UniPCMultistepScheduler": "unipc",
    "EulerDiscreteScheduler": "euler",
}
SERVING_FILE = "pagemesh.json"
MAX_STEPS = 200  # a default bound on steps per image; pagemesh.json may set another


class ModelFolderError(ValueError):
    """A folder this worker cannot serve (missing files, an unsupported layout, a bad
    pagemesh.json): a startup error, naming the folder and what is wrong."""


def read_model_index(path: str) -> dict[str, Any]:
    index = os.path.join(path, "model_index.json")
    if not os.path.isdir(path):
        raise ModelFolderError(f"{path}: not a folder")
    if not os.path.isfile(index):
        raise ModelFolderError(f"{path}: no model_index.json (not a folder in diffusers' layout)")
    with open(index) as f:
        return json.load(f)


def folder_name(path: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(path)))


def read_scheduler_config(path: str) -> dict[str, Any]:
    config = os.path.join(path, "scheduler", "scheduler_config.json")
    if not os.path.isfile(config):
        raise ModelFolderError(f"{path}: no scheduler/scheduler_config.json")
    with open(config) as f:
        return json.load(f)


@dataclass(frozen=True, kw_only=True)
class ServingDefaults:
    """What a model serves and what a request gets when it says nothing."""

    sizes: tuple[tuple[int, int], ...]  # (width, height); the first is the default
    samplers: tuple[str, ...]
    default_sampler: str
    default_steps: int
    max_steps: int
    guidance_scale: float

    def info(self, conditioning: str) -> ImageModelInfo:
        return ImageModelInfo(
            sizes=[f"{w}x{h}" for w, h in self.sizes],
            samplers=list(self.samplers),
            default_sampler=self.default_sampler,
            default_steps=self.default_steps,
            max_steps=self.max_steps,
            conditioning=conditioning,
        )


def model_defaults(
    *,
    native: tuple[int, int],
    size_multiple: int,
    scheduler_config: dict[str, Any],
    default_steps: int,
    guidance_scale: float,
) -> ServingDefaults:
    """The defaults a folder without pagemesh.json serves with: its native size (and, for a
    square native size of 256 px or more, the 4:3 and 3:4 sizes of the same long side, in
    multiples of 64), every sampler, its own scheduler's sampler first."""
    w, h = native
    sizes = [native]
    if w == h and w >= 256:
        short = w * 3 // 4 // 64 * 64
        if short % size_multiple == 0:
            sizes += [(w, short), (short, w)]
    max_steps = min(MAX_STEPS, scheduler_config.get("num_train_timesteps", MAX_STEPS))
    return ServingDefaults(
        sizes=tuple(sizes),
        samplers=SAMPLERS,
        default_sampler=SAMPLER_OF_SCHEDULER.get(scheduler_config.get("_class_name", ""), "ddim"),
        default_steps=min(default_steps, max_steps),
        max_steps=max_steps,
        guidance_scale=guidance_scale,
    )


def read_serving_defaults(path: str, defaults: ServingDefaults, *, size_multiple: int) -> ServingDefaults:
    """`defaults` overridden by the folder's pagemesh.json, when it has one, checked."""
    file = os.path.join(path, SERVING_FILE)
    if not os.path.isfile(file):
        return defaults
    with open(file) as f:
        raw = json.load(f)
    where = f"{file}:"
    known = {"sizes", "samplers", "default_sampler", "default_steps", "max_steps", "guidance_scale"}
    known |= {"teacache_coefficients", "teacache_fit"}  # read_teacache_coefficients's
    if not isinstance(raw, dict) or set(raw) - known:
        raise ModelFolderError(f"{where} an object with keys among {sorted(known)}")
    changes: dict[str, Any] = {}
    if "sizes" in raw:
        changes["sizes"] = tuple(_parse_size(s, size_multiple, where) for s in raw["sizes"])
        if not changes["sizes"]:
            raise ModelFolderError(f"{where} sizes: at least one")
    if "samplers" in raw:
        changes["samplers"] = tuple(raw["samplers"])
        if not changes["samplers"] or set(changes["samplers"]) - set(KNOWN_SAMPLERS):
            raise ModelFolderError(f"{where} samplers: a non-empty list among {list(KNOWN_SAMPLERS)}")
        if "default_sampler" not in raw and defaults.default_sampler not in changes["samplers"]:
            changes["default_sampler"] = changes["samplers"][0]
    for key, kind in (("default_sampler", str), ("default_steps", int), ("max_steps", int)):
        if key in raw:
            if type(raw[key]) is not kind:
                raise ModelFolderError(f"{where} {key}: a {kind.__name__}")
            changes[key] = raw[key]
    if "guidance_scale" in raw:
        if type(raw["guidance_scale"]) not in (int, float) or raw["guidance_scale"] < 0:
            raise ModelFolderError(f"{where} guidance_scale: a number >= 0")
        changes["guidance_scale"] = float(raw["guidance_scale"])
    if "max_steps" in raw and "default_steps" not in raw:
        changes["default_steps"] = min(defaults.default_steps, raw["max_steps"])
    serving = replace(defaults, **changes)
    if serving.default_sampler not in serving.samplers:
        raise ModelFolderError(f"{where} default_sampler: one of {list(serving.samplers)}")
    if not 1 <= serving.default_steps <= serving.max_steps:
        raise ModelFolderError(f"{where} 1 <= default_steps <= max_steps")
    return serving


def parse_teacache_coefficients(raw: Any, where: str) -> tuple[float, ...] | None:
    """pagemesh.json's "teacache_coefficients" (None when absent): TeaCache's rescaling
    polynomial, highest degree first (training/fit_teacache.py)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(type(c) in (int, float) and math.isfinite(c) for c in raw):
        raise ModelFolderError(f"{where} teacache_coefficients: a non-empty list of numbers")
    return tuple(float(c) for c in raw)


def read_teacache_coefficients(path: str) -> tuple[float, ...] | None:
    file = os.path.join(path, SERVING_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        raw = json.load(f)
    return parse_teacache_coefficients(raw.get("teacache_coefficients") if isinstance(raw, dict) else None, f"{file}:")


def _parse_size(text: Any, multiple: int, where: str) -> tuple[int, int]:
    parts = text.split("x") if isinstance(text, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ModelFolderError(f"{where} sizes: 'WxH' strings, not {text!r}")
    w, h = int(parts[0]), int(parts[1])
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE) or w % multiple or h % multiple:
        raise ModelFolderError(f"{where} size {text}: sides must be multiples of {multiple}, at most {MAX_SIDE}")
    return w, h


def resolve_request(
    params: ImageParams, serving: ServingDefaults, latent_shape: Callable[[int, int], tuple[int, ...]]
) -> Resolved:
    """`params` with `serving`'s defaults filled in, checked (the prompt is the pipeline's)."""
    default_w, default_h = serving.sizes[0]
    size = (params.width or default_w, params.height or default_h)
    if size not in serving.sizes:
        listed = ", ".join(f"{w}x{h}" for w, h in serving.sizes)
        raise InvalidImageRequest(f"size {size[0]}x{size[1]} is not one this model makes; sizes: {listed}", "size")
    steps = params.num_inference_steps or serving.default_steps
    if not 1 <= steps <= serving.max_steps:
        raise InvalidImageRequest(
            f"num_inference_steps must be in [1, {serving.max_steps}] for this model", "num_inference_steps"
        )
    sampler = params.sampler or serving.default_sampler
    if sampler not in serving.samplers:
        listed = ", ".join(serving.samplers)
        raise InvalidImageRequest(f"sampler {sampler!r} is not offered; samplers: {listed}", "sampler")
    guidance = serving.guidance_scale if params.guidance_scale is None else params.guidance_scale
    if not math.isfinite(guidance) or guidance < 0:
        raise InvalidImageRequest("guidance_scale must be a number >= 0", "guidance_scale")
    return Resolved(
        width=size[0],
        height=size[1],
        latent_shape=latent_shape(*size),
        steps=steps,
        sampler=sampler,
        guidance_scale=float(guidance),
        seed=secrets.randbelow(1 << 31) if params.seed is None else params.seed,
    )


@dataclass(frozen=True, kw_only=True)
class TextRows:
    """Text conditioning of batch rows: `embeds` [B, L, D] and, for a model that masks the
    padding (PixArt), `mask` [B, L] (1 = token, 0 = padding). Rows are padded to the model's
    fixed prompt length, so any rows stack."""

    embeds: torch.Tensor
    mask: torch.Tensor | None


def stack_text_rows(rows: list[TextRows]) -> TextRows:
    masks = [row.mask for row in rows]
    return TextRows(
        embeds=torch.cat([row.embeds for row in rows]),
        mask=None if masks[0] is None else torch.cat(masks),
    )


class PromptEncoder:
    """A tokenizer and its text encoder: a prompt -> one `TextRows` row, tokenized and padded to
    `max_tokens` as the model's diffusers pipeline does it. Prompts over `max_tokens` are refused,
    not truncated. The empty prompt's row (the usual uncond row) is encoded once and kept."""

    def __init__(
        self,
        tokenizer: Any,
        text_encoder: torch.nn.Module,
        *,
        max_tokens: int,
        lowercase: bool,  # PixArt lowercases and strips prompts (diffusers' caption cleaning off)
        mask_to_encoder: bool,
        keep_mask: bool,
        dtype: torch.dtype,
    ):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.max_tokens = max_tokens
        self.lowercase = lowercase
        self.mask_to_encoder = mask_to_encoder
        self.keep_mask = keep_mask
        self.dtype = dtype
        self._empty: TextRows | None = None

    def describe(self) -> str:
        return f"a text prompt of at most {self.max_tokens} tokens (special tokens included)"

    def _text(self, text: str) -> str:
        return text.lower().strip() if self.lowercase else text

    def check(self, text: str, param: str) -> None:
        if param == "prompt" and not text.strip():
            raise InvalidImageRequest(f"prompt must not be empty; this model takes {self.describe()}", param)
        count = len(self.tokenizer(self._text(text)).input_ids)
        if count > self.max_tokens:
            raise InvalidImageRequest(
                f"{param} is {count} tokens; this model's text encoder takes at most {self.max_tokens}", param
            )

    @torch.no_grad()
    def encode(self, text: str) -> TextRows:
        tokens = self.tokenizer(
            self._text(text), padding="max_length", max_length=self.max_tokens, truncation=True, return_tensors="pt"
        )
        device = self.text_encoder.device
        mask = tokens.attention_mask.to(device)
        embeds = self.text_encoder(tokens.input_ids.to(device), attention_mask=mask if self.mask_to_encoder else None)
        return TextRows(embeds=embeds[0].to(self.dtype), mask=mask if self.keep_mask else None)

    def encode_pair(self, prompt: str, negative_prompt: str | None) -> tuple[TextRows, TextRows]:
        self.check(prompt, "prompt")
        if negative_prompt:
            self.check(negative_prompt, "negative_prompt")
            return self.encode(prompt), self.encode(negative_prompt)
        if self._empty is None:
            self._empty = self.encode("")
        return self.encode(prompt), self._empty


def vae_scale_factor(vae: torch.nn.Module) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


def place_vae(vae: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The VAE on `device`; in float32 where it asks to be (`force_upcast`) and `dtype` is
    float16, whose range its decoder overflows (as diffusers' SDXL pipeline does it)."""
    if dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
        return vae.to(device=device, dtype=torch.float32)
    return vae.to(device)  # loaded in `dtype` already


def _float32_conv_forward(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    bias = None if conv.bias is None else conv.bias.float()
    return conv._conv_forward(x.float(), conv.weight.float(), bias).to(x.dtype)


def patch_embedding_in_float32_on_cpu(transformer: torch.nn.Module) -> None:
    """On the CPU in bfloat16, the patch embedding (diffusers' `PatchEmbed.proj`, a convolution
    of kernel = stride = the patch size) of `transformer` computes in float32 on its bfloat16
    weights and hands back bfloat16; everything else stays as loaded.

    torch's oneDNN (v3.12 in torch 2.13) runs bfloat16 convolutions on AMX CPUs with its BRGEMM
    kernel (`brg_conv_fwd:avx10_1_512_amx`), which returns wrong numbers for some strided
    shapes: 4 -> 24 channels with kernel = stride = 16 on 128 x 128 latents comes out with a
    relative error of about 1 (as good as random), then feeds every block. 3x3 stride-1
    convolutions (the VAE's, the UNet's) and float32 are correct. The patch embedding is one
    small convolution per forward, so float32 costs nothing a step would notice."""
    proj = getattr(getattr(transformer, "pos_embed", None), "proj", None)
    if isinstance(proj, torch.nn.Conv2d) and proj.weight.device.type == "cpu" and proj.weight.dtype == torch.bfloat16:
        proj.forward = _float32_conv_forward.__get__(proj)  # this one module's forward, weights as loaded


@torch.no_grad()
def decode_latents(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Latents [n, C, h, w] -> uint8 images [n, H, W, 3] on the CPU, as diffusers' pipelines
    decode (latents / scaling_factor (+ shift_factor), the VAE, [-1, 1] -> [0, 255] rounded)."""
    z = latents.to(device=vae.device, dtype=vae.dtype) / vae.config.scaling_factor
    if getattr(vae.config, "shift_factor", None):
        z = z + vae.config.shift_factor
    images = vae.decode(z, return_dict=False)[0]
    return to_uint8(images)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[n, C, H, W] in [-1, 1] -> uint8 [n, H, W, C] on the CPU."""
    pixels = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round()
    return pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()


class TextConditionedPipeline:
    """What the text-to-image pipelines (Stable Diffusion, PixArt) share: their parts, prompt
    checks and encoding by their `PromptEncoder`, text rows stacked per batch, the VAE decode. A
    subclass adds its denoiser, `native_size`, `_latent_shape(width, height)` and `denoise`."""

    def __init__(
        self,
        *,
        name: str,
        vae: torch.nn.Module,
        prompts: PromptEncoder,
        scheduler_config: dict[str, Any],
        serving: ServingDefaults,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.name = name
        self.vae = vae
        self.prompts = prompts
        self.scheduler_config = scheduler_config
        self.serving = serving
        self.device = device
        self.dtype = dtype
        self.scale = vae_scale_factor(vae)
        self.info = serving.info(prompts.describe())

    def _latent_shape(self, width: int, height: int) -> tuple[int, ...]:
        raise NotImplementedError

    def resolve(self, params: ImageParams) -> Resolved:
        self.prompts.check(params.prompt, "prompt")
        if params.negative_prompt:
            self.prompts.check(params.negative_prompt, "negative_prompt")
        return resolve_request(params, self.serving, self._latent_shape)

    def encode_prompt(self, prompt: str, negative_prompt: str | None) -> tuple[TextRows, TextRows]:
        return self.prompts.encode_pair(prompt, negative_prompt)

    def stack(self, rows: list[TextRows]) -> TextRows:
        return stack_text_rows(rows)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.vae, latents)
