"""`pagemesh simulate`: a cluster-sized question answered by the mesh's own scheduling code.

    pagemesh simulate --mixed 1 --rate 2 --num-requests 100                  # this CPU (calibrated)
    pagemesh simulate --prefill 1 --decode 1 --rate 2 --goodput ttft:500 tpot:50
    pagemesh simulate --cost h200 --model llama-3.1-8b --tp 1 --mixed 4 --rate 40 --link nvlink
    pagemesh simulate --cost h200 --model llama-3.1-8b --sweep rate=10,20,40,80 --out DIR
    pagemesh simulate --cost h100 --model llama-3.1-70b --tp 4 --rate 8 --find --goodput ttft:1000 tpot:60
    pagemesh simulate calibrate --threads 2 --out bench/simulator/calibration/cpu-2threads.json

The scheduler core, each worker's engine scheduler and block manager, and placement are the
real ones (services/scheduler/core.py, workers/engine/scheduler.py, block_manager.py); the
forward is a step-time model (`--cost cpu`: fitted on this machine by `calibrate`; `--cost
h100|h200`: a roofline of the GPU at `--tp`), and the KV handoff a transfer model (`--link`).
Prints the summary `pagemesh bench` prints (TTFT, TPOT, ITL, E2E, throughput, goodput), KV use
and preemptions; `--sweep KNOB=v1,v2,...` varies one knob (rate, pd as P:D, max_num_batched_tokens,
page_size, max_prefill_chunk, input_len, output_len, ...) and plots it; `--find` searches the
smallest cluster meeting the `--goodput` SLOs at p99.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import structlog

from pagemesh.bench.loadgen.metrics import parse_goodput
from pagemesh.bench.plots import save_png
from pagemesh.bench.simulator.cost import GPUS, LINKS, MODEL_SHAPES, LinearStepCost, RooflineStepCost, model_shape
from pagemesh.bench.simulator.role_cost import MeshStepCost
from pagemesh.bench.simulator.run import SimSettings, describe, find_smallest, simulate
from pagemesh.bench.simulator.workload import WorkloadSpec, from_trace

CALIBRATION = Path(__file__).resolve().parent / "calibration"
CPU_KV_BYTES = 2 * 2**30  # a CPU worker's default pool (workers/engine/kv_pool_size.py DEFAULT_CPU_KV_GB)
SHOWN = [
    ("completed", "{:.0f}"),
    ("failed", "{:.0f}"),
    ("request_throughput", "{:.2f}"),
    ("output_throughput", "{:.1f}"),
    ("median_ttft_ms", "{:.1f}"),
    ("p99_ttft_ms", "{:.1f}"),
    ("median_tpot_ms", "{:.2f}"),
    ("p99_tpot_ms", "{:.2f}"),
    ("p99_itl_ms", "{:.1f}"),
    ("median_e2el_ms", "{:.0f}"),
    ("request_goodput", "{:.2f}"),
    ("sim_preemptions", "{:.0f}"),
    ("sim_max_kv_used_pages", "{:.0f}"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagemesh simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("cluster")
    g.add_argument("--mixed", type=int, default=None, help="mixed workers (default 1 unless --prefill/--decode)")
    g.add_argument("--prefill", type=int, default=0)
    g.add_argument("--decode", type=int, default=0)
    g.add_argument("--cost", default="cpu", choices=["cpu", *GPUS], help="step-time model")
    g.add_argument(
        "--calibration", type=Path, default=None, help="a LinearStepCost or per-role MeshStepCost JSON (--cost cpu)"
    )
    g.add_argument(
        "--no-step-jitter",
        action="store_true",
        help="a per-role model's steps without their jitter and the host's slowdown",
    )
    g.add_argument(
        "--host-clock",
        type=float,
        default=None,
        help="replay the calibration's host slowdown as it was on its trace's clock, this clock time "
        "(perf_counter s) being the first request's send (validation against a recorded run)",
    )
    g.add_argument("--model", default="smollm2-135m", help=f"a model shape ({', '.join(MODEL_SHAPES)}) or a path")
    g.add_argument("--tp", type=int, default=1, help="GPUs per worker (roofline)")
    g.add_argument("--link", default=None, choices=list(LINKS), help="KV transfer (default loopback on cpu, nvlink)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None, help="per worker (default: from memory)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-prefill-chunk", type=int, default=512)
    g.add_argument("--batching", default="iteration", choices=["iteration", "request"])
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)  # as the engine's
    g.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="the older spelling of --no-enable-prefix-caching (kept for one release)",
    )
    g.add_argument(
        "--request-overhead-ms", type=float, default=0.0, help="fixed time per request outside the steps (measured)"
    )
    w = p.add_argument_group("workload")
    w.add_argument("--rate", type=float, default=2.0, help="requests/s (inf: all at once)")
    w.add_argument("--num-requests", type=int, default=100)
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1: Poisson)")
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--input-spread", type=float, default=0.0)
    w.add_argument("--output-spread", type=float, default=0.0)
    w.add_argument("--shared-prefix", type=int, default=0)
    w.add_argument("--prefix-groups", type=int, default=1)
    w.add_argument("--trace", type=Path, default=None, help="JSON lines of arrival_s, prompt_len, output_len")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="*", default=[], help="SLOs as NAME:MS (ttft, tpot, e2el)")
    o.add_argument("--sweep", default=None, help="KNOB=v1,v2,... (one knob)")
    o.add_argument("--find", action="store_true", help="the smallest cluster meeting --goodput at p99")
    o.add_argument("--max-workers", type=int, default=16, help="--find: the largest cluster tried")
    o.add_argument("--out", type=Path, default=None, help="a folder for the JSON results and the sweep's plot")
    return p


def cost_model(args) -> tuple[object, int]:
    """(step-time model, KV bytes per token per worker)."""
    shape = model_shape(args.model)
    if args.cost == "cpu":
        threads = 2 if (args.mixed or 0) > 0 or not (args.prefill or args.decode) else 1
        path = args.calibration or CALIBRATION / f"cpu-{threads}thread{'s' if threads > 1 else ''}.json"
        if not Path(path).exists():
            raise SystemExit(
                f"pagemesh simulate: no CPU step-time model at {path}; make one on a quiet machine with "
                f"`pagemesh simulate calibrate --threads {threads} --out {path}` (or use --cost h100|h200)"
            )
        cost = MeshStepCost.load(path) if MeshStepCost.is_one(path) else LinearStepCost.load(path)
        return cost, shape.kv_bytes_per_token(2)
    roofline = RooflineStepCost(GPUS[args.cost], shape, args.tp)
    return roofline, int(roofline.kv_bytes_per_token)


def settings_from(args, kv_bytes_per_token: int, cost) -> SimSettings:
    if args.num_pages is not None:
        pages = args.num_pages
    elif isinstance(cost, RooflineStepCost):
        pages = cost.kv_pages(args.page_size)
    else:
        pages = CPU_KV_BYTES // (kv_bytes_per_token * args.page_size)
    mixed = args.mixed if args.mixed is not None else (0 if args.prefill or args.decode else 1)
    workload = WorkloadSpec(
        num_requests=args.num_requests,
        rate=args.rate,
        burstiness=args.burstiness,
        input_len=args.input_len,
        output_len=args.output_len,
        input_spread=args.input_spread,
        output_spread=args.output_spread,
        shared_prefix=args.shared_prefix,
        prefix_groups=args.prefix_groups,
        seed=args.seed,
    )
    return SimSettings(
        mixed=mixed,
        prefill=args.prefill,
        decode=args.decode,
        page_size=args.page_size,
        num_pages=pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        batching=args.batching,
        prefix_caching=args.enable_prefix_caching,
        link=args.link or ("loopback" if args.cost == "cpu" else "nvlink"),
        request_overhead_s=args.request_overhead_ms / 1000,
        step_jitter=not args.no_step_jitter,
        host_clock_s=args.host_clock,
        workload=workload,
    )


def table(rows: list[tuple[str, dict]], first: str) -> str:
    head = f"| {first} | " + " | ".join(name for name, _ in SHOWN) + " |"
    lines = [head, "|" + " --- |" * (len(SHOWN) + 1)]
    for label, summary in rows:
        cells = []
        for name, fmt in SHOWN:
            value = summary.get(name)
            cells.append("—" if value is None else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(rows: list[tuple[str, dict]], knob: str, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [label for label, _ in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (title, keys) in zip(
        axes,
        [
            ("TTFT (ms)", ["median_ttft_ms", "p99_ttft_ms"]),
            ("TPOT (ms)", ["median_tpot_ms", "p99_tpot_ms"]),
            ("output tok/s", ["output_throughput"]),
        ],
    ):
        for key in keys:
            ax.plot(labels, [s[key] for _, s in rows], marker="o", label=key)
        ax.set_title(title)
        ax.set_xlabel(knob)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"sweep-{knob}.png"
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    args = parser().parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        raise SystemExit(f"pagemesh simulate: {e}") from None
    cost, kv_bytes = cost_model(args)
    step_time = cost if isinstance(cost, MeshStepCost) else cost.step_time
    base = settings_from(args, kv_bytes, cost)
    requests = from_trace(args.trace, seed=args.seed) if args.trace else None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.find:
        if not slos:
            raise SystemExit("pagemesh simulate --find: give the SLOs with --goodput, e.g. ttft:500 tpot:50")
        found = find_smallest(base, step_time, kv_bytes, slos, args.max_workers)
        if found is None:
            print(f"no cluster of up to {args.max_workers} workers meets {slos} at p99")
            raise SystemExit(1)
        settings, summary = found
        print(f"smallest cluster meeting {slos} at p99: {describe(settings)}")
        print(table([(describe(settings), summary)], "cluster"))
        return
    rows: list[tuple[str, dict]] = []
    if args.sweep:
        knob, _, values = args.sweep.partition("=")
        knob = knob.replace("-", "_")
        for value in values.split(","):
            try:
                settings = base.with_knob(knob, value)
            except (AttributeError, TypeError, ValueError) as e:
                raise SystemExit(f"pagemesh simulate --sweep: cannot set {knob}={value}: {e}") from None
            rows.append((value, simulate(settings, step_time, kv_bytes, slos or None, requests)))
    else:
        rows.append((describe(base), simulate(base, step_time, kv_bytes, slos or None, requests)))
    first = args.sweep.partition("=")[0] if args.sweep else "cluster"
    print(f"cost model: {describe_cost(cost)}; KV pages per worker: {base.num_pages}; link: {base.link}")
    print(table(rows, first))
    if args.out:
        (args.out / "simulate.json").write_text(json.dumps({label: s for label, s in rows}, indent=2, default=str))
        if args.sweep:
            path = plot_sweep(rows, first, args.out)
            if path:
                print(f"plot: {path}")


def describe_cost(cost) -> str:
    if isinstance(cost, RooflineStepCost):
        return f"roofline {cost.gpu.name} x{cost.tp}, weights {cost.weight_bytes / 1e9:.1f} GB"
    if isinstance(cost, MeshStepCost):
        host = f", the host's slowdown over {cost.host.span_s:.0f} s" if cost.host.factors else ""
        return f"fitted per role ({', '.join(cost.roles) or 'pooled only'}) on this CPU ({cost.source}){host}"
    return f"fitted on this CPU ({cost.source})"


def calibrate_main(argv: list[str]) -> None:
    from pagemesh.bench.simulator.calibrate import calibrate

    p = argparse.ArgumentParser(prog="pagemesh simulate calibrate")
    p.add_argument("--threads", type=int, default=2, help="torch threads, as the worker will have")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    calibrate(args.out, args.threads)


if __name__ == "__main__":
    main()
