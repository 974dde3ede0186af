"""LoRA deltas on a GPU, every row under its own adapter: Punica's BGMV as two kernels.

    shrink  h[r, k]  = sum_i a[s_r * width + k, i] * x[r, i]          (fp32)
    expand  y[r, j] += sum_k h[r, k] * b[s_r * width + k, j]          (in y's dtype)

a [slots * width, in] and b [slots * width, out] hold every slot's adapter (workers/model/lora.py);
s_r = slots[r], and a row with -1 is left as it is. A row reads only its own adapter. The CPU does
the same in C (kernels/cpu/lora.c); `lora_add_` here has its contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, next_power_of_2

BLOCK_IN = 128
BLOCK_OUT = 128


@triton.jit
def _lora_shrink_kernel(
    h_ptr,  # [R, width] fp32
    x_ptr,  # [R, in]
    a_ptr,  # [slots * width, in]
    slots_ptr,  # [R] int64 (-1: no adapter)
    fan_in,
    width,
    stride_x,
    BLOCK_W: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    k = tl.arange(0, BLOCK_W)
    k_ok = k < width
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + (slot * width + k)[:, None] * fan_in
        for start in range(0, fan_in, BLOCK_I):
            i = start + tl.arange(0, BLOCK_I)
            i_ok = i < fan_in
            x = tl.load(x_ptr + row * stride_x + i, mask=i_ok, other=0.0).to(tl.float32)
            a = tl.load(a_rows + i[None, :], mask=k_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + row * width + k, acc, mask=k_ok)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [R, out], updated in place
    h_ptr,  # [R, width] fp32
    b_ptr,  # [slots * width, out]
    slots_ptr,  # [R] int64
    fan_out,
    width,
    stride_y,
    BLOCK_W: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        j = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        j_ok = j < fan_out
        k = tl.arange(0, BLOCK_W)
        k_ok = k < width
        h = tl.load(h_ptr + row * width + k, mask=k_ok, other=0.0)
        b = tl.load(
            b_ptr + (slot * width + k)[:, None] * fan_out + j[None, :], mask=k_ok[:, None] & j_ok[None, :], other=0.0
        )
        delta = tl.sum(h[:, None] * b.to(tl.float32), axis=0)
        y = tl.load(y_ptr + row * stride_y + j, mask=j_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + j, (y + delta).to(y_ptr.dtype.element_ty), mask=j_ok)


def lora_add_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, width: int
) -> torch.Tensor:
    """y += each row's LoRA delta, in place (module docstring); y and x with contiguous rows."""
    check_launchable("lora_add_", y, x, a, b, slots)
    rows, fan_in = x.shape
    fan_out = y.shape[1]
    if a.shape != (a.shape[0], fan_in) or b.shape != (a.shape[0], fan_out) or a.shape[0] % width:
        raise ValueError("lora_add_: a [S*W, in] and b [S*W, out] for x [R, in] and y [R, out]")
    if x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError("lora_add_: contiguous rows")
    if rows == 0:
        return y
    h = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    block_w = next_power_of_2(width)
    _lora_shrink_kernel[(rows,)](h, x, a, slots, fan_in, width, x.stride(0), BLOCK_W=block_w, BLOCK_I=BLOCK_IN)
    grid = (rows, triton.cdiv(fan_out, BLOCK_OUT))
    _lora_expand_kernel[grid](y, h, b, slots, fan_out, width, y.stride(0), BLOCK_W=block_w, BLOCK_O=BLOCK_OUT)
    return y
