"""Plain torch references for every kernel in this package.

Each `<name>_ref` has the signature of the Triton `<name>` and favours being obviously right over
being fast: the kernel tests compare against these, and the CPU model path can call them. Math is
done in fp32 and rounded once to the input dtype at the end. No triton import here.

KV pool layout (one layer), see docs/design.md §3:

    kv_layer[page, kind, slot, kv_head, dim]     kind 0 = K, 1 = V; page 0 is the null page
    a token at `slot_mapping = page * page_size + slot` lives at kv_layer[page, :, slot]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    kv_layer: torch.Tensor,  # [num_pages, 2, page_size, KVH, D]
    block_tables: torch.Tensor,  # [num_seqs, max_pages_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per seq including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged keys; returns [T, H, D].

    Query token i of a sequence with q_len new tokens and seq_len keys sits at position
    p = seq_len - q_len + i and sees keys 0..p; with a sliding `window` W only keys p - W < j <= p
    (the pages before the first key any query sees are not read: they may have been freed).
    `softcap` c: scores become c * tanh(scores / c) before the mask (Gemma 2). `max_query_len`
    and `max_seq_len` are accepted for signature parity and unused.
    """
    del max_query_len, max_seq_len
    num_heads = q.shape[1]
    page_size, num_kv_heads, head_dim = kv_layer.shape[2:]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_lo, q_hi = starts[s], starts[s + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        first_page = 0 if window is None else max(0, seq_len - q_len - window + 1) // page_size
        pages = block_tables[s, first_page : math.ceil(seq_len / page_size)].long()
        first = first_page * page_size  # position of the first key read
        k = kv_layer[pages, 0].reshape(-1, num_kv_heads, head_dim)[: seq_len - first].float()
        v = kv_layer[pages, 1].reshape(-1, num_kv_heads, head_dim)[: seq_len - first].float()
        k = k.repeat_interleave(group, dim=1)  # q head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(first, seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def write_kv_ref(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [num_pages, 2, page_size, KVH, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64, page * page_size + slot; negative = skip
) -> None:
    """Store each token's K and V at its slot, in place. Tokens with a negative slot are skipped."""
    page_size = kv_layer.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, offsets = slots // page_size, slots % page_size
    kv_layer[pages, 0, offsets] = k[keep].to(kv_layer.dtype)
    kv_layer[pages, 1, offsets] = v[keep].to(kv_layer.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32, rounded to x.dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); the sum is rounded to the residual dtype
    before the norm, as an unfused model computes it."""
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX / HF rotate_half RoPE: pairs (x[j], x[j + D/2]) rotate by angle pos * inv_freq[j].
    Returns new tensors (q_out, k_out); inputs are not modified."""
    half = q.shape[-1] // 2
    cache = cos_sin_cache[positions.long()].float()
    cos, sin = cache[:, None, :half], cache[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x of shape [T, 2*I], in fp32, rounded to x.dtype."""
    inter = x.shape[-1] // 2
    return (F.silu(x[..., :inter].float()) * x[..., inter:].float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32, CPU) for default RoPE or Llama-3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = None
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    # Llama 3.1: wavelengths shorter than original_ctx / high_freq_factor keep their frequency,
    # longer than original_ctx / low_freq_factor are slowed by `factor`, and the band between
    # is a linear blend in original_ctx / wavelength.
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling["low_freq_factor"])
    high = float(rope_scaling["high_freq_factor"])
    original_ctx = float(rope_scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_ctx / low, inv_freq / factor, inv_freq)
    blend = (original_ctx / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelen >= original_ctx / high) & (wavelen <= original_ctx / low)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    theta: float,
    rope_scaling: dict | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[max_pos, head_dim] table for `rotary_embedding`: cos(p * f) in the first head_dim/2
    columns and sin(p * f) in the last, f from `rope_inv_freq` (matches HF transformers)."""
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device=device, dtype=dtype)
