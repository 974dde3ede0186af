"""Qwen3 (dense): the Llama family's layers with an RMSNorm over each head of q and of k, after
the projections and before RoPE (HF's Qwen3Attention: `q_norm`, `k_norm`, Llama-style norms
shared by every head, so each tensor-parallel rank holds them whole)."""

from __future__ import annotations

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.context import ForwardContext
from pagemesh.workers.model.layers import ParallelContext, RMSNorm
from pagemesh.workers.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    llama_layer_tensor_names,
    load_llama_layer_tensor,
)


def norm_heads(x: torch.Tensor, norm: nn.Module, ops) -> torch.Tensor:
    """`norm` over the last dimension of every head of x [T, heads, head_dim]; a new tensor."""
    tokens, heads, head_dim = x.shape
    # contiguous: one head per rank (k at -tp 2 of 2 KV heads) reshapes to a strided view of qkv
    return norm(x.reshape(tokens * heads, head_dim).contiguous(), None, ops)[0].view(tokens, heads, head_dim)


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with `q_norm` and `k_norm` on each head before RoPE."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int, model_layer: int):
        super().__init__(cfg, tp, layer_index, model_layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split_with_sizes(self.qkv_proj.local_sizes, dim=-1)
        q = norm_heads(q.view(tokens, self.num_heads, self.head_dim), self.q_norm, ctx.ops)
        k = norm_heads(k.view(tokens, self.num_kv_heads, self.head_dim), self.k_norm, ctx.ops)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = ctx.ops.rotary(q, k, ctx.rope)
        kv_layer = ctx.kv_cache[self.layer_index]
        ctx.backend.write_kv(k, v, kv_layer, ctx.metadata)
        out = ctx.backend.attend(q, kv_layer, ctx.metadata, self.scale, k, v, window=self.window)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 dense models (CausalLM's contract); `fits_fused_decode` is False: the C decode path
    has no q/k norms."""

    def make_layer(self, cfg: ModelConfig, tp: ParallelContext, index: int, kv_index: int) -> nn.Module:
        return Qwen3DecoderLayer(cfg, tp, kv_index, index)

    def layer_tensor_names(self, index: int) -> set[str]:
        return llama_layer_tensor_names(self.config) | {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}

    def load_layer_tensor(self, layer: nn.Module, name: str, t: torch.Tensor) -> bool:
        if name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            getattr(layer.self_attn, name.split(".")[1]).weight.data.copy_(t)
            return True
        return load_llama_layer_tensor(layer, name, t)
