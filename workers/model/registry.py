"""Which model code serves which architecture.

A model family is two things:

    common/model_families.py   HF architecture name -> ConfigMapping: the family's key
                               (`ModelConfig.architecture`), the config fields it refuses other
                               values of, and its own ModelConfig fields (no torch: the
                               tokenizer reads the config too); GGUF_FAMILIES: a GGUF's
                               `general.architecture` (the key itself) -> its own fields.
    workers/model/<family>.py  the model code: a `causal_lm.CausalLM` subclass with the
                               family's decoder layer and the names of its layers' tensors.

and one line in MODEL_CLASSES below, from the key to the class. The engine, the runner,
tensor and pipeline parallelism, pooling and quantization see only `CausalLM`'s contract
(`forward(input_ids, ctx, logit_rows, hidden)`, `load_weights`, `layers`, `lm_head`), so
adding a family touches no engine code. Families share what is the same (`layers.py`: the
parallel linears and norms; `rope.py`: the RoPE scalings; `llama.py`'s attention and MLP;
`moe.py`: the experts), and each writes out
what differs in its own file.

Classes are named "module:Class" and imported when a model is built, so loading one family
imports no other family's code.
"""

from __future__ import annotations

import importlib

from pagemesh.common.model_config import ModelConfig

# ModelConfig.architecture -> the CausalLM subclass that computes it
MODEL_CLASSES = {
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:LlamaForCausalLM",
    "qwen2": "llama:LlamaForCausalLM",
    "qwen2_vl": "qwen2_vl:Qwen2VLForCausalLM",  # Qwen2-VL's language model (M-RoPE)
    "qwen3": "qwen3:Qwen3ForCausalLM",
    "phi3": "phi3:Phi3ForCausalLM",
    "gemma2": "gemma:GemmaForCausalLM",
    "gemma3": "gemma:GemmaForCausalLM",
    "mixtral": "mixtral:MixtralForCausalLM",
    "qwen3_moe": "qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3moe": "qwen3_moe:Qwen3MoeForCausalLM",  # a llama.cpp GGUF's name
}


def model_class(cfg: ModelConfig) -> type:
    """The model class for `cfg`'s architecture (ValueError naming it where none serves it)."""
    name = MODEL_CLASSES.get(cfg.architecture)
    if name is None:
        raise ValueError(f"model: no model code for architecture {cfg.architecture!r} (have: {sorted(MODEL_CLASSES)})")
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(f"pagemesh.workers.model.{module}"), cls)
