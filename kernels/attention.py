"""Paged attention for a flat batch mixing prefill chunks and decodes: one attention launch
(plus a small reduction launch when split-KV is on).

Work split: one program per (query block, kv head[, kv split]). A query block is BLOCK_Q
consecutive new tokens of one sequence times the QPK query heads that share the kv head, so the
tile of rows is [BLOCK_Q * QPK_PAD, HEAD_DIM]:

    row m  ->  token  q_block * BLOCK_Q + m // QPK_PAD,  query head  kv_head * QPK + m % QPK_PAD

The program walks its keys TILE_N at a time, gathering each key's page from the block table:
the tiles every row may see in full go without masks, the tiles that cross the causal diagonal or
the end of the context (and, with a sliding window, the window's start) are masked. With
split-KV (flash-decoding) the key tiles are cut into `num_splits` contiguous ranges, each program
writes a partial output and its log-sum-exp, and `_reduce_splits_kernel` merges them.

Two `constexpr` features: SLIDING (a query at position p sees keys p - window < j <= p; the tiles
wholly before the program's first visible key are not visited, and no key before it is loaded, so
freed pages are never read) and SOFTCAP (Gemma 2: scores become c * tanh(scores / c) before the
mask; in the kernel's log2 units, c * log2(e)).

All pool offsets are int64: page_id * page_stride passes 2**31 elements on a large pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagemesh.kernels._util import check_launchable, next_power_of_2, sm_count, upcast_bf16_dot

# Split-KV pays off only when (sequences x kv heads) cannot fill the GPU; each split keeps at
# least this many keys so the extra partial traffic stays small next to the K/V it reads.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch knobs; `choose_config` picks one, tests may pass their own."""

    block_m: int  # rows per program = BLOCK_Q tokens x QPK_PAD heads (power of two)
    tile_n: int  # keys per inner step (power of two; any relation to page_size)
    num_warps: int
    num_stages: int


