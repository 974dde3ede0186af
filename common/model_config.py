"""The shape of a Llama-family model, read from an HF config.json or from GGUF metadata.

No torch: the tokenizer reads the context length from it, the workers build the model from it.
A config feature the Llama-family code does not implement is refused here, by name, so that no
model is served differently from Hugging Face transformers; the one exception is a sliding
attention window, which caps the context instead (see `ModelConfig.sliding_window`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model."""

    architecture: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # positions served: the model's context, at most its sliding window
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Where some layer attends only to a window shorter than the model's context: the window W
    # (as HF transformers: a query sees the last W positions, itself included) and the model's own
    # context. pagemesh attends to every position, which is the same up to W tokens, so
    # max_position_embeddings is then W: a longer context would be served wrong.
    sliding_window: int | None = None
    native_max_position_embeddings: int | None = None

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs[0]!r} (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
            )
        _refuse_unimplemented(cfg, arch)
        heads = cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling:
            scaling = {k: v for k, v in scaling.items() if isinstance(v, (int, float, str))}
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"model: unsupported rope scaling {kind!r} (supported: default, llama3)")
        eos = cfg.get("eos_token_id")
        context, window = _window_cap(cfg.get("max_position_embeddings", 4096), _hf_sliding_window(cfg, arch))
        return cls(
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
            # HF: Qwen2 has q/k/v biases always, Mistral never; Llama's flag (o_proj too) is refused above
            attention_bias=arch == "qwen2",
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            sliding_window=window,
            native_max_position_embeddings=cfg.get("max_position_embeddings", 4096) if window else None,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((folder / "config.json").read_text()))

    @classmethod
    def from_gguf_fields(cls, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model: unsupported GGUF architecture {arch!r}")
        p = f"{arch}."
        heads = int(meta[p + "attention.head_count"])
        hidden = int(meta[p + "embedding_length"])
        vocab = int(meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]))
        scaling = None
        if meta.get(p + "rope.scaling.type") == "llama3" or (p + "rope.scaling.factor") in meta:
            raise ValueError("model: GGUF rope scaling is not supported yet; use the HF folder")
        head_dim = int(meta.get(p + "attention.key_length") or hidden // heads)
        for key, value in (
            ("attention.value_length", meta.get(p + "attention.value_length")),
            ("rope.dimension_count", meta.get(p + "rope.dimension_count")),
        ):
            if value is not None and int(value) != head_dim:
                raise ValueError(f"model: GGUF {p}{key}={value} (head_dim {head_dim}) is not supported")
        window = meta.get(p + "attention.sliding_window")  # llama.cpp's key; a Mistral GGUF is `llama` without it
        context, window = _window_cap(int(meta.get(p + "context_length", 4096)), _window_value(window, "GGUF"))
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
            sliding_window=window,
            native_max_position_embeddings=int(meta.get(p + "context_length", 4096)) if window else None,
        )

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        return self.num_layers * 2 * (self.num_kv_heads // tp) * self.head_dim * dtype_bytes

    def sliding_window_note(self) -> str | None:
        """The load-log line of a model whose context its sliding window caps (None: no cap)."""
        if self.sliding_window is None:
            return None
        return (
            f"model: sliding_window={self.sliding_window} is shorter than the model's context "
            f"({self.native_max_position_embeddings}); pagemesh attends to every position, the same as the "
            f"window up to {self.sliding_window} tokens: serving at most {self.sliding_window} tokens a sequence"
        )


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


# HF's defaults where config.json leaves a field out (transformers' MistralConfig, Qwen2Config)
_HF_DEFAULT_SLIDING_WINDOW = {"mistral": 4096}
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28


def _hf_sliding_window(cfg: dict, arch: str) -> int | None:
    """The window some layer of this config attends through (HF transformers: a query sees the
    last W positions, itself included), or None where every layer attends to all positions.

    As transformers reads each family: Mistral slides on every layer when `sliding_window` is
    set (4096 where config.json leaves it out; `layer_types` ignored); Qwen2 only with
    `use_sliding_window`, on the layers `layer_types` names, else on those from
    `max_window_layers` up. Where transformers would not slide, the window counts all the same
    when `layer_types` names a `sliding_attention` layer (Qwen2 without `use_sliding_window`:
    transformers fails there), and in a Llama config without `layer_types` (Llama's modeling
    code ignores the field, but it is what the model was trained with): a cap is never wrong,
    at worst shorter than needed."""
    window = _window_value(cfg.get("sliding_window", _HF_DEFAULT_SLIDING_WINDOW.get(arch)), "HF")
    if window is None:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None and "sliding_attention" in layer_types:
        return window
    if arch == "mistral":
        return window
    if arch == "qwen2":
        if not cfg.get("use_sliding_window", False) or layer_types is not None:
            return None
        first = cfg.get("max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
        return window if first < cfg["num_hidden_layers"] else None
    return window if layer_types is None else None


def _window_value(window, source: str) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"model: {source} sliding_window={window!r} is not a positive number of tokens")
    return window


def _window_cap(context: int, window: int | None) -> tuple[int, int | None]:
    """(positions served, the window where it caps them): a window at least the context changes
    no served position, so it is dropped; a shorter one becomes the context."""
    if window is None or window >= context:
        return context, None
    return window, window


# config.json fields whose feature the Llama-family code does not have, and the values it does
_UNIMPLEMENTED = {
    "mlp_bias": (False, None),  # Llama: biases on gate/up/down
    "hidden_act": ("silu", "swish"),  # the MLP's activation (swish is SiLU in transformers)
    "partial_rotary_factor": (1, 1.0),  # RoPE on part of each head
}


def _refuse_unimplemented(cfg: dict, arch: str) -> None:
    """A feature of this config that the Llama-family code does not implement: a load error that
    names the field and its value, never a model served differently from HF."""
    for name, served in _UNIMPLEMENTED.items():
        value = cfg.get(name, served[0])
        if value not in served:
            raise ValueError(f"model: {name}={value!r} is not supported (supported: {list(served)})")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"model: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported")
    if arch == "llama" and cfg.get("attention_bias", False):
        raise ValueError("model: attention_bias=True (LlamaForCausalLM: biases on q/k/v and o_proj) is not supported")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"model: quantization_config (quant_method={method!r}) is not supported: give dense weights "
            "(--quantization int8 quantizes them at load) or a GGUF file"
        )


