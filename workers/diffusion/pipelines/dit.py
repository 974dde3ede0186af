"""A class-conditional DiT from a folder in diffusers' DiTPipeline layout, as an ImagePipeline.

    folder/model_index.json        _class_name DiTPipeline, id2label {"7": "7,seven", ...}
    folder/transformer/            DiTTransformer2DModel (config.json + safetensors)
    folder/scheduler/              the scheduler config every sampler is built from
    folder/vae/                    AutoencoderKL, or absent / null in model_index: pixel space
    folder/pagemesh.json           optional serving defaults (sizes, steps, sampler, guidance),
                                   "max_guidance_scale" (a student with guidance distilled in: 1.0)
                                   and "teacache_coefficients" (training/fit_teacache.py)

The prompt names a class (pipelines/class_conditioned.py, shared with the class-conditional U-Net):
the conditioning row of an image is its class id; the null class (id `num_embeds_ada_norm`, the
LabelEmbedding's extra row) is the unconditional row, unless the negative prompt names a class.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagemesh.workers.diffusion.pipelines.class_conditioned import ClassConditionedPipeline
from pagemesh.workers.diffusion.pipelines.common import (
    parse_teacache_coefficients,
    patch_embedding_in_float32_on_cpu,
)
from pagemesh.workers.diffusion.pipelines.dit_lean import (
    lean_block,
    lean_conditioning,
    lean_modulated,
    lean_unsupported,
    timestep_sinusoid,
)


@dataclasses.dataclass(frozen=True)
class DiTRows:
    """Each row's conditioning through the blocks: its timestep and its class label; on the lean
    path also its timestep sinusoid and block 0's conditioning (made once a forward: block 0, the
    final layer and TeaCache's signal read it)."""

    timesteps: torch.Tensor  # [B]
    labels: torch.Tensor  # [B] long
    sinusoid: torch.Tensor | None = None  # [B, 256]
    conditioning: torch.Tensor | None = None  # [B, D]

    def select(self, index: torch.Tensor) -> DiTRows:
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return DiTRows(pick(self.timesteps), pick(self.labels), pick(self.sinusoid), pick(self.conditioning))


