"""The names `--quantization` takes: which linear weights a model keeps quantized.

No torch: the engine's flags (workers/engine/config.py) are parsed by processes that never load
a model. What each name does is workers/model/quantization.py's (`none`, `int8`, `gguf`).

`auto`, the default, is chosen per model by `resolve_quantization`: a GGUF file is served from
its own quantized blocks (`gguf`), as llama.cpp, Ollama and vLLM serve one, unless `--dtype`
names a dtype: then its weights are that dtype, dense (`none`), so `--dtype float32` means
exact fp32 weights (the parity tests' setting) and `--dtype bfloat16` the dense bf16 model. An
HF folder is dense (`none`). A name other than auto is taken as given; with `gguf`, `--dtype` is
the activations' and the KV cache's dtype."""

from __future__ import annotations

from pathlib import Path

QUANTIZATIONS = ("none", "int8", "gguf")  # what a model loads with
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)  # what --quantization takes


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a GGUF file (by its magic bytes, not its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


def resolve_quantization(quantization: str, dtype: str, model_path: Path) -> str:
    """The quantization a model at `model_path` loads with: `quantization`, or for `auto` the
    rule above (`dtype` as the flag gives it: auto or a dtype's name)."""
    if quantization != "auto":
        return quantization
    return "gguf" if dtype == "auto" and is_gguf_file(model_path) else "none"
