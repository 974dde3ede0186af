"""A class-conditional UNet2DModel in pixel space from a folder in the ClassUNetPipeline layout,
as an ImagePipeline (the embedded digits-unet: python -m pagemesh.workers.diffusion.training.train_digits_unet).

    folder/model_index.json        _class_name ClassUNetPipeline, id2label {"7": "7,seven", ...}
    folder/unet/                   UNet2DModel (config.json + safetensors), num_class_embeds =
                                   the classes + 1: the last id is the null class
    folder/scheduler/              the scheduler config every sampler is built from
    folder/pagemesh.json           optional serving defaults (sizes, steps, sampler, guidance), the
                                   same keys as a DiT folder's (pipelines/dit.py)

"ClassUNetPipeline" is pagemesh's name, not a diffusers pipeline: diffusers' DDPMPipeline runs a
UNet2DModel without class labels. Prompts are read as the DiT's are (dit.ClassLabels): the prompt
names one class, its id is the conditioning row; the null class (id num_class_embeds - 1) is the
unconditional row, unless the negative prompt names a class, which then takes its place.

The diffusers module is `self.unet` (U-Net feature caches split it); `denoise` is its whole
forward with `class_labels`. Every op of the U-Net is per row (GroupNorm, convolutions, attention
within an image), so a row's output does not depend on its batch. It has no `block_forward` (that
is the transformer-block split); its `deep_cache_forward` (pipelines/unet.py) is DeepCache's split,
so the engine serves it the cache policies `none` and `interval:N` (engine/deep_cache.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagemesh.common.messages import ImageModelInfo, ImageParams
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest, Resolved
from pagemesh.workers.diffusion.pipelines.common import (
    KNOWN_SAMPLERS,
    SAMPLERS,
    ModelFolderError,
    ServingDefaults,
    resolve_request,
)
from pagemesh.workers.diffusion.pipelines.dit import FALLBACK_SERVING, ClassLabels
from pagemesh.workers.diffusion.pipelines.unet import unet_deep_cache

LAYOUT = "ClassUNetPipeline"


class ClassUNetPipelineModel:
    """The ImagePipeline of a class-conditional pixel-space UNet2DModel."""

    block_forward = None  # no transformer-block split: DeepCache's instead (deep_cache_forward)

    def __init__(
        self,
        *,
        name: str,
        unet: Any,
        scheduler_config: dict[str, Any],
        id2label: dict[str, str],
        serving: dict[str, Any],
    ):
        config = unet.config
        if not config.num_class_embeds or config.class_embed_type is not None:
            raise ModelFolderError(f"{name}: the unet is not class-conditional (num_class_embeds, no class_embed_type)")
        if config.in_channels != config.out_channels:
            raise ModelFolderError(f"{name}: the unet must predict as many channels as it takes (no learned sigma)")
        self.name = name
        self.unet = unet.eval()
        self.deep_cache_forward = unet_deep_cache(self.unet)
        self.device = unet.device
        self.dtype = unet.dtype
        self.scheduler_config = scheduler_config
        self.null_class = config.num_class_embeds - 1
        self.labels = ClassLabels(id2label)
        side = config.sample_size if isinstance(config.sample_size, int) else config.sample_size[0]
        self.latent_shape = (config.in_channels, side, side)
        self.native_size = (side, side)
        self.sizes: list[str] = list(serving.get("sizes", [f"{side}x{side}"]))
        self.samplers: list[str] = [s for s in serving.get("samplers", SAMPLERS) if s in KNOWN_SAMPLERS]
        self.default_steps = int(serving.get("default_steps", FALLBACK_SERVING["default_steps"]))
        self.default_sampler = str(serving.get("default_sampler", FALLBACK_SERVING["default_sampler"]))
        self.default_guidance = float(serving.get("default_guidance_scale", FALLBACK_SERVING["default_guidance_scale"]))
        self.max_steps = int(serving.get("max_steps", scheduler_config.get("num_train_timesteps", 1000)))
        self.serving = ServingDefaults(
            sizes=tuple(_size(size) for size in self.sizes),
            samplers=tuple(self.samplers),
            default_sampler=self.default_sampler,
            default_steps=self.default_steps,
            max_steps=self.max_steps,
            guidance_scale=self.default_guidance,
        )
        example = next(iter(id2label.values())).split(",")[0].strip()
        self.conditioning = str(serving.get("conditioning", f"the prompt must name one class label, e.g. '{example}'"))
        self.info = ImageModelInfo(
            sizes=self.sizes,
            samplers=self.samplers,
            default_sampler=self.default_sampler,
            default_steps=self.default_steps,
            max_steps=self.max_steps,
            conditioning=self.conditioning,
        )

    @classmethod
    def from_folder(
        cls, path: str | Path, *, name: str | None = None, device: str | torch.device = "cpu", dtype=torch.float32
    ) -> ClassUNetPipelineModel:
        from diffusers import UNet2DModel

        path = Path(path)
        index = json.loads((path / "model_index.json").read_text())
        unet = UNet2DModel.from_pretrained(path / "unet", torch_dtype=dtype).to(device)
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        serving_file = path / "pagemesh.json"
        serving = json.loads(serving_file.read_text()) if serving_file.exists() else {}
        classes = (unet.config.num_class_embeds or 1) - 1
        id2label = index.get("id2label") or {str(i): str(i) for i in range(classes)}
        return cls(
            name=name or path.name, unet=unet, scheduler_config=scheduler_config, id2label=id2label, serving=serving
        )

    # -- what a request may ask ------------------------------------------------------------

    def class_of(self, prompt: str) -> int:
        """The one class the prompt names; InvalidImageRequest when it names none or several."""
        found = self.labels.classes_in(prompt)
        if len(found) != 1:
            why = "names no class" if not found else f"names {len(found)} different classes"
            raise InvalidImageRequest(f"the prompt {why}: {self.conditioning}", param="prompt")
        return found.pop()

    def negative_class(self, negative_prompt: str | None) -> int:
        """The uncond row's class: the null class unless the negative prompt names one."""
        found = self.labels.classes_in(negative_prompt or "")
        if len(found) > 1:
            raise InvalidImageRequest(
                f"the negative prompt names {len(found)} different classes; it may name at most one",
                param="negative_prompt",
            )
        return found.pop() if found else self.null_class

    def resolve(self, params: ImageParams) -> Resolved:
        resolved = resolve_request(params, self.serving, lambda width, height: self.latent_shape)
        self.class_of(params.prompt)
        self.negative_class(params.negative_prompt)
        return resolved

    # -- the model -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, negative_prompt: str | None) -> tuple[int, int]:
        return self.class_of(prompt), self.negative_class(negative_prompt)

    def stack(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Noise predictions [B, C, h, w] for latents already scaled by each row's scheduler;
        timesteps [B], one per row, int or float as the scheduler gives; cond [B] class ids."""
        latents = latents.to(self.device, self.dtype)
        return self.unet(latents, timesteps.to(self.device), class_labels=cond.to(self.device)).sample

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixel space: [-1, 1] -> uint8 [n, H, W, C] at the native size."""
        pixels = ((latents.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu()


def _size(text: str) -> tuple[int, int]:
    """'WxH' (a size pagemesh.json lists) -> (W, H)."""
    width, height = text.split("x")
    return int(width), int(height)
