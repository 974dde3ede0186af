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

from pagemesh.bench.experiments.mesh import bench
from pagemesh.bench.experiments.report import new_figure
from pagemesh.bench.loadgen.datasets import DatasetSpec, conversations
from pagemesh.bench.local_mesh import metrics, running_mesh
from pagemesh.common.model_files import resolve_model_path
from pagemesh.common.tokenizer import Tokenizer


@dataclass(frozen=True)
class Setup:
    num_requests: int
    input_len: int
    output_len: int
    rate: float  # requests/s, Poisson


FULL = Setup(12, 1024, 32, 0.5)
QUICK = Setup(3, 32, 4, 4.0)


def stall_share(itls: list[float]) -> float:
    """Fraction of inter-token gaps longer than twice the median gap."""
    if not itls:
        return 0.0
    median = sorted(itls)[len(itls) // 2]
    return sum(g > 2 * median for g in itls) / len(itls)


def topologies(threads: int) -> list[tuple[str, list[str]]]:
    """(label, `pagemesh up` flags): the same threads in all when there are two or more to split;
    with one (a busy machine), one per worker, so the disaggregated mesh runs two."""
    return [
        ("disaggregated 1P+1D", ["--threads-per-worker", str(max(1, threads // 2))]),
        ("mixed 1", ["--mixed", "1", "--threads-per-worker", str(threads)]),
    ]


def run(ctx):
    setup = QUICK if ctx.quick else FULL
    tokenizer = Tokenizer.from_path(resolve_model_path(ctx.model_path))
    spec = DatasetSpec("random", setup.input_len, setup.output_len, seed=ctx.seed)
    workload = [c for c, _ in zip(conversations(spec, tokenizer), range(setup.num_requests + 1))]
    model = ["--model", ctx.model_path] if ctx.model_path else []
    points = []
    for label, flags in topologies(ctx.threads):
        with running_mesh(*flags, "--seed", str(ctx.seed), *model) as url:
            summary, results = bench(url, workload, tokenizer, setup.rate, ctx.seed)
            kv_bytes = metrics(url).get("pagemesh_kv_transfer_bytes_total", 0.0)
        points.append(
            {
                "label": label,
                "flags": " ".join(flags),
                "summary": summary,
                "kv_bytes": kv_bytes,
                "itls": sorted(gap for r in results if r.success for gap in r.itl),
            }
        )

    report = ctx.report("Disaggregated prefill/decode vs one mixed worker")
    report.text(__doc__.split("\n\n", 1)[1])
    report.table(
        ("", "value"),
        [
            ("requests", f"{setup.num_requests} (+1 unmeasured warm-up), Poisson at {setup.rate:g} req/s"),
            (
                "prompt / output tokens",
                f"{setup.input_len} / {setup.output_len} (random real tokens, sent as ids, EOS ignored)",
            ),
            (
                "torch threads per worker",
                ", ".join(
                    f"{label}: {flags[flags.index('--threads-per-worker') + 1]}"
                    for label, flags in topologies(ctx.threads)
                ),
            ),
        ]
        + [(f"`pagemesh up` for {p['label']}", f"`{p['flags']}`") for p in points],
        caption="Workload",
    )
    rows = []
    for p in points:
        s = p["summary"]
        rows.append(
            (
                p["label"],
                s["completed"],
                s["median_ttft_ms"],
                s["p99_ttft_ms"],
                s["median_itl_ms"],
                s["p90_itl_ms"],
                s["p99_itl_ms"],
                s["output_throughput"],
                p["kv_bytes"] / 2**20,
            )
        )
    report.table(
        (
            "topology",
            "completed",
            "p50 TTFT (ms)",
            "p99 TTFT (ms)",
            "p50 ITL (ms)",
            "p90 ITL (ms)",
            "p99 ITL (ms)",
            "output tok/s",
            "KV sent (MiB)",
        ),
        rows,
        caption="Result",
    )
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
    figure, (axis,) = new_figure(1, width=7)
    for p in points:
        n = len(p["itls"])
        axis.plot([g * 1000 for g in p["itls"]], [(i + 1) / n for i in range(n)], label=p["label"])
    axis.set(
        xscale="log",
        xlabel="inter-token latency (ms, log scale)",
        ylabel="fraction of gaps ≤ x",
        title="ITL distribution",
    )
    axis.legend()
    report.figure("itl_cdf", figure, "Cumulative distribution of every inter-token gap: prefill stalls are the tail.")
    d, m = points[0]["summary"], points[1]["summary"]
    split, mixed = (int(flags[flags.index("--threads-per-worker") + 1]) for _, flags in topologies(ctx.threads))
    if 2 * split == mixed:
        cores = f"Both topologies ran {mixed} torch threads in all."
    else:
        cores = (
            f"The machine was busy, so every worker ran {split} thread: {2 * split} threads for the "
            f"disaggregated mesh against {mixed} for the mixed worker, on the same 2 shared cores."
        )
    stalls = [stall_share(p["itls"]) for p in points]
    per_request_mib = points[0]["kv_bytes"] / 2**20 / (setup.num_requests + 1)
    medians = (
        "The split also wins on the medians here."
        if d["median_itl_ms"] <= m["median_itl_ms"] and d["median_ttft_ms"] <= m["median_ttft_ms"]
        else "On the medians the split costs more than it saves here: the two processes compete for the same "
        "cores and the decode worker also takes in the KV pages."
    )
    verdict = (
        "Keeping prompts off the decode worker removes most of those stalls: the effect the papers build on."
        if stalls[0] < stalls[1]
        else "The split did not remove the stalls here."
    )
    report.text(
        f"**Stalls.** In the mixed worker {stalls[1]:.0%} of the inter-token gaps are more than twice its median "
        f"(a prompt chunk in the decode step), against {stalls[0]:.0%} on the decode worker; p90 / p99 ITL "
        f"{d['p90_itl_ms']:.0f} / {d['p99_itl_ms']:.0f} ms disaggregated vs {m['p90_itl_ms']:.0f} / "
        f"{m['p99_itl_ms']:.0f} ms mixed. "
        f"{verdict}\n\n"
        f"**Medians.** p50 ITL {d['median_itl_ms']:.0f} vs {m['median_itl_ms']:.0f} ms, p50 TTFT "
        f"{d['median_ttft_ms']:.0f} vs {m['median_ttft_ms']:.0f} ms; output throughput {d['output_throughput']:.1f} vs "
        f"{m['output_throughput']:.1f} tok/s against an offered load of {setup.rate * setup.output_len:.0f} tok/s. "
        f"{cores} {medians} The decode worker receives and writes {per_request_mib:.1f} MiB of KV per request. "
        f"DistServe and Splitwise gain because each phase gets its own GPUs, sized and parallelized for it; one small "
        f"CPU machine cannot add hardware, so here the split can only move work off the decode steps."
    )
    report.key = (
        f"disagg: gaps > 2x median {stalls[0]:.0%} vs {stalls[1]:.0%}, p50 ITL {d['median_itl_ms']:.0f} vs "
        f"{m['median_itl_ms']:.0f} ms, p99 ITL {d['p99_itl_ms']:.0f} vs {m['p99_itl_ms']:.0f} ms, p50 TTFT "
        f"{d['median_ttft_ms']:.0f} vs "
        f"{m['median_ttft_ms']:.0f} ms, {d['output_throughput']:.1f} vs {m['output_throughput']:.1f} tok/s "
        f"(1P+1D vs mixed)"
    )
    return report
