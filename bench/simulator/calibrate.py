"""Fit the CPU step-time model from the real engine on this machine.

Runs the real `Engine` (the embedded model, in-process, `threads` torch threads as a worker
would have) over a grid of batch shapes — decode batches of 1..64 rows at several contexts,
prompt chunks of 16..2048 tokens, and mixes of both — records each step's shape (from the
scheduler's own plan) and its wall time, and fits `LinearStepCost` to them. Each shape is
stepped a few times and the median kept; the first steps (warm-up) are dropped.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.simulator.cost import LinearStepCost, StepShape
from bench.simulator.worker import shape_of

# (prompt length, requests, output tokens): prompts alone, then decode batches at growing contexts
GRID = [(16, 1, 24), (128, 1, 24), (512, 1, 8), (1024, 1, 4), (128, 8, 24), (128, 32, 24), (256, 64, 16), (900, 4, 24)]


def measure(threads: int, budget: int = 2048, grid=GRID, repeats_per_step: int = 1) -> list[tuple[StepShape, float]]:
    import torch

    from common.sampling import SamplingParams
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine(
        EngineConfig(
            max_num_batched_tokens=budget, enable_prefix_caching=False, max_num_seqs=64, kv_cache_memory_gb=0.25
        )
    )
    samples: list[tuple[StepShape, float]] = []
    original = engine.scheduler.schedule
    shapes: list[StepShape] = []

    def recording_schedule():
        plan = original()
        shapes.append(shape_of(plan))
        return plan

    engine.scheduler.schedule = recording_schedule
    vocab = engine.model_config.vocab_size
    for prompt_len, count, outputs in grid:
        params = SamplingParams(temperature=0.0, max_tokens=outputs, ignore_eos=True)
        for i in range(count):
            ids = [(7 + 31 * (i + 1) * (j + 1)) % vocab for j in range(prompt_len)]
            engine.add_request(f"cal-{prompt_len}-{count}-{i}", ids, params)
        first = True
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            took = time.perf_counter() - started
            if not first:  # the first step of a batch also pays one-off allocations
                samples.append((shapes[-1], took))
            first = False
    return samples


def fit(samples: list[tuple[StepShape, float]], source: str) -> LinearStepCost:
    grouped: dict[StepShape, list[float]] = {}
    for shape, seconds in samples:
        grouped.setdefault(shape, []).append(seconds)
    medians = [
        (shape, statistics.median(times))
        for shape, times in grouped.items()
        if shape.prefill_tokens or shape.decode_rows
    ]
    return LinearStepCost.fit(medians, source=source)


def calibrate(out: Path, threads: int) -> LinearStepCost:
    import os

    started = time.time()
    samples = measure(threads)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    model = fit(samples, source=f"{len(samples)} steps of the real engine, {threads} thread(s), load {load}")
    model.save(out)
    errors = [abs(model.step_time(s) - t) / t for s, t in samples if t > 0]
    print(f"calibrated in {time.time() - started:.0f} s: {model}")
    print(f"median relative error over the steps: {statistics.median(errors):.1%}")
    return model
