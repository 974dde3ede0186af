"""All-reduce between the tensor-parallel ranks of one worker on one host: gloo against a
shared-memory all-reduce, at the sizes a step all-reduces ([tokens, hidden] after o_proj and
down_proj; SmolLM2-135M's hidden is 576).

    python bench/tp_allreduce.py --world-size 3 [--tokens 1,8,32,128,512,2048] [--dtype float32]

Each rank is a process of this script (`--rank` set by rank 0, which starts the others); rank 0
prints a table of the median microseconds per all-reduce. The shared-memory version: every rank
copies its tensor into its slot of a shared buffer, publishes a generation counter, waits (yielding
the core) until every rank has published, then sums all slots; slots alternate between two
buffers, so one barrier per all-reduce suffices (a rank can reuse a buffer only after every rank
has passed the next barrier, i.e. finished reading it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

HIDDEN = 576


class SharedMemoryAllReduce:
    """Sum of one tensor per rank through shared memory (one host); see the module's docstring."""

    def __init__(self, name: str, rank: int, world_size: int, max_numel: int, dtype: torch.dtype, create: bool):
        self.rank, self.world_size, self.gen = rank, world_size, 0
        item = torch.empty(0, dtype=dtype).element_size()
        slots = 2 * world_size * max_numel * item
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=64 * world_size + slots)
        self.flags = np.ndarray((world_size,), dtype=np.int64, buffer=self.shm.buf[: 8 * world_size])
        if create:
            self.flags[:] = 0
        raw = torch.frombuffer(self.shm.buf[64 * world_size :], dtype=torch.uint8)
        self.slots = raw.view(dtype).view(2, world_size, max_numel)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.gen += 1
        n = x.numel()
        buf = self.slots[self.gen % 2, :, :n]
        buf[self.rank].copy_(x.view(-1))
        self.flags[self.rank] = self.gen  # x86 keeps stores in order: the slot is written before this
        while self.flags.min() < self.gen:
            os.sched_yield()
        torch.sum(buf, dim=0, out=x.view(-1))
        return x

    def close(self, unlink: bool) -> None:
        del self.flags, self.slots
        self.shm.close()
        if unlink:
            self.shm.unlink()


def timed(fn, x: torch.Tensor, iters: int) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def run_rank(args) -> None:
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    sizes = [int(t) for t in args.tokens.split(",")]
    dist.init_process_group(
        "gloo", init_method=args.init, rank=args.rank, world_size=args.world_size, timeout=timedelta(seconds=300)
    )
    numel = max(sizes) * HIDDEN
    if args.rank == 0:
        shm = SharedMemoryAllReduce(args.shm, 0, args.world_size, numel, dtype, create=True)
    dist.barrier()  # rank 0 made the buffer
    if args.rank:
        shm = SharedMemoryAllReduce(args.shm, args.rank, args.world_size, numel, dtype, create=False)
    dist.barrier()
    rows = []
    for tokens in sizes:
        x = torch.full((tokens, HIDDEN), float(args.rank + 1), dtype=dtype)
        expected = sum(range(1, args.world_size + 1))
        y = x.clone()
        shm.all_reduce(y)
        assert torch.all(y == expected), "shared-memory all-reduce is wrong"
        iters = max(20, min(args.iters, 200_000 // tokens))
        gloo_us = timed(lambda t: dist.all_reduce(t), x.clone(), iters)
        shm_us = timed(shm.all_reduce, x.clone(), iters)
        rows.append((tokens, tokens * HIDDEN * x.element_size(), gloo_us, shm_us))
    dist.barrier()
    shm.close(args.rank == 0)
    if args.rank == 0:
        print(f"world size {args.world_size}, {args.dtype}, hidden {HIDDEN}, 1 thread per rank; load {os.getloadavg()}")
        print("| tokens | bytes | gloo µs | shared memory µs | gloo / shm |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for tokens, nbytes, g, s in rows:
            print(f"| {tokens} | {nbytes} | {g:.0f} | {s:.0f} | {g / s:.2f} |")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tokens", default="1,8,32,128,512,2048")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--init", default=None)
    p.add_argument("--shm", default=None)
    args = p.parse_args()
    if args.init is not None:
        return run_rank(args)
    folder = tempfile.mkdtemp(prefix="pagemesh-allreduce-")
    args.init, args.shm = f"file://{folder}/group", f"pagemesh-allreduce-{os.getpid()}"
    base = [sys.executable, __file__, *sys.argv[1:], "--init", args.init, "--shm", args.shm]
    others = [subprocess.Popen([*base, "--rank", str(r)]) for r in range(1, args.world_size)]
    run_rank(args)
    for proc in others:
        proc.wait()


if __name__ == "__main__":
    main()
