"""Attention over paged KV memory for one flat batch (the CPU/torch path).

Per layer the pool is `kv[page, 2, slot, kv_head, head_dim]` (docs/design.md §3). Viewed flat as
`[page * 2 * page_size + (0 | page_size) + slot, kv_head, head_dim]`, the K of the token in slot
`o` of page `p` is row `p*2*S + o` and its V is `page_size` rows further. All gather indices are
computed once per step (`AttentionMetadata.build`, workers/attention/metadata.py) and reused by
every layer.

Batch order: the scheduler puts decodes (one query token each) first; they are attended in one
batched SDPA call over their gathered, padded contexts (or, with the C kernels of `pagemesh.kernels.cpu`,
by a kernel that reads the pages in place). Prefill chunks follow, one SDPA call each, causal
inside the chunk and attending to the sequence's earlier pages.

Two per-layer variants (every function here takes them as keywords):
- `window` W (sliding-window attention, HF transformers' semantics): a query at position p sees
  the keys at positions j with p - W < j <= p, itself and the W - 1 before it. Keys before that
  may sit on freed pages (the block manager hands them back; their table slots point at the null
  page): a prefill chunk gathers none of them, the decodes' gather masks them.
- `softcap` c (Gemma 2's attn_logit_softcapping): scores become c * tanh(scores / c) before the
  mask and the softmax; SDPA has no such hook, so those calls do the math in fp32 themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.kv_quant import dequantize, quantize


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata) -> None:
    flat = kv_layer.view(-1, *kv_layer.shape[-2:])
    flat.index_copy_(0, md.write_index, k)
    flat.index_copy_(0, md.write_index + md.page_size, v)


def write_kv_fp8_torch(
    k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata, kv_scales: torch.Tensor
) -> None:
    """write_kv_torch into an fp8 pool: quantize with the layer's `kv_scales` [2, KVH]. The rows
    are copied as bytes (torch has no fp8 index_copy_ on a CPU)."""
    flat = kv_layer.view(torch.uint8).view(-1, *kv_layer.shape[-2:])
    flat.index_copy_(0, md.write_index, quantize(k, kv_scales[0], kv_layer.dtype).view(torch.uint8))
    flat.index_copy_(0, md.write_index + md.page_size, quantize(v, kv_scales[1], kv_layer.dtype).view(torch.uint8))


def paged_attention_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; kv_layer: [P, 2, S, KVH, D] with this step's K/V already written (k, v
    [T, KVH, D]: the same rows, optional, see prefill_attention_torch). An fp8 pool comes with
    its layer's `kv_scales` [2, KVH]: gathered rows are dequantized (workers/engine/kv_quant.py).
    `window`, `softcap`: see the module docstring."""
    num_kv_heads, head_dim = kv_layer.shape[-2:]
    out = torch.empty_like(q)
    group = q.shape[1] // num_kv_heads
    nd = md.num_decodes
    if nd:
        # whole pages are gathered (one memcpy each), padding masked; the queries of one KV
        # head's group ride as a query length, so K/V need no expansion for GQA
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        # K and V halves are gathered page by page straight into contiguous [nd, L, KVH, D]
        # buffers (one memcpy per page, no second copy to merge the page and slot dimensions)
        halves = kv_layer.view(kv_layer.shape[0], 2, -1)
        index = md.decode_pages.reshape(-1)
        kd = halves[:, 0].index_select(0, index).view(nd, -1, num_kv_heads, head_dim)
        vd = halves[:, 1].index_select(0, index).view(nd, -1, num_kv_heads, head_dim)
        if kv_scales is not None:
            kd, vd = dequantize(kd, kv_scales[0], q.dtype), dequantize(vd, kv_scales[1], q.dtype)
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)
        o = attention(qd, kd, vd, scale, mask=md.decode_mask_for(window), softcap=softcap)
        out[:nd] = o.reshape(nd, -1, head_dim)
    prefill_attention_torch(q, kv_layer, md, scale, out, k, v, kv_scales, window=window, softcap=softcap)
    return out


def prefill_attention_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The prefill chunks of the batch (after its decodes), into `out`.

    A chunk with earlier context gathers its keys from the pages: one SDPA call each. A chunk
    that is its sequence's whole context (a fresh prompt) needs no pages when this step's k and v
    are given: consecutive fresh prompts of one length go through one batched causal SDPA call,
    straight from the projection's rows (one call per layer instead of one per prompt). With a
    `window`, a chunk gathers only the keys some of its queries see."""
    num_kv_heads, head_dim = kv_layer.shape[-2:]
    flat = kv_layer.view(-1, num_kv_heads, head_dim)
    prefills, i = md.prefills, 0
    while i < len(prefills):
        p = prefills[i]
        if k is not None and p.mask is None:
            j = i + 1  # a run of fresh prompts of p's length, rows back to back
            while (
                j < len(prefills)
                and prefills[j].mask is None
                and prefills[j].query_len == p.query_len
                and prefills[j].query_start == p.query_start + (j - i) * p.query_len
            ):
                j += 1
            n, rows = j - i, slice(p.query_start, p.query_start + (j - i) * p.query_len)

            def heads_first(t: torch.Tensor) -> torch.Tensor:  # [n * L, H, D] -> [n, H, L, D]
                return t[rows].view(n, p.query_len, t.shape[1], head_dim).transpose(1, 2)

            mask = windowed_causal_mask(p.query_len, p.query_len, window)
            o = attention(heads_first(q), heads_first(k), heads_first(v), scale, mask=mask, softcap=softcap)
            out[rows] = o.transpose(1, 2).reshape(-1, q.shape[1], head_dim)
            i = j
            continue
        qp = q[p.query_start : p.query_start + p.query_len].transpose(0, 1).unsqueeze(0)
        length = p.key_index.shape[0]
        first = 0 if window is None else max(0, length - p.query_len - window + 1)  # first key any query sees
        key_index = p.key_index[first:]
        kp, vp = flat[key_index], flat[key_index + md.page_size]
        if kv_scales is not None:
            kp, vp = dequantize(kp, kv_scales[0], q.dtype), dequantize(vp, kv_scales[1], q.dtype)
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        mask = p.mask if window is None else windowed_causal_mask(p.query_len, length, window, first)
        o = attention(qp, kp, vp, scale, mask=mask, softcap=softcap)
        out[p.query_start : p.query_start + p.query_len] = o[0].transpose(0, 1)
        i += 1


def windowed_causal_mask(query_len: int, length: int, window: int | None, first: int = 0) -> torch.Tensor | None:
    """[query_len, length - first] bool mask (True = attend) of the last `query_len` positions of a
    `length`-token context over its keys `first`..length-1: causal, and inside the window; None
    when that is plain causal attention over the whole context (SDPA's is_causal)."""
    q_pos = torch.arange(length - query_len, length)[:, None]
    k_pos = torch.arange(first, length)[None, :]
    if window is None or window >= length:
        return None if query_len == length and first == 0 else k_pos <= q_pos
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    mask: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], masked) v over [..., H, L, D] tensors; k and v may have
    fewer heads than q (GQA: query head h reads kv head h // group). mask: bool [..., L, S], True
    = attend; None = causal (L == S). Without a softcap this is one SDPA call."""
    group = q.shape[-3] // k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
