"""Fit the CPU step-time model from the real engine on this machine.

Runs the real `Engine` (the embedded model, in-process, `threads` torch threads as a worker
would have) over a grid of batch shapes — decode batches of 1..64 rows at several contexts,
prompt chunks of 16..2048 tokens, and mixes of both — records each step's shape (from the
scheduler's own plan) and its wall time, and fits `LinearStepCost` to them. Each shape is
stepped a few times and the median kept; the first steps (warm-up) are dropped.
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from pathlib import Path

from pagemesh.bench.simulator.cost import LinearStepCost, StepShape
from pagemesh.bench.simulator.role_cost import HostSlowdown, MeshStepCost, RoleStepCost, TracedStep
from pagemesh.bench.simulator.worker import shape_of

# (prompt length, requests, output tokens): prompts alone, then decode batches at growing contexts
GRID = [(16, 1, 24), (128, 1, 24), (512, 1, 8), (1024, 1, 4), (128, 8, 24), (128, 32, 24), (256, 64, 16), (900, 4, 24)]


def measure(threads: int, budget: int = 2048, grid=GRID, repeats_per_step: int = 1) -> list[tuple[StepShape, float]]:
    import torch

    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

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


BACK_TO_BACK_S = 0.05  # a gap shorter than this between two steps: the worker had work throughout


def traced_workers(folder: Path) -> list[tuple[str, list[TracedStep]]]:
    """(role, steps) of every worker of a running mesh that traced its steps (PAGEMESH_STEP_TRACE,
    workers/engine/step_trace.py; role "" where the trace does not say). A step's seconds are its
    whole cycle, from its start to the next step's start when the worker went straight on (the
    host work between steps: publishing tokens, taking messages, which a loaded mesh pays and the
    engine alone does not); the last step of a busy stretch gets its own time plus the median
    such gap of its worker. `others_busy` sums, over the other workers, the share of the step's
    time they spent in steps of their own (the clocks agree: perf_counter is system-wide)."""
    workers = read_traces(folder)
    intervals = [[(s["start"], s["start"] + s["seconds"]) for s in steps] for _, steps in workers]
    out = []
    for index, (role, steps) in enumerate(workers):
        others = [sorted(ivs) for i, ivs in enumerate(intervals) if i != index]
        traced = []
        for step, cycle in zip(steps, _cycles(steps)):
            shape = StepShape(**{k: step[k] for k in StepShape.__dataclass_fields__})
            traced.append(TracedStep(shape, cycle, sum(_busy_share(step, ivs) for ivs in others), step["start"]))
        out.append((role, traced))
    return out


def read_traces(folder: Path) -> list[tuple[str, list[dict]]]:
    """(role, steps as traced: start, seconds of the step alone, shape) of every worker's trace."""
    workers = []
    for path in sorted(folder.glob("steps-*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        role = next((line["role"] for line in lines if "role" in line), "")
        workers.append((role, [line for line in lines if "start" in line]))
    return workers


def _cycles(steps: list[dict]) -> list[float]:
    gaps, cycles = [], []
    for step, following in zip(steps, [*steps[1:], None]):
        gap = None if following is None else following["start"] - step["start"] - step["seconds"]
        if gap is not None and gap < BACK_TO_BACK_S:
            gaps.append(gap)
            cycles.append(step["seconds"] + gap)
        else:
            cycles.append(None)
    usual_gap = statistics.median(gaps) if gaps else 0.0
    return [cycle if cycle is not None else step["seconds"] + usual_gap for step, cycle in zip(steps, cycles)]


def _busy_share(step: dict, intervals: list[tuple[float, float]]) -> float:
    """The share of the step's time that one other worker spent in steps (`intervals`: its
    steps' (start, end), sorted and disjoint: at most one began before this step did)."""
    begin, end = step["start"], step["start"] + step["seconds"]
    if step["seconds"] <= 0:
        return 0.0
    index = max(0, bisect.bisect_left(intervals, (begin,)) - 1)
    inside = 0.0
    while index < len(intervals) and intervals[index][0] < end:
        a, b = intervals[index]
        inside += max(0.0, min(end, b) - max(begin, a))
        index += 1
    return inside / step["seconds"]


def samples_from_trace(folder: Path) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of every traced step of every worker (see traced_workers)."""
    return [(s.shape, s.seconds) for _, steps in traced_workers(folder) for s in steps]


HOST_WINDOW_S = 1.0  # the host's slowdown is taken per second of the trace
HOST_ROUNDS = 2  # fit the roles, then the host's factors against them, then the roles on deflated steps ...


def fit_trace(folder: Path, out: Path | None = None, host_window_s: float | None = HOST_WINDOW_S) -> MeshStepCost:
    """One model per worker role of the steps a mesh traced, a pooled one, and the host's slowdown
    over time (role_cost.py). The roles are fitted to steps deflated by the host factor of their
    second, and the factors against the roles' models, alternately (`host_window_s` None: no host
    slowdown, the roles fitted to the steps as measured)."""
    workers = [
        (role, [s for s in ss if s.shape.prefill_tokens or s.shape.decode_rows]) for role, ss in traced_workers(folder)
    ]
    steps = [s for _, ss in workers for s in ss]
    if not steps:
        raise SystemExit(f"no traced steps under {folder} (was PAGEMESH_STEP_TRACE set on the workers?)")
    host, factors = HostSlowdown(), [1.0] * len(steps)
    for _ in range(HOST_ROUNDS if host_window_s else 0):
        pooled, roles = _fit_roles(workers, factors)
        ratios = [
            s.seconds / max(roles.get(role, pooled).step_time(s.shape, s.others_busy), 1e-9)
            for role, ss in workers
            for s in ss
        ]
        host, factors = HostSlowdown.fit([s.start for s in steps], ratios, host_window_s)
    pooled, roles = _fit_roles(workers, factors)
    per_role: dict[str, int] = {}
    for role, ss in workers:
        if role:
            per_role[role] = per_role.get(role, 0) + len(ss)
    counts = ", ".join(f"{role} {n}" for role, n in sorted(per_role.items()))
    model = MeshStepCost(
        pooled,
        roles,
        source=f"{len(steps)} steps traced inside a running mesh ({folder.name}: {counts})",
        host=host,
    )
    if out is not None:
        model.save(out)
    return model


def _fit_roles(
    workers: list[tuple[str, list[TracedStep]]], factors: list[float]
) -> tuple[RoleStepCost, dict[str, RoleStepCost]]:
    """The pooled model and one per role, fitted to the steps each divided by its host factor
    (`factors`: one per step, in the order of `workers`)."""
    deflated, index = [], 0
    for role, ss in workers:
        deflated.append((role, [s.deflated(f) for s, f in zip(ss, factors[index : index + len(ss)])]))
        index += len(ss)
    pooled = RoleStepCost.fit([s for _, ss in deflated for s in ss])
    by_role: dict[str, list[TracedStep]] = {}
    for role, ss in deflated:
        if role:
            by_role.setdefault(role, []).extend(ss)
    return pooled, {role: RoleStepCost.fit(ss, fallback=pooled.linear) for role, ss in by_role.items() if ss}
