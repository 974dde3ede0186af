"""SiLU-and-multiply: the gate of a SwiGLU MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2 * I]: gate in [:, :I], up in [:, I:]
    stride_out,
    stride_x,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x[T, 2*I]; fp32 math, result [T, I] in x.dtype."""
    check_launchable("silu_and_mul", x)
    num_rows, width = x.shape
    if width % 2 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} needs an even, contiguous last dimension")
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(inter, BLOCK))
    _silu_and_mul_kernel[grid](out, x, out.stride(0), x.stride(0), inter, BLOCK=BLOCK, num_warps=4)
    return out
