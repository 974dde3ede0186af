"""A Stable-Diffusion-layout folder as an ImagePipeline: UNet2DConditionModel, a CLIP text
encoder and its tokenizer, AutoencoderKL, a scheduler (diffusers' `StableDiffusionPipeline`).

The forward is diffusers' own modules, called as `StableDiffusionPipeline.__call__` calls them,
row by row equal to it (tests/unit/test_pipeline_folders.py checks a whole sampling run against
diffusers' pipeline on the same weights and noise). No safety checker is run.

`UNetDeepCache` is the U-Net's forward in DeepCache's parts (the `deep_cache_forward` the
engine's feature caches run, engine/deep_cache.py), for a UNet2DConditionModel or a
class-conditional UNet2DModel:

    latents ─conv_in─▶ down 0 ─▶ down 1.. ─▶ mid ─▶ up ..-2 ─▶ feature ─▶ up -1 ─▶ norm, act, conv_out
                 │         │   └──────────── deep (cached per row) ─────┘        ▲
                 └─────────┴──────────────── shallow skips ──────────────────────┘
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel, UNet2DModel

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
    (CLIP embeddings [1, 77, D], no mask); latents are [C, H/8, W/8] for SD's VAE. Its
    `deep_cache_forward` (a `UNetDeepCache`) serves the cache policy interval:N (DeepCache)."""

    def __init__(self, *, unet: torch.nn.Module, **parts: Any):
        """`parts`: TextConditionedPipeline's (name, vae, prompts, scheduler_config, serving,
        device, dtype)."""
        super().__init__(**parts)
        self.unet = unet
        self.native_size = _native_size(unet, self.scale)
        self.deep_cache_forward = unet_deep_cache(unet)  # None: this layout serves only the cache 'none'

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


@dataclasses.dataclass(frozen=True)
class UNetRows:
    """Each row's conditioning through the U-Net's blocks."""

    emb: torch.Tensor  # [B, E] the timestep (+ class) embedding the resnets take
    context: torch.Tensor | None  # [B, L, D] encoder hidden states (UNet2DConditionModel), else None
    timesteps: torch.Tensor  # [B] (UNet2DModel's Fourier embedding divides its output by them)

    def select(self, index: torch.Tensor) -> UNetRows:
        context = None if self.context is None else self.context.index_select(0, index)
        return UNetRows(self.emb.index_select(0, index), context, self.timesteps.index_select(0, index))


@dataclasses.dataclass(frozen=True)
class UNetShallow:
    """The shallow down part's result for every row of a batch (what `deep` and `shallow_up` read)."""

    rows: UNetRows
    hidden: torch.Tensor  # down block 0's output: the deep branch's input
    skips: tuple[torch.Tensor, ...]  # conv_in's output, then down block 0's skip outputs (forward order)
    upsample_sizes: bool  # UNet2DConditionModel with a side not a multiple of its upsampling: sizes forwarded


