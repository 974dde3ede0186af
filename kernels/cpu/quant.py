"""The weight-quantized matmul in C (`quant_matmul.c`), for the CPU path:

    quant_linear(x, qw, bias, out_dtype) -> x W^T (+ bias)   W a `pagemesh.kernels.quantized.QuantizedWeight`
    dequantize_bf16(qw, start, stop) -> W[start:stop] in bf16 (the prefill path's weight tiles)
    quant_gemm(x, qw, bias, out_dtype) -> quant_linear's product through qw.tiles (decode batches)

x is fp32 or bf16 [M, K] (rows may be strided); x is rounded per row and block of 32 to int8
inside (see quant_matmul.c), the sums are fp32, the result is rounded to `out_dtype` (default x's).
A library of its own next to the `pagemesh_cpu` one (same build, same cache), loaded on first use;
`available()` says whether it loaded.
"""

from __future__ import annotations

import ctypes

import torch

from pagemesh.kernels.cpu import build
from pagemesh.kernels.quantized import QuantizedWeight, row_codes

SOURCE = build.KERNEL_DIR / "quant_matmul.c"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "pm_quant_matmul": [_P, _I64, _I32, _P, _P, _P, _I32, _P, _P, _I32, _I64, _I64, _I64],
    "pm_quant_dequantize_bf16": [_P, _P, _P, _I32, _P, _I64, _I64, _I64],
    "pm_quant_gemm_tiles": [_P, _I64, _I32, _P, _P, _I32, _P, _P, _I32, _I64, _I64, _I64],
}
_library = build.Library(SOURCE, _SIGNATURES)


def available() -> bool:
    """Build and load the library once; False (with `load_error()`) where that fails or
    PAGEMESH_CPU_KERNELS=0."""
    return _library.load() is not None


def load_error() -> str | None:
    return _library.error


def _matmul_args(name: str, x: torch.Tensor, n: int, k: int, bias, out_dtype):
    """The checks and buffers both matmuls share: (x with unit column stride, fp32 bias or None,
    the output [M, n], the loaded library); ValueError naming `name` on bad input."""
    out_dtype = out_dtype or x.dtype
    if x.dtype not in _DTYPES or out_dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"{name}: x and the output are CPU float32 or bfloat16")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be [M, {k}]")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"{name}: bias must be [{n}]")
        bias = bias.float().contiguous()
    lib = _library.load()
    if lib is None:
        raise RuntimeError(f"{name}: {load_error()}")
    return x, bias, torch.empty(x.shape[0], n, dtype=out_dtype), lib


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    n, k = qw.shape
    if not qw.has_row_codes:
        raise ValueError("quant_linear: the weight keeps its codes in tiles only (quant_gemm reads them)")
    for t in (qw.codes, qw.scale, qw.offset):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("quant_linear: the weight's tensors must be contiguous CPU tensors")
    x, bias, out, lib = _matmul_args("quant_linear", x, n, k, bias, out_dtype)
    if x.shape[0] == 0:
        return out
    lib.pm_quant_matmul(
        x.data_ptr(),
        x.stride(0),
        _DTYPES[x.dtype],
        qw.codes.data_ptr(),
        qw.scale.data_ptr(),
        qw.offset.data_ptr(),
        qw.bits,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        _DTYPES[out.dtype],
        x.shape[0],
        n,
        k,
    )
    return out


def dequantize_bf16(qw: QuantizedWeight, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows start:stop of W in bf16, [stop - start, K]: `pagemesh.kernels.quantized.dequantize` rounded to
    bf16, bit for bit (see pm_quant_dequantize_bf16)."""
    n, k = qw.shape
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"dequantize_bf16: rows {start}:{stop} of {n}")
    if not qw.has_row_codes:  # kept in tiles only: these rows' codes rebuilt from them
        part = slice(start, stop)
        qw = QuantizedWeight(qw.format, row_codes(qw, part), qw.scale[part], qw.offset[part])
        start, stop = 0, stop - start
    for t in (qw.codes, qw.scale, qw.offset):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("dequantize_bf16: the weight's tensors must be contiguous CPU tensors")
    lib = _library.load()
    if lib is None:
        raise RuntimeError(f"dequantize_bf16: {load_error()}")
    out = torch.empty(stop - start, k, dtype=torch.bfloat16)
    lib.pm_quant_dequantize_bf16(
        qw.codes.data_ptr(), qw.scale.data_ptr(), qw.offset.data_ptr(), qw.bits, out.data_ptr(), start, stop, k
    )
    return out


def quant_gemm(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`quant_linear`'s product (the same int8 activation blocks, fp32 sums in another order)
    through the weight's tiled copy (`pagemesh.kernels.quantized.with_tiles`), which decodes each weight
    block once for up to 8 activation rows: the kernel for decode batches (pm_quant_gemm_tiles)."""
    n, k = qw.shape
    if qw.tiles is None:
        raise ValueError("quant_gemm: the weight has no tiles (kernels.quantized.with_tiles)")
    x, bias, out, lib = _matmul_args("quant_gemm", x, n, k, bias, out_dtype)
    if x.shape[0] == 0:
        return out
    lib.pm_quant_gemm_tiles(
        x.data_ptr(),
        x.stride(0),
        _DTYPES[x.dtype],
        qw.tiles.codes.data_ptr(),
        qw.tiles.scales.data_ptr(),
        qw.bits,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        _DTYPES[out.dtype],
        x.shape[0],
        n,
        k,
    )
    return out
