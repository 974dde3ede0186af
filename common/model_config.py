"""The shape of a model, read from an HF config.json or from GGUF metadata.

No torch: the tokenizer reads the context length from it, the workers build the model from it.
Each HF architecture's mapping is `pagemesh.common.model_families`'; a config feature its
family's code does not implement is refused here, by name, so that no model is served
differently from Hugging Face transformers."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pagemesh.common.model_families import GGUF_FAMILIES, HF_FAMILIES, longrope_context, rope_scaling_items
from pagemesh.common.model_files import text_weights_path
from pagemesh.common.multimodal import TEXT_WEIGHTS_KEY, multimodal_kind, text_config

SUPPORTED_ARCHITECTURES = {name: mapping.architecture for name, mapping in HF_FAMILIES.items()}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's expert layers (`pagemesh.workers.model.moe`): each token's
    MLP is the weighted sum of `experts_per_token` of `num_experts` experts, its router's choice."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # each expert's gate/up rows (ModelConfig.intermediate_size: a dense layer's)
    renormalize: bool  # the chosen experts' weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (Qwen3-MoE: mlp_only_layers, decoder_sparse_step)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model."""

    architecture: str  # the model code's key (model_families.HF_FAMILIES): llama | mistral | qwen2 | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # positions served: the model's context
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: tuple[tuple[str, float | str | tuple[float, ...]], ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Sliding-window attention: None where no layer slides, else one entry per decoder layer, its
    # window W (as HF transformers: a query sees the last W positions, itself included) or None
    # (full attention). A window at least the context is no window. Pages every layer's window has
    # passed are freed while a sequence runs (workers/engine/block_manager.py).
    layer_windows: tuple[int | None, ...] | None = None
    moe: MoEConfig | None = None  # mixture-of-experts families only
    # What some families add (model_families.py maps them; the defaults are Llama's)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # scores become c * tanh(scores / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits become c * tanh(logits / c) (Gemma 2 and 3)
    rope_local_theta: float | None = None  # the RoPE base of sliding layers, unscaled (Gemma 3)
    rope_local_layers: tuple[int, ...] = ()  # the layers that rotate with rope_local_theta
    # Multimodal models (common/multimodal.py): how images enter (None: a text-only model), and
    # Qwen2-VL's M-RoPE: the head dim's rotary pairs split into (temporal, height, width) sections
    multimodal: str | None = None
    mrope_section: tuple[int, ...] | None = None

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        kind = multimodal_kind(cfg)
        if kind is not None:  # the language model's config, and how images enter it
            return dataclasses.replace(cls.from_hf_dict(text_config(cfg)), multimodal=kind)
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        family = HF_FAMILIES.get(archs[0])
        if family is None:
            raise ValueError(
                f"model: unsupported architecture {archs[0]!r} (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        arch = family.architecture
        _refuse_unimplemented(cfg, arch, family.served)
        heads = cfg["num_attention_heads"]
        nested_rope = "full_attention" in (cfg.get("rope_parameters") or {})  # per layer type: the family reads it
        scaling = (
            None if nested_rope else rope_scaling_items(cfg.get("rope_scaling") or cfg.get("rope_parameters"), cfg)
        )
        eos = cfg.get("eos_token_id")
        context = longrope_context(cfg.get("max_position_embeddings", 4096), scaling)
        common = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=context,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=False,  # HF: Qwen2 has q/k/v biases always (its mapping says so), Mistral never
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            layer_windows=_hf_layer_windows(cfg, arch, context),
            moe=_hf_moe(cfg, arch),
        )
        return cls(**{**common, **family.fields(cfg, context)})

    @classmethod
    def from_hf_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((folder / "config.json").read_text()))

    @classmethod
    def from_gguf_fields(cls, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]
        if arch not in GGUF_FAMILIES:
            raise ValueError(f"model: unsupported GGUF architecture {arch!r} (supported: {sorted(GGUF_FAMILIES)})")
        p = f"{arch}."
        heads = int(meta[p + "attention.head_count"])
        hidden = int(meta[p + "embedding_length"])
        vocab = int(meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]))
        scaling = None
        # attn_factor: Phi-3's LongRoPE (its original_context_length alone is written for every Phi-3)
        scaled = [k for k in ("factor", "attn_factor") if p + "rope.scaling." + k in meta]
        if meta.get(p + "rope.scaling.type") == "llama3" or scaled:
            key = f"{p}rope.scaling.{(scaled or ['type'])[0]}"
            raise ValueError(f"model: GGUF rope scaling ({key}) is not supported yet; use the HF folder")
        head_dim = int(meta.get(p + "attention.key_length") or hidden // heads)
        for key, value in (
            ("attention.value_length", meta.get(p + "attention.value_length")),
            ("rope.dimension_count", meta.get(p + "rope.dimension_count")),
        ):
            if value is not None and int(value) != head_dim:
                raise ValueError(f"model: GGUF {p}{key}={value} (head_dim {head_dim}) is not supported")
        window = meta.get(p + "attention.sliding_window")  # llama.cpp's key; a Mistral GGUF is `llama` without it
        window = None if window == 0 else window  # llama.cpp's Phi-3 converter writes 0 for none
        context, window = int(meta.get(p + "context_length", 4096)), _window_value(window, "GGUF")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            num_layers=int(meta[p + "block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get(p + "attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=scaling,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            layer_windows=_uniform_windows(window, int(meta[p + "block_count"]), context),
            moe=_gguf_moe(meta, arch),
            **GGUF_FAMILIES[arch],
        )

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        return self.num_layers * 2 * (self.num_kv_heads // tp) * self.head_dim * dtype_bytes

    @property
    def kv_window(self) -> int | None:
        """How many of a sequence's last positions its KV pages must keep: the widest layer's window,
        None where some layer attends to every position (then no page can be freed)."""
        if self.layer_windows is None or None in self.layer_windows:
            return None
        return max(self.layer_windows)


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


def _gguf_moe(meta: dict, arch: str) -> MoEConfig | None:
    """The experts of a llama.cpp `qwen3moe` file: every layer sparse, the top k renormalised
    (llama.cpp's Qwen3-MoE graph always normalises them, as the released checkpoints'
    norm_topk_prob)."""
    if arch != "qwen3moe":
        return None
    p = f"{arch}."
    experts, top_k = int(meta[p + "expert_count"]), int(meta[p + "expert_used_count"])
    if not 0 < top_k <= experts:
        raise ValueError(f"model: GGUF {p}expert_used_count={top_k} with {experts} experts is not supported")
    return MoEConfig(experts, top_k, int(meta[p + "expert_feed_forward_length"]), True, ())


def _hf_moe(cfg: dict, arch: str) -> MoEConfig | None:
    """The experts of a Mixtral or Qwen3-MoE config.json, as transformers reads them: Mixtral's
    router renormalises its top k always, Qwen3-MoE's when `norm_topk_prob`; a Qwen3-MoE layer
    is dense where `mlp_only_layers` names it or (index + 1) is not a multiple of
    `decoder_sparse_step`."""
    if arch == "mixtral":
        experts, inter, renormalize, dense = cfg.get("num_local_experts", 8), cfg["intermediate_size"], True, ()
    elif arch == "qwen3_moe":
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        inter, renormalize = cfg.get("moe_intermediate_size", 768), bool(cfg.get("norm_topk_prob", False))
        step, only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or experts == 0 or (i + 1) % step != 0)
    else:
        return None
    top_k = cfg.get("num_experts_per_tok", 2)
    if not 0 < top_k <= max(experts, 1):
        raise ValueError(f"model: num_experts_per_tok={top_k} with {experts} experts is not supported")
    return MoEConfig(experts, top_k, inter, renormalize, dense)


# HF's defaults where config.json leaves a field out (transformers' MistralConfig, Qwen2Config)
_HF_DEFAULT_SLIDING_WINDOW = {"mistral": 4096}
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28


def _hf_layer_windows(cfg: dict, arch: str, context: int) -> tuple[int | None, ...] | None:
    """`ModelConfig.layer_windows` of an HF config: each layer's window (HF transformers: a query
    sees the last W positions, itself included) or None, as transformers reads each family.

    Mistral slides on every layer when `sliding_window` is set (4096 where config.json leaves it
    out; `layer_types` ignored, as MistralConfig does). Qwen2 slides only with
    `use_sliding_window`: on the layers `layer_types` names `sliding_attention`, else on those
    from `max_window_layers` up. A Llama config slides on the layers its `layer_types` names, and
    on every layer when it has a window and no `layer_types` (Llama's modeling code ignores the
    field, but it is what such a checkpoint, a Mistral under Llama's name, was trained with).
    A Qwen2 config whose `layer_types` names a sliding layer without `use_sliding_window` slides
    there too (transformers fails on it)."""
    window = _window_value(cfg.get("sliding_window", _HF_DEFAULT_SLIDING_WINDOW.get(arch)), "HF")
    layers = cfg["num_hidden_layers"]
    if window is None or window >= context:
        return None
    layer_types = cfg.get("layer_types")
    if arch == "mixtral" or (arch == "qwen3_moe" and cfg.get("use_sliding_window", False)):
        return _uniform_windows(window, layers, context)  # as transformers' Mixtral and Qwen3-MoE attention
    if arch == "mistral" or (arch == "llama" and layer_types is None):
        return _uniform_windows(window, layers, context)
    if layer_types is not None:
        if len(layer_types) != layers:
            raise ValueError(f"model: layer_types names {len(layer_types)} layers, num_hidden_layers is {layers}")
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    elif arch == "qwen2" and cfg.get("use_sliding_window", False):
        first = cfg.get("max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
        windows = tuple(window if i >= first else None for i in range(layers))
    else:
        return None
    return windows if any(w is not None for w in windows) else None


def _uniform_windows(window: int | None, layers: int, context: int) -> tuple[int, ...] | None:
    """Every layer sliding through `window` (None: none, or a window at least the context)."""
    return None if window is None or window >= context else (window,) * layers


def _window_value(window, source: str) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"model: {source} sliding_window={window!r} is not a positive number of tokens")
    return window


# config.json fields whose feature no family's code has, and the values it serves (HF's default first);
# each family adds its own (model_families.ConfigMapping.served)
_UNIMPLEMENTED = {
    "mlp_bias": (False, None),  # Llama: biases on gate/up/down
    "partial_rotary_factor": (1, 1.0),  # RoPE on part of each head
}


def _refuse_unimplemented(cfg: dict, arch: str, family_served: dict[str, tuple]) -> None:
    """A feature of this config that its family's code does not implement: a load error that
    names the field and its value, never a model served differently from HF."""
    for name, served in {**_UNIMPLEMENTED, **family_served}.items():
        value = cfg.get(name, served[0])
        if value not in served:
            raise ValueError(f"model: {name}={value!r} is not supported for {arch} (supported: {list(served)})")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    for params in (rope, *(v for v in rope.values() if isinstance(v, dict))):  # Gemma 3 nests per layer type
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"model: partial_rotary_factor={params['partial_rotary_factor']!r} is not supported")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"model: quantization_config (quant_method={method!r}) is not supported: give dense weights "
            "(--quantization int8 quantizes them at load) or a GGUF file"
        )


DEFAULT_MAX_MODEL_LEN_CAP = 8192


def default_max_model_len(path: Path) -> int:
    """The context length served when none is given: the model's, capped (a 128k-token context
    would make every length check and KV budget assume prompts nobody sends on a small box)."""
    return min(read_model_config(path).max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)


def read_model_config(path: Path) -> ModelConfig:
    """The config of an HF folder (config.json) or a GGUF file (its metadata); a multimodal folder
    whose language model is the embedded GGUF (digits-vlm): the GGUF's, with the folder's images."""
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get(TEXT_WEIGHTS_KEY) != "default":
            return ModelConfig.from_hf_dict(cfg)
        text = read_model_config(text_weights_path(path))
        return dataclasses.replace(text, multimodal=multimodal_kind(cfg))
    meta, names = _gguf_meta(path)
    return ModelConfig.from_gguf_fields(meta, names)


def _gguf_meta(path: Path) -> tuple[dict, set[str]]:
    from pagemesh.common.gguf_file import read_gguf

    gguf = read_gguf(path)
    return gguf.metadata, {t.name for t in gguf.tensors}
