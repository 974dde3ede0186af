"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N] x + residual (HAS_RESIDUAL only)
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (HAS_RESIDUAL only)
    weight_ptr,  # [N]
    stride_out,
    stride_res_out,
    stride_x,
    stride_res,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype first: that is the residual the next layer adds to.
        summed = (x + res.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    check_launchable("rms_norm", x, weight)
    num_rows, n_cols = x.shape
    if weight.shape != (n_cols,) or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} / weight {tuple(weight.shape)} mismatch or strided")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else out
    if num_rows == 0:
        return out, res_out
    block_n = next_power_of_2(n_cols)
    num_warps = 4 if block_n <= 1024 else (8 if block_n <= 8192 else 16)
    res_in = residual if residual is not None else x
    _rms_norm_kernel[(num_rows,)](
        out,
        res_out,
        x,
        res_in,
        weight,
        out.stride(0),
        res_out.stride(0),
        x.stride(0),
        res_in.stride(0),
        n_cols,
        eps,
        BLOCK_N=block_n,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x[T, N] / sqrt(mean(x^2) + eps) * weight[N]; fp32 math, result in x.dtype (new tensor)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual) as new tensors; the sum is rounded
    to the model dtype before it is normalised, exactly as the unfused layers would do."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
    return _launch(x, residual, weight, eps)
