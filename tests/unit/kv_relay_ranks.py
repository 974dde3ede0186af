"""The ranks of tests/unit/test_kv_relay.py's relay test, in a module of their own: a spawned rank
imports its target by module name, and pytest's names for test modules are not importable."""

from __future__ import annotations

from pathlib import Path

import torch

from pagemesh.workers.engine.kv_relay import (
    decode_kv_command,
    follow_kv_command,
    gather_kv_scales,
    gather_pages,
    rank_layers,
    scatter_pages,
)
from pagemesh.workers.engine.tensor_parallel import FollowerSpec, init_group

LAYERS, PAGES = 3, 6  # tp 2 x pp 2 over 3 layers: stage 0 holds [0, 2), stage 1 [2, 3) (padded on the wire)
TP, PP = 2, 2


def pool_of(rank: int) -> torch.Tensor:
    """Rank `rank`'s pool [its layers, PAGES, 2, 4, 1, 2]: every value says (layer, page, tp rank)."""
    layers = rank_layers(LAYERS, TP, PP)[rank]
    pool = torch.zeros(len(layers), PAGES, 2, 4, 1, 2)
    for i, layer in enumerate(layers):
        for page in range(PAGES):
            pool[i, page] = layer * 100 + page * 10 + rank % TP
    return pool


class PipeToFollowers:
    """Rank 0's side of the followers' pipes, as FollowerRanks sends a KV command (here a queue
    per follower instead of its stdin: the frame and the collective are the real ones)."""

    def __init__(self, queues):
        self.queues = queues
        self.spec = FollowerSpec(Path("m"), "float32", "cpu", PAGES, 4, TP, pipeline_size=PP)

    def send_frame(self, data: bytes) -> None:
        for queue in self.queues:
            queue.put(data)


def scales_of(rank: int) -> torch.Tensor:
    """Rank `rank`'s fp8 scales [its layers, 2, 1], each saying (rank, layer)."""
    layers = rank_layers(LAYERS, TP, PP)[rank]
    return torch.tensor([[[rank + 1 + layer / 8]] * 2 for layer in layers])


def run_rank(rank: int, init_method: str, queues, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_group(rank, TP * PP, init_method, "cpu")
    for dtype in (torch.float32, torch.float8_e4m3fn):  # an fp8 pool crosses as its bytes
        pool = pool_of(rank).to(dtype)
        scales = gather_kv_scales(scales_of(rank), LAYERS, TP, PP)
        if rank == 0:
            followers = PipeToFollowers(queues)
            gathered = gather_pages(followers, pool, [1, 3], rank_layers(LAYERS, TP, PP))
            shards = [(-pool_of(r).index_select(1, torch.tensor([2, 4]))).to(dtype) for r in range(TP * PP)]
            scatter_pages(followers, pool, [4, 5], shards)
            torch.save((gathered, scales), f"{out_dir}/gathered-{dtype}.pt")
            for queue in queues:
                queue.put(None)
        else:
            assert scales is None  # rank 0's alone
            while (frame := queues[rank - 1].get()) is not None:
                follow_kv_command(decode_kv_command(frame), pool)
        torch.save(pool, f"{out_dir}/pool{rank}-{dtype}.pt")
