"""A PixArt-layout folder as an ImagePipeline: PixArtTransformer2DModel (a text-conditioned DiT),
a T5 encoder and its tokenizer, AutoencoderKL, a scheduler (diffusers' `PixArtAlphaPipeline` and
`PixArtSigmaPipeline`).

The forward is diffusers' own modules, called as the PixArt pipelines call them: prompts
lowercased and stripped (diffusers' `clean_caption` needs bs4 and ftfy; without them it does
just this), padded to 120 tokens (Alpha) or 300 (Sigma) with the attention mask carried per row,
the transformer's resolution and aspect-ratio conditions when its config uses them, the
learned-sigma channels dropped. Sizes are served as asked (no resolution binning).

`PixArtBlocks` (the pipeline's `block_forward`) is the same forward split at its transformer
blocks (pipelines/base.py's `BlockForward`) for the engine's feature caches
(engine/feature_cache.py; First-Block-Cache, TeaCache, interval, decided per row):

    embed   patch embedding, adaln_single's timestep embedding (+ the micro-conditions), the
            caption projection, the text mask as an attention bias        -> hidden, PixArtRows
    blocks  BasicTransformerBlocks start..stop-1 (ada_norm_single) on the rows given
    final   norm_out, the output scale-shift table, proj_out, unpatchify, learned sigma dropped
"""

from __future__ import annotations

import dataclasses
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
    read_teacache_coefficients,
    vae_scale_factor,
)

# class name -> (diffusers pipeline, its max_sequence_length)
LAYOUTS = {"PixArtAlphaPipeline": (PixArtAlphaPipeline, 120), "PixArtSigmaPipeline": (PixArtSigmaPipeline, 300)}
DEFAULT_STEPS = 20  # the PixArt pipelines' defaults
DEFAULT_GUIDANCE = 4.5


@dataclasses.dataclass(frozen=True)
class PixArtRows:
    """Each row's conditioning through the blocks, as PixArtTransformer2DModel.forward hands it
    to every block, and what `final` needs."""

    timestep: torch.Tensor  # [B, 6 D] adaln_single's modulation (every block adds its own table)
    embedded_timestep: torch.Tensor  # [B, D] the output layer's
    encoder_hidden_states: torch.Tensor  # [B, L, D] the projected caption
    encoder_attention_mask: torch.Tensor | None  # [B, 1, L] bias: 0 = token, -10000 = padding
    patches: tuple[int, int]  # (height, width) in patches: every row of a batch has the same
    out_dtype: torch.dtype  # the latents' dtype, which denoise returns

    def select(self, index: torch.Tensor) -> PixArtRows:
        mask = self.encoder_attention_mask
        return dataclasses.replace(
            self,
            timestep=self.timestep.index_select(0, index),
            embedded_timestep=self.embedded_timestep.index_select(0, index),
            encoder_hidden_states=self.encoder_hidden_states.index_select(0, index),
            encoder_attention_mask=None if mask is None else mask.index_select(0, index),
        )


