"""Wall time against block fraction at 16 clients: does a cached step cost its share of blocks?

    python -m pagemesh.bench.diffusion_cache_wall [--requests 16] [--steps 25] [--rounds 6]
        [--caches teacache:0.1,fbcache:0.1,interval:3] [--fewer 11,13]

16 one-image requests (guidance 2: 2 rows each, dpmsolver++) run together in one in-process
engine (step-level batching, one torch thread), uncached, with each cache policy, and at fewer
steps; the DiT's blocks as straight-line calls (pipelines/dit_lean.py) and as diffusers' module
calls, side by side in every round, the order alternating. Prints ms per image (median of the
rounds), each setting's block fraction, and time / (uncached time × block fraction): 1.0 means a
cached step costs exactly its share of blocks; issue 33's goal is at most 1.15.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineConfig, ImageJob
from pagemesh.workers.diffusion.pipelines.embedded import load_embedded


def run(pipeline, cache: str, steps: int, requests: int) -> tuple[float, float]:
    """(ms per image, block fraction computed) of `requests` one-image requests run together."""
    engine = DiffusionEngine(pipeline, EngineConfig(max_running=requests))
    started = time.perf_counter()
    for i in range(requests):
        params = ImageParams(
            prompt=f"a {i % 10}",
            negative_prompt=None,
            n=1,
            width=None,
            height=None,
            num_inference_steps=steps,
            guidance_scale=2.0,
            sampler="dpmsolver++",
            seed=i,
            cache=cache,
        )
        engine.add(ImageJob(request_id=f"r{i}", params=params, arrival=time.monotonic()))
    while engine.has_work():
        engine.step()
    ms = (time.perf_counter() - started) * 1e3 / requests
    stats = engine.stats()
    return ms, stats.blocks_computed / max(1, stats.blocks_computed + stats.blocks_skipped)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--caches", default="teacache:0.1,fbcache:0.1,interval:3")
    p.add_argument("--fewer", default="11,13", help="step counts of the fewer-steps runs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pipeline = load_embedded()
    settings = [("none", args.steps)] + [(c, args.steps) for c in args.caches.split(",") if c]
    settings += [("none", int(s)) for s in args.fewer.split(",") if s]
    times: dict[tuple, list[float]] = {}
    fractions: dict[tuple, float] = {}
    run(pipeline, "none", 4, 2)  # warm-up
    for r in range(args.rounds):
        for lean in (False, True) if r % 2 == 0 else (True, False):
            pipeline.block_forward.lean = lean
            for cache, steps in settings:
                ms, fraction = run(pipeline, cache, steps, args.requests)
                times.setdefault((lean, cache, steps), []).append(ms)
                fractions[(cache, steps)] = fraction * (steps / args.steps)
    print(f"{args.requests} requests x {args.steps} steps, dpmsolver++, guidance 2, {args.rounds} rounds")
    print(f"{'blocks':<10} {'setting':<14} {'fraction':>8} {'ms/image':>9} {'time/(full x fraction)':>24}")
    for lean in (False, True):
        full = statistics.median(times[(lean, "none", args.steps)])
        for cache, steps in settings:
            ms = statistics.median(times[(lean, cache, steps)])
            label = cache if steps == args.steps else f"{steps} steps"
            fraction = fractions[(cache, steps)]
            print(
                f"{'lean' if lean else 'diffusers':<10} {label:<14} {fraction:>8.2f} {ms:>9.2f} "
                f"{ms / (full * fraction):>24.2f}"
            )


if __name__ == "__main__":
    main()