def choose_config(max_query_len: int, group_pad: int, dtype: torch.dtype) -> AttentionConfig:
    """Decode-like batches get 16 rows (the smallest MMA tile); anything with prefill chunks gets
    64 rows, one warpgroup's MMA, which also keeps the decodes mixed into it memory-bound.
    fp32 (no tensor cores with IEEE products) takes smaller tiles so it does not spill."""
    wide = dtype != torch.float32
    tile_n = 64 if wide else 32
    decode_rows = max(16, group_pad)
    if max_query_len * group_pad <= decode_rows:
        return AttentionConfig(block_m=decode_rows, tile_n=tile_n, num_warps=4, num_stages=3)
    prefill_rows = max(64 if wide else 32, group_pad)
    return AttentionConfig(block_m=prefill_rows, tile_n=tile_n, num_warps=4, num_stages=2)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Power-of-two split count so decode launches have about PROGRAMS_PER_SM programs per SM."""
    programs = num_seqs * num_kv_heads
    wanted = math.ceil(num_sms * PROGRAMS_PER_SM / max(programs, 1))
    cap = min(MAX_SPLITS, max_seq_len // MIN_KEYS_PER_SPLIT)
    splits = min(wanted, cap)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with an fp32 accumulator; IEEE keeps fp32 inputs out of TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,  # running output [M, D], row max [M], row sum [M] (fp32, log2 domain)
    q,  # [M, D]
    q_pos,  # [M] absolute position of each row's token
    kv_ptr,  # [num_pages, 2, PAGE_SIZE, KVH, D]
    bt_row_ptr,  # [max_pages] this sequence's block-table row
    tile_lo,
    tile_hi,
    kv_start,  # the program's first visible key (0 without a window): none before it is loaded
    kv_end,
    window,  # SLIDING: a row at position p sees keys p - window < j <= p
    softcap,  # SOFTCAP: the cap in log2 units (c * log2(e))
    qk_scale,
    kv_head_off,
    stride_kv_kind,
    stride_kv_page,
    stride_kv_slot,
    BLOCK_M: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP8: tl.constexpr,  # fp8 pages: widened to q's dtype here, their scales applied by the caller
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + offs_n  # [TILE_N]
        if MASKED:
            key_ok = key_pos < kv_end
            if SLIDING:
                key_ok = key_ok & (key_pos >= kv_start)
            page = tl.load(bt_row_ptr + key_pos // PAGE_SIZE, mask=key_ok, other=0)
        else:
            page = tl.load(bt_row_ptr + key_pos // PAGE_SIZE)
        key_off = page.to(tl.int64) * stride_kv_page + (key_pos % PAGE_SIZE).to(tl.int64) * stride_kv_slot + kv_head_off
        k_ptrs = kv_ptr + key_off[None, :] + offs_d[:, None]  # [D, TILE_N]
        v_ptrs = kv_ptr + stride_kv_kind + key_off[:, None] + offs_d[None, :]  # [TILE_N, D]
        if MASKED:
            k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if FP8:
            k = k.to(q.dtype)
        s = _dot(q, k, tl.zeros([BLOCK_M, TILE_N], tl.float32), UPCAST_DOT, IEEE_DOT)
        s = s * qk_scale  # [M, TILE_N], log2 units
        if SOFTCAP:  # c * tanh(s / c), tanh(x) = 1 - 2 / (e^2x + 1): +-1 at the extremes, no NaN
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        if MASKED:
            visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
            if SLIDING:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if MASKED:  # a row may have no key yet (a split range past its position): no -inf - -inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Garbage past the context (freed pages, the null page) may hold NaN: never load it.
        if MASKED:
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if FP8:
            v = v.to(q.dtype)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT, IEEE_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    # Sequence s owns programs from first(s) = query_start_loc[s] // BLOCK_Q + s on; first() is
    # strictly increasing, so the owner of `pid` is the last s with first(s) <= pid.
    lo = tl.zeros((), tl.int32)
    hi = tl.zeros((), tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] model dtype; with SPLIT: partial outputs [T, H, S, D] fp32
    lse_ptr,  # [T, H, S] fp32 log2-sum-exp of each split (SPLIT only)
    q_ptr,  # [T, H, D]
    kv_ptr,  # [num_pages, 2, PAGE_SIZE, KVH, D]
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    kv_scales_ptr,  # [2, KVH] fp32 (FP8 only): K's, then V's scale of each kv head
    num_seqs,
    num_splits,
    window,  # SLIDING only
    softcap,  # SOFTCAP only: c * log2(e)
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_o_split,
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_seq,
    QPK: tl.constexpr,  # query heads per kv head
    QPK_PAD: tl.constexpr,  # next power of two of QPK
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    ONE_BLOCK_PER_SEQ: tl.constexpr,  # every q_len <= BLOCK_Q: program id = sequence id
    SPLIT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP8: tl.constexpr,  # the pool is fp8: a page value is fp8 * its head's scale (kv_quant.py)
    SLIDING: tl.constexpr,  # a sliding window
    SOFTCAP: tl.constexpr,  # logit soft-capping
):
    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_BLOCK_PER_SEQ:
        seq = pid
        q_block = 0
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
        q_block = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys written before this step

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_block * BLOCK_Q + offs_m // QPK_PAD
    head = kv_head * QPK + offs_m % QPK_PAD
    row_ok = (tok < q_len) & (offs_m % QPK_PAD < QPK)
    q_pos = context + tok
    q_off = (q_start + tok).to(tl.int64) * stride_q_tok + head.to(tl.int64) * stride_q_head
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    # Keys 0 .. first_pos are visible to every row; the last row sees up to kv_end - 1. With a
    # window, the first row sees from kv_start on and every row from kv_end - window on:
    #   tiles [first_tile, full_lo) masked | [full_lo, num_full) in full | [num_full, num_tiles) masked
    first_pos = context + q_block * BLOCK_Q
    kv_end = context + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    num_full = (first_pos + 1) // TILE_N
    kv_start = first_pos * 0
    first_tile = first_pos * 0
    full_lo = first_pos * 0
    if SLIDING:
        kv_start = tl.maximum(first_pos - window + 1, 0)
        first_tile = kv_start // TILE_N
        full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N), first_tile), num_full)
    if SPLIT:
        per_split = tl.cdiv(num_tiles - first_tile, num_splits)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = first_tile
        tile_hi = num_tiles

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_head_off = kv_head.to(tl.int64) * stride_kv_head
    v_scale = 1.0
    if FP8:  # K's scale goes into the scores' scale, V's onto the output (both linear)
        qk_scale = qk_scale * tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + tl.num_programs(1) + kv_head)
    # three ranges of tiles (see above); the arguments after lo, hi are the same for all three
    # fmt: off
    if SLIDING:  # the tiles that cross the window's start
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, tile_lo, tl.minimum(tile_hi, full_lo),
            kv_start, kv_end, window, softcap, qk_scale, kv_head_off, stride_kv_kind, stride_kv_page, stride_kv_slot,
            BLOCK_M, PAGE_SIZE, TILE_N, HEAD_DIM, True, UPCAST_DOT, IEEE_DOT, FP8, SLIDING, SOFTCAP,
        )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, tl.maximum(tile_lo, full_lo), tl.minimum(tile_hi, num_full),
        kv_start, kv_end, window, softcap, qk_scale, kv_head_off, stride_kv_kind, stride_kv_page, stride_kv_slot,
        BLOCK_M, PAGE_SIZE, TILE_N, HEAD_DIM, False, UPCAST_DOT, IEEE_DOT, FP8, SLIDING, SOFTCAP,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, kv_ptr, bt_row_ptr, tl.maximum(tile_lo, tl.maximum(num_full, full_lo)), tile_hi,
        kv_start, kv_end, window, softcap, qk_scale, kv_head_off, stride_kv_kind, stride_kv_page, stride_kv_slot,
        BLOCK_M, PAGE_SIZE, TILE_N, HEAD_DIM, True, UPCAST_DOT, IEEE_DOT, FP8, SLIDING, SOFTCAP,
    )
    # fmt: on

    out_off = (q_start + tok).to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head
    if SPLIT:
        empty = l_i == 0.0  # this split held no key for the row
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
        part_off = out_off + split * stride_o_split
        tl.store(lse_ptr + part_off // HEAD_DIM, lse, mask=row_ok)
        tl.store(out_ptr + part_off[:, None] + offs_d[None, :], acc * (v_scale / l_safe)[:, None], mask=row_ok[:, None])
    else:
        if SLIDING:  # a padding row past q_len may see no key of the window: 0 / 0, never stored
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc * (v_scale / l_i)[:, None]
        tl.store(out_ptr + out_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr,  # [T, H, D] model dtype
    part_ptr,  # [T, H, S, D] fp32
    lse_ptr,  # [T, H, S] fp32
    num_heads,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    row = (tok.to(tl.int64) * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    lse = tl.load(lse_ptr + row, mask=split_ok, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))  # empty splits: exp2(-inf) = 0
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    out_off = tok.to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head
    tl.store(out_ptr + out_off + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_layer: torch.Tensor,  # [num_pages, 2, page_size, KVH, D]
    block_tables: torch.Tensor,  # [num_seqs, max_pages_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed prefill/decode batch; returns a new [T, H, D] tensor.

    `window` W: a query at position p sees keys p - W < j <= p, and no page before the first key
    a program's queries see is read (it may be freed). `softcap` c: scores become
    c * tanh(scores / c) before the mask (Gemma 2).

    An fp8 `kv_layer` (float8_e4m3fn / float8_e5m2) needs `kv_scales` [2, KVH] fp32 on its
    device: page values are fp8 * the head's scale (workers/engine/kv_quant.py).

    `max_query_len` / `max_seq_len` must be upper bounds of the true values (they pick the tile
    shape and the split count without a device sync). `num_splits`: None = heuristic, 1 = no
    split-KV, n = force n splits. `config`: override the tile shape (tests).
    """
    check_launchable("paged_attention", q, kv_layer)
    num_tokens, num_heads, head_dim = q.shape
    _, two, page_size, num_kv_heads, kv_head_dim = kv_layer.shape
    if two != 2 or kv_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match kv_layer {tuple(kv_layer.shape)}")
    fp8 = kv_layer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8 and (kv_scales is None or kv_scales.dtype != torch.float32 or kv_scales.shape != (2, num_kv_heads)):
        raise ValueError(f"an fp8 kv_layer needs kv_scales fp32 [2, {num_kv_heads}]")
    if not fp8 and q.dtype != kv_layer.dtype:
        raise ValueError(f"q is {q.dtype} but kv_layer is {kv_layer.dtype}")
    if head_dim & (head_dim - 1) or page_size & (page_size - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} and page_size {page_size} must be powers of two")
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("q and kv_layer need a contiguous last dimension")
    if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
        raise ValueError(f"window {window} and softcap {softcap} must be positive")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out

    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    cfg = config or choose_config(max_query_len, group_pad, q.dtype)
    block_q = cfg.block_m // group_pad
    one_block_per_seq = max_query_len <= block_q
    if num_splits is None:
        num_splits = 1
        if one_block_per_seq:
            keys = max_seq_len if window is None else min(max_seq_len, window + max_query_len)  # read per query
            num_splits = choose_num_splits(num_seqs, num_kv_heads, keys, sm_count(q.device))

    if one_block_per_seq:
        num_q_blocks = num_seqs
    else:
        num_q_blocks = num_tokens // block_q + num_seqs
    grid = (num_q_blocks, num_kv_heads, num_splits)
    split = num_splits > 1
    if split:
        part = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        target, o_strides = part, part.stride()[:3]
    else:
        lse = out  # unused
        target, o_strides = out, (out.stride(0), out.stride(1), 0)

    _paged_attention_kernel[grid](
        target,
        lse,
        q,
        kv_layer,
        block_tables,
        seq_lens,
        query_start_loc,
        kv_scales.contiguous() if fp8 else seq_lens,  # any pointer when unused
        num_seqs,
        num_splits,
        window or 0,
        (softcap or 1.0) * math.log2(math.e),
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        *o_strides,
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        block_tables.stride(0),
        QPK=group,
        QPK_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        TILE_N=cfg.tile_n,
        ONE_BLOCK_PER_SEQ=one_block_per_seq,
        SPLIT=split,
        UPCAST_DOT=upcast_bf16_dot(q.dtype),
        IEEE_DOT=q.dtype == torch.float32,
        FP8=fp8,
        SLIDING=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            part,
            lse,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
