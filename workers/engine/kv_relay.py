"""A parallel worker's KV pages in and out of its follower ranks, relayed by rank 0.

Each rank's pool holds its share of the KV heads (tensor parallel) of its stage's layers
(pipeline parallel), so a handoff between two workers of N×M ranks moves N×M shards: rank r's
pages go to the other worker's rank r (tp rank r % N, stage r // N: the same heads, the same
layers). Rank 0 is the worker's only face to the mesh (one KV endpoint, one acknowledgement, one
deadline), so it relays:

    prefill worker                                         decode worker
    rank 0 ─export cmd─▶ ranks 1..N-1 (their pipe)         rank 0 ─import cmd─▶ ranks 1..N-1
    dist.gather: every rank's [Ls, n, 2, S, H/N, D]        dist.scatter: rank r gets shard r,
      shard ─▶ rank 0 ─▶ N×M KVPagesHeader messages ═════▶   writes it into the same page ids
              (tp_rank r % N, tp_size N, its stage's        (every rank's block table is rank 0's)
               layer range [layer_start, layer_end))

A collective takes tensors of one shape, and stages differ by a layer where M does not divide
the layers (`stage_layers`): every shard is padded to stage 0's count (the largest) on the way
and trimmed after; the command says that count.

An fp8 pool's pages cross the group as their bytes (uint8: gloo has no fp8), and each rank's
scales reach rank 0 once, at start (`gather_kv_scales`), so that each part's header carries its
rank's scales and the receiving rank 0 converts each part for its own rank's pool.

The command goes down the follower's step pipe (a msgpack map, where a step is a msgpack array),
and the collective follows on the worker's process group: followers run pipe frames in order and
rank 0 issues them between steps, so every rank meets the same collective. Pure of zmq.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from pagemesh.workers.engine.kv_quant import is_fp8
from pagemesh.workers.engine.pipeline_parallel import stage_layers
from pagemesh.workers.engine.tensor_parallel import FollowerRanks


@dataclass(frozen=True)
class KVPageCommand:
    """Rank 0 -> followers: `export` (gather these pages' shards to rank 0) or import (receive
    them by scatter and write them into these pages); every shard crosses padded to `layers`
    layers (stage 0's count)."""

    export: bool
    pages: list[int]
    layers: int = 0  # 0: the rank's own count (one stage)


def rank_layers(num_layers: int, tp_size: int, pp_size: int) -> list[range]:
    """Every rank's layers, rank 0's first (rank = stage × tp_size + tp rank)."""
    return [stage_layers(num_layers, pp_size, rank // tp_size) for rank in range(tp_size * pp_size)]


def encode_kv_command(cmd: KVPageCommand) -> bytes:
    return msgpack.packb({"kv": "export" if cmd.export else "import", "pages": cmd.pages, "layers": cmd.layers})


def is_kv_command(frame: bytes) -> bool:
    """A KV command is a msgpack fixmap (first byte 0x80-0x8f); a step is an array."""
    return bool(frame) and frame[0] & 0xF0 == 0x80


def decode_kv_command(frame: bytes) -> KVPageCommand:
    """Raises ValueError on anything else (the bytes come from rank 0 of the same worker)."""
    value = msgpack.unpackb(frame, raw=False)
    if (
        not isinstance(value, dict)
        or value.keys() != {"kv", "pages", "layers"}
        or value["kv"] not in ("export", "import")
    ):
        raise ValueError(f"kv command: unexpected {value!r:.80}")
    return KVPageCommand(
        export=value["kv"] == "export", pages=[int(p) for p in value["pages"]], layers=int(value["layers"])
    )


def gather_kv_scales(kv_scales: torch.Tensor, num_layers: int, tp_size: int, pp_size: int) -> list[torch.Tensor] | None:
    """Every rank at once, after its fp8 pool is calibrated: rank 0 gets every rank's scales
    [its layers, 2, kv_heads / N] fp32 (CPU), rank 0's first; the others get None."""
    import torch.distributed as dist

    layers = rank_layers(num_layers, tp_size, pp_size)
    mine = _padded(kv_scales.float().cpu(), len(layers[0])).contiguous()
    if dist.get_rank() != 0:
        dist.gather(mine, dst=0)
        return None
    shards = [torch.empty_like(mine) for _ in layers]
    dist.gather(mine, gather_list=shards, dst=0)
    return [s[: len(r)] for s, r in zip(shards, layers, strict=True)]


def _wire(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool as the collectives move it: an fp8 pool as its bytes (gloo has no fp8 type, and a
    CPU fp8 tensor has no index_copy_)."""
    return kv_cache.view(torch.uint8) if is_fp8(kv_cache.dtype) else kv_cache


def _index(kv_cache: torch.Tensor, pages: list[int]) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.int64, device=kv_cache.device)


def _padded(shard: torch.Tensor, layers: int) -> torch.Tensor:
    """`shard` [Ls, ...] with zero layers appended up to `layers` (a later stage may hold one
    layer fewer than stage 0)."""
    if shard.shape[0] >= layers:
        return shard
    return torch.cat([shard, shard.new_zeros((layers - shard.shape[0], *shard.shape[1:]))])


def gather_pages(
    followers: FollowerRanks, kv_cache: torch.Tensor, pages: list[int], layers: list[range]
) -> list[torch.Tensor]:
    """Rank 0: every rank's `pages` as CPU tensors [len(layers[r]), len(pages), 2, S, kv_heads/N,
    D], rank 0's first (`layers`: every rank's, `rank_layers`)."""
    import torch.distributed as dist

    width = len(layers[0])  # stage 0 holds the most layers: every shard crosses at its count
    followers.send_frame(encode_kv_command(KVPageCommand(export=True, pages=pages, layers=width)))
    pool = _wire(kv_cache)
    mine = _padded(pool.index_select(1, _index(kv_cache, pages)), width)
    shards = [torch.empty_like(mine) for _ in range(followers.spec.total_ranks)]
    dist.gather(mine, gather_list=shards, dst=0)
    return [s[: len(r)].cpu().view(kv_cache.dtype) for s, r in zip(shards, layers, strict=True)]


def scatter_pages(
    followers: FollowerRanks, kv_cache: torch.Tensor, pages: list[int], shards: list[torch.Tensor]
) -> None:
    """Rank 0: write shard r ([rank r's layers, len(pages), 2, S, kv_heads/N, D]) into rank r's
    `pages`; shard 0 (rank 0's, stage 0's) has the most layers."""
    import torch.distributed as dist

    width = shards[0].shape[0]
    followers.send_frame(encode_kv_command(KVPageCommand(export=False, pages=pages, layers=width)))
    pool = _wire(kv_cache)
    on_device = [_padded(_wire(s.to(kv_cache.device).contiguous()), width).contiguous() for s in shards]
    mine = torch.empty_like(on_device[0])
    dist.scatter(mine, scatter_list=on_device, src=0)
    pool.index_copy_(1, _index(kv_cache, pages), mine)


def follow_kv_command(cmd: KVPageCommand, kv_cache: torch.Tensor) -> None:
    """A follower: take part in the gather or scatter rank 0 started (its shards padded to
    `cmd.layers` layers on the wire, its own `kv_cache.shape[0]` in its pool)."""
    import torch.distributed as dist

    index = _index(kv_cache, cmd.pages)
    pool = _wire(kv_cache)
    own, width = pool.shape[0], max(cmd.layers, pool.shape[0])
    if cmd.export:
        dist.gather(_padded(pool.index_select(1, index), width).contiguous(), dst=0)
        return
    shard = torch.empty((width, len(cmd.pages), *pool.shape[2:]), dtype=pool.dtype, device=pool.device)
    dist.scatter(shard, src=0)
    pool.index_copy_(1, index, shard[:own])