class DiTBlocks:
    """DiTTransformer2DModel.forward in the parts of `BlockForward` (pipelines/base.py), calling
    the model's own modules in its order, so embed -> blocks(0, L) -> final gives the numbers the
    whole forward gives. `out_channels`: keep that many output channels (a learned sigma's
    variance dropped), None for all. `teacache_coefficients`: TeaCache's rescaling polynomial
    for this model (highest degree first; training/fit_teacache.py), None to use the raw change."""

    def __init__(
        self,
        transformer: Any,
        out_channels: int | None = None,
        teacache_coefficients: tuple[float, ...] | None = None,
    ):
        self.transformer = transformer
        self.num_blocks = len(transformer.transformer_blocks)
        self.dtype = transformer.dtype
        self.device = transformer.device
        self.patch_size = transformer.config.patch_size
        self.inner_dim = transformer.inner_dim
        self.out_channels = out_channels
        self.teacache_coefficients = teacache_coefficients
        # diffusers' blocks as straight-line calls (dit_lean.py), the same numbers, when they are the kind written there
        self.lean = lean_unsupported(transformer) is None

    def hidden_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, int]:
        _, height, width = latent_shape
        return (height // self.patch_size) * (width // self.patch_size), self.inner_dim

    def embed(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, DiTRows]:
        hidden = self.transformer.pos_embed(latents.to(self.device, self.dtype))
        timesteps = timesteps.to(self.device)
        if not self.lean:
            return hidden, DiTRows(timesteps, cond)
        sinusoid = timestep_sinusoid(self.transformer, timesteps)
        conditioning = lean_conditioning(self.transformer.transformer_blocks[0], sinusoid, cond, hidden.dtype)
        return hidden, DiTRows(timesteps, cond, sinusoid, conditioning)

    def modulated_input(self, hidden: torch.Tensor, rows: DiTRows) -> torch.Tensor:
        block = self.transformer.transformer_blocks[0]
        if rows.conditioning is not None:
            return lean_modulated(block, hidden, rows.conditioning)[0]
        return block.norm1(hidden, rows.timesteps, rows.labels, hidden_dtype=hidden.dtype)[0]

    def blocks(self, hidden: torch.Tensor, rows: DiTRows, start: int, stop: int) -> torch.Tensor:
        blocks = self.transformer.transformer_blocks
        if self.lean and start < stop:
            sinusoid = (
                rows.sinusoid if rows.sinusoid is not None else timestep_sinusoid(self.transformer, rows.timesteps)
            )
            for index in range(start, stop):
                given = rows.conditioning if index == 0 else None  # block 0's, made in embed
                hidden = lean_block(blocks[index], hidden, sinusoid, rows.labels, given)
            return hidden
        for index in range(start, stop):
            hidden = blocks[index](hidden, timestep=rows.timesteps, class_labels=rows.labels)
        return hidden

    def final(self, hidden: torch.Tensor, rows: DiTRows) -> torch.Tensor:
        model = self.transformer
        conditioning = rows.conditioning
        if conditioning is None:
            conditioning = model.transformer_blocks[0].norm1.emb(rows.timesteps, rows.labels, hidden_dtype=hidden.dtype)
        shift, scale = F.linear(F.silu(conditioning), model.proj_out_1.weight, model.proj_out_1.bias).chunk(2, dim=1)
        norm = model.norm_out
        hidden = F.layer_norm(hidden, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        hidden = hidden * (1 + scale[:, None]) + shift[:, None]
        hidden = F.linear(hidden, model.proj_out_2.weight, model.proj_out_2.bias)
        side, p, c = int(hidden.shape[1] ** 0.5), self.patch_size, model.out_channels
        hidden = hidden.reshape(shape=(-1, side, side, p, p, c))
        out = torch.einsum("nhwpqc->nchpwq", hidden).reshape(shape=(-1, c, side * p, side * p))
        return out if self.out_channels is None else out[:, : self.out_channels]


class DiTPipelineModel(ClassConditionedPipeline):
    """The ImagePipeline of a class-conditional DiT (pixel space or with an AutoencoderKL)."""

    def __init__(
        self,
        *,
        name: str,
        transformer: Any,
        vae: Any | None,
        scheduler_config: dict[str, Any],
        id2label: dict[str, str],
        serving: dict[str, Any],
    ):
        self.name = name
        self.transformer = transformer.eval()
        self.vae = vae.eval() if vae is not None else None
        self.device = transformer.device
        self.dtype = transformer.dtype
        self.scheduler_config = scheduler_config
        config = transformer.config
        self.in_channels = config.in_channels
        self.learned_sigma = transformer.out_channels == 2 * config.in_channels
        self.block_forward = DiTBlocks(
            self.transformer,
            self.in_channels if self.learned_sigma else None,
            parse_teacache_coefficients(serving.get("teacache_coefficients"), f"{name}: pagemesh.json:"),
        )
        scale = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1
        self.latent_shape = (config.in_channels, config.sample_size, config.sample_size)
        self.native_size = (config.sample_size * scale, config.sample_size * scale)
        self.serve_classes(serving, scheduler_config, id2label, null_class=config.num_embeds_ada_norm)

    @classmethod
    def from_folder(
        cls, path: str | Path, *, name: str | None = None, device: str | torch.device = "cpu", dtype=torch.float32
    ) -> DiTPipelineModel:
        from diffusers import AutoencoderKL, DiTTransformer2DModel

        path = Path(path)
        index = json.loads((path / "model_index.json").read_text())
        transformer = DiTTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype).to(device)
        patch_embedding_in_float32_on_cpu(transformer)
        vae = None
        if (index.get("vae") or [None])[0] is not None and (path / "vae").is_dir():
            vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype).to(device)
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        serving_file = path / "pagemesh.json"
        serving = json.loads(serving_file.read_text()) if serving_file.exists() else {}
        id2label = index.get("id2label") or {str(i): str(i) for i in range(transformer.config.num_embeds_ada_norm)}
        return cls(
            name=name or path.name,
            transformer=transformer,
            vae=vae,
            scheduler_config=scheduler_config,
            id2label=id2label,
            serving=serving,
        )

    # -- the model -------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Noise predictions [B, C, h, w] for latents already scaled by each row's scheduler
        (`scale_model_input`); timesteps [B], one per row, int or float as the scheduler gives."""
        if self.block_forward.lean:  # the transformer's forward in its parts: the same ops, fewer calls
            forward = self.block_forward
            hidden, rows = forward.embed(latents, timesteps, cond)
            return forward.final(forward.blocks(hidden, rows, 0, forward.num_blocks), rows)  # (eps only)
        out = self.transformer(
            latents.to(self.device, self.dtype), timestep=timesteps.to(self.device), class_labels=cond
        ).sample
        # A DiT trained with learned sigma returns [eps, variance]: the scheduler takes eps.
        return out[:, : self.in_channels] if self.learned_sigma else out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        samples = latents.to(self.device, self.dtype)
        if self.vae is not None:
            samples = self.vae.decode(samples / self.vae.config.scaling_factor).sample
        pixels = ((samples.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu()
