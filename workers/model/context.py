"""What a model's forward pass reads besides the tokens (`ForwardContext`), and the attention
backend's interface every family's attention calls (`AttentionBackend`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.model.ops import ModelOps
from pagemesh.workers.model.pooling import PoolSpans


class AttentionBackend(Protocol):
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """k, v: this step's rows, already in the pages; a backend may read them from here.
        `window` W: a query at position p sees key positions j with p - W < j <= p (HF's: the
        last W positions, itself included); `softcap` c: scores become c * tanh(scores / c)
        before the mask and the softmax (Gemma 2's attn_logit_softcapping)."""


@dataclass
class ForwardContext:
    """What one forward pass reads besides the tokens: the KV pool and where things are in it,
    and the device's attention backend and ops (chosen once: `pagemesh.workers.engine.backend.select_backend`)."""

    kv_cache: torch.Tensor  # [layers, pages, 2, page_size, kv_heads, head_dim]
    metadata: AttentionMetadata
    backend: AttentionBackend
    ops: ModelOps
    rope: object = None  # ops.rope_tables(...) of this step, filled by the model
    decode_layers: object = None  # workers.model.decode_layers.DecodeLayers: all layers in one C call
    pool: PoolSpans | None = None  # embedding requests' spans of final-norm hidden states to sum
    pooled: torch.Tensor | None = None  # [pool.count, hidden] fp32, filled by the last stage's model
    rope_local: object = None  # a second RoPE's tables (Gemma 3's sliding layers), filled by the model
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, their embeddings): images' placeholders
    mrope_positions: torch.Tensor | None = None  # [3, T] (temporal, height, width): an M-RoPE model's image step
