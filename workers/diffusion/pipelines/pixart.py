"""A PixArt-layout folder as an ImagePipeline: PixArtTransformer2DModel (a text-conditioned DiT),
a T5 encoder and its tokenizer, AutoencoderKL, a scheduler (diffusers' `PixArtAlphaPipeline` and
`PixArtSigmaPipeline`).

The forward is diffusers' own modules, called as the PixArt pipelines call them: prompts
lowercased and stripped (diffusers' `clean_caption` needs bs4 and ftfy; without them it does
just this), padded to 120 tokens (Alpha) or 300 (Sigma) with the attention mask carried per row,
the transformer's resolution and aspect-ratio conditions when its config uses them, the
learned-sigma channels dropped. Sizes are served as asked (no resolution binning).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import PixArtAlphaPipeline, PixArtSigmaPipeline

from pagemesh.workers.diffusion.pipelines.common import (
    PromptEncoder,
    TextConditionedPipeline,
    TextRows,
    folder_name,
    model_defaults,
    patch_embedding_in_float32_on_cpu,
    place_vae,
    read_model_index,
    read_scheduler_config,
    read_serving_defaults,
    vae_scale_factor,
)

# class name -> (diffusers pipeline, its max_sequence_length)
LAYOUTS = {"PixArtAlphaPipeline": (PixArtAlphaPipeline, 120), "PixArtSigmaPipeline": (PixArtSigmaPipeline, 300)}
DEFAULT_STEPS = 20  # the PixArt pipelines' defaults
DEFAULT_GUIDANCE = 4.5


class PixArtPipelineModel(TextConditionedPipeline):
    """The ImagePipeline of a PixArt-layout folder. Conditioning rows are `TextRows` (T5
    embeddings [1, L, D] with their mask [1, L]); latents are [C, H/8, W/8] for its VAE."""

    def __init__(self, *, transformer: torch.nn.Module, **parts: Any):
        """`parts`: TextConditionedPipeline's (name, vae, prompts, scheduler_config, serving,
        device, dtype)."""
        super().__init__(**parts)
        self.transformer = transformer
        side = transformer.config.sample_size * self.scale
        self.native_size = (side, side)
        # learned sigma: the variance channels follow the prediction; the pipelines drop them
        self.learned_sigma = transformer.config.out_channels // 2 == transformer.config.in_channels

    @classmethod
    def from_folder(
        cls, path: str, *, name: str | None = None, device: str | torch.device = "cpu", dtype=torch.float32
    ) -> PixArtPipelineModel:
        device = torch.device(device)
        pipeline_cls, max_tokens = LAYOUTS[read_model_index(path)["_class_name"]]
        pipe = pipeline_cls.from_pretrained(path, torch_dtype=dtype)
        transformer, vae = pipe.transformer.to(device), place_vae(pipe.vae, device, dtype)
        patch_embedding_in_float32_on_cpu(transformer)
        prompts = PromptEncoder(
            pipe.tokenizer,
            pipe.text_encoder.to(device),
            max_tokens=max_tokens,
            lowercase=True,
            mask_to_encoder=True,
            keep_mask=True,
            dtype=dtype,
        )
        scheduler_config = read_scheduler_config(path)
        scale = vae_scale_factor(vae)
        side = transformer.config.sample_size * scale
        multiple = scale * transformer.config.patch_size
        defaults = model_defaults(
            native=(side, side),
            size_multiple=multiple,
            scheduler_config=scheduler_config,
            default_steps=DEFAULT_STEPS,
            guidance_scale=DEFAULT_GUIDANCE,
        )
        return cls(
            name=name or folder_name(path),
            transformer=transformer,
            vae=vae,
            prompts=prompts,
            scheduler_config=scheduler_config,
            serving=read_serving_defaults(path, defaults, size_multiple=multiple),
            device=device,
            dtype=dtype,
        )

    def _latent_shape(self, width: int, height: int) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, height // self.scale, width // self.scale)

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: TextRows) -> torch.Tensor:
        """`latents` already scaled by each row's scheduler (`scale_model_input`)."""
        x = latents.to(device=self.device, dtype=self.dtype)
        added = {"resolution": None, "aspect_ratio": None}
        if self.transformer.use_additional_conditions:
            # PixArt-Alpha's micro-conditions: the image's (height, width) in pixels and height / width
            height, width = x.shape[-2] * self.scale, x.shape[-1] * self.scale
            rows = x.shape[0]
            added = {
                "resolution": torch.tensor([[height, width]], dtype=self.dtype, device=self.device).repeat(rows, 1),
                "aspect_ratio": torch.tensor([[height / width]], dtype=self.dtype, device=self.device).repeat(rows, 1),
            }
        out = self.transformer(
            x,
            encoder_hidden_states=cond.embeds,
            encoder_attention_mask=cond.mask,
            timestep=timesteps.to(self.device),
            added_cond_kwargs=added,
            return_dict=False,
        )[0]
        if self.learned_sigma:
            out = out.chunk(2, dim=1)[0]
        return out.to(latents.dtype)
