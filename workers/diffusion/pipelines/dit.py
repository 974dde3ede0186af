"""A class-conditional DiT from a folder in diffusers' DiTPipeline layout, as an ImagePipeline.

    folder/model_index.json        _class_name DiTPipeline, id2label {"7": "7,seven", ...}
    folder/transformer/            DiTTransformer2DModel (config.json + safetensors)
    folder/scheduler/              the scheduler config every sampler is built from
    folder/vae/                    AutoencoderKL, or absent / null in model_index: pixel space
    folder/pagemesh.json           optional serving defaults (sizes, steps, sampler, guidance),
                                   "max_guidance_scale" (a student with guidance distilled in: 1.0)
                                   and "teacache_coefficients" (training/fit_teacache.py)

The prompt names a class: the labels of id2label (comma-separated synonyms) are matched as whole
words, case-insensitively, longest first, so "a handwritten 7", "the digit seven" and "7" are all
class 7. The conditioning row of an image is its class id; the null class (id
`num_embeds_ada_norm`, the LabelEmbedding's extra row) is the unconditional row, unless the
negative prompt names a class, which then takes its place.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagemesh.common.messages import ImageModelInfo, ImageParams
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest, Resolved
from pagemesh.workers.diffusion.pipelines.common import (
    KNOWN_SAMPLERS,
    SAMPLERS,
    ServingDefaults,
    parse_teacache_coefficients,
    patch_embedding_in_float32_on_cpu,
    resolve_request,
)
from pagemesh.workers.diffusion.pipelines.dit_lean import lean_block, lean_unsupported, timestep_sinusoid

# A folder without pagemesh.json serves its native size with DiTPipeline's defaults.
FALLBACK_SERVING = {"default_steps": 50, "default_sampler": "ddim", "default_guidance_scale": 4.0}


class ClassLabels:
    """id2label's synonyms -> class ids, and the one class a prompt names."""

    def __init__(self, id2label: dict[str, str]):
        self.by_label: dict[str, int] = {}  # a label listed under two ids: the last wins, as in DiTPipeline
        for key, value in id2label.items():
            for label in value.split(","):
                if label.strip():
                    self.by_label[label.strip().lower()] = int(key)
        # Longest first: "tiger shark" claims its words before "tiger" can.
        labels = sorted(self.by_label, key=len, reverse=True)
        self.pattern = re.compile(r"(?<!\w)(" + "|".join(re.escape(label) for label in labels) + r")(?!\w)", re.I)

    def classes_in(self, text: str) -> set[int]:
        return {self.by_label[m.group(1).lower()] for m in self.pattern.finditer(text)}


@dataclasses.dataclass(frozen=True)
class DiTRows:
    """Each row's conditioning through the blocks: its timestep and its class label."""

    timesteps: torch.Tensor  # [B]
    labels: torch.Tensor  # [B] long

    def select(self, index: torch.Tensor) -> DiTRows:
        return DiTRows(self.timesteps.index_select(0, index), self.labels.index_select(0, index))


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
        return hidden, DiTRows(timesteps.to(self.device), cond)

    def modulated_input(self, hidden: torch.Tensor, rows: DiTRows) -> torch.Tensor:
        norm1 = self.transformer.transformer_blocks[0].norm1
        return norm1(hidden, rows.timesteps, rows.labels, hidden_dtype=hidden.dtype)[0]

    def blocks(self, hidden: torch.Tensor, rows: DiTRows, start: int, stop: int) -> torch.Tensor:
        blocks = self.transformer.transformer_blocks
        if self.lean and start < stop:
            sinusoid = timestep_sinusoid(self.transformer, rows.timesteps)
            for index in range(start, stop):
                hidden = lean_block(blocks[index], hidden, sinusoid, rows.labels)
            return hidden
        for index in range(start, stop):
            hidden = blocks[index](hidden, timestep=rows.timesteps, class_labels=rows.labels)
        return hidden

    def final(self, hidden: torch.Tensor, rows: DiTRows) -> torch.Tensor:
        model = self.transformer
        conditioning = model.transformer_blocks[0].norm1.emb(rows.timesteps, rows.labels, hidden_dtype=hidden.dtype)
        shift, scale = model.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden = model.norm_out(hidden) * (1 + scale[:, None]) + shift[:, None]
        hidden = model.proj_out_2(hidden)
        side, p, c = int(hidden.shape[1] ** 0.5), self.patch_size, model.out_channels
        hidden = hidden.reshape(shape=(-1, side, side, p, p, c))
        out = torch.einsum("nhwpqc->nchpwq", hidden).reshape(shape=(-1, c, side * p, side * p))
        return out if self.out_channels is None else out[:, : self.out_channels]


class DiTPipelineModel:
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
        self.null_class = config.num_embeds_ada_norm
        self.block_forward = DiTBlocks(
            self.transformer,
            self.in_channels if self.learned_sigma else None,
            parse_teacache_coefficients(serving.get("teacache_coefficients"), f"{name}: pagemesh.json:"),
        )
        self.labels = ClassLabels(id2label)
        scale = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1
        self.latent_shape = (config.in_channels, config.sample_size, config.sample_size)
        self.native_size = (config.sample_size * scale, config.sample_size * scale)
        native = f"{self.native_size[0]}x{self.native_size[1]}"
        self.sizes: list[str] = list(serving.get("sizes", [native]))
        self.samplers: list[str] = [s for s in serving.get("samplers", SAMPLERS) if s in KNOWN_SAMPLERS]
        self.default_steps = int(serving.get("default_steps", FALLBACK_SERVING["default_steps"]))
        self.default_sampler = str(serving.get("default_sampler", FALLBACK_SERVING["default_sampler"]))
        self.default_guidance = float(serving.get("default_guidance_scale", FALLBACK_SERVING["default_guidance_scale"]))
        self.max_steps = int(serving.get("max_steps", scheduler_config.get("num_train_timesteps", 1000)))
        # what resolve_request (pipelines/common.py) checks a request against, as the text pipelines'
        self.serving = ServingDefaults(
            sizes=tuple(_size(size) for size in self.sizes),
            samplers=tuple(self.samplers),
            default_sampler=self.default_sampler,
            default_steps=self.default_steps,
            max_steps=self.max_steps,
            guidance_scale=self.default_guidance,
        )
        # A model with guidance distilled in answers one row per image: a guidance scale above 1
        # would add uncond rows it was never trained to be combined with, so it is refused (a
        # silent no-op would hand back the same image for 1 and for 7, which nobody asking expects).
        cap = serving.get("max_guidance_scale")
        self.max_guidance: float | None = None if cap is None else float(cap)
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
        """The size, steps, sampler and guidance as every pipeline checks them (one latent shape:
        the model's), then the guidance cap and the classes the prompts name."""
        resolved = resolve_request(params, self.serving, lambda width, height: self.latent_shape)
        guidance = resolved.guidance_scale
        if self.max_guidance is not None and guidance > self.max_guidance:
            raise InvalidImageRequest(
                f"guidance_scale must be <= {self.max_guidance:g} for {self.name}: its classifier-free guidance "
                f"is distilled in; got {guidance:g}",
                param="guidance_scale",
            )
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


def _size(text: str) -> tuple[int, int]:
    """'WxH' (a size pagemesh.json lists) -> (W, H)."""
    width, height = text.split("x")
    return int(width), int(height)