def check_max_model_len(cfg: ModelConfig, max_model_len: int) -> None:
    """An explicit context length longer than a sliding window lets the model serve exactly: an error
    that names the window (a longer one without a window is capped at the model's, as before)."""
    if cfg.sliding_window is not None and max_model_len > cfg.sliding_window:
        raise ValueError(
            f"max_model_len {max_model_len}: the model attends through sliding_window={cfg.sliding_window}, "
            f"which pagemesh does not implement; attending to every position is the same only up to "
            f"{cfg.sliding_window} tokens, so --max-model-len must be at most {cfg.sliding_window}"
        )


DEFAULT_MAX_MODEL_LEN_CAP = 8192


def default_max_model_len(path: Path) -> int:
    """The context length served when none is given: the model's, capped (a 128k-token context
    would make every length check and KV budget assume prompts nobody sends on a small box)."""
    return min(read_model_config(path).max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)


def read_model_config(path: Path) -> ModelConfig:
    """The config of an HF folder (config.json) or a GGUF file (its metadata)."""
    if path.is_dir():
        return ModelConfig.from_hf_folder(path)
    meta, names = _gguf_meta(path)
    return ModelConfig.from_gguf_fields(meta, names)


def _gguf_meta(path: Path) -> tuple[dict, set[str]]:
    from pagemesh.common.gguf_file import read_gguf

    gguf = read_gguf(path)
    return gguf.metadata, {t.name for t in gguf.tensors}
