"""A test fixture: a tiny randomly-initialised class-conditional DiT (diffusers'
`DiTTransformer2DModel`, 1 channel, 8×8 latents, 10 classes) behind the `ImagePipeline` protocol,
for the diffusion engine's tests and the engine bench's fallback until a real pipeline is there.

Prompts name a digit ("a 7", "7"); the uncond row is the null class 10. Two sizes, 8x8 and 16x16,
give two latent shapes (the DiT's sin-cos position embedding follows the input's size). Pixel
space: decode maps [-1, 1] to [0, 255]. It records every forward's rows and latent shape
(`calls`) and every decode's input (`decoded`) so tests can see what was batched. Its
`block_forward` (the DiT pipeline's DiTBlocks) serves the feature caches and records each run of
blocks as (start, stop, rows) in `block_calls`; `blocks=False` builds one without it.
"""

from __future__ import annotations

import random
import re
from typing import Any

import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel

from pagemesh.common.messages import ImageModelInfo, ImageParams
from pagemesh.workers.diffusion.engine.samplers import SAMPLERS
from pagemesh.workers.diffusion.pipelines.base import InvalidImageRequest, Resolved
from pagemesh.workers.diffusion.pipelines.dit import DiTBlocks

NUM_CLASSES = 10
SIZES = {"8x8": (1, 8, 8), "16x16": (1, 16, 16)}
MAX_STEPS = 100


class TinyDiTPipeline:
    name = "tiny-dit"

    def __init__(
        self,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        variance_type: str = "fixed_small",
        blocks: bool = True,
        num_layers: int = 2,
    ):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.transformer = DiTTransformer2DModel(
                num_attention_heads=2,
                attention_head_dim=8,
                in_channels=1,
                out_channels=2,  # noise + a learned variance, as DiT predicts
                num_layers=num_layers,
                sample_size=8,
                patch_size=2,
                num_embeds_ada_norm=NUM_CLASSES,
                norm_num_groups=1,
            )
        self.transformer.eval()
        if dtype != torch.float32:
            self.transformer.to(dtype)
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.native_size = (8, 8)
        self.scheduler_config: dict[str, Any] = dict(DDPMScheduler(variance_type=variance_type).config)
        self.info = ImageModelInfo(
            sizes=list(SIZES),
            samplers=list(SAMPLERS),
            default_sampler="ddim",
            default_steps=10,
            max_steps=MAX_STEPS,
            conditioning="a digit from 0 to 9",
        )
        self.calls: list[tuple[int, tuple[int, ...]]] = []  # (rows, latent shape) of each forward
        self.decoded: list[torch.Tensor] = []
        self.block_calls: list[tuple[int, int, int]] = []  # (start, stop, rows) of each run of blocks
        self.block_forward = RecordingBlocks(self) if blocks else None

    def resolve(self, params: ImageParams) -> Resolved:
        size = f"{params.width or 8}x{params.height or 8}"
        if size not in SIZES:
            raise InvalidImageRequest(f"size {size} is not one of {', '.join(SIZES)}", "size")
        steps = params.num_inference_steps or self.info.default_steps
        if steps > MAX_STEPS:
            raise InvalidImageRequest(f"num_inference_steps must be at most {MAX_STEPS}", "num_inference_steps")
        sampler = params.sampler or self.info.default_sampler
        if sampler not in SAMPLERS:
            raise InvalidImageRequest(f"sampler must be one of {', '.join(SAMPLERS)}", "sampler")
        width, height = (int(side) for side in size.split("x"))
        return Resolved(
            width=width,
            height=height,
            latent_shape=SIZES[size],
            steps=steps,
            sampler=sampler,
            guidance_scale=1.0 if params.guidance_scale is None else params.guidance_scale,
            seed=random.randrange(2**31) if params.seed is None else params.seed,
        )

    def encode_prompt(self, prompt: str, negative_prompt: str | None) -> tuple[Any, Any]:
        digit = re.search(r"\d", prompt)
        if digit is None:
            raise InvalidImageRequest(f"the prompt must name {self.info.conditioning}", "prompt")
        return torch.tensor(int(digit.group())), torch.tensor(NUM_CLASSES)

    def stack(self, rows: list[Any]) -> torch.Tensor:
        return torch.stack(rows)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        self.calls.append((latents.shape[0], tuple(latents.shape[1:])))
        return self.transformer(latents, timestep=timesteps, class_labels=cond).sample

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        self.decoded.append(latents.float().clone())
        pixels = ((latents.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1)


class RecordingBlocks(DiTBlocks):
    """DiTBlocks that records, on its pipeline, each forward (`calls`) and each run of blocks."""

    def __init__(self, pipe: TinyDiTPipeline):
        super().__init__(pipe.transformer)
        self.pipe = pipe

    def embed(self, latents, timesteps, cond):
        self.pipe.calls.append((latents.shape[0], tuple(latents.shape[1:])))
        return super().embed(latents, timesteps, cond)

    def blocks(self, hidden, rows, start, stop):
        self.pipe.block_calls.append((start, stop, hidden.shape[0]))
        return super().blocks(hidden, rows, start, stop)
