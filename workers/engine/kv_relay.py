"""A tensor-parallel worker's KV pages in and out of its follower ranks, relayed by rank 0.

Each rank's pool holds its share of the KV heads, so a handoff between two N-rank workers moves
N shards: rank i's pages go to the other worker's rank i. Rank 0 is the worker's only face to
the mesh (one KV endpoint, one acknowledgement, one deadline), so it relays:

    prefill worker                                         decode worker
    rank 0 ─export cmd─▶ ranks 1..N-1 (their pipe)         rank 0 ─import cmd─▶ ranks 1..N-1
    dist.gather: every rank's [L, n, 2, S, H/N, D]         dist.scatter: rank i gets shard i,
      shard ─▶ rank 0 ─▶ N KVPagesHeader messages ═══════▶   writes it into the same page ids
                          (tp_rank i, tp_size N)            (every rank's block table is rank 0's)

The command goes down the follower's step pipe (a msgpack map, where a step is a msgpack array),
and the collective follows on the worker's process group: followers run pipe frames in order and
rank 0 issues them between steps, so every rank meets the same collective. Pure of zmq.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from workers.engine.tensor_parallel import FollowerRanks


@dataclass(frozen=True)
class KVPageCommand:
    """Rank 0 -> followers: `export` (gather these pages' shards to rank 0) or import (receive
    them by scatter and write them into these pages)."""

    export: bool
    pages: list[int]


def encode_kv_command(cmd: KVPageCommand) -> bytes:
    return msgpack.packb({"kv": "export" if cmd.export else "import", "pages": cmd.pages})


def is_kv_command(frame: bytes) -> bool:
    """A KV command is a msgpack fixmap (first byte 0x80-0x8f); a step is an array."""
    return bool(frame) and frame[0] & 0xF0 == 0x80


def decode_kv_command(frame: bytes) -> KVPageCommand:
    """Raises ValueError on anything else (the bytes come from rank 0 of the same worker)."""
    value = msgpack.unpackb(frame, raw=False)
    if not isinstance(value, dict) or value.keys() != {"kv", "pages"} or value["kv"] not in ("export", "import"):
        raise ValueError(f"kv command: unexpected {value!r:.80}")
    return KVPageCommand(export=value["kv"] == "export", pages=[int(p) for p in value["pages"]])


def _index(kv_cache: torch.Tensor, pages: list[int]) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.int64, device=kv_cache.device)


def gather_pages(followers: FollowerRanks, kv_cache: torch.Tensor, pages: list[int]) -> list[torch.Tensor]:
    """Rank 0: every rank's `pages` as CPU tensors [layers, len(pages), 2, S, kv_heads/N, D],
    rank 0's first."""
    import torch.distributed as dist

    followers.send_frame(encode_kv_command(KVPageCommand(export=True, pages=pages)))
    mine = kv_cache.index_select(1, _index(kv_cache, pages))
    shards = [torch.empty_like(mine) for _ in range(followers.spec.world_size)]
    dist.gather(mine, gather_list=shards, dst=0)
    return [s.cpu() for s in shards]


def scatter_pages(
    followers: FollowerRanks, kv_cache: torch.Tensor, pages: list[int], shards: list[torch.Tensor]
) -> None:
    """Rank 0: write shard i ([layers, len(pages), 2, S, kv_heads/N, D]) into rank i's `pages`."""
    import torch.distributed as dist

    followers.send_frame(encode_kv_command(KVPageCommand(export=False, pages=pages)))
    on_device = [s.to(kv_cache.device).contiguous() for s in shards]
    mine = torch.empty_like(on_device[0])
    dist.scatter(mine, scatter_list=on_device, src=0)
    kv_cache.index_copy_(1, _index(kv_cache, pages), mine)


def follow_kv_command(cmd: KVPageCommand, kv_cache: torch.Tensor) -> None:
    """A follower: take part in the gather or scatter rank 0 started."""
    import torch.distributed as dist

    index = _index(kv_cache, cmd.pages)
    if cmd.export:
        dist.gather(kv_cache.index_select(1, index), dst=0)
        return
    shard = torch.empty(
        (kv_cache.shape[0], len(cmd.pages), *kv_cache.shape[2:]), dtype=kv_cache.dtype, device=kv_cache.device
    )
    dist.scatter(shard, src=0)
    kv_cache.index_copy_(1, index, shard)
