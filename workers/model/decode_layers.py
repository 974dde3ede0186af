"""A decode step's decoder layers in one C call, for a CPU model whose linears are quantized.

At one decode row a small model's layer is ~80 µs of kernels and, before this, about as much
Python around them (module calls, ten tensor allocations, ten ctypes calls). `DecodeLayers`
runs every layer of a step whose sequences all decode one token through
`kernels/cpu/decode_layers.c`, which calls the same C kernels with the same arguments in the
same order as the Python layers do (`LlamaDecoderLayer.forward` with `CpuKernelOps`,
`CpuKernelAttentionBackend` and `pagemesh.kernels.cpu.quant.quant_gemm` or `quant_linear`), so its outputs are theirs,
bit for bit (tests/unit/test_decode_layers.py).

    layers = DecodeLayers.for_model(model, kv_cache, ops, attention)   None where it does not apply
    if layers is not None and layers.can_run(md, x): out, residual = layers.run(x, md)

It applies (unless PAGEMESH_DECODE_LAYERS=0, for A/B runs) on a CPU with the C kernels loaded,
one tensor- and pipeline-parallel rank holding the whole model, a KV pool in the model dtype
(not fp8), and every decoder linear quantized. A step qualifies when every sequence decodes
(query length 1) and the rows stay below `layers.DEQUANTIZE_MIN_ROWS` (from there a bf16 linear
widens W, which the C call does not do).
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagemesh.kernels.quantized import QuantizedWeight, is_quantized
from pagemesh.workers.engine.attention import AttentionMetadata

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("norm", "rotary", "write_kv", "attention", "silu_and_mul", "matmul", "gemm_tiles")),
        ("tiled_min_rows", _I64),
    ]


class _Weight(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("codes", "scale", "offset", "bias", "tiles", "tile_scales")),
        ("n", _I64),
        ("k", _I64),
        ("bits", _I32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_attn_norm", _P),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("kv_layer", _P),
    ]


class _Model(ctypes.Structure):
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
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("normed", "qkv", "attn", "o", "gate_up", "act")]


_SIGNATURES = {"pm_decode_layers": [_P, _P, _P, _I32, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _P]}
_library = None


def _load():
    """The decode_layers.c library (built once, like the other CPU kernels), or None."""
    global _library
    from pagemesh.kernels.cpu import build

    if _library is None:
        _library = build.Library(build.SOURCE.with_name("decode_layers.c"), _SIGNATURES)
    return _library.load()


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeLayers:
    """Every decoder layer of one model, for decode-only steps, in one C call (module docstring).
    Holds the addresses of the model's weights and KV pool: build it after they are in place
    (`ModelRunner` does, once) and keep the model and the pool alive as long as it lives."""

    def __init__(self, model, kv_cache: torch.Tensor, lib, kernels: _Kernels):
        cfg = model.config
        self.lib, self.kernels = lib, kernels
        self.dtype = model.dtype
        self.hidden, self.intermediate = cfg.hidden_size, cfg.intermediate_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.model = _Model(
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=kv_cache.shape[3],
            dt=1 if self.dtype == torch.bfloat16 else 0,
            eps=model.layers[0].input_layernorm.eps,
            scale=model.layers[0].self_attn.scale,
            cos_sin_cache=model.rotary.cos_sin_cache.data_ptr(),
        )
        self._keep: list[torch.Tensor] = [model.rotary.cos_sin_cache]  # tensors the C side points into
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers[i] = _Layer(
                input_norm=layer.input_layernorm.weight.data_ptr(),
                post_attn_norm=layer.post_attention_layernorm.weight.data_ptr(),
                qkv=self._weight(attn.qkv_proj.packed, attn.qkv_proj.bias),
                o=self._weight(attn.o_proj.packed, None),
                gate_up=self._weight(mlp.gate_up_proj.packed, None),
                down=self._weight(mlp.down_proj.packed, None),
                kv_layer=kv_cache[i].data_ptr(),
            )
        self.num_layers = len(model.layers)

    def _weight(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> _Weight:
        if bias is not None:
            bias = bias.float().contiguous()  # what quant_linear hands the kernel
            self._keep.append(bias)
        n, k = qw.shape
        return _Weight(
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

    @classmethod
    def for_model(cls, model, kv_cache: torch.Tensor, ops, attention) -> DecodeLayers | None:
        """The fused layers of `model`, or None where they do not apply (module docstring)."""
        from pagemesh.workers.engine.backend import CpuKernelAttentionBackend
        from pagemesh.workers.model.ops import CpuKernelOps

        if os.environ.get("PAGEMESH_DECODE_LAYERS", "1") == "0":
            return None
        if not isinstance(ops, CpuKernelOps) or type(attention) is not CpuKernelAttentionBackend:
            return None
        dtype = model.dtype
        if kv_cache.device.type != "cpu" or kv_cache.dtype != dtype or dtype not in (torch.bfloat16, torch.float32):
            return None
        if model.tp.world_size != 1 or not (model.is_first and model.is_last):
            return None
        linears = [
            p
            for layer in model.layers
            for p in (
                layer.self_attn.qkv_proj.packed,
                layer.self_attn.o_proj.packed,
                layer.mlp.gate_up_proj.packed,
                layer.mlp.down_proj.packed,
            )
        ]
        if not all(is_quantized(p) for p in linears):
            return None
        import pagemesh.kernels.cpu
        import pagemesh.kernels.cpu.quant
        from pagemesh.workers.model.layers import TILED_MIN_ROWS

        lib = _load()
        if lib is None or not pagemesh.kernels.cpu.available() or not pagemesh.kernels.cpu.quant.available():
            return None
        base, quant = pagemesh.kernels.cpu._library.load(), pagemesh.kernels.cpu.quant._library.load()
        fns = _Kernels(
            norm=_address(base.pm_add_rms_norm),
            rotary=_address(base.pm_rotary),
            write_kv=_address(base.pm_write_kv),
            attention=_address(base.pm_paged_attention),
            silu_and_mul=_address(base.pm_silu_and_mul),
            matmul=_address(quant.pm_quant_matmul),
            gemm_tiles=_address(quant.pm_quant_gemm_tiles),
            tiled_min_rows=TILED_MIN_ROWS,
        )
        return cls(model, kv_cache, lib, fns)

    def can_run(self, md: AttentionMetadata, x: torch.Tensor) -> bool:
        from pagemesh.workers.model.layers import DEQUANTIZE_MIN_ROWS

        rows = x.shape[0]
        small = rows < DEQUANTIZE_MIN_ROWS or self.dtype != torch.bfloat16
        return small and md.num_decodes == rows and md.max_query_len == 1 and x.dtype == self.dtype

    def run(self, x: torch.Tensor, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embedding [T, hidden] (becomes the residual stream, updated in place). Returns
        (the last layer's output, the residual), as the Python layers' loop would."""
        rows = x.shape[0]
        residual = x.contiguous()
        out = torch.empty_like(residual)
        scratch = [
            torch.empty(rows, size, dtype=self.dtype)
            for size in (
                self.hidden,
                self.q_size + 2 * self.kv_size,
                self.q_size,
                self.hidden,
                2 * self.intermediate,
                self.intermediate,
            )
        ]
        buffers = _Scratch(*(t.data_ptr() for t in scratch))
        positions, slots = md.positions.contiguous(), md.slot_mapping.contiguous()
        tables, lens, starts = md.block_tables, md.seq_lens, md.query_start_loc
        self.lib.pm_decode_layers(
            ctypes.addressof(self.kernels),
            ctypes.addressof(self.model),
            ctypes.addressof(self.layers),
            self.num_layers,
            ctypes.addressof(buffers),
            residual.data_ptr(),
            out.data_ptr(),
            rows,
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            starts.data_ptr(),
        )
        return out, residual
