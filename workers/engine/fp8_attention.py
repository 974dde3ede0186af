"""The attention backend of an fp8 KV pool: writes quantize, reads dequantize (kv_quant.py).

It has the `AttentionBackend` interface of workers/engine/backend.py, so the model does not know
the pool is fp8. The model hands it `kv_cache[layer]`; the backend finds that layer's scales from
where the view starts in the pool it was built with (a view of layer i starts i layer-strides
past the pool's first byte), so no per-layer argument has to be threaded through the model.

    kernels="torch"  gather pages, dequantize, torch SDPA (any CPU)
    kernels="cpu"    the C kernels of `pagemesh.kernels.cpu` write and attend the decodes in place;
                     prefill chunks gather and dequantize as in the torch path
    kernels="triton" the Triton kernels (GPU) with their fp8 flag
"""

from __future__ import annotations

import torch

from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.attention import paged_attention_torch, prefill_attention_torch, write_kv_fp8_torch

FP8_KERNELS = ("torch", "cpu", "triton")


class Fp8KVAttention:
    """Attention over the fp8 pool `kv_cache` [layers, pages, 2, S, KVH, D] with `kv_scales`
    [layers, 2, KVH] fp32 (on the pool's device)."""

    def __init__(
        self, kv_cache: torch.Tensor, kv_scales: torch.Tensor, kernels: str = "torch", batch_invariant: bool = False
    ):
        if kernels not in FP8_KERNELS:
            raise ValueError(f"fp8 attention kernels: one of {FP8_KERNELS}")
        self.kv_scales = kv_scales
        self.kernels = kernels
        if batch_invariant and kernels != "cpu":
            raise ValueError("batch_invariant: an fp8 pool needs the C kernels")
        self.batch_invariant = batch_invariant  # prefill rows through the decode kernel too (backend.py)
        self.base = kv_cache.data_ptr()
        self.layer_bytes = kv_cache.stride(0) * kv_cache.element_size()
        self.builds_cpu_indices = kernels != "triton"
        self.decode_gather = kernels == "torch"
        # writes and decodes are pagemesh.kernels.cpu's fp8 kernels, nothing around them: the
        # model's DecodeLayers may call them in its one C call (with `kv_scales`)
        self.cpu_decode_kernels = kernels == "cpu"
        if kernels == "cpu":
            import pagemesh.kernels.cpu as cpu_kernels

            self.lib = cpu_kernels
        elif kernels == "triton":
            import pagemesh.kernels as triton_kernels

            self.lib = triton_kernels

    def layer_scales(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """[2, KVH] scales of the layer `kv_layer` is a view of."""
        return self.kv_scales[(kv_layer.data_ptr() - self.base) // self.layer_bytes]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata) -> None:
        scales = self.layer_scales(kv_layer)
        if self.kernels == "torch":
            write_kv_fp8_torch(k, v, kv_layer, md, scales)
        else:
            self.lib.write_kv(k, v, kv_layer, md.slot_mapping, kv_scales=scales)

    def attend(self, q, kv_layer, md, scale, k=None, v=None, *, window=None, softcap=None):
        scales = self.layer_scales(kv_layer)
        variant = {"window": window, "softcap": softcap}
        if self.kernels == "torch":
            return paged_attention_torch(q, kv_layer, md, scale, k, v, kv_scales=scales, **variant)
        if self.kernels == "triton":
            return self.lib.paged_attention(
                q,
                kv_layer,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                scale,
                md.max_query_len,
                md.max_seq_len,
                kv_scales=scales,
                **variant,
            )
        if self.batch_invariant:  # every row through the C kernel (the prefill chunks too)
            return self.lib.paged_attention(
                q, kv_layer, md.block_tables, md.seq_lens, md.query_start_loc, scale, kv_scales=scales, **variant
            )
        nd = md.num_decodes
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.lib.paged_attention(
                q[:nd],
                kv_layer,
                md.block_tables[:nd],
                md.seq_lens[:nd],
                md.query_start_loc[: nd + 1],
                scale,
                kv_scales=scales,
                **variant,
            )
        if nd < q.shape[0]:
            prefill_attention_torch(q, kv_layer, md, scale, out, k, v, kv_scales=scales, **variant)
        return out


def fp8_kernels_for(backend) -> str:
    """Which kernels read an fp8 pool beside `backend` (a `pagemesh.workers.engine.backend.Backend`): the
    Triton ones on CUDA, the C ones where the CPU backend uses them and they have fp8 functions,
    else torch."""
    if backend.device.type == "cuda":
        return "triton"
    if not backend.attention.decode_gather:  # the C kernels run this engine's attention
        import pagemesh.kernels.cpu

        if hasattr(pagemesh.kernels.cpu, "FP8_DTYPES"):
            return "cpu"
    return "torch"
