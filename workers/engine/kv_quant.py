"""An fp8 KV cache (`--kv-cache-dtype fp8_e4m3|fp8_e5m2`): storage dtype, scales, quantize.

The pool keeps its layout (`kv[layer, page, 2, slot, kv_head, head_dim]`, docs/design.md §3) in one
byte per value. Each (layer, K|V, kv_head) has one fixed fp32 scale:

    stored = fp8(clamp(x / scale, ±fp8_max))        read = float(stored) * scale
    scales: [layers, 2, kv_heads] fp32, fixed for the pool's life

Why fixed per head per layer and not per page: fp8 is a float format, so a scale only places a
head's range inside fp8's exponent range (precision is relative, 3 or 2 mantissa bits, wherever
the values sit); one per head follows the spread between heads (in SmolLM2's first layer K's
range is ~15x V's, and its heads' differ by up to 1.8x), and a fixed scale lets a token be
written into a half-filled page without requantizing the page, lets pages be shared (prefix
cache, copy-on-write) and moved (swap, KV transfer) as bytes, and costs the kernels one load per
head. Per-page scales would need a page requantized whenever a later token exceeds its range.

The scales come from one calibration forward pass at start-up (`calibrate_kv_scales`) over a fixed
text (the tokenizer's) or fixed random token ids (a model without one): the amax of each head
maps to fp8_max / CALIBRATION_HEADROOM, so serving-time values up to that many times the
calibrated amax still fit; larger ones saturate. Two workers of one model calibrate to the same
scales; the KV transfer carries them anyway and the receiver converts if its own differ.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CALIBRATION_HEADROOM = 4.0
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for 2027. Revenue rose 4.2% to $18.6 million, "
    "while costs fell. def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Q: What is the capital of France? A: Paris. Les enfants jouent dans le parc; die Sonne scheint. "
    '1, 1, 2, 3, 5, 8, 13, 21, 34 ... {"name": "pagemesh", "pages": [16, 32, 64]}\n'
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter."
)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype: the model's for `auto`, else the fp8 format named."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [T, KVH, D]; scales: [KVH] fp32 -> fp8 [T, KVH, D] (saturating, round to nearest)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scales[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., KVH, D] fp8; scales: [KVH] -> `dtype` values (the fp8 value times its head's scale)."""
    return (x.float() * scales[:, None]).to(dtype)


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[layers, 2, KVH] amax -> scales mapping each amax to fp8_max / CALIBRATION_HEADROOM (a
    head that never saw a nonzero value keeps scale 1)."""
    target = torch.finfo(dtype).max / CALIBRATION_HEADROOM
    return torch.where(amax > 0, amax.float() / target, torch.ones_like(amax, dtype=torch.float32))


def calibration_token_ids(tokenizer, vocab_size: int, length: int = 256) -> list[int]:
    """Token ids of CALIBRATION_TEXT, or fixed random ids when there is no tokenizer."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT))
        if ids:
            return ids[:length]
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


class AmaxRecorder:
    """An attention backend for one calibration pass: records each layer's per-head |K| and |V|
    maxima (layers come in order: the n-th write is layer n) and attends with `inner` on a
    scratch pool of the model dtype."""

    builds_cpu_indices = True
    decode_gather = True

    def __init__(self, inner, num_layers: int, num_kv_heads: int):
        self.inner = inner
        self.builds_cpu_indices = inner.builds_cpu_indices
        self.decode_gather = inner.decode_gather
        self.amax = torch.zeros(num_layers, 2, num_kv_heads, dtype=torch.float32)
        self.layer = 0

    def write_kv(self, k, v, kv_layer, md):
        self.amax[self.layer, 0] = k.abs().amax(dim=(0, 2)).float().cpu()
        self.amax[self.layer, 1] = v.abs().amax(dim=(0, 2)).float().cpu()
        self.layer += 1
        self.inner.write_kv(k, v, kv_layer, md)

    def attend(self, q, kv_layer, md, scale, k=None, v=None, *, window=None, softcap=None):
        return self.inner.attend(q, kv_layer, md, scale, k, v, window=window, softcap=softcap)


def convert_pages(
    pages: torch.Tensor,
    from_scales: torch.Tensor | None,
    to_dtype: torch.dtype,
    to_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Pages [n, 2, S, KVH, D] of one layer, as another pool stores them: dequantized with
    `from_scales` [2, KVH] if fp8, then quantized with `to_scales` if `to_dtype` is fp8. The
    same dtype and scales come back as they are (no copy)."""
    same_scales = (from_scales is None) == (to_scales is None) and (
        from_scales is None or torch.equal(from_scales.cpu(), to_scales.cpu())
    )
    if pages.dtype == to_dtype and same_scales:
        return pages
    x = pages.float()
    if from_scales is not None:
        x = x * from_scales.cpu()[None, :, None, :, None]
    if to_scales is None:
        return x.to(to_dtype)
    limit = torch.finfo(to_dtype).max
    return (x / to_scales.cpu()[None, :, None, :, None]).clamp_(-limit, limit).to(to_dtype)
