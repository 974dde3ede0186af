"""A class-conditional UNet2DModel in pixel space from a folder in the ClassUNetPipeline layout,
as an ImagePipeline (the embedded digits-unet: python -m pagemesh.workers.diffusion.training.train_digits_unet).

    folder/model_index.json        _class_name ClassUNetPipeline, id2label {"7": "7,seven", ...}
    folder/unet/                   UNet2DModel (config.json + safetensors), num_class_embeds =
                                   the classes + 1: the last id is the null class
    folder/scheduler/              the scheduler config every sampler is built from
    folder/pagemesh.json           optional serving defaults (sizes, steps, sampler, guidance), the
                                   same keys as a DiT folder's (pipelines/dit.py)

"ClassUNetPipeline" is pagemesh's name, not a diffusers pipeline: diffusers' DDPMPipeline runs a
UNet2DModel without class labels. Prompts are read as the DiT's are (pipelines/class_conditioned.py): the prompt
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

from pagemesh.workers.diffusion.pipelines.class_conditioned import ClassConditionedPipeline
from pagemesh.workers.diffusion.pipelines.common import (
    ModelFolderError,
)
from pagemesh.workers.diffusion.pipelines.unet import unet_deep_cache

LAYOUT = "ClassUNetPipeline"


class ClassUNetPipelineModel(ClassConditionedPipeline):
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
        side = config.sample_size if isinstance(config.sample_size, int) else config.sample_size[0]
        self.latent_shape = (config.in_channels, side, side)
        self.native_size = (side, side)
        self.serve_classes(serving, scheduler_config, id2label, null_class=config.num_class_embeds - 1)

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

    # -- the model -------------------------------------------------------------------------

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
