"""Moving a request's KV pages between workers: pack on the prefill side, check and write on the
decode side. The wire format is `KVPagesHeader` + one tensor frame per layer (common.protocol).

    prefill pool kv[L, P, 2, S, H, D] --index_select(pages)--> [L, n, 2, S, H, D] --frames-->
    decode pool  kv[L, P', 2, S, H, D] <--copy into its own freshly allocated pages--

An fp8 pool's pages travel as fp8 with the sender's scales in the header. The receiver converts
what differs from its own pool (another dtype, other scales: `kv_quant.convert_pages`), so a
bf16 prefill worker can feed an fp8 decode worker and the other way round.

Only the pages the decode worker lacks travel: the scheduler says how many leading prompt pages
it holds (`skip_pages`), and the header's `page_indices` are the logical pages sent, always the
tail [skip, total) of the prompt's pages.

A tensor-parallel worker sends one header per rank (`tp_rank`, `tp_size`), each with that
rank's KV heads; rank 0 gathers and scatters the other ranks' shards (workers/engine/kv_relay.py).
"""

from __future__ import annotations

import torch

from common.messages import KVPagesHeader
from workers.engine.engine import PrefillResult
from workers.engine.kv_quant import convert_pages, is_fp8
from workers.engine.kv_relay import gather_pages, scatter_pages
from workers.engine.tensor_parallel import FollowerRanks

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def pack_pages(
    kv_cache: torch.Tensor, result: PrefillResult, skip_pages: int = 0, kv_scales: torch.Tensor | None = None
) -> tuple[KVPagesHeader, list[torch.Tensor]]:
    """One contiguous CPU tensor per layer holding the request's prompt pages from `skip_pages`
    on, and the header. At least the last page is always sent. An fp8 pool passes its
    `kv_scales` [layers, 2, KVH]: they go in the header."""
    skip = _skip(result, skip_pages)
    index = torch.tensor(result.block_table[skip:], dtype=torch.int64, device=kv_cache.device)
    pages = kv_cache.index_select(1, index).cpu()  # [L, n, 2, S, H, D], one copy
    return _header(result, skip, pages, kv_scales=kv_scales), list(pages.unbind(0))


def pack_rank_pages(
    kv_cache: torch.Tensor,
    result: PrefillResult,
    skip_pages: int,
    followers: FollowerRanks | None,
    kv_scales: torch.Tensor | None = None,
) -> list[tuple[KVPagesHeader, list[torch.Tensor]]]:
    """`pack_pages` for every rank of the worker, rank 0's first: a tensor-parallel worker's
    followers hand their shards to rank 0 (`gather_pages`), one header per rank."""
    if followers is None:
        return [pack_pages(kv_cache, result, skip_pages, kv_scales)]
    skip = _skip(result, skip_pages)
    shards = gather_pages(followers, kv_cache, result.block_table[skip:])
    return [(_header(result, skip, s, rank, len(shards)), list(s.unbind(0))) for rank, s in enumerate(shards)]


def _skip(result: PrefillResult, skip_pages: int) -> int:
    return max(0, min(skip_pages, len(result.block_table) - 1))


def _header(
    result: PrefillResult,
    skip: int,
    pages: torch.Tensor,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_scales: torch.Tensor | None = None,
) -> KVPagesHeader:
    total = len(result.block_table)
    return KVPagesHeader(
        request_id=result.request_id,
        seq_index=0,
        num_tokens=len(result.prompt_token_ids),
        layer_start=0,
        layer_end=pages.shape[0],
        num_pages=total - skip,
        dtype=DTYPE_NAMES[pages.dtype],
        page_shape=list(pages.shape[2:]),
        checksum=0,  # filled in by encode_tensor_frames
        first_token_ids=list(result.first_token_ids),
        last=True,
        page_indices=list(range(skip, total)),
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_scales=[] if kv_scales is None else kv_scales.flatten().tolist(),
    )


def check_header(header: KVPagesHeader, kv_cache: torch.Tensor, prompt_len: int, tp_size: int = 1) -> int:
    """Raise ValueError unless the pages fit this worker's pool exactly (`kv_cache`: a rank's
    pool; `tp_size`: this worker's ranks, which must be the sender's). Returns how many leading
    prompt pages the header skips (the receiver must hold them already)."""
    if header.tp_size != tp_size:
        raise ValueError(
            f"kv: pages from a worker of tensor-parallel size {header.tp_size}, this worker's is {tp_size} "
            "(KV heads are not resharded: pair workers of one size)"
        )
    layers, _, *page_shape = kv_cache.shape
    page_size = page_shape[1]
    if (header.layer_start, header.layer_end) != (0, layers):
        raise ValueError(f"kv: layers [{header.layer_start}, {header.layer_end}) but the model has {layers}")
    if header.page_shape != page_shape:
        raise ValueError(f"kv: page shape {header.page_shape}, this pool's is {page_shape}")
    if header.dtype not in DTYPES_BY_NAME:  # any other is converted on write (write_pages)
        raise ValueError(f"kv: dtype {header.dtype}, this pool takes {sorted(DTYPES_BY_NAME)}")
    total = -(-prompt_len // page_size)
    if header.num_tokens != prompt_len or not 1 <= header.num_pages <= total:
        raise ValueError(f"kv: {header.num_pages} pages for {header.num_tokens} tokens, the prompt has {prompt_len}")
    skip = total - header.num_pages
    if header.page_indices != list(range(skip, total)):
        raise ValueError(f"kv: pages must be the prompt's last {header.num_pages} of {total}, in order")
    return skip


def write_rank_pages(
    kv_cache: torch.Tensor,
    block_table: list[int],
    rank_layers: list[list[torch.Tensor]],
    followers: FollowerRanks | None,
    sent_scales: list[float] | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """`write_pages` for every rank: `rank_layers[i]` are rank i's layers (`scatter_pages`
    hands the followers theirs; an fp8 pool has one rank only, so scales go with rank 0)."""
    if followers is None:
        return write_pages(kv_cache, block_table, rank_layers[0], sent_scales, kv_scales)
    scatter_pages(followers, kv_cache, block_table, [torch.stack(layers) for layers in rank_layers])


def write_pages(
    kv_cache: torch.Tensor,
    block_table: list[int],
    layers: list[torch.Tensor],
    sent_scales: list[float] | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Copy received pages into the pool at `block_table` (one copy per layer), converted first
    where the sender's dtype or `sent_scales` (the header's) differ from this pool's (`kv_scales`
    [layers, 2, KVH] for an fp8 pool)."""
    index = torch.tensor(block_table, dtype=torch.int64, device=kv_cache.device)
    heads = kv_cache.shape[-2]
    sent = torch.tensor(sent_scales).view(len(layers), 2, heads) if sent_scales else None
    fp8 = is_fp8(kv_cache.dtype)
    for layer, pages in enumerate(layers):
        own = None if kv_scales is None else kv_scales[layer]
        pages = convert_pages(pages, None if sent is None else sent[layer], kv_cache.dtype, own)
        pages = pages.to(kv_cache.device, non_blocking=True)
        if fp8:  # torch has no fp8 index_copy_ on a CPU: the same bytes
            kv_cache[layer].view(torch.uint8).index_copy_(0, index, pages.view(torch.uint8))
        else:
            kv_cache[layer].index_copy_(0, index, pages)
