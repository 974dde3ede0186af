"""Rotary position embedding, NeoX / Hugging Face rotate_half layout, out of place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, next_power_of_2


@triton.jit
def _rotate_heads(
    out_ptr,
    x_ptr,  # one token's [heads, D] rows (output / input)
    stride_out_head,
    stride_x_head,
    cos,
    sin,  # cos, sin: [HALF] fp32
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_j = tl.arange(0, HALF)[None, :]
    mask = offs_h < NUM_HEADS
    x_lo_ptrs = x_ptr + offs_h * stride_x_head + offs_j
    x1 = tl.load(x_lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    out_lo_ptrs = out_ptr + offs_h * stride_out_head + offs_j
    dtype = out_ptr.dtype.element_ty
    tl.store(out_lo_ptrs, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(out_lo_ptrs + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,  # [T, H, D]
    k_out_ptr,  # [T, KVH, D]
    q_ptr,  # [T, H, D] (any token/head strides)
    k_ptr,  # [T, KVH, D]
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cache_pos,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_j = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cache_pos + offs_j).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache_pos + HALF + offs_j).to(tl.float32)
    _rotate_heads(
        q_out_ptr + tok * stride_qo_tok,
        q_ptr + tok * stride_q_tok,
        stride_qo_head,
        stride_q_head,
        cos,
        sin,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
    )
    _rotate_heads(
        k_out_ptr + tok * stride_ko_tok,
        k_ptr + tok * stride_k_tok,
        stride_ko_head,
        stride_k_head,
        cos,
        sin,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their token's position; returns new contiguous (q_out, k_out) and leaves
    the inputs untouched (they may be strided views of a fused QKV output). fp32 math."""
    check_launchable("rotary_embedding", q, k, cos_sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[::2] != q.shape[::2] or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, cache {tuple(cos_sin_cache.shape)} do not fit together"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dimension")
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"head_dim {head_dim}: head_dim / 2 must be a power of two")
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        q_out,
        k_out,
        q,
        k,
        positions,
        cos_sin_cache,
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        HEADS_PAD=next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HALF=half,
        num_warps=4,
    )
    return q_out, k_out
