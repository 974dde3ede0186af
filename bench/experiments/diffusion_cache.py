"""Feature caching (DeepCache / FORA's fixed interval, First-Block-Cache, TeaCache) against simply
running fewer denoising steps, on the embedded digits DiT, through the diffusion engine: each
request keeps its own cache and each row decides per step (engine/feature_cache.py).

Speed: the fraction of transformer-block evaluations against the full uncached run (one row
through one block is one evaluation; CFG rows count), and wall time per image. Fidelity: PSNR
and SSIM of each image against the uncached image of the same seed and noise; class accuracy of
the project's digit classifier and the Fréchet distance (FD) in its feature space to the 300
held-out real digits. Fewer steps are run at the step count that costs the same block fraction
as each cache setting (equal compute), so each cache row has its fewer-steps twin.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pagemesh.bench.experiments.diffusion_cache_report import write_report
from pagemesh.bench.experiments.image_metrics import psnr, ssim
from pagemesh.common.messages import ImageParams
from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineConfig, ImageJob

GUIDANCE = 2.0  # fixed here, whatever the default in the model's pagemesh.json (main ships 1.5)
SWEEPS = {  # sampler -> (full steps, policies, images per digit); fewer-steps twins follow the results
    "dpmsolver++": (
        25,
        ["interval:2", "interval:3", "interval:4"]
        + ["fbcache:0.05", "fbcache:0.1", "fbcache:0.2", "fbcache:0.4"]
        + ["teacache:0.05", "teacache:0.1", "teacache:0.2", "teacache:0.4", "teacache:0.8"],
        10,
    ),
    "ddim": (50, ["interval:2", "interval:3", "interval:5", "fbcache:0.2", "teacache:0.2"], 5),
}
QUICK_SWEEPS = {"dpmsolver++": (10, ["interval:2", "fbcache:0.2", "teacache:0.2"], 1)}
LOAD_POLICIES = ("none", "fbcache:0.1", "teacache:0.1")
LOAD_FRACTIONS = (0.7, 1.2)  # arrival rates as fractions of the measured uncached capacity
BURST = 16  # requests queued at once: the saturated cell of the load test


@dataclass(frozen=True, kw_only=True)
class Run:
    sampler: str
    steps: int
    cache: str
    images: torch.Tensor  # uint8 [N, 8, 8]
    blocks_computed: int
    blocks_skipped: int
    seconds: float  # the whole set, batched in one engine


@dataclass(frozen=True, kw_only=True)
class Point:
    """One setting, judged against the full uncached run of its sampler."""

    label: str  # "fbcache:0.1" or "13 steps"
    images: int
    kind: str  # none | interval | fbcache | teacache | steps
    sampler: str
    steps: int
    fraction: float  # block evaluations / the full run's
    ms_per_image: float  # batched
    ms_alone: float  # one image alone (median), nan where not measured
    psnr: float
    ssim: float
    accuracy: float
    fd: float


def request_params(digit: int, n: int, sampler: str, steps: int, cache: str, seed: int) -> ImageParams:
    return ImageParams(
        prompt=str(digit),
        negative_prompt=None,
        n=n,
        width=8,
        height=8,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        sampler=sampler,
        seed=seed,
        cache=cache,
    )


def generate(pipeline, sampler: str, steps: int, cache: str, per_class: int, seed: int) -> Run:
    """`per_class` images of each digit, one request per digit (image i seeded seed + 1000 d + i),
    all batched at every step by one engine."""
    config = EngineConfig(max_running=64, max_batch_rows=4096, max_waiting=1024, cache_budget_bytes=2**30)
    engine = DiffusionEngine(pipeline, config)
    for digit in range(10):
        params = request_params(digit, per_class, sampler, steps, cache, seed + 1000 * digit)
        engine.add(ImageJob(request_id=str(digit), params=params, arrival=time.monotonic()))
    began = time.perf_counter()
    done = []
    while engine.has_work():
        done += engine.step()
    seconds = time.perf_counter() - began
    done.sort(key=lambda d: int(d.request_id))
    return Run(
        sampler=sampler,
        steps=steps,
        cache=cache,
        images=torch.cat([d.images[..., 0] for d in done]),
        blocks_computed=sum(d.blocks_computed for d in done),
        blocks_skipped=sum(d.blocks_skipped for d in done),
        seconds=seconds,
    )


def time_alone(pipeline, sampler: str, steps: int, cache: str, reps: int) -> float:
    """Median ms of one image (n = 1, guided: 2 rows) alone in the engine."""
    times = []
    for rep in range(reps):
        engine = DiffusionEngine(pipeline)
        engine.add(ImageJob(request_id="a", params=request_params(rep % 10, 1, sampler, steps, cache, rep), arrival=0))
        began = time.perf_counter()
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


class Judge:
    """Accuracy and FD by the project's digit classifier; PSNR / SSIM against a reference run."""

    def __init__(self):
        from pagemesh.bench.diffusion.classifier import digit_classifier
        from pagemesh.workers.diffusion.training.digits_data import heldout_split

        self.clf = digit_classifier()
        self.real = self.clf.features(heldout_split().images)

    def floor(self, count: int) -> float:
        from pagemesh.bench.diffusion.classifier import frechet_distance
        from pagemesh.workers.diffusion.training.digits_data import train_split

        return frechet_distance(self.clf.features(train_split().images[:count]), self.real)

    def point(self, run: Run, reference: Run, full_blocks: int, label: str, kind: str, ms_alone: float) -> Point:
        from pagemesh.bench.diffusion.classifier import frechet_distance

        pixels = run.images.float()[:, None] / 127.5 - 1  # the data's [-1, 1]
        per_class = len(run.images) // 10
        classes = torch.arange(10).repeat_interleave(per_class)
        return Point(
            label=label,
            images=len(run.images),
            kind=kind,
            sampler=run.sampler,
            steps=run.steps,
            fraction=run.blocks_computed / full_blocks,
            ms_per_image=run.seconds / len(run.images) * 1e3,
            ms_alone=ms_alone,
            psnr=psnr(run.images, reference.images),
            ssim=float(ssim(run.images, reference.images).mean()),
            accuracy=float((self.clf.predict(pixels) == classes).float().mean()),
            fd=frechet_distance(self.clf.features(pixels), self.real),
        )


