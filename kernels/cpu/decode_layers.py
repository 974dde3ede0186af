"""The ctypes binding of `decode_layers.c`: a decode step's decoder layers in one C call.

The C side calls the kernels of the two other libraries (`pagemesh.kernels.cpu`'s norm, rotary,
KV write, paged attention and SiLU-and-mul; `pagemesh.kernels.cpu.quant`'s quantized matmuls)
through a table of their addresses. This module holds the C structs, the library and the call;
what a model fills them with, and when a step may take this path, is
`pagemesh.workers.model.decode_layers.DecodeLayers`'s.

    kernel_table(tiled_min_rows) -> Kernels | None   the kernels' addresses (None: a library did not load)
    Model, Layer, Weight: the model's constants, one layer's weights and KV layer, one quantized W
    weight(qw, bias) -> Weight                        bias: fp32 and contiguous, or None
    decode_layers(kernels, model, layers, scratch, residual, out, positions, slot_mapping,
                  block_tables, seq_lens, query_start_loc) -> None     (residual and out in place)

The structs hold raw addresses: whoever fills them keeps the tensors alive while they are used.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from pagemesh.kernels.cpu import build
from pagemesh.kernels.quantized import QuantizedWeight

SOURCE = build.KERNEL_DIR / "decode_layers.c"
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class Kernels(ctypes.Structure):
    """pm_decode_kernels: the addresses of the kernels the layers call."""

    _fields_ = [
        *((name, _P) for name in ("norm", "rotary", "write_kv", "attention", "silu_and_mul", "matmul", "gemm_tiles")),
        ("tiled_min_rows", _I64),
        ("write_kv_fp8", _P),
        ("attention_fp8", _P),
    ]


class Weight(ctypes.Structure):
    """pm_quant_weight: one quantized W [n, k] (kernels/quantized.py's layout) and its bias."""

    _fields_ = [
        *((name, _P) for name in ("codes", "scale", "offset", "bias", "tiles", "tile_scales")),
        ("n", _I64),
        ("k", _I64),
        ("bits", _I32),
    ]


class Layer(ctypes.Structure):
    """pm_decode_layer: one decoder layer's norms, linears and KV layer, its sliding window and
    soft-cap (0: none)."""

    _fields_ = [
        ("input_norm", _P),
        ("post_attn_norm", _P),
        ("qkv", Weight),
        ("o", Weight),
        ("gate_up", Weight),
        ("down", Weight),
        ("kv_layer", _P),
        ("window", _I32),
        ("softcap", _F),
        ("kv_scales", _P),  # an fp8 layer's [2, kv_heads] fp32 scales, or None
    ]


class Model(ctypes.Structure):
    """pm_decode_model: the model's shapes and constants (dt: 0 fp32, 1 bf16)."""

    _fields_ = [
        ("hidden", _I64),
        ("intermediate", _I64),
        ("num_heads", _I32),
        ("num_kv_heads", _I32),
        ("head_dim", _I32),
        ("page_size", _I32),
        ("dt", _I32),
        ("eps", _F),
        ("scale", _F),
        ("cos_sin_cache", _P),
        ("kv_fmt", _I32),  # an fp8 pool's format (pagemesh.kernels.cpu.FP8_DTYPES), where layers have scales
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("normed", "qkv", "attn", "o", "gate_up", "act")]


_SIGNATURES = {"pm_decode_layers": [_P, _P, _P, _I32, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P]}
_library = build.Library(SOURCE, _SIGNATURES)


def load_error() -> str | None:
    return _library.error


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def kernel_table(tiled_min_rows: int) -> Kernels | None:
    """The kernels' addresses, with `tiled_min_rows` (from that many rows a weight with tiles
    goes through pm_quant_gemm_tiles, as `workers.model.layers.quantized_linear` picks); None
    where this library, `pagemesh.kernels.cpu`'s or `pagemesh.kernels.cpu.quant`'s did not load.
    Builds and loads all three on first call."""
    from pagemesh.kernels import cpu
    from pagemesh.kernels.cpu import quant

    if _library.load() is None or not cpu.available() or not quant.available():
        return None
    base, matmuls = cpu._library.load(), quant._library.load()
    return Kernels(
        norm=_address(base.pm_add_rms_norm),
        rotary=_address(base.pm_rotary),
        write_kv=_address(base.pm_write_kv),
        attention=_address(base.pm_paged_attention),
        silu_and_mul=_address(base.pm_silu_and_mul),
        matmul=_address(matmuls.pm_quant_matmul),
        gemm_tiles=_address(matmuls.pm_quant_gemm_tiles),
        tiled_min_rows=tiled_min_rows,
        write_kv_fp8=_address(base.pm_write_kv_fp8),
        attention_fp8=_address(base.pm_paged_attention_fp8),
    )


def weight(qw: QuantizedWeight, bias: torch.Tensor | None) -> Weight:
    """The struct of `qw` (its tiles too, where it has them); `bias` fp32 and contiguous, or None."""
    n, k = qw.shape
    return Weight(
        codes=qw.codes.data_ptr(),
        scale=qw.scale.data_ptr(),
        offset=qw.offset.data_ptr(),
        bias=None if bias is None else bias.data_ptr(),
        tiles=None if qw.tiles is None else qw.tiles.codes.data_ptr(),
        tile_scales=None if qw.tiles is None else qw.tiles.scales.data_ptr(),
        n=n,
        k=k,
        bits=qw.bits,
    )


def decode_layers(
    kernels: Kernels,
    model: Model,
    layers: ctypes.Array,
    scratch: Sequence[torch.Tensor],
    residual: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Every layer of `layers` (an array of `Layer`) over the T rows of `residual` (contiguous
    [T, hidden], the embedding; left as the residual stream), the last layer's output into `out`.
    scratch: contiguous [T, size] activations in the model dtype, of sizes hidden, q + 2 kv,
    q, hidden, 2 intermediate, intermediate (decode_layers.c's pm_decode_scratch). positions and
    slot_mapping: contiguous int64 [T]; block_tables, seq_lens, query_start_loc: as
    `pagemesh.kernels.cpu.paged_attention` takes them, one query row per sequence. Trusts its
    arguments: the caller checks them."""
    buffers = _Scratch(*(t.data_ptr() for t in scratch))
    _library.load().pm_decode_layers(
        ctypes.addressof(kernels),
        ctypes.addressof(model),
        ctypes.addressof(layers),
        len(layers),
        ctypes.addressof(buffers),
        residual.data_ptr(),
        out.data_ptr(),
        residual.shape[0],
        positions.data_ptr(),
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
    )