class UNetDeepCache:
    """UNet2DConditionModel.forward or UNet2DModel.forward in DeepCache's three parts (the
    `DeepCacheForward` of pipelines/base.py), calling the model's own modules with the arguments
    and in the order its forward does, so shallow_down -> deep -> shallow_up gives the numbers
    the whole forward gives:

        shallow_down  time (+ class) embedding, conv_in, down block 0 (skips for the last up block)
        deep          down blocks 1.., the mid block, up blocks ..-2 -> the feature the last up block takes
        shallow_up    the last up block (that feature + the shallow skips), norm, act, conv_out

    A "block" (what blocks_computed counts, per row and step) is one down, mid or up block: a
    cached step runs 2 of them (down block 0 and the last up block).

    `cond` is what the pipeline's `denoise` takes: `TextRows` (or the embeddings [B, L, D]) for a
    UNet2DConditionModel, class labels [B] (long; None for an unconditional model) for a
    UNet2DModel. Build one with `unet_deep_cache`, which says None for a layout it cannot split."""

    shallow_blocks = 2

    def __init__(self, unet: torch.nn.Module):
        self.unet = unet
        self.conditional = isinstance(unet, UNet2DConditionModel)
        self.num_blocks = len(unet.down_blocks) + (unet.mid_block is not None) + len(unet.up_blocks)
        self.num_shallow_skips = len(unet.up_blocks[-1].resnets)  # conv_in's + down block 0's resnets'
        self.feature_channels = unet.up_blocks[-2].resnets[-1].out_channels

    # conv_in's weight, not the model's own dtype / device (diffusers walks every module for them,
    # about a millisecond each: a tenth of a small U-Net's forward)
    @property
    def dtype(self) -> torch.dtype:
        return self.unet.conv_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.unet.conv_in.weight.device

    def feature_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The deep branch hands the last up block [C, h, w] per row: back at the latents' size."""
        _, height, width = latent_shape
        return self.feature_channels, height, width

    # ---- the three parts ------------------------------------------------------------------
    def shallow_down(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Any) -> UNetShallow:
        unet = self.unet
        sample = latents.to(self.device, self.dtype)
        if unet.config.center_input_sample:
            sample = 2 * sample - 1.0
        if self.conditional:
            timesteps = timesteps.to(self.device)
            emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timesteps), None)
            if unet.time_embed_act is not None:
                emb = unet.time_embed_act(emb)
            context = getattr(cond, "embeds", cond)
            upsample_sizes = any(side % 2**unet.num_upsamplers != 0 for side in sample.shape[-2:])
        else:
            if timesteps.dim() == 0:
                timesteps = timesteps[None].to(sample.device)
            timesteps = timesteps * torch.ones(sample.shape[0], dtype=timesteps.dtype, device=timesteps.device)
            emb = unet.time_embedding(unet.time_proj(timesteps).to(dtype=self.dtype))
            if unet.class_embedding is not None:
                labels = unet.time_proj(cond) if unet.config.class_embed_type == "timestep" else cond
                emb = emb + unet.class_embedding(labels).to(dtype=self.dtype)
            context, upsample_sizes = None, False
        rows = UNetRows(emb, context, timesteps)
        sample = unet.conv_in(sample)
        hidden, res = self._down(unet.down_blocks[0], sample, rows)
        return UNetShallow(rows=rows, hidden=hidden, skips=(sample, *res), upsample_sizes=upsample_sizes)

    def deep(self, shallow: UNetShallow, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `index` of the batch (a long tensor; None: every row) through the deep branch."""
        unet, rows, hidden = self.unet, shallow.rows, shallow.hidden
        res = shallow.skips[self.num_shallow_skips :]
        if index is not None:
            rows, hidden = rows.select(index), hidden.index_select(0, index)
            res = tuple(skip.index_select(0, index) for skip in res)
        for block in unet.down_blocks[1:]:
            hidden, out = self._down(block, hidden, rows)
            res += out
        if unet.mid_block is not None:
            hidden = self._mid(hidden, rows)
        for block in unet.up_blocks[:-1]:
            n = len(block.resnets)
            res, taken = res[:-n], res[-n:]
            size = (res[-1] if res else shallow.skips[self.num_shallow_skips - 1]).shape[2:]
            hidden = self._up(block, hidden, taken, rows, size if shallow.upsample_sizes else None)
        return hidden

    def shallow_up(self, shallow: UNetShallow, feature: torch.Tensor) -> torch.Tensor:
        """The last up block on the deep `feature` [B, ...] and the batch's shallow skips -> the
        model output, as the whole forward returns it."""
        unet, rows = self.unet, shallow.rows
        skips = shallow.skips[: self.num_shallow_skips]
        # the forward keeps the size its previous up block was given (the last block has no upsampler)
        size = skips[-1].shape[2:] if shallow.upsample_sizes else None
        sample = self._up(unet.up_blocks[-1], feature, skips, rows, size)
        if unet.conv_norm_out is not None:
            sample = unet.conv_act(unet.conv_norm_out(sample))
        sample = unet.conv_out(sample)
        if not self.conditional and unet.config.time_embedding_type == "fourier":
            sample = sample / rows.timesteps.reshape((sample.shape[0], *([1] * len(sample.shape[1:]))))
        return sample

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Any) -> torch.Tensor:
        """All three parts on every row: the whole forward's output."""
        shallow = self.shallow_down(latents, timesteps, cond)
        return self.shallow_up(shallow, self.deep(shallow))

    # ---- the model's blocks, called as its forward calls them -----------------------------
    def _cross(self, block: torch.nn.Module) -> bool:
        return self.conditional and bool(getattr(block, "has_cross_attention", False))

    def _down(self, block, hidden, rows: UNetRows) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if self._cross(block):
            return block(
                hidden_states=hidden,
                temb=rows.emb,
                encoder_hidden_states=rows.context,
                attention_mask=None,
                cross_attention_kwargs=None,
                encoder_attention_mask=None,
            )
        return block(hidden_states=hidden, temb=rows.emb)

    def _mid(self, hidden, rows: UNetRows) -> torch.Tensor:
        mid = self.unet.mid_block
        if self._cross(mid):
            return mid(
                hidden,
                rows.emb,
                encoder_hidden_states=rows.context,
                attention_mask=None,
                cross_attention_kwargs=None,
                encoder_attention_mask=None,
            )
        return mid(hidden, rows.emb)

    def _up(self, block, hidden, res: tuple[torch.Tensor, ...], rows: UNetRows, size) -> torch.Tensor:
        if not self.conditional:
            return block(hidden, res, rows.emb)
        if self._cross(block):
            return block(
                hidden_states=hidden,
                temb=rows.emb,
                res_hidden_states_tuple=res,
                encoder_hidden_states=rows.context,
                cross_attention_kwargs=None,
                upsample_size=size,
                attention_mask=None,
                encoder_attention_mask=None,
            )
        return block(hidden_states=hidden, temb=rows.emb, res_hidden_states_tuple=res, upsample_size=size)


def deep_cache_unsupported(unet: torch.nn.Module) -> str | None:
    """Why `unet` cannot be split for DeepCache (None: it can)."""
    if not isinstance(unet, UNet2DConditionModel | UNet2DModel):
        return f"{type(unet).__name__} is not a UNet2DConditionModel or UNet2DModel"
    config = unet.config
    if isinstance(unet, UNet2DConditionModel):
        for key in ("time_cond_proj_dim", "addition_embed_type", "class_embed_type", "num_class_embeds"):
            if config.get(key) is not None:
                return f"{key} (an extra conditioning input)"
        if unet.encoder_hid_proj is not None:
            return "an encoder_hid_proj"
    elif any(hasattr(block, "skip_conv") for block in (*unet.down_blocks, *unet.up_blocks)):
        return "skip blocks (the score-SDE layout)"
    down, up = unet.down_blocks, unet.up_blocks
    if len(down) < 2 or len(up) != len(down) or down[0].downsamplers is None:
        return "fewer than two resolutions"
    if len(up[-1].resnets) != 1 + len(down[0].resnets):
        return "a last up block that takes skips from below down block 0"
    return None


def unet_deep_cache(unet: torch.nn.Module) -> UNetDeepCache | None:
    """The DeepCache split of `unet`, or None when its layout has none (it then serves only 'none')."""
    return None if deep_cache_unsupported(unet) is not None else UNetDeepCache(unet)
