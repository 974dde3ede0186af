"""Serial, request-level and step-level batching of the diffusion worker, through the mesh.

One `pagemesh up --prefill 0 --decode 0 --diffusion 1 --diffusion-batching MODE` per mode, all
up at once. At 1, 4 and 16 closed-loop clients (each sends its next request when its last one is
answered: `--max-concurrency C` at an infinite rate), each repetition sends the same image
requests to each mode's mesh in turn, the order reversed every other repetition (A-B-C C-B-A), so
that a machine that drifts over the run favours no mode and a point's modes run minutes apart at
most; every mode does the same work (a fixed step count). Prints a table
of images/s and latency p50/p99 (means over the repetitions) and the step/request and step/serial
ratios, each taken within one repetition and then averaged; writes DIR/diffusion_batching.md,
.json (every point) and .png.

    python -m pagemesh.bench.diffusion_batching --out /tmp/batching                      # 3 modes x 2 repeats
    python -m pagemesh.bench.diffusion_batching --out /tmp/b --clients 1,16 --num-inference-steps 10,50 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from pagemesh.bench.loadgen.images import IMAGES_ENDPOINT, ImageTarget, image_prompts, parse_steps, run_image_point  # noqa: E402
from pagemesh.bench.loadgen.metrics import summarize_images  # noqa: E402
from pagemesh.bench.loadgen.runner import LoadPoint  # noqa: E402
from pagemesh.bench.plots import save_png  # noqa: E402

MODES = ("serial", "request", "step")


def mode_order(modes: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The modes in the given order on even repetitions, reversed on odd ones (ABC CBA ABC ...)."""
    return modes if repeat % 2 == 0 else tuple(reversed(modes))


def requests_for(clients: int, rounds: int, least: int) -> int:
    """Requests in a point: `rounds` per client, and at least `least`."""
    return max(least, rounds * clients)


def point_record(mode: str, repeat: int, clients: int, summary: dict, batched_with: list[int]) -> dict:
    """The figures of one point that the tables use."""
    return {
        "mode": mode,
        "repeat": repeat,
        "clients": clients,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "images_per_s": summary["image_throughput"],
        "p50_ms": summary["median_e2el_ms"],
        "p99_ms": summary["p99_e2el_ms"],
        "mean_queue_ms": summary.get("mean_queue_ms"),
        "mean_compute_ms": summary.get("mean_compute_ms"),
        "mean_batched_with": statistics.fmean(batched_with) if batched_with else None,
    }


def aggregate(records: list[dict]) -> dict[tuple[str, int], dict]:
    """(mode, clients) -> means over the repetitions, and each repetition's images/s."""
    out: dict[tuple[str, int], dict] = {}
    for key in sorted({(r["mode"], r["clients"]) for r in records}, key=lambda k: (k[1], MODES.index(k[0]))):
        rows = sorted((r for r in records if (r["mode"], r["clients"]) == key), key=lambda r: r["repeat"])
        batched = [r["mean_batched_with"] for r in rows if r["mean_batched_with"] is not None]
        out[key] = {
            "images_per_s": statistics.fmean(r["images_per_s"] for r in rows),
            "per_repeat": [r["images_per_s"] for r in rows],
            "p50_ms": statistics.fmean(r["p50_ms"] for r in rows),
            "p99_ms": statistics.fmean(r["p99_ms"] for r in rows),
            "mean_batched_with": statistics.fmean(batched) if batched else None,
            "failed": sum(r["failed"] for r in rows),
        }
    return out


def paired_ratios(records: list[dict], top: str, bottom: str, figure: str = "images_per_s") -> dict[int, list[float]]:
    """clients -> `top`'s figure over `bottom`'s, one ratio per repetition that has both."""
    by = {(r["mode"], r["clients"], r["repeat"]): r[figure] for r in records}
    ratios: dict[int, list[float]] = {}
    for mode, clients, repeat in sorted(by):
        if mode == top and (bottom, clients, repeat) in by and by[(bottom, clients, repeat)] > 0:
            ratios.setdefault(clients, []).append(by[(top, clients, repeat)] / by[(bottom, clients, repeat)])
    return ratios


