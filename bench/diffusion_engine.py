"""In-process images/s and latency of the diffusion engine's batching modes: serial (one request
at a time), request-level (a batch starts together and ends together, after a gathering window)
and step-level (every denoising step regroups the running requests: ORCA for diffusion).

    PYTHONPATH=. python bench/diffusion_engine.py [--pipeline workers/diffusion/models/digits-dit]
        [--clients 1,4,16] [--requests 96] [--steps 10,25,50] [--samplers ddim,dpmsolver++,euler]
        [--arrivals closed|poisson] [--rate 10,40,80] [--rounds 2] [--threads 1]

Every (mode, load) cell replays the same request list (steps and samplers drawn from a fixed
seed); each round runs every cell, the modes side by side, so drifts of a shared machine fall on
all of them. Closed loop: `clients` clients each send a request, wait for its images and send the
next. Poisson (`--arrivals poisson`): requests arrive at each `--rate` per second whatever
finishes. On CUDA the table adds the peak memory the engine's tensors reached.

Latency: the request's arrival to its images decoded; images/s: images over the first arrival to
the last image. Mixed step counts are what step-level batching is for: in a request-level batch a
10-step request's client waits for the batch's 50-step one before it can send again. Without the
pipeline folder (or its pipeline code) it falls back, with a warning, to a random tiny DiT
(tests/diffusion_tiny.py): the figures then measure the engine, not a model.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from pagemesh.common.messages import ImageParams  # noqa: E402
from pagemesh.workers.diffusion.engine import DiffusionEngine, EngineConfig, ImageJob  # noqa: E402

DEFAULT_PIPELINE = ROOT / "workers/diffusion/models/digits-dit"
MODES = ("serial", "request", "step")
POLL_S = 0.001  # how long the driver sleeps when the engine can run nothing yet


@dataclass(frozen=True, kw_only=True)
class Cell:
    mode: str
    load: float  # closed loop: clients; poisson: requests per second
    images: int
    seconds: float
    latencies: list[float]
    rows: int
    forwards: int
    peak_mib: float | None  # CUDA only
    arrivals: str = "closed"  # closed | poisson
    cache: str = "none"  # the engine's default feature-cache policy
    block_fraction: float = 1.0  # blocks computed / an uncached run's (engine/stats.py)


def load_pipeline(path: Path, device: str, dtype: str):
    """The DiT pipeline in `path`, or the random tiny DiT of the tests (with a warning)."""
    if not path.exists():
        print(f"warning: no pipeline at {path}")
    else:
        try:
            from pagemesh.workers.diffusion.pipelines.dit import DiTPipelineModel
        except ImportError as e:
            print(f"warning: {path} is there but the DiT pipeline code is not ({e})")
        else:
            on = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
            auto = torch.bfloat16 if on.type == "cuda" else torch.float32
            return DiTPipelineModel.from_folder(
                path, device=on, dtype=auto if dtype == "auto" else getattr(torch, dtype)
            )
    print("warning: falling back to a random tiny DiT (tests/diffusion_tiny.py): the figures measure the engine")
    from pagemesh.tests.diffusion_tiny import TinyDiTPipeline

    return TinyDiTPipeline()


def workload(count: int, steps: list[int], samplers: list[str], guidance: float | None) -> list[ImageParams]:
    rng = random.Random(0)
    return [
        ImageParams(
            prompt=f"a handwritten {rng.randrange(10)}",
            negative_prompt=None,
            n=1,
            width=None,
            height=None,
            num_inference_steps=rng.choice(steps),
            guidance_scale=guidance,
            sampler=rng.choice(samplers),
            seed=i,
        )
        for i in range(count)
    ]


class Driver:
    """Sends requests into an engine, steps it, and times each request from arrival to images."""

    def __init__(self, engine: DiffusionEngine):
        self.engine = engine
        self.arrival: dict[str, float] = {}
        self.latencies: list[float] = []
        self.images = 0
        self.sent = 0

    def send(self, params: ImageParams, at: float) -> None:
        request_id = f"r{self.sent}"
        self.sent += 1
        self.arrival[request_id] = at
        self.engine.add(ImageJob(request_id=request_id, params=params, arrival=at))

    def step(self) -> int:
        """One engine step (or a short wait when it can run nothing); returns requests finished."""
        if not self.engine.has_work():
            time.sleep(POLL_S)
            return 0
        finished = self.engine.step()
        now = time.monotonic()
        for done in finished:
            self.latencies.append(now - self.arrival.pop(done.request_id))
            self.images += done.images.shape[0]
        if self.engine.stalled():  # request mode's window: the worker would wait for news
            time.sleep(POLL_S)
        return len(finished)


def closed_loop(driver: Driver, requests: list[ImageParams], clients: int) -> float:
    """`clients` clients, each sending its next request when its last one's images are back."""
    start = time.monotonic()
    for params in requests[:clients]:
        driver.send(params, start)
    while len(driver.latencies) < len(requests):
        for _ in range(driver.step()):
            if driver.sent < len(requests):
                driver.send(requests[driver.sent], time.monotonic())
    return time.monotonic() - start


