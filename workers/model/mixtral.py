"""Mixtral (MixtralForCausalLM): Llama/Mistral attention (a sliding window on every layer where
config.json sets one) and, in place of the dense MLP, a sparse mixture of experts whose router
renormalises its top k (`pagemesh.workers.model.moe`)."""

from __future__ import annotations

import torch
from torch import nn

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.layers import ParallelContext
from pagemesh.workers.model.llama import LlamaAttention, llama_layer_tensor_names, load_llama_layer_tensor
from pagemesh.workers.model.moe import MoEDecoderLayer, SparseMoE

# Mixtral's expert tensors: w1 the gate, w3 the up projection, w2 the down projection
EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}
BLOCK = "block_sparse_moe."  # the checkpoint's name of each layer's MoE block (the layer's `mlp`)


class MixtralForCausalLM(CausalLM):
    """CausalLM's contract; every layer's MLP is a SparseMoE."""

    def make_layer(self, cfg: ModelConfig, tp: ParallelContext, index: int, kv_index: int) -> nn.Module:
        moe = cfg.moe
        experts = SparseMoE(
            cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.experts_per_token, moe.renormalize, tp
        )
        return MoEDecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, LlamaAttention(cfg, tp, kv_index, index), experts)

    def layer_tensor_names(self, index: int) -> set[str]:
        attention_and_norms = {n for n in llama_layer_tensor_names(self.config) if not n.startswith("mlp.")}
        return attention_and_norms | {BLOCK + n for n in self.layers[0].mlp.tensor_names(EXPERT_PARTS)}

    def load_layer_tensor(self, layer: nn.Module, name: str, t: torch.Tensor) -> bool:
        if name.startswith(BLOCK):
            return layer.mlp.load_tensor(name[len(BLOCK) :], t, EXPERT_PARTS)
        return load_llama_layer_tensor(layer, name, t)
