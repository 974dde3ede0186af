"""Small helpers shared by the kernel launchers (no triton import here)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (1 for the CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_launchable(name: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error instead of Triton's when a kernel is called on CPU tensors."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kernels.{name} needs CUDA tensors (got {t.device}); on CPU call "
                f"pagemesh.kernels.reference.{name}_ref, or set TRITON_INTERPRET=1 for testing"
            )


def upcast_bf16_dot(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands must be upcast to fp32 before the product.

    Triton's interpreter stores bfloat16 as raw uint16 and `tl.dot` multiplies the bit
    patterns (triton-lang/triton#11584); compiled kernels are fine, so only the interpreter
    takes the upcast path.
    """
    return dtype == torch.bfloat16 and interpreting()
