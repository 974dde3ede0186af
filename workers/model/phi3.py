"""Phi-3 (Phi3ForCausalLM): the Llama family's computation, its checkpoint fused differently.

A Phi-3 checkpoint holds each layer's q, k and v as one `qkv_proj` and gate and up as one
`gate_up_proj`. Each is cut into its parts at load and every part sharded on its own, as the
separate Llama tensors are, so a tensor-parallel rank gets its heads of q, k and v (a plain row
split of the fused tensor would not). The layers are Llama's, so the fused C decode path fits.
"""

from __future__ import annotations

import torch
from torch import nn

from pagemesh.workers.model.llama import LlamaForCausalLM, load_llama_layer_tensor

_FUSED = {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 models (CausalLM's contract), loaded from their fused tensors."""

    def layer_tensor_names(self, index: int) -> set[str]:
        return (
            _FUSED
            | {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
            | {
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            }
        )

    def load_layer_tensor(self, layer: nn.Module, name: str, t: torch.Tensor) -> bool:
        if name == "self_attn.qkv_proj.weight":
            fused = layer.self_attn.qkv_proj
        elif name == "mlp.gate_up_proj.weight":
            fused = layer.mlp.gate_up_proj
        else:
            return load_llama_layer_tensor(layer, name, t)
        if t.shape[0] != sum(fused.output_sizes):
            raise ValueError(f"model: {name} has {t.shape[0]} rows, expected {sum(fused.output_sizes)}")
        for part, piece in enumerate(t.split(fused.output_sizes, dim=0)):
            fused.load_part(part, piece)
        return True
