"""Weight-quantized matmul on CUDA: y = x W^T (+ b), W a `pagemesh.kernels.quantized.QuantizedWeight`.

Each program computes a [BLOCK_M, BLOCK_N] tile of y. Per step along K it loads the weight
tile's codes (one byte per code for 8-bit formats; for 4-bit ones the byte holding the code
and which nibble, GGUF's order), widens them with the block's fp16 scale and offset
(W = d q + c) in registers, in x's dtype, and feeds tl.dot with fp32 accumulation. The
activations stay in x's dtype (no activation rounding, unlike the CPU kernel: a GPU's decode
step is bound by the bytes of W, which this reads once at 4 or 8 bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, upcast_bf16_dot
from pagemesh.kernels.quantized import BLOCK, QuantizedWeight


@triton.jit
def _quant_matmul_kernel(
    out_ptr,  # [M, N] out dtype
    x_ptr,  # [M, K] rows strided by stride_x
    codes_ptr,  # [N, K * BITS / 8] uint8
    scale_ptr,  # [N, K / 32] fp16
    offset_ptr,  # [N, K / 32] fp16
    bias_ptr,  # [N] fp32 (HAS_BIAS)
    M,
    N,
    K,
    stride_x,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands (fp32 x; bf16 under the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    kb = K // 32
    row_bytes = K * BITS // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        n64 = cols[None, :].to(tl.int64)
        if BITS == 8:
            q = tl.load(codes_ptr + n64 * row_bytes + ks[:, None], mask=w_mask, other=0)
        else:
            in_block = ks % 32
            byte = (ks // 32) * 16 + in_block % 16
            packed = tl.load(codes_ptr + n64 * row_bytes + byte[:, None], mask=w_mask, other=0)
            q = (packed >> ((in_block // 16) * 4)[:, None]) & 15
        blocks = (ks // 32)[:, None]
        d = tl.load(scale_ptr + n64 * kb + blocks, mask=w_mask, other=0.0).to(tl.float32)
        c = tl.load(offset_ptr + n64 * kb + blocks, mask=w_mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * d + c  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, contiguous rows) W^T (+ bias): [M, N] in out_dtype (default x's)."""
    check_launchable("quant_linear", x, qw.codes)
    n, k = qw.shape
    if x.dim() != 2 or x.shape[1] != k or k % BLOCK:
        raise ValueError(f"quant_linear: x must be [M, {k}]")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    bias32 = bias.float().contiguous() if bias is not None else out  # placeholder pointer when absent
    block_m = 16 if x.shape[0] <= 16 else 64
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, 64))
    _quant_matmul_kernel[grid](
        out,
        x,
        qw.codes,
        qw.scale,
        qw.offset,
        bias32,
        x.shape[0],
        n,
        k,
        x.stride(0),
        BITS=qw.bits,
        HAS_BIAS=bias is not None,
        UPCAST=x.dtype == torch.float32 or upcast_bf16_dot(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=64,
        num_warps=4,
    )
    return out
