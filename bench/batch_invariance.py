"""What the batch-invariant mode costs: prefill and decode with `--batch-invariant` on and off.

    python bench/batch_invariance.py [--rounds 3] [--quantization gguf] [--kv-cache-dtype auto]
                                     [--prompts 128,512,2048] [--streams 1,32] [--tokens 64]

Two engines in this process (set up as `pagemesh worker` sets itself up: passive OpenMP waits,
the usable cores), the embedded SmolLM2-135M, one with `batch_invariant=True`. Per round, in
alternating order: the time to prefill one prompt of each length (`max_tokens=1`: the engine's
time to first token), and output tok/s of `streams` greedy requests of 128-token prompts
decoding `--tokens` tokens each (their prefill included). Prints the medians over rounds and
on/off ratios (> 1: the invariant mode is slower for prefill, faster for tok/s), and the load
average before and after: this machine is shared, read the figures of one run against each other.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--prompts", default="128,512,2048", help="prefill lengths (tokens)")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each stream decodes")
    args = parser.parse_args()

    from pagemesh.common.cpu_threads import prepare_worker_threads

    prepare_worker_threads()
    import torch

    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    def engine(invariant: bool) -> Engine:
        config = EngineConfig(
            batch_invariant=invariant,
            quantization=args.quantization,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory_gb=0.75,
            enable_prefix_caching=False,  # every round prefills its prompts again
            max_model_len=4096,
        )
        return Engine(config)

    engines = {"off": engine(False), "on": engine(True)}
    vocab = engines["off"].model_config.vocab_size
    rng = random.Random(0)
    lengths = [int(x) for x in args.prompts.split(",") if x]
    streams = [int(x) for x in args.streams.split(",") if x]
    load_before = os.getloadavg()[0]
    print(
        f"SmolLM2-135M quantization={args.quantization} dtype={args.dtype} kv={args.kv_cache_dtype}, "
        f"{torch.get_num_threads()} threads, load average {load_before:.2f}",
        flush=True,
    )

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    prefill: dict[tuple[str, int], list[float]] = {}
    decode: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
        for n in lengths:
            p = prompt(n)
            for name in order:
                t = time.perf_counter()
                engines[name].generate([p], SamplingParams(temperature=0, max_tokens=1))
                prefill.setdefault((name, n), []).append(time.perf_counter() - t)
        for s in streams:
            ps = [prompt(128) for _ in range(s)]
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            for name in order:
                t = time.perf_counter()
                engines[name].generate(ps, params)
                decode.setdefault((name, s), []).append(s * args.tokens / (time.perf_counter() - t))
        print(f"round {r + 1} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)

    print("\n| prefill of one prompt | off (s) | on (s) | on/off |\n| --- | ---: | ---: | ---: |")
    for n in lengths:
        off, on = (statistics.median(prefill[(k, n)]) for k in ("off", "on"))
        print(f"| {n} tokens | {off:.3f} | {on:.3f} | {on / off:.2f}x |")
    print(f"\n| streams (128 -> {args.tokens} tokens) | off tok/s | on tok/s | on/off |")
    print("| --- | ---: | ---: | ---: |")
    for s in streams:
        off, on = (statistics.median(decode[(k, s)]) for k in ("off", "on"))
        print(f"| {s} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")
    print(f"\nload average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; medians of {args.rounds} rounds")


if __name__ == "__main__":
    main()
