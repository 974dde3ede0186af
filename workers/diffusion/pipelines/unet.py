"""A Stable-Diffusion-layout folder as an ImagePipeline: UNet2DConditionModel, a CLIP text
encoder and its tokenizer, AutoencoderKL, a scheduler (diffusers' `StableDiffusionPipeline`).

The forward is diffusers' own modules, called as `StableDiffusionPipeline.__call__` calls them,
row by row equal to it (tests/unit/test_pipeline_folders.py checks a whole sampling run against
diffusers' pipeline on the same weights and noise). No safety checker is run.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import StableDiffusionPipeline

from pagemesh.workers.diffusion.pipelines.common import (
    ModelFolderError,
    PromptEncoder,
    TextConditionedPipeline,
    TextRows,
    folder_name,
    model_defaults,
    place_vae,
    read_scheduler_config,
    read_serving_defaults,
    vae_scale_factor,
)

DEFAULT_STEPS = 50  # StableDiffusionPipeline's defaults
DEFAULT_GUIDANCE = 7.5


class UNetPipelineModel(TextConditionedPipeline):
    """The ImagePipeline of a Stable-Diffusion-layout folder. Conditioning rows are `TextRows`
    (CLIP embeddings [1, 77, D], no mask); latents are [C, H/8, W/8] for SD's VAE."""

    def __init__(self, *, unet: torch.nn.Module, **parts: Any):
        """`parts`: TextConditionedPipeline's (name, vae, prompts, scheduler_config, serving,
        device, dtype)."""
        super().__init__(**parts)
        self.unet = unet
        self.native_size = _native_size(unet, self.scale)

    @classmethod
    def from_folder(
        cls, path: str, *, name: str | None = None, device: str | torch.device = "cpu", dtype=torch.float32
    ) -> UNetPipelineModel:
        device = torch.device(device)
        pipe = StableDiffusionPipeline.from_pretrained(
            path, torch_dtype=dtype, safety_checker=None, feature_extractor=None, requires_safety_checker=False
        )
        unet = pipe.unet
        for key in ("time_cond_proj_dim", "addition_embed_type", "class_embed_type"):
            if unet.config.get(key) is not None:
                raise ModelFolderError(f"{path}: a UNet with {key} (an extra conditioning input) is not supported")
        vae = place_vae(pipe.vae, device, dtype)
        tokenizer, text_encoder = pipe.tokenizer, pipe.text_encoder.to(device)
        prompts = PromptEncoder(
            tokenizer,
            text_encoder,
            # some tokenizers say a huge model_max_length; the encoder's positions are the bound
            max_tokens=min(tokenizer.model_max_length, text_encoder.config.max_position_embeddings),
            lowercase=False,
            mask_to_encoder=bool(getattr(text_encoder.config, "use_attention_mask", False)),
            keep_mask=False,
            dtype=dtype,
        )
        scheduler_config = read_scheduler_config(path)
        scale = vae_scale_factor(vae)
        multiple = scale * 2 ** (len(unet.config.down_block_types) - 1)  # the UNet halves all but its last block
        defaults = model_defaults(
            native=_native_size(unet, scale),
            size_multiple=multiple,
            scheduler_config=scheduler_config,
            default_steps=DEFAULT_STEPS,
            guidance_scale=DEFAULT_GUIDANCE,
        )
        return cls(
            name=name or folder_name(path),
            unet=unet.to(device),
            vae=vae,
            prompts=prompts,
            scheduler_config=scheduler_config,
            serving=read_serving_defaults(path, defaults, size_multiple=multiple),
            device=device,
            dtype=dtype,
        )

    def _latent_shape(self, width: int, height: int) -> tuple[int, ...]:
        return (self.unet.config.in_channels, height // self.scale, width // self.scale)

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: TextRows) -> torch.Tensor:
        """`latents` already scaled by each row's scheduler (`scale_model_input`)."""
        out = self.unet(
            latents.to(device=self.device, dtype=self.dtype),
            timesteps.to(self.device),
            encoder_hidden_states=cond.embeds,
            return_dict=False,
        )[0]
        return out.to(latents.dtype)


def _native_size(unet: torch.nn.Module, scale: int) -> tuple[int, int]:
    size = unet.config.sample_size  # latent side(s): an int or (height, width)
    height, width = (size, size) if isinstance(size, int) else size
    return width * scale, height * scale
