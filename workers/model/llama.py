"""The Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM) over one flat token batch.

Every op except attention runs on all tokens of the step at once (selective batching);
attention goes through the backend, which reads and writes the paged KV pool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    linear,
)
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
    ) -> torch.Tensor:
        """k, v: this step's rows, already in the pages; a backend may read them from here."""


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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_heads, "num_heads")[1]
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_kv_heads")[1]
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.attention_bias, tp)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split_with_sizes(self.qkv_proj.local_sizes, dim=-1)  # no Tensor.split wrapper
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = ctx.ops.rotary(q, k, ctx.rope)
        kv_layer = ctx.kv_cache[self.layer_index]
        ctx.backend.write_kv(k, v, kv_layer, ctx.metadata)
        out = ctx.backend.attend(q, kv_layer, ctx.metadata, self.scale, k, v)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, sizes, False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(ctx.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x, residual, ctx):
        x, residual = self.input_layernorm(x, residual, ctx.ops)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual, ctx.ops)
        return self.mlp(x, ctx), residual


class LlamaForCausalLM(nn.Module):
    """forward(token ids [T], ctx, logit rows) -> logits [len(logit rows), vocab] in fp32; with
    `ctx.pool`, the sums of its spans of final-norm hidden states go to `ctx.pooled` as well.

    A pipeline stage (`layers`: a contiguous range of the model's layers, default all) holds only
    those decoder layers, the embedding if it is the first stage, the final norm and the LM head
    if it is the last; `self.layers[i]` is layer `layers.start + i` and reads KV pool layer i.
    A stage that is not the first takes the previous stage's activations (`hidden`); one that is
    not the last returns its own, `[2, T, hidden]`: the layers' output and the residual stream."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext = ParallelContext(), layers: range | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.layer_range = layers if layers is not None else range(cfg.num_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_layers
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, i - self.layer_range.start) for i in self.layer_range)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling_dict)
        self.lm_head = None
        if self.is_last:
            tied = cfg.tie_word_embeddings and self.embed_tokens is not None
            self.lm_head = self.embed_tokens if tied else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' and activations' dtype (every stage has a layer, so a norm to ask)."""
        return self.layers[0].input_layernorm.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        logit_rows: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.is_first:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = hidden[0], hidden[1]
        fused = ctx.decode_layers
        if fused is not None and residual is None and fused.can_run(ctx.metadata, x):
            x, residual = fused.run(x, ctx.metadata)  # the loop below, bit for bit, without the Python
        else:
            ctx.rope = ctx.ops.rope_tables(self.rotary.cos_sin_cache, ctx.metadata.positions, x.dtype)
            for layer in self.layers:
                x, residual = layer(x, residual, ctx)
        if not self.is_last:
            # both halves, not their sum: the next stage's first norm adds them as this one would
            return torch.stack((x, residual))
        x, _ = self.norm(x, residual, ctx.ops)
        if ctx.pool is not None:
            ctx.pooled = ctx.pool.sum(x)
        return linear(x[logit_rows], self.lm_head.weight, None, self.lm_head.packed, torch.float32)

    # ---- weights --------------------------------------------------------------------------
    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take tensors named as in a Hugging Face checkpoint; shard and fuse them in place."""
        loaded: set[str] = set()
        for name, tensor in weights:
            self._load_one(name, tensor)
            loaded.add(name)
        missing = self._expected_names() - loaded
        if missing:
            raise ValueError(f"model: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _load_one(self, name: str, t: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is not None:
                self.embed_tokens.weight.data.copy_(t)
            if self.lm_head is not None and self.lm_head is not self.embed_tokens and self.config.tie_word_embeddings:
                self.lm_head.weight.data.copy_(t)  # a last stage without the embedding: the tied head
            return
        if name == "model.norm.weight":
            if self.norm is not None:
                self.norm.weight.data.copy_(t)
            return
        if name == "lm_head.weight":
            if not self.config.tie_word_embeddings and self.lm_head is not None:
                self.lm_head.weight.data.copy_(t)
            return
        m = self._LAYER.fullmatch(name)
        if m is None:
            if name.endswith("rotary_emb.inv_freq"):
                return
            raise ValueError(f"model: unexpected tensor {name}")
        index = int(m.group(1))
        if index not in self.layer_range:
            if index >= self.config.num_layers:
                raise ValueError(f"model: unexpected tensor {name}")
            return  # another pipeline stage's layer
        layer = self.layers[index - self.layer_range.start]
        attn, mlp, rest = layer.self_attn, layer.mlp, m.group(2)
        qkv_part = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        if rest.startswith("self_attn.") and rest.split(".")[1] in qkv_part:
            part = qkv_part[rest.split(".")[1]]
            if rest.endswith(".bias"):
                start, size = attn.qkv_proj.tp.shard(attn.qkv_proj.output_sizes[part], "output")
                offset = sum(attn.qkv_proj.local_sizes[:part])
                attn.qkv_proj.bias.data[offset : offset + size].copy_(t[start : start + size])
            else:
                attn.qkv_proj.load_part(part, t)
        elif rest == "self_attn.o_proj.weight":
            attn.o_proj.load(t)
        elif rest == "mlp.gate_proj.weight":
            mlp.gate_up_proj.load_part(0, t)
        elif rest == "mlp.up_proj.weight":
            mlp.gate_up_proj.load_part(1, t)
        elif rest == "mlp.down_proj.weight":
            mlp.down_proj.load(t)
        elif rest == "input_layernorm.weight":
            layer.input_layernorm.weight.data.copy_(t)
        elif rest == "post_attention_layernorm.weight":
            layer.post_attention_layernorm.weight.data.copy_(t)
        else:
            raise ValueError(f"model: unexpected tensor {name}")

    def _expected_names(self) -> set[str]:
        """The checkpoint's tensors this stage needs (all of them without pipeline stages)."""
        names = set()
        if self.is_first or (self.is_last and self.config.tie_word_embeddings):
            names.add("model.embed_tokens.weight")
        if self.is_last:
            names.add("model.norm.weight")
            if not self.config.tie_word_embeddings:
                names.add("lm_head.weight")
        for i in self.layer_range:
            p = f"model.layers.{i}."
            names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
            names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            if self.config.attention_bias:
                names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        return names

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (benchmarks of large shapes with nothing to download)."""
        gen = torch.Generator(device=self.rotary.cos_sin_cache.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, std, generator=gen)
