"""Decode throughput of a pipeline-parallel worker against one rank, and the pipeline's bubble
against the number of batches in flight: SmolLM2-135M (fp32), the model runner alone (no
scheduler or sampler), through the real rank processes.

B streams decode at a fixed context; with M stages and K batches in flight the streams are split
into K micro-batches of B/K that rank 0 launches round-robin, keeping K launched and not yet
collected (`ModelRunner.launch`), so stage 1 runs micro-batch k while stage 0 runs k+1. The bubble
is stage 0's idle share: the time rank 0 waits for logits over the wall time. K = 1 is one step
in flight (the engine's own micro-batches, through its scheduler: bench/pp_engine.py).

On a 2-core CPU this is a correctness feature, not a speed-up: the stages share the same two
cores, so overlap can only hide the transfer and the waiting, never add compute.

    python bench/pp_step.py [--streams 1,8,32] [--in-flight 1,2,4] [--context 128] [--rounds 8]
    python bench/pp_step.py --transfer      # one activation hand-over: gloo point-to-point vs a pipe

`measure(...)` is the entry for other drivers (`pagemesh experiment parallel`): rows as dicts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from pagemesh.common.model_config import read_model_config
from pagemesh.common.model_files import default_model_path
from pagemesh.workers.engine.model_input import ModelInput
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.engine.pipeline_parallel import StagePipe, stage_layers
from pagemesh.workers.engine.tensor_parallel import COLLECTIVE_TIMEOUT_S, FollowerRanks, FollowerSpec, rank_context
from pagemesh.workers.model.loader import load_model

PAGE = 16


def micro_batches(streams: int, in_flight: int, context: int) -> list[ModelInput]:
    """`in_flight` decode steps over disjoint streams (and pages), as even as can be."""
    pages = (context + PAGE) // PAGE
    steps, first = [], 0
    for k in range(in_flight):
        n = streams // in_flight + (k < streams % in_flight)
        tables = [list(range(1 + (first + i) * pages, 1 + (first + i + 1) * pages)) for i in range(n)]
        steps.append(ModelInput([7] * n, [1] * n, [context] * n, tables, list(range(n)), [], n))
        first += n
    return steps


def runner_for(path: Path, stages: int, num_pages: int, threads: int) -> tuple[ModelRunner, FollowerRanks | None]:
    cpu, dtype = torch.device("cpu"), torch.float32
    torch.set_num_threads(threads)
    if stages == 1:
        return ModelRunner(load_model(path, dtype, cpu), num_pages, PAGE, cpu), None
    cfg = read_model_config(path)
    model = load_model(path, dtype, cpu, rank_context(0, 1, None, 0, dtype), stage_layers(cfg.num_layers, stages, 0))
    pipe = StagePipe(0, 1, stages, cfg, dtype, cpu, COLLECTIVE_TIMEOUT_S)
    followers = FollowerRanks(FollowerSpec(path, "float32", "cpu", num_pages, PAGE, 1, threads, pipeline_size=stages))
    return ModelRunner(model, num_pages, PAGE, cpu, followers=followers, pipe=pipe), followers


def run_rounds(runner: ModelRunner, steps: list[ModelInput], rounds: int) -> tuple[float, float]:
    """(seconds per round of every micro-batch, share of the wall time spent waiting for logits),
    keeping len(steps) launched; the first round warms up."""
    in_flight, waited = [], 0.0
    start = None
    for r in range(rounds + 1):
        if r == 1:
            start, waited = time.perf_counter(), 0.0
        for step in steps:
            if len(in_flight) == len(steps):
                t = time.perf_counter()
                in_flight.pop(0).result()
                waited += time.perf_counter() - t
            in_flight.append(runner.launch(step))
    t = time.perf_counter()
    for f in in_flight:
        f.result()
    waited += time.perf_counter() - t
    wall = time.perf_counter() - start
    return wall / rounds, waited / wall


def measure(
    streams: tuple[int, ...] = (1, 8, 32),
    in_flight: tuple[int, ...] = (1, 2, 4),
    stages: tuple[int, ...] = (1, 2),
    context: int = 128,
    rounds: int = 8,
    model: Path | None = None,
) -> list[dict]:
    """One row per (stages, batches in flight, streams): tok/s of the decode, ms per round (a step
    of every stream), stage 0's bubble share, and the load average while it ran. Rows where the
    streams do not fill the batches (B < K) are skipped; one stage has no batches to overlap."""
    path = model or default_model_path()
    pages_per_stream = (context + PAGE) // PAGE
    cores = os.cpu_count() or 1
    rows = []
    for m in stages:
        runner, followers = runner_for(path, m, max(streams) * pages_per_stream + 1, max(1, cores // m))
        try:
            for k in in_flight if m > 1 else (1,):
                for b in streams:
                    if b < k:
                        continue
                    per_round, bubble = run_rounds(runner, micro_batches(b, k, context), rounds)
                    rows.append(
                        dict(
                            stages=m,
                            in_flight=k,
                            streams=b,
                            tok_s=b / per_round,
                            round_ms=per_round * 1e3,
                            bubble=bubble if m > 1 else 0.0,
                            load=os.getloadavg()[0],
                        )
                    )
        finally:
            if followers is not None:
                followers.close()
                torch.distributed.destroy_process_group()
    return rows


def _ping_pong(rank: int, init: str, tokens: tuple[int, ...], reps: int, pipe, out) -> None:
    """Two processes hand [2, T, 576] fp32 (SmolLM2's activations) back and forth, over gloo
    point-to-point and over an OS pipe (bytes, what a zmq ipc socket also does); rank 0 puts the
    median one-way µs of each into `out`."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results = {}
    for t in tokens:
        x = torch.randn(2, t, 576)
        for channel in ("gloo", "pipe"):
            times = []
            for _ in range(reps + 2):
                start = time.perf_counter()
                if channel == "gloo" and rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                elif channel == "gloo":
                    dist.recv(x, 0)
                    dist.send(x, 0)
                elif rank == 0:
                    pipe.send_bytes(x.numpy().tobytes())
                    x = torch.frombuffer(bytearray(pipe.recv_bytes()), dtype=torch.float32).view(2, t, 576)
                else:
                    x = torch.frombuffer(bytearray(pipe.recv_bytes()), dtype=torch.float32).view(2, t, 576)
                    pipe.send_bytes(x.numpy().tobytes())
                times.append((time.perf_counter() - start) / 2)
            results[(t, channel)] = statistics.median(times[2:]) * 1e6
    if rank == 0:
        out.put(results)


def transfer(tokens: tuple[int, ...] = (1, 32, 512, 2048), reps: int = 30) -> list[dict]:
    """One-way µs of a stage's activations, gloo against a pipe, per token count."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = "file://" + os.path.join(folder, "group")
        procs = [ctx.Process(target=_ping_pong, args=(r, init, tokens, reps, end, out)) for r, end in ((0, a), (1, b))]
        for proc in procs:
            proc.start()
        results = out.get()
        for proc in procs:
            proc.join()
    return [
        dict(tokens=t, bytes=2 * t * 576 * 4, gloo_us=results[(t, "gloo")], pipe_us=results[(t, "pipe")])
        for t in tokens
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--in-flight", default="1,2,4")
    p.add_argument("--stages", default="1,2")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--transfer", action="store_true", help="time one activation hand-over instead")
    args = p.parse_args()
    if args.transfer:
        print("| tokens | bytes | gloo µs | pipe µs | load |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for r in transfer():
            print(
                f"| {r['tokens']} | {r['bytes']} | {r['gloo_us']:.0f} | {r['pipe_us']:.0f} | {os.getloadavg()[0]:.1f} |"
            )
        return

    def ints(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split(","))

    rows = measure(ints(args.streams), ints(args.in_flight), ints(args.stages), args.context, args.rounds)
    print(f"SmolLM2-135M fp32, decode at {args.context} tokens of context, {args.rounds} rounds")
    print("| stages | batches in flight | streams | tok/s | ms per round | stage-0 bubble | load |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['stages']} | {r['in_flight']} | {r['streams']} | {r['tok_s']:.1f} | {r['round_ms']:.1f} "
            f"| {r['bubble']:.2f} | {r['load']:.1f} |"
        )
    print(f"median load {statistics.median(r['load'] for r in rows):.1f}")


if __name__ == "__main__":
    main()
