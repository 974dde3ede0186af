"""The engine's pages in a prefill→decode handoff (DESIGN.md §1, §3): copies out of its pool,
writes into it, and the references a handoff holds. The worker's handoff
(workers/llm/handoff_out.py, workers/llm/handoff_in.py) calls the `Engine` methods that delegate
here, never the block manager, the runner or the follower ranks.

    prefill engine                                    decode engine
    hold (prefilled.py): one reference on the         pin_prefix_pages: references on the cached
      prompt's pages, the choices out of scheduling     leading prompt pages the sender skips
    export_pages: CPU copies of pages [skip, n),      write_pages (from Engine.import_pages): the
      every rank's (rank 0 gathers its followers'       received pages into new ones, converted
      shards: kv_relay.py)                              for each rank's pool (rank 0 scatters)
    release (prefilled.py): the reference dropped     free_pages: the pins dropped (refused, expired)

A parallel worker's rank r holds tp rank r % N's KV heads of stage r // N's layers
(`KVLayout.rank_layers`); its export has one `RankPages` per rank, rank 0's first, and its
import takes one list of layers per rank in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagemesh.workers.engine.kv_quant import convert_pages, is_fp8
from pagemesh.workers.engine.kv_relay import gather_pages, rank_layers, scatter_pages
from pagemesh.workers.engine.outputs import PrefillResult

if TYPE_CHECKING:
    from pagemesh.workers.engine.block_manager import BlockManager
    from pagemesh.workers.engine.model_runner import ModelRunner
    from pagemesh.workers.engine.tensor_parallel import FollowerRanks

# the dtypes a pool holds and a transfer carries, by their names on the wire
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class KVLayout:
    """What pages must match to enter this engine's pools: rank r's pool holds `pool_shape[-2]`
    KV heads (tp rank r % tp_size's) of the layers `rank_layers[r]` of the model's `num_layers`."""

    num_layers: int
    tp_size: int
    pp_size: int
    pool_shape: tuple[int, ...]  # rank 0's pool: [its layers, pages, 2 (K,V), page size, its KV heads, head dim]

    @property
    def rank_layers(self) -> list[range]:
        """Every rank's layers, rank 0's first (rank = stage × tp_size + tp rank)."""
        return rank_layers(self.num_layers, self.tp_size, self.pp_size)


@dataclass(frozen=True)
class RankPages:
    """One rank's part of an export."""

    tp_rank: int
    layers: range  # the model's layers the rank's stage holds
    pages: torch.Tensor  # [len(layers), n, 2, S, its KV heads, D] on the CPU, in the pool's dtype
    kv_scales: torch.Tensor | None  # an fp8 pool's [len(layers), 2, its KV heads]; None otherwise


@dataclass(frozen=True)
class PageExport:
    """A prefilled request's pages to send: the prompt's pages [skip_pages, num_pages)."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_ids: list[int]  # one per choice, in choice order
    skip_pages: int  # leading prompt pages not exported (the receiver holds them)
    num_pages: int  # the prompt's pages
    tp_size: int
    ranks: list[RankPages]  # rank 0's first


class HandoffPages:
    """The engine's handoff pages: exports copies of held pages, pins cached prefix pages,
    writes received pages and frees references, in every rank's pool. The `Engine` owns one
    and delegates its handoff API here; `runner` (None: pins and frees only) holds rank 0's
    pool and every rank's fp8 scales, `followers` the other ranks (None: a single rank)."""

    def __init__(
        self,
        blocks: BlockManager,
        layout: KVLayout,
        runner: ModelRunner | None = None,
        followers: FollowerRanks | None = None,
    ) -> None:
        self.blocks, self.kv_layout, self.runner, self.followers = blocks, layout, runner, followers

    def pin_prefix_pages(self, token_ids: Sequence[int], num_pages: int) -> list[int]:
        """A reference on each cached page of the first `num_pages` full pages of `token_ids`
        (fewer where the cache holds fewer): eviction cannot take them until `free_pages`."""
        hits = self.blocks.match_prefix(token_ids)
        pinned = hits[:num_pages]
        self.blocks.free_table(hits[num_pages:])
        return pinned

    def free_pages(self, pages: list[int]) -> None:
        """Drop one reference to each of `pages` (pinned, or any the caller holds) and empty it."""
        self.blocks.free_table(pages)

    def export_pages(self, result: PrefillResult, skip_pages: int) -> PageExport:
        """Copies of a held request's prompt pages from `skip_pages` on, every rank's (at least
        the last page is always exported); the pages stay held."""
        kv_cache, scales = self.runner.kv_cache, self.runner.rank_kv_scales or None
        skip = max(0, min(skip_pages, len(result.block_table) - 1))
        pages = result.block_table[skip:]
        if self.followers is None:
            tp_size, layers, shards = 1, [range(kv_cache.shape[0])], [select_pages(kv_cache, pages)]
        else:
            tp_size, layers = self.kv_layout.tp_size, self.kv_layout.rank_layers
            shards = gather_pages(self.followers, kv_cache, pages, layers)
        ranks = [
            RankPages(rank % tp_size, layers[rank], shard, None if scales is None else scales[rank])
            for rank, shard in enumerate(shards)
        ]
        return PageExport(
            result.request_id,
            list(result.prompt_token_ids),
            list(result.first_token_ids),
            skip,
            len(result.block_table),
            tp_size,
            ranks,
        )

    def write_pages(
        self, block_table: list[int], rank_pages: list[list[torch.Tensor]], rank_sent_scales: list[list[float]]
    ) -> None:
        """Received pages into `block_table`'s pages of every rank's pool (`write_rank_pages`)."""
        runner = self.runner
        write_rank_pages(
            runner.kv_cache, block_table, rank_pages, self.followers, rank_sent_scales, runner.rank_kv_scales
        )


def select_pages(kv_cache: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """`pages` of every layer of a pool as one CPU tensor [L, n, 2, S, H, D] (one copy)."""
    index = torch.tensor(pages, dtype=torch.int64, device=kv_cache.device)
    return kv_cache.index_select(1, index).cpu()


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