def sweep(pipeline, judge: Judge, sampler: str, full_steps: int, policies: list[str], per_class: int, seed: int, reps):
    """The full run, each policy, and fewer steps at each policy's block fraction (its twin)."""
    reference = generate(pipeline, sampler, full_steps, "none", per_class, seed)

    def judged(run: Run, label: str, kind: str) -> Point:
        alone = time_alone(pipeline, sampler, run.steps, run.cache, reps) if reps else float("nan")
        return judge.point(run, reference, reference.blocks_computed, label, kind, alone)

    points = [judged(reference, f"{full_steps} steps", "none")]
    twins: dict[int, Point] = {}
    for cache in policies:
        point = judged(generate(pipeline, sampler, full_steps, cache, per_class, seed), cache, cache.split(":")[0])
        points.append(point)
        steps = max(1, round(point.fraction * full_steps))
        if steps not in twins and steps < full_steps:
            short = generate(pipeline, sampler, steps, "none", per_class, seed)
            twins[steps] = judged(short, f"{steps} steps", "steps")
        print(f"  {sampler} {cache}: blocks {point.fraction:.2f} PSNR {point.psnr:.1f} FD {point.fd:.1f}", flush=True)
    return points + [twins[s] for s in sorted(twins, reverse=True)]


def capacity(pipeline, count: int) -> float:
    """Images/s of step-level batching, uncached, with `count` one-image requests all queued."""
    engine = DiffusionEngine(pipeline)
    for i in range(count):
        engine.add(ImageJob(request_id=str(i), params=load_request(i), arrival=0.0))
    began = time.perf_counter()
    while engine.has_work():
        engine.step()
    return count / (time.perf_counter() - began)


def load_request(i: int) -> ImageParams:
    return request_params(i % 10, 1, "dpmsolver++", 25, None, i)


def run_load(pipeline, rates: list[float], count: int, rounds: int) -> list:
    """Step-level batching with each worker-default cache policy: bursts of BURST requests queued
    at once (twice as many rounds: they are short), then Poisson arrivals at each rate; the
    policies side by side in each round, their order rotated round to round."""
    from pagemesh.bench.diffusion_engine import run_cell

    requests = [load_request(i) for i in range(count)]
    plan = [(BURST, "closed", r) for r in range(2 * rounds)] + [
        (rate, "poisson", r) for rate in rates for r in range(rounds)
    ]
    cells = []
    for load, arrivals, round_ in plan:
        for k in range(len(LOAD_POLICIES)):
            policy = LOAD_POLICIES[(k + round_) % len(LOAD_POLICIES)]
            mine = requests[:BURST] if arrivals == "closed" else requests
            cells.append(run_cell(pipeline, EngineConfig(cache=policy), load, mine, arrivals))
    return cells


def load_rows(cells: list) -> list[tuple]:
    """diffusion-batching's load table without its batching column (all step-level here); the
    burst cells labelled by how many were queued."""
    from pagemesh.bench.experiments.diffusion_batching import load_rows as rows_of

    rows = [(label, *rest) for label, _mode, *rest in rows_of(cells)]
    return [(f"{BURST} at once" if label == f"{BURST} clients" else label, *rest) for label, *rest in rows]


def run(ctx):
    from pagemesh.workers.diffusion.pipelines.embedded import load_embedded

    return run_on(ctx, load_embedded(), QUICK_SWEEPS if ctx.quick else SWEEPS, with_load=True)


def run_on(ctx, pipeline, sweeps: dict, with_load: bool):
    """The sweeps (and, `with_load`, the load section) on `pipeline`; also diffusion-cache-deep's."""
    judge = Judge()
    points = []
    for sampler, (full_steps, policies, per_class) in sweeps.items():
        reps = 0 if ctx.quick or sampler != "dpmsolver++" else 3
        points += sweep(pipeline, judge, sampler, full_steps, policies, per_class, ctx.seed, reps)
    if not with_load:
        return write_report(ctx, pipeline, judge, points, None, "")
    count, rounds = (6, 1) if ctx.quick else (40, 2)
    full_rate = capacity(pipeline, BURST)
    fractions = (1.0,) if ctx.quick else LOAD_FRACTIONS
    rates = [round(f * full_rate, 1) for f in fractions]
    load = load_rows(run_load(pipeline, rates, count, rounds))
    note = (
        f"One-image requests (dpmsolver++ 25 steps, guidance 2, 2 rows each): {BURST} queued at once (images/s "
        f"there is the engine's throughput), then {count} arriving as a Poisson process at "
        f"{' and '.join(f'{r:g}' for r in rates)} /s ({' and '.join(f'{f:g}' for f in fractions)}× the "
        f"{full_rate:.1f} images/s measured uncached with {BURST} queued; images/s there is bounded by the "
        f"arrivals); the worker default policy set per cell, the policies side by side in each of {2 * rounds} "
        f"burst and {rounds} Poisson round(s) (images/s: the median round; latencies pooled); in-process, "
        "step-level batching, max 16 running; latency from arrival to the image decoded. Batching modes "
        "against each other under Poisson load: diffusion-batching.md."
    )
    return write_report(ctx, pipeline, judge, points, load, note)
