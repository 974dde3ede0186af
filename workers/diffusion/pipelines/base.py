"""The contract between the diffusion engine and a model (a pipeline).

The engine owns requests, their latents, their per-request samplers and the step batches; a
pipeline owns the model: what a request may ask of it (`resolve`), the prompt's conditioning
(`encode_prompt`, once per request), the batched denoiser forward (`denoise`, once per step
batch) and the latents-to-pixels decode (`decode`, once per finished request).

    ImageParams ──resolve──▶ Resolved (sizes, steps, sampler, guidance; or InvalidImageRequest)
    prompt      ──encode_prompt──▶ (cond row, uncond row)   stacked per batch by `stack`
    [B, *latent_shape] latents, [B] timesteps, stack(rows) ──denoise──▶ [B, *latent_shape] model output
    [n, *latent_shape] ──decode──▶ uint8 [n, H, W, C] at the native resolution

Rows of one batch may come from requests at different timesteps, with different samplers and
step counts; a pipeline must treat every row on its own (no cross-row state), so a request's
image does not depend on who shares its batch. Classifier-free guidance is the engine's: it
sends the cond and uncond rows of a request in the same batch and combines the outputs.

A pipeline whose denoiser is a stack of transformer blocks may also offer `block_forward` (a
`BlockForward`): the same forward in parts, so the engine's feature caches can run the deep
blocks on some rows of a batch and reuse their cached output on the others. A pipeline without
it (`block_forward` absent or None) serves only the cache policy `none`.

    latents, timesteps, cond ──embed──▶ hidden [B, T, D], rows (each row's conditioning)
    hidden[rows r] ──blocks(start, stop, rows.select(r))──▶ hidden[r] after blocks start..stop-1
    hidden ──final──▶ the model output `denoise` would give (same ops: the same numbers)

A U-Net pipeline may offer `deep_cache_forward` (a `DeepCacheForward`) instead: its forward in
DeepCache's three parts, so a row may reuse the deep branch's output from its last computed
step while the shallow path (the first down block and the last up block) runs every step. It
serves the policies `none` and `interval:N`.

    latents, timesteps, cond ──shallow_down──▶ shallow (every row: embeddings, skips, down block 0's output)
    shallow, rows r ──deep──▶ feature[r] [b, *feature_shape]: what the last up block takes
    shallow, feature [B, ...] ──shallow_up──▶ the model output `denoise` would give (same numbers)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagemesh.common.messages import ImageModelInfo, ImageParams


class InvalidImageRequest(ValueError):
    """A request this model cannot serve: the client's fault, a 400 with `param` named."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """A request's parameters with the model's defaults filled in and checked."""

    width: int  # the output image size asked for (pixels)
    height: int
    latent_shape: tuple[int, ...]  # one image's latents, e.g. (1, 8, 8); equal shapes share a batch
    steps: int
    sampler: str
    guidance_scale: float  # <= 1: no classifier-free guidance (no uncond rows)
    seed: int


class BlockRows(Protocol):
    """The per-row conditioning a block forward carries (DiT: timesteps and class labels)."""

    def select(self, index: torch.Tensor) -> BlockRows:
        """The conditioning of rows `index` (a long tensor), in that order."""


class BlockForward(Protocol):
    """A denoiser split at its blocks (see the module doc). Rows are independent throughout."""

    num_blocks: int
    dtype: torch.dtype  # the hidden states' dtype

    def hidden_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, int]:
        """(tokens, dim) of one row's hidden states for latents of `latent_shape`."""

    def embed(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Any) -> tuple[torch.Tensor, BlockRows]:
        """Latents [B, ...] (scaled by each row's scheduler) -> hidden [B, T, D] and the rows."""

    def modulated_input(self, hidden: torch.Tensor, rows: BlockRows) -> torch.Tensor:
        """The first block's timestep-modulated input [B, T, D] (TeaCache's signal)."""

    def blocks(self, hidden: torch.Tensor, rows: BlockRows, start: int, stop: int) -> torch.Tensor:
        """Blocks start..stop-1 over hidden [b, T, D], whose conditioning is `rows`."""

    def final(self, hidden: torch.Tensor, rows: BlockRows) -> torch.Tensor:
        """Hidden [B, T, D] after every block -> the model output, as `denoise` returns it."""


class DeepCacheForward(Protocol):
    """A U-Net split for DeepCache (see the module doc). Rows are independent throughout.

    A block, for blocks_computed / blocks_skipped, is one down, mid or up block: a row that
    computes runs `num_blocks`, one that reuses its deep feature `shallow_blocks`."""

    num_blocks: int
    shallow_blocks: int
    dtype: torch.dtype  # the deep feature's dtype

    def feature_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """One row's deep feature (what its cache keeps) for latents of `latent_shape`."""

    def shallow_down(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Any) -> Any:
        """Latents [B, ...] (scaled by each row's scheduler) -> the shallow state of every row:
        its embeddings, conv_in's and the first down block's outputs (what `deep` and
        `shallow_up` read)."""

    def deep(self, shallow: Any, index: torch.Tensor | None = None) -> torch.Tensor:
        """The deep branch (the down blocks after the first, the mid block, the up blocks before
        the last) on rows `index` of `shallow` (a long tensor; None: every row) -> their deep
        feature [b, *feature_shape]."""

    def shallow_up(self, shallow: Any, feature: torch.Tensor) -> torch.Tensor:
        """The last up block on every row's deep `feature` [B, ...] (fresh or cached) and its
        fresh shallow skips, then the output head -> the model output, as `denoise` returns it."""


class ImagePipeline(Protocol):
    name: str  # the model id the mesh serves it under
    info: ImageModelInfo
    device: torch.device
    dtype: torch.dtype
    native_size: tuple[int, int]  # (width, height) of decoded images before any resize
    scheduler_config: dict[str, Any]  # the diffusers scheduler config samplers are built from

    def resolve(self, params: ImageParams) -> Resolved:
        """Fill defaults and check `params` against the model; raises InvalidImageRequest."""

    def encode_prompt(self, prompt: str, negative_prompt: str | None) -> tuple[Any, Any]:
        """The (cond, uncond) conditioning rows of one image; raises InvalidImageRequest when the
        prompt says nothing the model can condition on."""

    def stack(self, rows: list[Any]) -> Any:
        """Conditioning rows -> the batched conditioning `denoise` takes."""

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Any) -> torch.Tensor:
        """One batched model forward: the model output (noise / v / x0 prediction as the
        scheduler config's `prediction_type` says) for every row."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [n, ...] -> uint8 images [n, H, W, C] (C = 1 or 3), native size."""