class PixArtBlocks:
    """PixArtTransformer2DModel.forward (diffusers 0.42) in the parts of `BlockForward`
    (pipelines/base.py), calling the model's own modules in its order, so that
    final(blocks(0, L, embed(...))) is `PixArtPipelineModel.denoise`, bit for bit.
    `teacache_coefficients`: TeaCache's rescaling polynomial for this model (the folder's
    pagemesh.json, training/fit_teacache.py), None to use the raw change."""

    def __init__(
        self,
        pipeline: PixArtPipelineModel,
        teacache_coefficients: tuple[float, ...] | None = None,
    ):
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.num_blocks = len(self.transformer.transformer_blocks)
        self.dtype = pipeline.dtype
        self.patch_size = self.transformer.config.patch_size
        self.inner_dim = self.transformer.inner_dim
        self.teacache_coefficients = teacache_coefficients

    def hidden_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, int]:
        _, height, width = latent_shape
        return (height // self.patch_size) * (width // self.patch_size), self.inner_dim

    def embed(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: TextRows) -> tuple[torch.Tensor, PixArtRows]:
        model, pipe = self.transformer, self.pipeline
        x = latents.to(device=pipe.device, dtype=pipe.dtype)
        added = pipe.added_conditions(x)
        mask = cond.mask
        if mask is not None:  # the forward's mask -> bias, in the input's dtype
            mask = ((1 - mask.to(x.dtype)) * -10000.0).unsqueeze(1)
        batch_size = x.shape[0]
        patches = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        hidden = model.pos_embed(x)
        timestep, embedded_timestep = model.adaln_single(
            timesteps.to(pipe.device), added, batch_size=batch_size, hidden_dtype=hidden.dtype
        )
        encoder_hidden_states = cond.embeds
        if model.caption_projection is not None:
            encoder_hidden_states = model.caption_projection(encoder_hidden_states)
            encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden.shape[-1])
        rows = PixArtRows(timestep, embedded_timestep, encoder_hidden_states, mask, patches, latents.dtype)
        return hidden, rows

    def modulated_input(self, hidden: torch.Tensor, rows: PixArtRows) -> torch.Tensor:
        """Block 0's normalized input under its timestep shift and scale (the attention's input),
        as BasicTransformerBlock computes it for ada_norm_single."""
        block = self.transformer.transformer_blocks[0]
        modulation = block.scale_shift_table[None] + rows.timestep.reshape(hidden.shape[0], 6, -1)
        shift_msa, scale_msa = modulation.chunk(6, dim=1)[:2]
        return block.norm1(hidden) * (1 + scale_msa) + shift_msa

    def blocks(self, hidden: torch.Tensor, rows: PixArtRows, start: int, stop: int) -> torch.Tensor:
        for block in self.transformer.transformer_blocks[start:stop]:
            hidden = block(
                hidden,
                attention_mask=None,
                encoder_hidden_states=rows.encoder_hidden_states,
                encoder_attention_mask=rows.encoder_attention_mask,
                timestep=rows.timestep,
                cross_attention_kwargs=None,
                class_labels=None,
            )
        return hidden

    def final(self, hidden: torch.Tensor, rows: PixArtRows) -> torch.Tensor:
        model, p = self.transformer, self.patch_size
        table = model.scale_shift_table
        shift, scale = (table[None] + rows.embedded_timestep[:, None].to(table.device)).chunk(2, dim=1)
        hidden = model.norm_out(hidden)
        hidden = hidden * (1 + scale.to(hidden.device)) + shift.to(hidden.device)
        hidden = model.proj_out(hidden)
        hidden = hidden.squeeze(1)
        height, width = rows.patches
        hidden = hidden.reshape(shape=(-1, height, width, p, p, model.out_channels))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        out = hidden.reshape(shape=(-1, model.out_channels, height * p, width * p))
        if self.pipeline.learned_sigma:
            out = out.chunk(2, dim=1)[0]
        return out.to(rows.out_dtype)


class PixArtPipelineModel(TextConditionedPipeline):
    """The ImagePipeline of a PixArt-layout folder. Conditioning rows are `TextRows` (T5
    embeddings [1, L, D] with their mask [1, L]); latents are [C, H/8, W/8] for its VAE."""

    def __init__(
        self, *, transformer: torch.nn.Module, teacache_coefficients: tuple[float, ...] | None = None, **parts: Any
    ):
        """`parts`: TextConditionedPipeline's (name, vae, prompts, scheduler_config, serving,
        device, dtype). `teacache_coefficients`: see PixArtBlocks."""
        super().__init__(**parts)
        self.transformer = transformer
        side = transformer.config.sample_size * self.scale
        self.native_size = (side, side)
        # learned sigma: the variance channels follow the prediction; the pipelines drop them
        self.learned_sigma = transformer.config.out_channels // 2 == transformer.config.in_channels
        self.block_forward = PixArtBlocks(self, teacache_coefficients)

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
            teacache_coefficients=read_teacache_coefficients(path),
            device=device,
            dtype=dtype,
        )

    def _latent_shape(self, width: int, height: int) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, height // self.scale, width // self.scale)

    def added_conditions(self, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """adaln_single's added conditions for latents `x` [B, C, h, w] (in the model's dtype)."""
        if not self.transformer.use_additional_conditions:
            return {"resolution": None, "aspect_ratio": None}
        # PixArt-Alpha's micro-conditions: the image's (height, width) in pixels and height / width
        height, width = x.shape[-2] * self.scale, x.shape[-1] * self.scale
        rows = x.shape[0]
        return {
            "resolution": torch.tensor([[height, width]], dtype=self.dtype, device=self.device).repeat(rows, 1),
            "aspect_ratio": torch.tensor([[height / width]], dtype=self.dtype, device=self.device).repeat(rows, 1),
        }

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: TextRows) -> torch.Tensor:
        """`latents` already scaled by each row's scheduler (`scale_model_input`)."""
        x = latents.to(device=self.device, dtype=self.dtype)
        out = self.transformer(
            x,
            encoder_hidden_states=cond.embeds,
            encoder_attention_mask=cond.mask,
            timestep=timesteps.to(self.device),
            added_cond_kwargs=self.added_conditions(x),
            return_dict=False,
        )[0]
        if self.learned_sigma:
            out = out.chunk(2, dim=1)[0]
        return out.to(latents.dtype)
