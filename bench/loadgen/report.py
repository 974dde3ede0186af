"""Showing results: the printed summary, the result JSON, and the plot of a sweep."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

_LATENCIES = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token (excl. 1st)"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)


def format_summary(summary: dict, title: str) -> str:
    """A fixed-width text block of the summary."""
    rows = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total generated tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
    ]
    if summary.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", summary["request_goodput"]))
    rows += [
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    lines = [f"{' ' + title + ' ':=^52}"]
    lines += [
        f"{name:<38}{value:>14.2f}" if isinstance(value, float) else f"{name:<38}{value:>14}" for name, value in rows
    ]
    for key, heading in _LATENCIES:
        lines.append(f"{' ' + heading + ' ':-^52}")
        for stat, value in summary.items():
            if stat.endswith(f"_{key}_ms") and not stat.startswith("std_"):
                name = stat[: -len(f"_{key}_ms")]
                label = "P" + name[1:].replace("_", ".") if name.startswith("p") else name.title()
                lines.append(f"{label + ' ' + key.upper() + ' (ms)':<38}{value:>14.2f}")
    lines.append("=" * 52)
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def plot_sweep(points: Sequence[dict], path: str | Path, sweep_name: str, title: str) -> None:
    """Latency (p50/p99 of TTFT and TPOT) against output throughput, one marker per point,
    labelled with its request rate or concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [p["summary"]["output_throughput"] for p in points]
    for axis, metric in zip(axes, ("ttft", "tpot")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            axis.plot(
                x,
                [p["summary"][f"{stat}_{metric}_ms"] for p in points],
                style,
                label=f"{'p50' if stat == 'median' else stat} {metric.upper()}",
            )
        for xi, point in zip(x, points):
            axis.annotate(
                f"{sweep_name}={point['sweep_value']:g}",
                (xi, point["summary"][f"p99_{metric}_ms"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        axis.set_xlabel("output throughput (tok/s)")
        axis.set_ylabel(f"{metric.upper()} (ms)")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
