"""Moving a request's KV pages between workers: pack on the prefill side, check and write on the
decode side. The wire format is `KVPagesHeader` + one tensor frame per layer (common.protocol).

    prefill pool kv[L, P, 2, S, H, D] --index_select(pages)--> [L, n, 2, S, H, D] --frames-->
    decode pool  kv[L, P', 2, S, H, D] <--copy into its own freshly allocated pages--

An fp8 pool's pages travel as fp8 with the sender's scales in the header (a parallel worker: each
rank's part with that rank's scales). The receiver converts what differs from its own pool
(another dtype, other scales: `kv_quant.convert_pages`; a parallel receiver's rank 0 converts each
part for its rank), so a bf16 prefill worker can feed an fp8 decode worker and the other way round.

Only the pages the decode worker lacks travel: the scheduler says how many leading prompt pages
it holds (`skip_pages`), and the header's `page_indices` are the logical pages sent, always the
tail [skip, total) of the prompt's pages.

A tensor- or pipeline-parallel worker sends one header per rank (`tp_rank`, `tp_size`, and its
stage's `layer_start`/`layer_end`), each with that rank's KV heads of its stage's layers; rank 0
gathers and scatters the other ranks' shards (workers/engine/kv_relay.py). The receiver keys the
parts by (tp rank, first layer) and imports once every tp rank's layers cover the model.
"""

from __future__ import annotations

import torch

from pagemesh.common.messages import KVPagesHeader
from pagemesh.workers.engine.engine import PrefillResult
from pagemesh.workers.engine.kv_quant import convert_pages, is_fp8
from pagemesh.workers.engine.kv_relay import gather_pages, rank_layers, scatter_pages
from pagemesh.workers.engine.tensor_parallel import FollowerRanks

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
    rank_kv_scales: list[torch.Tensor] | None = None,
    *,
    num_layers: int,
) -> list[tuple[KVPagesHeader, list[torch.Tensor]]]:
    """`pack_pages` for every rank of the worker, rank 0's first: a parallel worker's followers
    hand their shards to rank 0 (`gather_pages`), one header per rank, with its tp rank, its
    stage's layers of the model's `num_layers` and, for an fp8 pool, its scales
    (`rank_kv_scales`: every rank's, `ModelRunner.rank_kv_scales`)."""
    scales = rank_kv_scales or None
    if followers is None:
        return [pack_pages(kv_cache, result, skip_pages, None if scales is None else scales[0])]
    skip = _skip(result, skip_pages)
    tp_size = followers.spec.world_size
    layers = rank_layers(num_layers, tp_size, followers.spec.pipeline_size)
    shards = gather_pages(followers, kv_cache, result.block_table[skip:], layers)
    return [
        (
            _header(result, skip, s, rank % tp_size, tp_size, None if scales is None else scales[rank], layers[rank]),
            list(s.unbind(0)),
        )
        for rank, s in enumerate(shards)
    ]


def _skip(result: PrefillResult, skip_pages: int) -> int:
    return max(0, min(skip_pages, len(result.block_table) - 1))


