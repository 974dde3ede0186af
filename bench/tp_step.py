"""One model step of a tensor-parallel worker against one rank: SmolLM2-135M (fp32), a decode
step of B sequences and a prefill chunk, through the real rank processes, with the all-reduce in
shared memory or over gloo. On a 2-core CPU this measures the cost of the ranks (the step and the
all-reduces), not a speed-up: there are no spare cores for the shards to run on.

    python bench/tp_step.py [--world-sizes 1,3] [--batch 8] [--context 128] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagemesh.common.model_config import read_model_config
from pagemesh.common.model_files import default_model_path
from pagemesh.workers.engine.model_input import ModelInput
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.tensor_parallel import FollowerRanks, FollowerSpec, create_shared_all_reduce, rank_context
from pagemesh.workers.model.loader import load_model

PAGE = 16


def steps(batch: int, context: int, prefill: int) -> tuple[ModelInput, ModelInput]:
    pages = (context + PAGE) // PAGE
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(batch)]
    decode = ModelInput([7] * batch, [1] * batch, [context] * batch, tables, list(range(batch)), [], batch)
    first = 1 + batch * pages
    chunk_table = list(range(first, first + (prefill + PAGE - 1) // PAGE))
    chunk = ModelInput([7] * prefill, [prefill], [prefill], [chunk_table], [prefill - 1], [])
    return decode, chunk


def timed(runner: ModelRunner, step: ModelInput, iters: int) -> float:
    for _ in range(3):
        runner.execute(step)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(world: int, all_reduce: str, args) -> tuple[float, float]:
    path, cpu, dtype = default_model_path(), torch.device("cpu"), torch.float32
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    shm, numel = (None, 0)
    if world > 1 and all_reduce == "shared":
        shm, numel = create_shared_all_reduce(world, read_model_config(path), 2048, dtype, cpu)
    model = load_model(path, dtype, cpu, rank_context(0, world, shm, numel, dtype))
    num_pages = args.batch * ((args.context + PAGE) // PAGE) + (args.prefill + PAGE - 1) // PAGE + 1
    followers = None
    if world > 1:
        spec = FollowerSpec(path, "float32", "cpu", num_pages, PAGE, world, torch.get_num_threads(), shm, numel)
        followers = FollowerRanks(spec)
    try:
        runner = ModelRunner(model, num_pages, PAGE, cpu, followers=followers)
        decode, chunk = steps(args.batch, args.context, args.prefill)
        return timed(runner, decode, args.iters), timed(runner, chunk, max(3, args.iters // 4))
    finally:
        if followers is not None:
            followers.close()
            torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="1,3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    print(f"SmolLM2-135M fp32, decode of {args.batch} x {args.context} context, prefill chunk of {args.prefill}")
    print("| ranks | all-reduce | decode step ms | prefill step ms | load |")
    print("| ---: | --- | ---: | ---: | --- |")
    for world in [int(w) for w in args.world_sizes.split(",")]:
        for all_reduce in ("shared", "gloo") if world > 1 else ("none",):
            decode_ms, prefill_ms = measure(world, all_reduce, args)
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"| {world} | {all_reduce} | {decode_ms:.1f} | {prefill_ms:.1f} | {load} |", flush=True)


if __name__ == "__main__":
    main()
