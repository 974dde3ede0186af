"""Builders of random paged-attention inputs, shared by tests/kernels, tests/gpu and the bench.

`make_paged_batch` lays sequences out the way the engine does: each sequence gets
ceil(seq_len / page_size) pages in a shuffled (non-contiguous) order, padding entries of the
block table are 0 (the null page), and the new tokens of a sequence are its last q_len positions.
With `poison=True`, every pool slot that no sequence owns (the null page, unused pages, the slots
past a context's end in its last page) holds NaN, so a kernel that reads one shows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    kv_layer: torch.Tensor  # [num_pages, 2, page_size, KVH, D]
    block_tables: torch.Tensor  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [T] int64, slots of the new tokens
    scale: float
    max_query_len: int
    max_seq_len: int

    def attention_args(self) -> tuple:
        return (
            self.q,
            self.kv_layer,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    num_pages: int | None = None,
    pages_at_end: bool = False,
    poison: bool = True,
) -> PagedBatch:
    """Random q / K / V for sequences with the given new-token and total lengths.

    `num_pages` (default: just enough, plus the null page and a few spare) sets the pool size;
    with `pages_at_end` the sequences use the highest page ids, and only the pages in use and the
    null page are written, so a huge pool costs only the memory it touches (CPU: lazily mapped).
    """
    assert len(query_lens) == len(seq_lens)
    assert all(0 <= q <= s and s > 0 for q, s in zip(query_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)  # layout (page order)
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # values, made where they live
    pages_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    needed = sum(pages_per_seq)
    num_pages = num_pages or needed + 4
    assert num_pages > needed, "page 0 is the null page"

    first = num_pages - needed if pages_at_end else 1
    order = torch.randperm(needed, generator=gen) + first
    if not pages_at_end:  # spread over the pool, not just its low ids
        order = torch.randperm(num_pages - 1, generator=gen)[:needed] + 1

    pool_shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
    kv_layer = torch.zeros(
        pool_shape, dtype=dtype, device=device
    )  # unowned slots: 0, as in the engine, unless poisoned
    if poison and not pages_at_end:
        kv_layer.fill_(float("nan"))
    elif poison:
        kv_layer[0].fill_(float("nan"))

    max_pages = max(pages_per_seq) + 1  # one padding column beyond the longest sequence
    block_tables = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    slots = []
    used = 0
    for s, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        pages = order[used : used + pages_per_seq[s]]
        used += pages_per_seq[s]
        block_tables[s, : len(pages)] = pages.to(torch.int32)
        values = torch.randn((len(pages), 2, page_size, num_kv_heads, head_dim), generator=dev_gen, device=device)
        tail = len(pages) * page_size - seq_len
        if poison and tail:
            values[-1, :, page_size - tail :] = float("nan")
        kv_layer[pages.to(device)] = values.to(dtype)
        positions = torch.arange(seq_len - q_len, seq_len)
        slots.append(pages[positions // page_size].long() * page_size + positions % page_size)

    total = sum(query_lens)
    q = torch.randn((total, num_heads, head_dim), generator=dev_gen, device=device).to(dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PagedBatch(
        q=q,
        kv_layer=kv_layer,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        slot_mapping=torch.cat(slots).to(device),
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def free_window_pages(batch: PagedBatch, query_lens: list[int], window: int) -> int:
    """Free what a sliding `window` leaves behind, as the engine does: each page wholly before the
    first key any of a sequence's new tokens sees is poisoned with NaN and its block-table entry
    pointed at the null page (NaN too, when `make_paged_batch` poisoned it). Returns how many."""
    page_size, freed = batch.kv_layer.shape[2], 0
    for s, (q_len, seq_len) in enumerate(zip(query_lens, batch.seq_lens.tolist())):
        for i in range(max(0, seq_len - q_len - window + 1) // page_size):
            batch.kv_layer[int(batch.block_tables[s, i])] = float("nan")
            batch.block_tables[s, i] = 0
            freed += 1
    return freed


def quantize_kv_layer(
    kv_layer: torch.Tensor, dtype: torch.dtype, headroom: float = 4.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An fp8 copy of a float pool layer [P, 2, S, KVH, D] with one scale per (K|V, kv_head) from
    the layer's own amax (NaN slots ignored, kept NaN): returns (fp8 layer, scales [2, KVH] fp32,
    the fp8 layer dequantized to fp32: what an exact fp8 kernel sees)."""
    finite = torch.nan_to_num(kv_layer.float(), nan=0.0)
    amax = finite.abs().amax(dim=(0, 2, 4))  # [2, KVH]
    scales = torch.where(amax > 0, amax / (torch.finfo(dtype).max / headroom), torch.ones_like(amax))
    shaped = scales[None, :, None, :, None]
    limit = torch.finfo(dtype).max
    quantized = (kv_layer.float() / shaped).clamp(-limit, limit).to(dtype)
    return quantized, scales, quantized.float() * shaped