def _header(
    result: PrefillResult,
    skip: int,
    pages: torch.Tensor,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_scales: torch.Tensor | None = None,
    layers: range | None = None,  # None: all of them, [0, pages.shape[0])
) -> KVPagesHeader:
    total = len(result.block_table)
    layers = range(pages.shape[0]) if layers is None else layers
    return KVPagesHeader(
        request_id=result.request_id,
        seq_index=0,
        num_tokens=len(result.prompt_token_ids),
        layer_start=layers.start,
        layer_end=layers.stop,
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


def check_header(
    header: KVPagesHeader, kv_cache: torch.Tensor, prompt_len: int, tp_size: int = 1, layers: range | None = None
) -> int:
    """Raise ValueError unless the pages fit this worker's pool exactly (`kv_cache`: a rank's
    pool; `tp_size`: this worker's tensor-parallel ranks, which must be the sender's; `layers`:
    the layers of the receiving rank's stage, which the header's must be; None: the whole pool's).
    Returns how many leading prompt pages the header skips (the receiver must hold them already)."""
    if header.tp_size != tp_size:
        raise ValueError(
            f"kv: pages from a worker of tensor-parallel size {header.tp_size}, this worker's is {tp_size} "
            "(KV heads are not resharded: pair workers of one size)"
        )
    _, _, *page_shape = kv_cache.shape
    page_size = page_shape[1]
    layers = range(kv_cache.shape[0]) if layers is None else layers
    if (header.layer_start, header.layer_end) != (layers.start, layers.stop):
        raise ValueError(
            f"kv: layers [{header.layer_start}, {header.layer_end}) but this worker's stage holds "
            f"[{layers.start}, {layers.stop}) (pipeline stages are not resharded: pair workers of one shape)"
        )
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


def parts_cover(parts: dict[tuple[int, int], KVPagesHeader], tp_size: int, num_layers: int) -> bool:
    """Whether the parts received so far (keyed by (tp rank, first layer)) hold every layer of
    the model for each of the sender's `tp_size` ranks: the sender's stages, whatever their
    number, chain [0, num_layers) for every tp rank."""
    for tp_rank in range(tp_size):
        layer = 0
        while layer < num_layers and (h := parts.get((tp_rank, layer))) is not None and h.layer_end > layer:
            layer = h.layer_end
        if layer != num_layers:
            return False
    return True


def rank_parts(
    parts: dict[tuple[int, int], KVPagesHeader], tp_size: int, pp_size: int, num_layers: int
) -> list[tuple[int, int]]:
    """The keys of `parts` in this worker's rank order (rank r: tp rank r % tp_size, its stage's
    first layer). ValueError naming both shapes unless the sender's ranks are exactly ours: KV
    heads and layer ranges are not resharded."""
    layers = rank_layers(num_layers, tp_size, pp_size)
    mine = sorted((rank % tp_size, r.start, r.stop) for rank, r in enumerate(layers))
    sent = sorted((h.tp_rank, h.layer_start, h.layer_end) for h in parts.values())
    if sent != mine:
        their_tp = next(iter(parts.values())).tp_size
        raise ValueError(
            f"kv: pages from a worker of {_shape(their_tp, sent)}, this worker is {_shape(tp_size, mine)} "
            "(KV pages go rank i to rank i and stage j to stage j, not resharded: pair workers of one shape)"
        )
    return [(rank % tp_size, r.start) for rank, r in enumerate(layers)]


def _shape(tp_size: int, ranks: list[tuple[int, int, int]]) -> str:
    stages = sorted({(start, end) for _, start, end in ranks})
    return f"tp {tp_size} x pp {len(stages)} (layers {' '.join(f'[{s}, {e})' for s, e in stages)})"


def write_rank_pages(
    kv_cache: torch.Tensor,
    block_table: list[int],
    rank_pages: list[list[torch.Tensor]],
    followers: FollowerRanks | None,
    rank_sent_scales: list[list[float]] | None = None,
    rank_kv_scales: list[torch.Tensor] | None = None,
) -> None:
    """`write_pages` for every rank: `rank_pages[i]` are rank i's layers, sent with
    `rank_sent_scales[i]` (its header's; empty: not fp8) and written into a pool whose scales
    are `rank_kv_scales[i]` (None: not fp8). Rank 0 converts every rank's part for that rank's
    pool, then `scatter_pages` hands the followers theirs."""
    sent = rank_sent_scales or [[] for _ in rank_pages]
    own = rank_kv_scales or [None for _ in rank_pages]
    if followers is None:
        return write_pages(kv_cache, block_table, rank_pages[0], sent[0], own[0])
    heads = kv_cache.shape[-2]
    shards = [
        torch.stack(converted_layers(layers, s, kv_cache.dtype, o, heads))
        for layers, s, o in zip(rank_pages, sent, own, strict=True)
    ]
    scatter_pages(followers, kv_cache, block_table, shards)


def converted_layers(
    layers: list[torch.Tensor],
    sent_scales: list[float] | None,
    dtype: torch.dtype,
    kv_scales: torch.Tensor | None,
    heads: int,
) -> list[torch.Tensor]:
    """Received layers of pages as a pool of `dtype` (with `kv_scales` [layers, 2, heads] if
    fp8) stores them: converted where the sender's dtype or `sent_scales` differ."""
    sent = torch.tensor(sent_scales).view(len(layers), 2, heads) if sent_scales else None
    return [
        convert_pages(pages, None if sent is None else sent[i], dtype, None if kv_scales is None else kv_scales[i])
        for i, pages in enumerate(layers)
    ]


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
    fp8 = is_fp8(kv_cache.dtype)
    for layer, pages in enumerate(converted_layers(layers, sent_scales, kv_cache.dtype, kv_scales, kv_cache.shape[-2])):
        pages = pages.to(kv_cache.device, non_blocking=True)
        if fp8:  # torch has no fp8 index_copy_ on a CPU: the same bytes
            kv_cache[layer].view(torch.uint8).index_copy_(0, index, pages.view(torch.uint8))
        else:
            kv_cache[layer].index_copy_(0, index, pages)
