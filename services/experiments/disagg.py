"""Disaggregated prefill and decode (DistServe, Zhong et al., OSDI 2024; Splitwise): with prompts
and decodes on different workers, a prefill never sits in a decode step, so inter-token latency
is steady, and each phase can be sized on its own; the price is the KV transfer and, on equal
hardware, half the compute per phase.

The same seeded workload is streamed over HTTP (`pagemesh bench`'s runner and metrics) to
`pagemesh up` (1 prefill + 1 decode worker) and to `pagemesh up --mixed 1` (one colocated worker
with chunked prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.model_files import resolve_model_path
from common.tokenizer import Tokenizer
from services.bench.datasets import DatasetSpec, conversations
from services.experiments.mesh import bench, metrics, running_mesh
from services.experiments.report import new_figure


@dataclass(frozen=True)
class Setup:
    num_requests: int
    input_len: int
    output_len: int
    rate: float  # requests/s, Poisson


FULL = Setup(16, 256, 32, 1.0)
QUICK = Setup(3, 32, 4, 4.0)


def topologies(threads: int) -> list[tuple[str, list[str]]]:
    """(label, `pagemesh up` flags): the same threads in all when there are two or more to split;
    with one (a busy machine), one per worker, so the disaggregated mesh runs two."""
    return [("disaggregated 1P+1D", ["--threads-per-worker", str(max(1, threads // 2))]),
            ("mixed 1", ["--mixed", "1", "--threads-per-worker", str(threads)])]


def run(ctx):
    setup = QUICK if ctx.quick else FULL
    tokenizer = Tokenizer.from_path(resolve_model_path(ctx.model_path))
    spec = DatasetSpec("random", setup.input_len, setup.output_len, seed=ctx.seed)
    workload = [c for c, _ in zip(conversations(spec, tokenizer), range(setup.num_requests + 1))]
    model = ["--model", ctx.model_path] if ctx.model_path else []
    points = []
    for label, flags in topologies(ctx.threads):
        with running_mesh(*flags, "--seed", str(ctx.seed), *model) as url:
            summary, _ = bench(url, workload, tokenizer, setup.rate, ctx.seed)
            kv_bytes = metrics(url).get("pagemesh_kv_transfer_bytes_total", 0.0)
        points.append({"label": label, "flags": " ".join(flags), "summary": summary, "kv_bytes": kv_bytes})

    report = ctx.report("Disaggregated prefill/decode vs one mixed worker")
    report.text(__doc__.split("\n\n", 1)[1])
    report.table(("", "value"), [
        ("requests", f"{setup.num_requests} (+1 unmeasured warm-up), Poisson at {setup.rate:g} req/s"),
        ("prompt / output tokens", f"{setup.input_len} / {setup.output_len} (random real tokens, sent as ids, EOS ignored)"),
        ("torch threads per worker", ", ".join(f"{label}: {flags[flags.index('--threads-per-worker') + 1]}"
                                               for label, flags in topologies(ctx.threads))),
    ] + [(f"`pagemesh up` for {p['label']}", f"`{p['flags']}`") for p in points], caption="Workload")
    rows = []
    for p in points:
        s = p["summary"]
        rows.append((p["label"], s["completed"], s["median_ttft_ms"], s["p99_ttft_ms"], s["median_itl_ms"], s["p99_itl_ms"],
                     s["output_throughput"], p["kv_bytes"] / 2**20))
    report.table(("topology", "completed", "p50 TTFT (ms)", "p99 TTFT (ms)", "p50 ITL (ms)", "p99 ITL (ms)",
                  "output tok/s", "KV sent (MiB)"), rows, caption="Result")
    figure, (left, right) = new_figure(2)
    labels = [p["label"] for p in points]
    for axis, metric in ((left, "ttft"), (right, "itl")):
        x = range(len(points))
        axis.bar([i - 0.2 for i in x], [p["summary"][f"median_{metric}_ms"] for p in points], 0.4, label="p50")
        axis.bar([i + 0.2 for i in x], [p["summary"][f"p99_{metric}_ms"] for p in points], 0.4, label="p99")
        axis.set_xticks(list(x), labels)
        axis.set(ylabel=f"{metric.upper()} (ms)", title=metric.upper())
        axis.legend()
    report.figure("latency", figure, "TTFT and inter-token latency, disaggregated vs mixed.")
    d, m = points[0]["summary"], points[1]["summary"]
    split, mixed = (int(flags[flags.index("--threads-per-worker") + 1]) for _, flags in topologies(ctx.threads))
    if 2 * split == mixed:
        cores = (f"Both topologies ran {mixed} torch threads in all, so disaggregation adds no compute here: it only "
                 f"keeps prompts out of decode steps, and pays the KV transfer and a second copy of the weights.")
    else:
        cores = (f"The machine was busy, so every worker ran {split} thread: the disaggregated mesh had {2 * split} "
                 f"threads against the mixed worker's {mixed}, and part of its advantage is that extra thread "
                 f"(on 2 shared cores, less than 2×).")
    report.text(
        f"p99 ITL: {d['p99_itl_ms']:.0f} ms disaggregated vs {m['p99_itl_ms']:.0f} ms mixed; p50 TTFT "
        f"{d['median_ttft_ms']:.0f} vs {m['median_ttft_ms']:.0f} ms; output throughput {d['output_throughput']:.1f} vs "
        f"{m['output_throughput']:.1f} tok/s (the offered load is {setup.rate * setup.output_len:.0f} tok/s: a "
        f"topology that keeps up delivers about that). {cores} The papers' gains come from giving each phase its own GPUs "
        f"and parallelism, which one small CPU machine cannot show."
    )
    report.key = (f"disagg: p99 ITL {d['p99_itl_ms']:.0f} vs {m['p99_itl_ms']:.0f} ms, p50 TTFT {d['median_ttft_ms']:.0f} vs "
                  f"{m['median_ttft_ms']:.0f} ms, {d['output_throughput']:.1f} vs {m['output_throughput']:.1f} tok/s "
                  f"(1P+1D vs mixed)")
    return report