def poisson(driver: Driver, requests: list[ImageParams], rate: float) -> float:
    """Requests arriving at `rate` per second (exponential gaps, a fixed seed)."""
    gaps = np.random.default_rng(1).exponential(1.0 / rate, size=len(requests))
    start = time.monotonic()
    due = (start + np.cumsum(gaps)).tolist()
    while len(driver.latencies) < len(requests):
        now = time.monotonic()
        while driver.sent < len(requests) and due[driver.sent] <= now:
            driver.send(requests[driver.sent], due[driver.sent])
        driver.step()
    return time.monotonic() - start


def run_cell(pipeline, config: EngineConfig, load: float, requests: list[ImageParams], arrivals: str) -> Cell:
    """One fresh engine with `config` serving `requests`: `load` closed-loop clients, or Poisson
    arrivals at `load` per second. (Also the diffusion experiments' load cells.)"""
    driver = Driver(DiffusionEngine(pipeline, config))
    on_cuda = pipeline.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(pipeline.device)
    if arrivals == "closed":
        seconds = closed_loop(driver, requests, int(load))
    else:
        seconds = poisson(driver, requests, load)
    stats = driver.engine.stats()
    return Cell(
        mode=config.batching,
        arrivals=arrivals,
        cache=config.cache,
        block_fraction=stats.block_fraction,
        load=load,
        images=driver.images,
        seconds=seconds,
        latencies=driver.latencies,
        rows=stats.rows,
        forwards=stats.steps,
        peak_mib=torch.cuda.max_memory_allocated(pipeline.device) / 2**20 if on_cuda else None,
    )


def report(cells: list[Cell], loads: list[float], arrivals: str) -> None:
    label = "clients" if arrivals == "closed" else "req/s"
    print(
        f"\n{'mode':<8} {label:>7} {'images/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'rows/fwd':>9} {'forwards':>9} "
        f"{'peak MiB':>9}"
    )
    rate: dict[tuple[str, float], float] = {}
    for load in loads:
        for mode in MODES:
            mine = [cell for cell in cells if cell.mode == mode and cell.load == load]
            rate[mode, load] = sum(c.images for c in mine) / sum(c.seconds for c in mine)
            p50, p99 = np.percentile([x for c in mine for x in c.latencies], [50, 99]) * 1e3
            forwards = sum(c.forwards for c in mine)
            rows = sum(c.rows for c in mine) / forwards
            peak = "-" if mine[0].peak_mib is None else f"{max(c.peak_mib for c in mine):.0f}"
            print(
                f"{mode:<8} {load:>7g} {rate[mode, load]:>9.1f} {p50:>8.0f} {p99:>8.0f} {rows:>9.2f} "
                f"{forwards // len(mine):>9} {peak:>9}"
            )
    print("\nimages/s ratios")
    for load in loads:
        step = rate["step", load]
        print(
            f"  {label} {load:>4g}: step/request {step / rate['request', load]:.2f}x   "
            f"step/serial {step / rate['serial', load]:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", type=Path, default=DEFAULT_PIPELINE)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--clients", default="1,4,16", help="closed loop: concurrent clients per cell")
    parser.add_argument("--requests", type=int, default=96, help="requests per cell")
    parser.add_argument("--steps", default="10,25,50", help="step counts, drawn per request")
    parser.add_argument("--samplers", default="ddim,dpmsolver++,euler", help="samplers, drawn per request")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    parser.add_argument("--arrivals", choices=("closed", "poisson"), default="closed")
    parser.add_argument("--rate", default="10,40,80", help="poisson: requests per second, a cell each")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--max-batch-rows", type=int, default=64)
    parser.add_argument("--request-wait-s", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pipeline = load_pipeline(args.pipeline, args.device, args.dtype)
    requests = workload(args.requests, [int(s) for s in args.steps.split(",")], args.samplers.split(","), args.guidance)
    loads = [float(x) for x in (args.clients if args.arrivals == "closed" else args.rate).split(",")]
    print(
        f"pipeline {pipeline.name} on {pipeline.device} {pipeline.dtype}, torch threads {torch.get_num_threads()}; "
        f"{args.requests} requests a cell, steps {args.steps}, samplers {args.samplers}, {args.arrivals} arrivals, "
        f"{args.rounds} rounds"
    )

    def config(mode: str) -> EngineConfig:
        return EngineConfig(
            batching=mode,
            max_running=args.max_running,
            max_batch_rows=args.max_batch_rows,
            request_wait_s=args.request_wait_s,
        )

    run_cell(pipeline, config("step"), 4, requests[:8], "closed")  # warm-up
    cells = [
        run_cell(pipeline, config(mode), load, requests, args.arrivals)
        for _ in range(args.rounds)
        for load in loads
        for mode in MODES
    ]
    report(cells, loads, args.arrivals)


if __name__ == "__main__":
    main()
