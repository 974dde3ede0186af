"""Tensor parallel inside a worker (Megatron-LM, Shoeybi et al. 2019): each rank holds 1/N of
every layer's heads and MLP and of the KV heads; two all-reduces per layer join the shards.

On this 2-core CPU tensor parallel is a correctness feature, not a speed-up: N ranks share the
same two cores, so the shards find no idle compute, and every layer pays two all-reduces between
processes. What is measured here is that cost: the all-reduce (gloo against pagemesh's shared
memory one) and the serving throughput and latency of 1, 2 and 3 ranks at 1, 8 and 32 streams,
and of two pipeline stages with the engine keeping one step in flight against two.
What tensor parallel buys on GPUs comes from a roofline model, not a run: weights and KV per GPU,
the all-reduce bytes per token, and a decode step's lower bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagemesh.bench.experiments.parallel_model import H200, LLAMA_3_8B, tensor_parallel_point, valid_sizes
from pagemesh.bench.experiments.report import new_figure
from pagemesh.common.model_config import read_model_config
from pagemesh.common.model_files import resolve_model_path
from pagemesh.common.python_command import python_module

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Configuration:
    """One row group of the CPU measurements: a label and the EngineConfig overrides."""

    label: str
    engine: dict = field(default_factory=dict)


# more layouts are one line each, e.g.
#   Configuration("tp3 pp2", {"tensor_parallel_size": 3, "pipeline_parallel_size": 2})
CONFIGURATIONS = [
    Configuration("tp1"),
    Configuration("tp2", {"tensor_parallel_size": 2}),
    Configuration("tp3", {"tensor_parallel_size": 3}),
    # two stages, the engine keeping one step in flight against two (micro-batches: workers/engine/in_flight.py)
    Configuration("pp2, 1 in flight", {"pipeline_parallel_size": 2, "max_steps_in_flight": 1}),
    Configuration("pp2, 2 in flight", {"pipeline_parallel_size": 2}),
]


@dataclass(frozen=True)
class Setup:
    labels: tuple[str, ...]  # which CONFIGURATIONS run
    streams: tuple[int, ...]
    prompt: int
    output: int
    world_sizes: tuple[int, ...]  # of the all-reduce benchmark
    tokens: tuple[int, ...]
    iters: int


FULL = Setup(tuple(c.label for c in CONFIGURATIONS), (1, 8, 32), 64, 32, (2, 3), (1, 8, 32, 512), 300)
QUICK = Setup(("tp1", "tp2"), (1,), 8, 2, (2,), (1, 8), 20)
GPU_BATCH, GPU_CONTEXT = 64, 2048


def all_reduce_rows(world_size: int, setup: Setup) -> list[tuple[int, int, float, float]]:
    """(tokens, bytes, gloo µs, shared memory µs) from bench/tp_allreduce.py's table (float32)."""
    argv = [sys.executable, str(ROOT / "bench" / "tp_allreduce.py"), f"--world-size={world_size}"]
    argv += [f"--tokens={','.join(map(str, setup.tokens))}", f"--iters={setup.iters}"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("| \n").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows.append((int(cells[0]), int(cells[1]), float(cells[2]), float(cells[3])))
    return rows


def refusal(cfg, configuration: Configuration) -> str | None:
    """Why the model cannot be split this way (the worker's own check), or None."""
    from pagemesh.workers.engine.pipeline_parallel import check_pipeline_parallel
    from pagemesh.workers.engine.tensor_parallel import check_tensor_parallel

    try:
        check_tensor_parallel(cfg, configuration.engine.get("tensor_parallel_size", 1))
        check_pipeline_parallel(cfg, configuration.engine.get("pipeline_parallel_size", 1))
    except ValueError as e:
        return str(e)
    return None


def measure(ctx, configuration: Configuration, setup: Setup) -> list[dict] | str:
    """The configuration's points (one per stream count), or why it did not run."""
    argv = [
        *python_module("pagemesh.bench.experiments.parallel_run"),
        f"--engine={json.dumps(configuration.engine)}",
    ]
    argv += [f"--streams={','.join(map(str, setup.streams))}", f"--prompt={setup.prompt}", f"--output={setup.output}"]
    argv += [f"--threads={ctx.threads}", f"--seed={ctx.seed}"] + (
        [f"--model={ctx.model_path}"] if ctx.model_path else []
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    points = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"streams"')]
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return f"failed (exit {proc.returncode}): {lines[-1] if lines else 'no message'}"
    return points


def serving_summary(results: dict[str, list[dict] | str], threads: int) -> str:
    """Each configuration's throughput as a share of one rank's, stream count by stream count."""
    base = results.get("tp1")
    if not isinstance(base, list):
        return ""
    by_streams = {p["streams"]: p["output_throughput"] for p in base}
    shares = []
    for label, points in results.items():
        if label == "tp1" or isinstance(points, str):
            continue
        ratios = ", ".join(
            f"{p['output_throughput'] / by_streams[p['streams']]:.0%} at {p['streams']}"
            for p in points
            if by_streams.get(p["streams"])
        )
        shares.append(f"{label} gave {ratios} streams")
    return (
        f"Against one rank ({threads} torch thread(s)): {'; '.join(shares) or 'no other configuration ran'} "
        "(output tokens/s as a share of tp1's). The ranks' extra threads find no idle core here, and "
        "each step adds the all-reduces above (tensor parallel) or the hand-over of activations between "
        "stages (pipeline parallel) and the step's trip down the followers' pipes; with two steps in "
        "flight the stages overlap, but on two shared cores overlap can only hide waiting, not add "
        "compute. The greedy text is the same (tests/integration/test_mesh_tensor_parallel*.py, "
        "test_pipeline_in_flight.py), which is what both are for on this machine."
    )


def run(ctx):
    setup = QUICK if ctx.quick else FULL
    model_cfg = read_model_config(resolve_model_path(ctx.model_path))
    steps_all_reduces = 2 * model_cfg.num_layers
    reduces = {w: all_reduce_rows(w, setup) for w in setup.world_sizes}
    results: dict[str, list[dict] | str] = {}
    for configuration in [c for c in CONFIGURATIONS if c.label in setup.labels]:
        results[configuration.label] = refusal(model_cfg, configuration) or measure(ctx, configuration, setup)

    report = ctx.report("Tensor and pipeline parallel on this CPU, and what they buy on GPUs")
    report.text(__doc__.split("\n\n", 1)[1])
    report.text("## The all-reduce: gloo against shared memory")
    report.table(
        (
            "ranks",
            "tokens",
            "bytes",
            "gloo µs",
            "shared memory µs",
            "gloo / shm",
            "per step gloo ms",
            "per step shm ms",
        ),
        [
            (w, t, b, g, s, g / s, g * steps_all_reduces / 1000, s * steps_all_reduces / 1000)
            for w, rows in reduces.items()
            for t, b, g, s in rows
        ],
        caption=f"`bench/tp_allreduce.py`, float32 `[tokens, {model_cfg.hidden_size}]`, median of {setup.iters}; "
        f"a step does {steps_all_reduces} of them (2 per layer). A decode step of S streams all-reduces S tokens.",
    )
    report.text("## Serving: throughput and latency by ranks and streams")
    rows, refused = [], []
    for label, points in results.items():
        if isinstance(points, str):
            refused.append((label, points))
            continue
        for p in points:
            rows.append(
                (
                    label,
                    p["streams"],
                    p["output_throughput"],
                    p["median_ttft_ms"],
                    p["median_itl_ms"],
                    p["decode_step_ms"],
                )
            )
    report.table(
        ("configuration", "streams", "output tok/s", "median TTFT ms", "median ITL ms", "mean decode step ms"),
        rows,
        caption=f"In-process engine (the follower ranks are processes), {setup.prompt} prompt + {setup.output} "
        f"output tokens per request, all at once; {ctx.threads} torch thread(s) shared out among the ranks.",
    )
    if refused:
        report.table(("configuration", "not run"), refused, caption="Configurations this model cannot take")
    report.text(serving_summary(results, ctx.threads))

    report.text("## What it buys on GPUs: a roofline model")
    models = {"SmolLM2-135M": model_cfg, "Llama-3-8B": LLAMA_3_8B}
    gpu_points = {
        name: [tensor_parallel_point(cfg, n, H200, GPU_BATCH, GPU_CONTEXT) for n in valid_sizes(cfg)]
        for name, cfg in models.items()
    }
    report.table(
        (
            "model",
            "TP",
            "weights / GPU GB",
            "KV bytes / token / GPU",
            "KV tokens",
            "all-reduce bytes / token",
            "ring bytes / token / GPU",
            "decode step ms ≥",
            "tok/s ≤",
        ),
        [
            (
                name,
                p.tp,
                p.weight_bytes_per_gpu / 1e9,
                p.kv_bytes_per_token_per_gpu,
                p.kv_tokens,
                p.all_reduce_bytes_per_token,
                p.link_bytes_per_token_per_gpu,
                1000 * p.decode_step_s,
                p.tokens_per_s,
            )
            for name, points in gpu_points.items()
            for p in points
        ],
        caption=f"bf16 weights and KV on {H200.name} (HBM {H200.hbm_bytes / 1e9:.0f} GB at "
        f"{H200.hbm_bytes_per_s / 1e12:.1f} TB/s, {H200.bf16_flops_per_s / 1e12:.0f} TFLOP/s bf16 dense, NVLink "
        f"{H200.link_bytes_per_s / 1e9:.0f} GB/s, {H200.all_reduce_latency_s * 1e6:.0f} µs per all-reduce assumed); "
        f"KV takes {H200.kv_share:.0%} of what the weights leave; a decode step of {GPU_BATCH} sequences at "
        f"{GPU_CONTEXT} tokens of context: max(HBM reads, FLOPs) + the all-reduces.",
    )
    report.text(
        "Splitting a model N ways divides its layer weights and every token's KV by N on each GPU, so the KV "
        "pool (in tokens) grows by more than N: the replicated embedding aside, each GPU also frees the "
        "weights it no longer holds. The price is 2 all-reduces per layer of `tokens × hidden × 2` bytes; at "
        "decode batch sizes their fixed latency, not their bytes, is what NVLink charges. A model as small as "
        "SmolLM2 gains nothing from TP on a GPU (its weights are a fraction of a millisecond of HBM time); an 8B "
        "model gains KV room (more sequences in flight) and a shorter memory-bound step."
    )

    figure, (left, middle, right) = new_figure(3)
    for label, points in results.items():
        if not isinstance(points, str):
            left.plot([p["streams"] for p in points], [p["output_throughput"] for p in points], "o-", label=label)
    left.set(xlabel="streams", ylabel="output tokens/s", title="this CPU (2 cores)")
    left.legend()
    for w, rows_w in reduces.items():
        tokens = [t for t, *_ in rows_w]
        middle.plot(tokens, [g for _, _, g, _ in rows_w], "o--", label=f"gloo, {w} ranks")
        middle.plot(tokens, [s for _, _, _, s in rows_w], "o-", label=f"shared memory, {w} ranks")
    middle.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs per all-reduce", title="all-reduce")
    middle.legend(fontsize=7)
    for name, points in gpu_points.items():
        right.plot([p.tp for p in points], [p.kv_tokens / 1e6 for p in points], "o-", label=name)
    right.set(xlabel="tensor-parallel size", ylabel="KV capacity (M tokens)", yscale="log", title="model: H200")
    right.legend()
    report.figure("tp", figure, "Throughput by ranks and streams; the all-reduce; KV capacity on H200 (model).")

    ran = {k: v for k, v in results.items() if not isinstance(v, str)}
    mid = setup.streams[len(setup.streams) // 2]
    w = max(reduces)
    small = reduces[w][0]
    eight_b = {p.tp: p for p in gpu_points["Llama-3-8B"]}
    report.key = (
        "parallel: "
        + ", ".join(
            f"{k} {next(p['output_throughput'] for p in v if p['streams'] == mid):.1f} tok/s" for k, v in ran.items()
        )
        + f" at {mid} streams; all-reduce of {small[0]} token(s), {w} ranks: "
        + f"gloo {small[2]:.0f} µs, shm {small[3]:.0f} µs"
        + f"; Llama-3-8B on H200 KV tokens tp1 {eight_b[1].kv_tokens / 1e6:.2f}M -> tp{max(eight_b)} "
        + f"{eight_b[max(eight_b)].kv_tokens / 1e6:.2f}M"
    )
    return report
