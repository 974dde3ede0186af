"""How each Hugging Face architecture's config.json maps onto `ModelConfig` (no torch).

    HF_FAMILIES["Gemma2ForCausalLM"] = ConfigMapping(
        architecture="gemma2",                     ModelConfig.architecture: the model code's key
        served={"hidden_activation": (...)},       config fields whose other values are refused by name
        fields=_gemma2_fields,                     config.json -> the family's own ModelConfig fields
    )

`ModelConfig.from_hf_dict` reads what every family shares (sizes, heads, eps, RoPE, context,
token ids, sliding windows as `_hf_layer_windows` reads them), refuses what this table says the
family's code does not serve, and lets `fields` set or override the rest. The model code for
each architecture key is `pagemesh.workers.model.registry`'s. Adding a family: an entry here, a
file of model code, a line in the registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# HF rope_type values the model code implements (`workers/model/rope.py` ROPE_SCALINGS)
ROPE_SCALING_TYPES = ("linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class ConfigMapping:
    """One HF architecture: its `ModelConfig.architecture` key, the config fields whose values
    its code serves (field -> (HF's default, other served values...)), and its own fields."""

    architecture: str
    served: dict[str, tuple] = field(default_factory=dict)
    fields: Callable[[dict, int], dict] = lambda cfg, context: {}


def _llama_fields(cfg: dict, context: int) -> dict:
    return {}


def _qwen2_fields(cfg: dict, context: int) -> dict:
    return {"attention_bias": True}  # HF's Qwen2 has q/k/v biases always


def _qwen2_vl_fields(cfg: dict, context: int) -> dict:
    section = cfg.get("mrope_section")
    if not section:
        raise ValueError("model: Qwen2-VL without rope_scaling.mrope_section is not supported")
    return {"attention_bias": True, "mrope_section": tuple(int(x) for x in section)}


def _qwen3_fields(cfg: dict, context: int) -> dict:
    from pagemesh.common.model_config import _hf_layer_windows

    # Qwen3 reads its windows as Qwen2 does (use_sliding_window, layer_types, max_window_layers)
    return {
        "qk_norm": True,
        "head_dim": cfg.get("head_dim") or 128,  # Qwen3Config's default, whatever hidden / heads is
        "layer_windows": _hf_layer_windows(cfg, "qwen2", context),
    }


def _phi3_fields(cfg: dict, context: int) -> dict:
    from pagemesh.common.model_config import _uniform_windows, _window_value

    # HF's Phi3Attention slides on every layer when sliding_window is set, layer_types or not
    window = _window_value(cfg.get("sliding_window"), "HF")
    return {"layer_windows": _uniform_windows(window, cfg["num_hidden_layers"], context)}


def _gemma_layer_types(cfg: dict, every: int) -> list[str]:
    """Gemma's `layer_types` where config.json has it, else every `every`-th layer (1-based)
    attends fully and the others slide (Gemma 2: every 2nd; Gemma 3: its
    `sliding_window_pattern`, 6 by default), as transformers fills it."""
    layers = cfg["num_hidden_layers"]
    return cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
    ]


def _gemma_windows(cfg: dict, context: int, types: list[str]) -> tuple[int | None, ...] | None:
    from pagemesh.common.model_config import _hf_layer_windows

    sliding = {**cfg, "layer_types": types, "sliding_window": cfg.get("sliding_window", 4096)}
    return _hf_layer_windows(sliding, "gemma", context)


def _gemma_common(cfg: dict) -> dict:
    return {
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "head_dim": cfg.get("head_dim") or 256,
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }


def _gemma2_fields(cfg: dict, context: int) -> dict:
    return {
        **_gemma_common(cfg),
        "attn_logit_softcapping": _opt_float(cfg.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _opt_float(cfg.get("final_logit_softcapping", 30.0)),
        "layer_windows": _gemma_windows(cfg, context, _gemma_layer_types(cfg, 2)),
    }


def _gemma3_fields(cfg: dict, context: int) -> dict:
    """Gemma 3's two RoPEs: full-attention layers at `rope_theta` with the rope scaling, sliding
    ones at `rope_local_base_freq` unscaled (transformers >= 5 nests both in `rope_parameters`)."""
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"model: rope scaling {local.get('rope_type')!r} on sliding layers is not supported")
    if full.get("rope_type", full.get("type")) == "longrope":
        raise ValueError("model: rope scaling 'longrope' on Gemma 3's full layers is not supported")
    types = _gemma_layer_types(cfg, cfg.get("sliding_window_pattern", 6))
    return {
        **_gemma_common(cfg),
        "qk_norm": True,
        "final_logit_softcapping": _opt_float(cfg.get("final_logit_softcapping")),
        "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
        "rope_scaling": rope_scaling_items(full, cfg),
        "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
        # by layer type, not window: a window at least the context is no window, the RoPE stays local
        "rope_local_layers": tuple(i for i, kind in enumerate(types) if kind == "sliding_attention"),
        "layer_windows": _gemma_windows(cfg, context, types),
    }


def rope_scaling_items(params: dict | None, cfg: dict) -> tuple[tuple[str, float | str | tuple], ...] | None:
    """`ModelConfig.rope_scaling` of HF rope parameters (`rope_scaling` or `rope_parameters`) in
    config.json `cfg`: None for plain RoPE, a ValueError naming a kind the model code does not
    implement."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "longrope":
        return _longrope_items(params, cfg)
    params = {k: v for k, v in params.items() if isinstance(v, (int, float, str)) and k != "rope_theta"}
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"model: unsupported rope scaling {kind!r} (supported: default, {', '.join(ROPE_SCALING_TYPES)})"
        )
    needs = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings")}
    needs["yarn"] = needs["llama3"]
    for key in needs[kind]:
        if key not in params:
            raise ValueError(f"model: rope scaling {kind!r} without {key} is not supported")
    return tuple(sorted(params.items()))


def _longrope_items(params: dict, cfg: dict) -> tuple[tuple[str, float | str | tuple], ...]:
    """LongRoPE (Phi-3) as transformers computes it for a sequence within the pretraining context
    (`original_max_position_embeddings`): frequencies divided by `short_factor`, cos and sin times
    the attention factor. Past that context transformers switches the whole batch to
    `long_factor` while its cache keeps keys rotated the short way, so no paged server can
    match it there: the model is served up to that context (`longrope_context`)."""
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None or params.get("short_factor") is None:
        raise ValueError("model: rope scaling 'longrope' without original_max_position_embeddings or short_factor")
    factor = params.get("factor") or cfg.get("max_position_embeddings", 4096) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = tuple(float(x) for x in params["short_factor"])
    return (
        ("attention_factor", float(attention)),
        ("original_max_position_embeddings", int(original)),
        ("rope_type", "longrope"),
        ("short_factor", short),
    )


def longrope_context(context: int, scaling: tuple | None) -> int:
    """The positions served: a LongRoPE model's pretraining context at most (`_longrope_items`)."""
    items = dict(scaling or ())
    if items.get("rope_type") != "longrope":
        return context
    return min(context, items["original_max_position_embeddings"])


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


_SILU = {"hidden_act": ("silu", "swish")}  # swish is SiLU in transformers
_GEMMA = {
    "hidden_activation": ("gelu_pytorch_tanh",),
    "attention_bias": (False,),
    "use_bidirectional_attention": (None, False),
}

HF_FAMILIES: dict[str, ConfigMapping] = {
    "LlamaForCausalLM": ConfigMapping("llama", {**_SILU, "attention_bias": (False,)}, _llama_fields),
    "MistralForCausalLM": ConfigMapping("mistral", _SILU, _llama_fields),
    "Qwen2ForCausalLM": ConfigMapping("qwen2", _SILU, _qwen2_fields),
    # Qwen2-VL's language model (common/multimodal.py's text_config names it so): Qwen2 with M-RoPE
    "Qwen2VLTextForCausalLM": ConfigMapping("qwen2_vl", _SILU, _qwen2_vl_fields),
    "Qwen3ForCausalLM": ConfigMapping("qwen3", {**_SILU, "attention_bias": (False,)}, _qwen3_fields),
    "Phi3ForCausalLM": ConfigMapping("phi3", _SILU, _phi3_fields),
    "Gemma2ForCausalLM": ConfigMapping("gemma2", _GEMMA, _gemma2_fields),
    "Gemma3ForCausalLM": ConfigMapping("gemma3", {**_GEMMA, "attn_logit_softcapping": (None,)}, _gemma3_fields),
    # mixture-of-experts families: their experts are ModelConfig.moe (model_config._hf_moe)
    "MixtralForCausalLM": ConfigMapping("mixtral", _SILU),
    "Qwen3MoeForCausalLM": ConfigMapping(
        "qwen3_moe", {**_SILU, "attention_bias": (False,)}, lambda cfg, context: {"qk_norm": True}
    ),
}

# GGUF general.architecture -> its family's own ModelConfig fields (the architecture key is the
# same name; ModelConfig.from_gguf_fields reads the shared ones)
GGUF_FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"qk_norm": True},  # llama.cpp's attn_q_norm / attn_k_norm
    "phi3": {},  # fused attn_qkv and ffn_up (gate and up), as the HF checkpoint
    "qwen3moe": {"qk_norm": True},  # and its experts: ModelConfig.moe (model_config._gguf_moe)
}