def markdown(records: list[dict], setup: dict) -> str:
    """The report: setup, the table, the ratios."""
    table = aggregate(records)
    lines = [
        "# Diffusion batching through the mesh: serial vs request-level vs step-level",
        "",
        f"{setup['date']}, commit {setup['commit']}, {setup['machine']}; load average {setup['load_before']} "
        f"before, {setup['load_after']} after.",
        f"`pagemesh up {' '.join(setup['mesh_flags'])} --diffusion-batching MODE`; closed-loop clients, "
        f"{setup['requests']}; steps {setup['steps'] or 'the model default'}, "
        f"sampler {setup.get('sampler') or 'the model default'}, n={setup['n']}; "
        f"{setup['repeats']} repetitions, mode order {' / '.join(' '.join(o) for o in setup['orders'])}.",
        "",
        "| batching | clients | images/s | per repetition | p50 ms | p99 ms | batched with (mean) | failed |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for (mode, clients), row in table.items():
        each = ", ".join(f"{x:.2f}" for x in row["per_repeat"])
        batched = f"{row['mean_batched_with']:.1f}" if row["mean_batched_with"] is not None else "-"
        lines.append(
            f"| {mode} | {clients} | {row['images_per_s']:.2f} | {each} | {row['p50_ms']:.0f} | "
            f"{row['p99_ms']:.0f} | {batched} | {row['failed']} |"
        )
    lines += ["", "Ratios, each within one repetition (mean, and the repetitions' range):", ""]
    lines += ["| clients | step/request images/s | step/serial images/s | step/request p99 | step/serial p99 |"]
    lines += ["| ---: | ---: | ---: | ---: | ---: |"]
    columns = [
        paired_ratios(records, "step", "request"),
        paired_ratios(records, "step", "serial"),
        paired_ratios(records, "step", "request", "p99_ms"),
        paired_ratios(records, "step", "serial", "p99_ms"),
    ]
    for clients in sorted({c for column in columns for c in column}):
        cells = [_ratio_cell(column.get(clients, [])) for column in columns]
        lines.append(f"| {clients} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio_cell(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    mean = f"{statistics.fmean(ratios):.2f}x"
    return mean if len(ratios) == 1 else f"{mean} ({min(ratios):.2f}-{max(ratios):.2f})"


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = aggregate(records)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    all_clients = sorted({c for _, c in table})
    for mode, colour in zip(MODES, ("tab:gray", "tab:orange", "tab:green")):
        points = sorted((c, row) for (m, c), row in table.items() if m == mode)
        if not points:
            continue
        clients = [c for c, _ in points]
        axes[0].plot(clients, [row["images_per_s"] for _, row in points], "o-", color=colour, label=mode)
        axes[1].plot(clients, [row["p99_ms"] for _, row in points], "s--", color=colour, label=f"{mode} p99")
        axes[1].plot(clients, [row["p50_ms"] for _, row in points], "o-", color=colour, alpha=0.5, label=f"{mode} p50")
    for axis, label in zip(axes, ("images/s", "latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(all_clients, [str(c) for c in all_clients])
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    save_png(figure, path, dpi=110)
    plt.close(figure)


def measure_point(args: argparse.Namespace, url: str, mode: str, repeat: int, clients: int, steps) -> dict:
    """One point (`clients` closed-loop clients) on the mesh of `mode` at `url`."""
    target = ImageTarget(
        url=url + IMAGES_ENDPOINT,
        n=args.n,
        num_inference_steps=steps,
        sampler=args.sampler,
        seed=args.seed,
        warmup=1,
        progress=False,
    )
    load = LoadPoint(max_concurrency=clients, num_prompts=requests_for(clients, args.rounds, args.least))
    results, duration = asyncio.run(run_image_point(target, load, image_prompts(seed=args.seed)))
    summary = summarize_images(results, duration, [50.0, 99.0])
    batched = [r.batched_with for r in results if r.batched_with is not None]
    record = point_record(mode, repeat, clients, summary, batched)
    print(
        f"  [repeat {repeat}] {mode:>7}, {clients:>3} clients: {record['images_per_s']:.2f} images/s, "
        f"p50 {record['p50_ms']:.0f} ms, p99 {record['p99_ms']:.0f} ms, {record['completed']} ok / "
        f"{record['failed']} failed {summary['failed_by_status'] or ''}",
        flush=True,
    )
    return record


def meshes(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, str]:
    """One mesh per mode, all up at once (an idle one costs next to nothing): mode -> its URL."""
    from pagemesh.bench.local_mesh import running_mesh

    urls = {}
    for mode in args.modes:
        started = time.monotonic()
        urls[mode] = stack.enter_context(running_mesh(*mesh_flags(args), "--diffusion-batching", mode))
        print(f"{mode}: mesh up after {time.monotonic() - started:.0f}s", flush=True)
    return urls


def mesh_flags(args: argparse.Namespace) -> list[str]:
    return [  # no LLM worker: the meshes of the other modes, up beside it, would only idle
        "--prefill",
        "0",
        "--decode",
        "0",
        "--diffusion",
        "1",
        "--diffusion-max-running",
        str(args.max_running),
        *shlex.split(args.mesh_args),
    ]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for diffusion_batching.md/.json/.png")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of serial, request, step")
    p.add_argument("--clients", default="1,4,16", help="comma-separated numbers of closed-loop clients")
    p.add_argument("--repeats", default=2, type=int)
    p.add_argument("--num-inference-steps", default="50", help="steps per request; a comma list is cycled")
    p.add_argument("--sampler", default=None)
    p.add_argument("--n", default=1, type=int, help="images per request")
    p.add_argument("--rounds", default=4, type=int, help="requests per client in a point")
    p.add_argument("--least", default=16, type=int, help="requests in a point, at least")
    p.add_argument("--max-running", default=16, type=int, help="--diffusion-max-running")
    p.add_argument("--mesh-args", default="", help="more `pagemesh up` flags, e.g. '--diffusion-request-wait 0.1'")
    p.add_argument("--seed", default=0, type=int)
    args = p.parse_args(argv)
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not args.modes or set(args.modes) - set(MODES):
        p.error(f"--modes: of {', '.join(MODES)}")
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if not args.clients or min(args.clients) < 1 or args.repeats < 1:
        p.error("--clients >= 1 each, --repeats >= 1")
    return args


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    steps = parse_steps(args.num_inference_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_before": _load(),
        "mesh_flags": mesh_flags(args),
        "requests": f"{args.rounds} per client (at least {args.least}) after 1 warm-up",
        "steps": ",".join(map(str, steps)),
        "sampler": args.sampler,
        "n": args.n,
        "repeats": args.repeats,
        "orders": [mode_order(args.modes, r) for r in range(args.repeats)],
    }
    records: list[dict] = []
    with contextlib.ExitStack() as stack:
        urls = meshes(args, stack)
        for clients in args.clients:  # each point A-B-C then C-B-A: its modes side by side in time
            for repeat in range(args.repeats):
                for mode in mode_order(args.modes, repeat):
                    records.append(measure_point(args, urls[mode], mode, repeat, clients, steps))
                    (out / "diffusion_batching.json").write_text(
                        json.dumps({"setup": setup, "points": records}, indent=2)
                    )
    setup["load_after"] = _load()
    report = markdown(records, setup)
    (out / "diffusion_batching.json").write_text(json.dumps({"setup": setup, "points": records}, indent=2) + "\n")
    (out / "diffusion_batching.md").write_text(report)
    plot(records, out / "diffusion_batching.png", f"diffusion batching, {setup['steps'] or 'default'} steps")
    print(report)
    print(f"wrote {out / 'diffusion_batching.md'}, .json, .png")


if __name__ == "__main__":
    main()
