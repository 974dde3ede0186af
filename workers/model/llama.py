"""The Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM) over one flat token batch.

Every op except attention runs on all tokens of the step at once (selective batching);
attention goes through the backend, which reads and writes the paged KV pool. The model's
skeleton (embedding, stages, final norm, LM head, loading) is `causal_lm.CausalLM`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.context import AttentionBackend, ForwardContext  # noqa: F401  (the engine's imports)
from pagemesh.workers.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RowParallelLinear,
    rows_independent,
)


def layer_window(cfg: ModelConfig, index: int) -> int | None:
    """Decoder layer `index`'s sliding window (None: it attends to every position)."""
    return cfg.layer_windows[index] if cfg.layer_windows else None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int, model_layer: int | None = None):
        """`layer_index`: the KV pool layer this attention reads (its index in a pipeline stage);
        `model_layer`: its index in the whole model (default the same)."""
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_heads, "num_heads")[1]
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_kv_heads")[1]
        self.scale = cfg.head_dim**-0.5
        self.window = layer_window(cfg, layer_index if model_layer is None else model_layer)  # sliding window, or None
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
        out = ctx.backend.attend(q, kv_layer, ctx.metadata, self.scale, k, v, window=self.window)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))


# A CPU step of more rows runs its MLP in slices of this many where each row's numbers do not depend
# on the rows beside it (rows_independent). The gate/up output is a step's widest activation (2 x
# intermediate per row: 25 MB in fp32 for a 2048-token SmolLM2 prefill), and glibc keeps a step's
# freed blocks for the next (kernels/cpu/memory.py): whole, a prefill worker's heap grew 70 MB more
# over two bursts of 2048-token steps than sliced.
MLP_SLICE_ROWS = 512


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, sizes, False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # (LoRA adapters map a step's rows to their adapters as a whole: not sliced)
        if (
            x.shape[0] <= MLP_SLICE_ROWS
            or self.gate_up_proj.lora is not None
            or self.down_proj.lora is not None
            or not rows_independent(self.gate_up_proj, x)
            or not rows_independent(self.down_proj, x)
        ):
            return self.down_proj(self.activation(self.gate_up_proj(x), ctx))
        slices = x.split(MLP_SLICE_ROWS)
        return torch.cat([self.down_proj(self.activation(self.gate_up_proj(part), ctx)) for part in slices])

    def activation(self, gate_up: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return ctx.ops.silu_and_mul(gate_up)


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # a family whose layer differs only in its attention names its own

    def __init__(self, cfg: ModelConfig, tp: ParallelContext, layer_index: int, model_layer: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, tp, layer_index, model_layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x, residual, ctx):
        x, residual = self.input_layernorm(x, residual, ctx.ops)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual, ctx.ops)
        return self.mlp(x, ctx), residual


# a Llama layer's checkpoint tensors -> (the module path in LlamaDecoderLayer, fused part or None)
_QKV_PARTS = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
_GATE_UP_PARTS = {"mlp.gate_proj": 0, "mlp.up_proj": 1}


class LlamaForCausalLM(CausalLM):
    """The Llama family: pre-norm layers of GQA attention with RoPE and a SwiGLU MLP (CausalLM's
    contract). `fits_fused_decode`: `DecodeLayers`' C code computes exactly these layers."""

    fits_fused_decode = True

    def make_layer(self, cfg: ModelConfig, tp: ParallelContext, index: int, kv_index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, tp, kv_index, index)

    def layer_tensor_names(self, index: int) -> set[str]:
        return llama_layer_tensor_names(self.config)

    def load_layer_tensor(self, layer: nn.Module, name: str, t: torch.Tensor) -> bool:
        return load_llama_layer_tensor(layer, name, t)


def llama_layer_tensor_names(cfg: ModelConfig) -> set[str]:
    """A Llama layer's checkpoint tensors, without `model.layers.{i}.`."""
    names = {f"self_attn.{x}_proj.weight" for x in "qkvo"}
    names |= {f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    names |= {"input_layernorm.weight", "post_attention_layernorm.weight"}
    if cfg.attention_bias:
        names |= {f"self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def load_llama_layer_tensor(layer: nn.Module, name: str, t: torch.Tensor) -> bool:
    """One tensor of a Llama-shaped layer (`self_attn.{qkv_proj, o_proj}`, `mlp.{gate_up_proj,
    down_proj}`, its two norms), by its HF name without `model.layers.{i}.`; False: not one."""
    module, _, kind = name.rpartition(".")
    attn, mlp = layer.self_attn, layer.mlp
    if module in _QKV_PARTS:
        part = _QKV_PARTS[module]
        if kind == "bias":
            if attn.qkv_proj.bias is None:
                return False
            start, size = attn.qkv_proj.tp.shard(attn.qkv_proj.output_sizes[part], "output")
            offset = sum(attn.qkv_proj.local_sizes[:part])
            attn.qkv_proj.bias.data[offset : offset + size].copy_(t[start : start + size])
        else:
            attn.qkv_proj.load_part(part, t)
    elif module in _GATE_UP_PARTS and kind == "weight":
        mlp.gate_up_proj.load_part(_GATE_UP_PARTS[module], t)
    elif name == "self_attn.o_proj.weight":
        attn.o_proj.load(t)
    elif name == "mlp.down_proj.weight":
        mlp.down_proj.load(t)
    elif name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        getattr(layer, module).weight.data.copy_(t)
    else:
        return False
    return True
