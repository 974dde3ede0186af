"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k RMSNorm per head) and a sparse mixture
of experts whose router renormalises its top k only with `norm_topk_prob`; the layers that
`mlp_only_layers` names, or that `decoder_sparse_step` skips, keep a dense SwiGLU MLP of
`intermediate_size` (`ModelConfig.moe.dense_layers`)."""

from __future__ import annotations

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.layers import ParallelContext
from pagemesh.workers.model.llama import LlamaMLP, llama_layer_tensor_names, load_llama_layer_tensor
from pagemesh.workers.model.moe import MoEDecoderLayer, SparseMoE
from pagemesh.workers.model.qwen3 import Qwen3Attention

EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
BLOCK = "mlp."  # the checkpoint's name of each layer's MoE block (the layer's `mlp`)
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


class Qwen3MoeForCausalLM(CausalLM):
    """CausalLM's contract; a layer's MLP is a SparseMoE, or a LlamaMLP on the dense layers."""

    def make_layer(self, cfg: ModelConfig, tp: ParallelContext, index: int, kv_index: int) -> nn.Module:
        moe = cfg.moe
        if index in moe.dense_layers:
            mlp = LlamaMLP(cfg, tp)
        else:
            mlp = SparseMoE(
                cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.experts_per_token, moe.renormalize, tp
            )
        attention = Qwen3Attention(cfg, tp, kv_index, index)
        return MoEDecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, attention, mlp)

    def layer_tensor_names(self, index: int) -> set[str]:
        names = llama_layer_tensor_names(self.config) | set(QK_NORMS)
        mlp = self.layers[index - self.layer_range.start].mlp
        if isinstance(mlp, SparseMoE):
            names = {n for n in names if not n.startswith(BLOCK)} | {BLOCK + n for n in mlp.tensor_names(EXPERT_PARTS)}
        return names

    def load_layer_tensor(self, layer: nn.Module, name: str, t: torch.Tensor) -> bool:
        if name in QK_NORMS:
            getattr(layer.self_attn, name.split(".")[1]).weight.data.copy_(t)
            return True
        if isinstance(layer.mlp, SparseMoE) and name.startswith(BLOCK):
            return layer.mlp.load_tensor(name[len(BLOCK) :], t, EXPERT_PARTS)
        return load_llama_layer_tensor(layer, name, t)
