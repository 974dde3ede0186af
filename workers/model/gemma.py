"""Gemma 2 and Gemma 3 (text): Hugging Face's Gemma2ForCausalLM and Gemma3ForCausalLM.

What differs from the Llama family, each from HF's modeling code:
  - embeddings times sqrt(hidden), the factor rounded to the model dtype first;
  - RMSNorms applied as (1 + w), in fp32 (`layers.OffsetRMSNorm`), before *and* after each of
    attention and the MLP (`post_attention_layernorm`, `pre_feedforward_layernorm`,
    `post_feedforward_layernorm`);
  - a GeGLU MLP (gelu_pytorch_tanh);
  - attention scores scaled by query_pre_attn_scalar ** -0.5;
  - interleaved sliding and full layers (`ModelConfig.layer_windows`);
  - Gemma 2: attention scores and final logits soft-capped, c * tanh(x / c);
  - Gemma 3: q/k norms per head before RoPE; sliding layers (`rope_local_layers`) rotate with
    their own base (`rope_local_theta`, unscaled), full layers with `rope_theta` and the rope
    scaling; final logits soft-capped where the config says.
"""

from __future__ import annotations

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.context import ForwardContext
from pagemesh.workers.model.layers import (
    ColumnParallelLinear,
    OffsetRMSNorm,
    ParallelContext,
    RowParallelLinear,
    gelu_tanh_and_mul,
)
from pagemesh.workers.model.llama import LlamaMLP, layer_window, load_llama_layer_tensor
from pagemesh.workers.model.qwen3 import norm_heads
from pagemesh.workers.model.rope import RotaryEmbedding

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int, model_layer: int):
        super().__init__()
        self.layer_index = layer_index  # the KV pool layer
        self.head_dim = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_heads, "num_heads")[1]
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_kv_heads")[1]
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = layer_window(cfg, model_layer)
        self.softcap = cfg.attn_logit_softcapping
        self.local_rope = model_layer in cfg.rope_local_layers  # Gemma 3's sliding layers: ctx.rope_local
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size], False, tp)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split_with_sizes(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = norm_heads(q, self.q_norm, ctx.ops), norm_heads(k, self.k_norm, ctx.ops)
        q, k = ctx.ops.rotary(q, k, ctx.rope_local if self.local_rope else ctx.rope)
        kv_layer = ctx.kv_cache[self.layer_index]
        ctx.backend.write_kv(k, v, kv_layer, ctx.metadata)
        out = ctx.backend.attend(q, kv_layer, ctx.metadata, self.scale, k, v, window=self.window, softcap=self.softcap)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))


class GemmaMLP(LlamaMLP):
    """Llama's MLP with GeGLU (tanh-approximated GELU) for SiLU."""

    def activation(self, gate_up: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after each block; the post-block norms take no residual, the next
    pre-block norm adds it (the hidden state stays `x + residual`, CausalLM's contract)."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int, model_layer: int):
        super().__init__()
        for name in _NORMS:
            setattr(self, name, OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.self_attn = GemmaAttention(cfg, tp, layer_index, model_layer)
        self.mlp = GemmaMLP(cfg, tp)

    def forward(self, x, residual, ctx):
        x, residual = self.input_layernorm(x, residual)
        x, _ = self.post_attention_layernorm(self.self_attn(x, ctx), None)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x, _ = self.post_feedforward_layernorm(self.mlp(x, ctx), None)
        return x, residual


class GemmaForCausalLM(CausalLM):
    """Gemma 2 and Gemma 3 text models (CausalLM's contract); the C decode path does not fit."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext = ParallelContext(), layers: range | None = None):
        super().__init__(cfg, tp, layers)
        self.rotary_local = None
        if cfg.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None)

    def make_layer(self, cfg: ModelConfig, tp: ParallelContext, index: int, kv_index: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, tp, kv_index, index)

    def make_norm(self, hidden: int, eps: float) -> nn.Module:
        return OffsetRMSNorm(hidden, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by the factor rounded to the model dtype; a Python float of that value
        # gives the same products and keeps a CUDA graph free of host tensors
        return x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype).item()

    def prepare_rope(self, ctx: ForwardContext, x: torch.Tensor) -> None:
        super().prepare_rope(ctx, x)
        if self.rotary_local is not None:
            ctx.rope_local = ctx.ops.rope_tables(self.rotary_local.cos_sin_cache, ctx.metadata.positions, x.dtype)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().logits_of(x)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def layer_tensor_names(self, index: int) -> set[str]:
        names = {f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {f"{norm}.weight" for norm in _NORMS}
        if self.config.qk_norm:
            names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
        return names

    def load_layer_tensor(self, layer: nn.Module, name: str, t: torch.Tensor) -> bool:
        module = name.removesuffix(".weight")
        if module in _NORMS:
            getattr(layer, module).weight.data.copy_(t)
        elif module in ("self_attn.q_norm", "self_attn.k_norm") and layer.self_attn.q_norm is not None:
            getattr(layer.self_attn, module.split(".")[1]).weight.data.copy_(t)
        else:
            return load_llama_layer_tensor(layer, name, t)
        return True
