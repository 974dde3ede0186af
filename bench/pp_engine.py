"""The pipeline's bubble and throughput through the ENGINE (scheduler, runner, sampler, update),
with 1 against up to M steps in flight: SmolLM2-135M, a pp-stage engine as a worker runs it
(it starts the other stages itself), against the same engine with one rank.

B requests of a random `--prompt`-token prompt each decode `--tokens` tokens, all at once
(`Engine.generate`). The bubble is stage 0's idle share of the run: the time rank 0 waits for a
step's logits (`StepsInFlight.wait_seconds`) over the wall time. With K steps in flight the
engine's scheduler splits the live requests into K micro-batches (workers/engine/in_flight.py);
K = 1 is one step at a time. The depth of one loaded engine is changed between runs (a bench
switch: `scheduler.in_flight.depth`), so every K runs on the same ranks.

On a 2-core CPU this is a correctness feature, not a speed-up: the stages share the two cores,
so overlapping steps can only hide waiting. Figures taken on a loaded machine are noisy.

    python bench/pp_engine.py [--streams 8,32] [--in-flight 1,2] [--prompt 32] [--tokens 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine


def prompts(streams: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 20000, (length,), generator=gen).tolist() for _ in range(streams)]


def run(engine: Engine, streams: int, prompt: int, tokens: int, seed: int) -> dict:
    """One batch of `streams` requests to the end: wall s, output tok/s, bubble, steps applied,
    steps launched while another was in flight."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    steps = engine.scheduler.in_flight
    waited, overlapped = (steps.wait_seconds, steps.overlapped) if steps is not None else (0.0, 0)
    applied = engine.stats.steps
    start = time.perf_counter()
    results = engine.generate(prompts(streams, prompt, seed), params)
    wall = time.perf_counter() - start
    assert all(len(r.token_ids[0]) == tokens for r in results)
    return dict(
        streams=streams,
        wall_s=wall,
        tok_s=streams * tokens / wall,
        bubble=(steps.wait_seconds - waited) / wall if steps is not None else 0.0,
        steps=engine.stats.steps - applied,
        overlapped=(steps.overlapped - overlapped) if steps is not None else 0,
        load=os.getloadavg()[0],
    )


def measure(
    streams: tuple[int, ...] = (8, 32),
    in_flight: tuple[int, ...] = (1, 2),
    stages: int = 2,
    prompt: int = 32,
    tokens: int = 32,
    dtype: str = "float32",
    baseline: bool = True,
) -> list[dict]:
    """Rows of (stages, steps in flight, streams, ...): first one rank with every core's
    threads (`baseline`), then `stages` stages of cores/stages threads each at each depth."""
    cores = os.cpu_count() or 1
    limits = dict(dtype=dtype, max_num_seqs=max(streams), max_num_batched_tokens=max(512, prompt * 8), seed=0)
    rows = []
    configs = ([(1, cores)] if baseline else []) + [(stages, max(1, cores // stages))]
    for m, threads in configs:
        torch.set_num_threads(threads)
        engine = Engine(EngineConfig(pipeline_parallel_size=m, max_steps_in_flight=max(in_flight), **limits))
        try:
            run(engine, 2, prompt, 4, seed=1)  # warm-up
            for k in in_flight if m > 1 else (1,):
                if m > 1:
                    engine.scheduler.in_flight.depth = k
                for b in streams:
                    rows.append(dict(stages=m, in_flight=k, threads=threads, **run(engine, b, prompt, tokens, seed=b)))
        finally:
            engine.close()
            if m > 1:
                torch.distributed.destroy_process_group()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="8,32")
    p.add_argument("--in-flight", default="1,2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-rank rows")
    args = p.parse_args()
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    rows = measure(
        ints(args.streams),
        ints(args.in_flight),
        args.stages,
        args.prompt,
        args.tokens,
        args.dtype,
        not args.no_baseline,
    )
    print("| stages | steps in flight | streams | output tok/s | wall s | stage-0 bubble | steps | overlapped | load |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        bubble = f"{r['bubble']:.2f}" if r["stages"] > 1 else "—"
        print(
            f"| {r['stages']} | {r['in_flight']} | {r['streams']} | {r['tok_s']:.1f} | {r['wall_s']:.1f} | {bubble} "
            f"| {r['steps']} | {r['overlapped']} | {r['load']:.1f} |"
        )


if __name__ == "__main__":
    main()
