"""Engine configuration (frozen) and how `auto` choices resolve on this machine."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Limits and choices for one engine (one worker). Defaults suit the embedded model on CPU."""

    model: str | None = None  # GGUF file or HF folder; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    page_size: int = 16
    num_pages: int | None = None  # fixes the pool size; else from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # default: 2 GiB on CPU, 90% of free memory on GPU
    max_model_len: int | None = None  # default: the model's, capped at 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 512
    max_num_partial_prefills: int = 4
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype: must be auto or one of {sorted(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError("device: must be auto, cpu or cuda")
        if self.page_size < 1 or self.page_size & (self.page_size - 1) or self.page_size > 128:
            raise ValueError("page_size: must be a power of two up to 128")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_num_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16, as vLLM's CPU backend decides."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
