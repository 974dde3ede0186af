"""Write this step's K and V into their pool slots (in place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, next_power_of_2


@triton.jit
def _write_kv_kernel(
    kv_ptr,  # [num_pages, 2, PAGE_SIZE, KVH, D]
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    slot_mapping_ptr,  # [T] int64: page * PAGE_SIZE + slot, negative = skip
    kv_scales_ptr,  # [2, KVH] fp32 (FP8 only): K's, then V's scale of each kv head
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr = False,  # quantize: x / scale, saturated at +-FP8_MAX, to the pool's fp8
    FP8_MAX: tl.constexpr = 448.0,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token of a captured batch
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    dst = (
        (slot // PAGE_SIZE) * stride_kv_page
        + (slot % PAGE_SIZE) * stride_kv_slot
        + offs_h[:, None] * stride_kv_head
        + offs_d[None, :]
    )  # [HEADS_PAD, D]
    k = tl.load(k_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    if FP8:
        head_ok = offs_h < NUM_KV_HEADS
        k_scale = tl.load(kv_scales_ptr + offs_h, mask=head_ok, other=1.0)
        v_scale = tl.load(kv_scales_ptr + NUM_KV_HEADS + offs_h, mask=head_ok, other=1.0)
        k = tl.clamp(k.to(tl.float32) / k_scale[:, None], -FP8_MAX, FP8_MAX).to(kv_ptr.dtype.element_ty)
        v = tl.clamp(v.to(tl.float32) / v_scale[:, None], -FP8_MAX, FP8_MAX).to(kv_ptr.dtype.element_ty)
    tl.store(kv_ptr + dst, k, mask=mask)
    tl.store(kv_ptr + stride_kv_kind + dst, v, mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [num_pages, 2, page_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64
    kv_scales: torch.Tensor | None = None,  # [2, KVH] fp32, an fp8 kv_layer's
) -> None:
    """kv_layer[slot // page_size, 0|1, slot % page_size] = k|v for each token, in place.
    Tokens whose slot is negative are skipped. An fp8 kv_layer stores k / its head's scale,
    saturated (workers/engine/kv_quant.py)."""
    check_launchable("write_kv", k, v, kv_layer)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or kv_layer.shape[3:] != k.shape[1:] or kv_layer.shape[1] != 2:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not match kv_layer {tuple(kv_layer.shape)}")
    fp8 = kv_layer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8 and (kv_scales is None or kv_scales.dtype != torch.float32 or kv_scales.shape != (2, num_kv_heads)):
        raise ValueError(f"an fp8 kv_layer needs kv_scales fp32 [2, {num_kv_heads}]")
    if v.dtype != k.dtype or (not fp8 and k.dtype != kv_layer.dtype):
        raise ValueError(f"k/v are {k.dtype}/{v.dtype} but kv_layer is {kv_layer.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("k, v and kv_layer need a contiguous last dimension")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        kv_layer,
        k,
        v,
        slot_mapping,
        kv_scales.contiguous() if fp8 else slot_mapping,  # any pointer when unused
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        PAGE_SIZE=kv_layer.shape[2],
        FP8=fp8,
        FP8_MAX=torch.finfo(kv_layer.dtype).max if fp8 else 448.0,
        num_warps=4,
    )
