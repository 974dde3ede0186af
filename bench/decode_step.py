"""Time one decode step of the engine at a fixed batch, and say where it goes.

    python bench/decode_step.py [--batch 32] [--prompt-len 128] [--dtype bfloat16] [--profile]
    python bench/decode_step.py --prefill [--batch 16] [--prompt-len 128]

Fills the engine with `batch` requests of `prompt-len` random tokens, runs their prefill, then
times `--steps` decode steps (median). `--profile` adds the torch profiler's table of ops and a
cProfile of the Python side (the C kernels show up there, by their Python wrappers).
`--prefill` times instead one step that prefills `batch` fresh prompts at once (a 2048-token
budget: the first step of a burst of arrivals), median of `--steps` waves.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--prefill", action="store_true")
    args = parser.parse_args()
    if args.prefill:
        return time_prefill(args)
    engine = Engine(
        EngineConfig(dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=512, enable_prefix_caching=False)
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
    while engine.stats.decode_tokens < args.batch:  # prefill, then every sequence decoding
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    print(
        f"batch {args.batch}, context ~{args.prompt_len + 4 + args.steps // 2}, {args.dtype}: "
        f"decode step {statistics.median(times) * 1000:.1f} ms (median of {args.steps}), "
        f"{args.batch / statistics.median(times):.0f} tok/s; attention backend {type(engine.runner.attention).__name__}"
    )
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(args.steps):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [engine.step() for _ in range(args.steps)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def time_prefill(args) -> None:
    tokens = args.batch * args.prompt_len
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, tokens),
            enable_prefix_caching=False,
        )
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for wave in range(args.steps + 2):  # two waves to warm up
        for i in range(args.batch):
            engine.add_request(f"{wave}-{i}", [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    step = statistics.median(times[2:])
    print(
        f"prefill step of {args.batch} x {args.prompt_len} tokens, {args.dtype}: {step * 1000:.1f} ms "
        f"(median of {args.steps}), {tokens / step:.0f} tok/s"
    )


if __name__ == "__main__":
    main()
