"""The shape of a Llama-family model, read from an HF config.json or from GGUF metadata.

No torch: the tokenizer reads the context length from it, the workers build the model from it."""

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
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

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
        heads = cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling:
            scaling = {k: v for k, v in scaling.items() if isinstance(v, (int, float, str))}
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"model: unsupported rope scaling {kind!r}")
        eos = cfg.get("eos_token_id")
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
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
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
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            num_layers=int(meta[p + "block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get(p + "attention.head_count_kv", heads)),
            head_dim=int(meta.get(p + "attention.key_length") or hidden // heads),
            rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta.get(p + "context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=scaling,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        )

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        return self.num_layers * 2 * (self.num_kv_heads // tp) * self.head_dim * dtype_bytes


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


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
