"""A decode step's decoder layers in one C call, for a CPU model whose linears are quantized.

At one decode row a small model's layer is ~80 µs of kernels and, before this, about as much
Python around them (module calls, ten tensor allocations, ten ctypes calls). `DecodeLayers`
runs every layer of a step whose sequences all decode one token through
`kernels/cpu/decode_layers.c` (bound in `pagemesh.kernels.cpu.decode_layers`), which calls the
same C kernels with the same arguments in the same order as the Python layers do
(`LlamaDecoderLayer.forward` with `CpuKernelOps`, `CpuKernelAttentionBackend` and
`pagemesh.kernels.cpu.quant.quant_gemm` or `quant_linear`), so its outputs are theirs, bit for
bit (tests/unit/test_decode_layers.py).

    layers = DecodeLayers.for_model(model, kv_cache, ops, attention)   None where it does not apply
    if layers is not None and layers.can_run(md, x): out, residual = layers.run(x, md)

It applies (unless PAGEMESH_DECODE_LAYERS=0, for A/B runs) on a CPU with the C kernels loaded,
one tensor- and pipeline-parallel rank holding the whole model, a KV pool in the model dtype or
fp8 (its attention on the C kernels: the layers write and read it with its per-layer scales), and
every decoder linear quantized. A step qualifies when every sequence decodes
(query length 1) and the rows stay below `layers.DEQUANTIZE_MIN_ROWS` (from there a bf16 linear
widens W, which the C call does not do).
"""

from __future__ import annotations

import os

import torch

from pagemesh.kernels.cpu import FP8_DTYPES
from pagemesh.kernels.cpu import decode_layers as binding
from pagemesh.kernels.quantized import QuantizedWeight, is_quantized
from pagemesh.workers.attention.metadata import AttentionMetadata


class DecodeLayers:
    """Every decoder layer of one model, for decode-only steps, in one C call (module docstring).
    Holds the addresses of the model's weights and KV pool: build it after they are in place
    (`ModelRunner` does, once) and keep the model and the pool alive as long as it lives."""

    def __init__(self, model, kv_cache: torch.Tensor, kernels: binding.Kernels, kv_scales: torch.Tensor | None = None):
        """`kv_scales`: an fp8 pool's [layers, 2, kv_heads] fp32 scales (None: the model dtype's pool)."""
        cfg = model.config
        self.kernels = kernels
        self.dtype = model.dtype
        self.hidden, self.intermediate = cfg.hidden_size, cfg.intermediate_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.model = binding.Model(
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
            kv_fmt=FP8_DTYPES.get(kv_cache.dtype, 0),
        )
        self._keep: list[torch.Tensor] = [model.rotary.cos_sin_cache]  # tensors the C side points into
        if kv_scales is not None:
            kv_scales = kv_scales.contiguous()
            self._keep.append(kv_scales)
        self.layers = (binding.Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers[i] = binding.Layer(
                input_norm=layer.input_layernorm.weight.data_ptr(),
                post_attn_norm=layer.post_attention_layernorm.weight.data_ptr(),
                qkv=self._weight(attn.qkv_proj.packed, attn.qkv_proj.bias),
                o=self._weight(attn.o_proj.packed, None),
                gate_up=self._weight(mlp.gate_up_proj.packed, None),
                down=self._weight(mlp.down_proj.packed, None),
                kv_layer=kv_cache[i].data_ptr(),
                window=getattr(attn, "window", None) or 0,  # the layer's sliding window, if any
                softcap=getattr(attn, "softcap", None) or 0.0,
                kv_scales=None if kv_scales is None else kv_scales[i].data_ptr(),
            )
        self.num_layers = len(model.layers)
        self.any_rows = False  # True in the batch-invariant mode (for_model)

    def _weight(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> binding.Weight:
        if bias is not None:
            bias = bias.float().contiguous()  # what quant_linear hands the kernel
            self._keep.append(bias)
        return binding.weight(qw, bias)

    @classmethod
    def for_model(
        cls, model, kv_cache: torch.Tensor, ops, attention, batch_invariant: bool = False
    ) -> DecodeLayers | None:
        """The fused layers of `model`, or None where they do not apply (module docstring).
        `attention` qualifies where it says its K/V writes and decodes are the C kernels' own
        (`cpu_decode_kernels`: the engine's `CpuKernelAttentionBackend`), so that this C call may
        run them in its place."""
        from pagemesh.workers.model.ops import CpuKernelOps

        if os.environ.get("PAGEMESH_DECODE_LAYERS", "1") == "0":
            return None
        if not isinstance(ops, CpuKernelOps) or not getattr(attention, "cpu_decode_kernels", False):
            return None
        dtype = model.dtype
        kv_scales = getattr(attention, "kv_scales", None)  # an fp8 pool's (Fp8KVAttention on the C kernels)
        pool_dtype_ok = kv_cache.dtype == dtype or (kv_cache.dtype in FP8_DTYPES and kv_scales is not None)
        if kv_cache.device.type != "cpu" or not pool_dtype_ok or dtype not in (torch.bfloat16, torch.float32):
            return None
        if model.tp.world_size != 1 or not (model.is_first and model.is_last):
            return None
        if not model.fits_fused_decode:  # a family whose layers the C code does not compute (CausalLM)
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
        from pagemesh.workers.model.layers import TILED_MIN_ROWS

        # a weight kept in its tiles only (quantization.without_row_codes) has no row-major codes
        # for the plain kernel to read: the tiled GEMM takes every row count then
        tiles_only = any(p.tiles is not None and not p.has_row_codes for p in linears)
        kernels = binding.kernel_table(0 if tiles_only else TILED_MIN_ROWS)
        if kernels is None:
            return None
        layers = cls(model, kv_cache, kernels, kv_scales if kv_cache.dtype in FP8_DTYPES else None)
        layers.any_rows = batch_invariant  # the Python layers never widen W then: no row limit
        return layers

    def can_run(self, md: AttentionMetadata, x: torch.Tensor) -> bool:
        from pagemesh.workers.model.layers import DEQUANTIZE_MIN_ROWS

        rows = x.shape[0]
        small = rows < DEQUANTIZE_MIN_ROWS or self.dtype != torch.bfloat16 or self.any_rows
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
        binding.decode_layers(
            self.kernels,
            self.model,
            self.layers,
            scratch,
            residual,
            out,
            md.positions.contiguous(),
            md.slot_mapping.contiguous(),
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
        )
        return out, residual
