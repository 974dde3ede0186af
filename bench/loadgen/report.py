"""Showing results: the printed summary, the result JSON, and the plot of a sweep."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pagemesh.bench.plots import save_png

_LATENCIES = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token (excl. 1st)"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)
_IMAGE_LATENCIES = (
    ("e2el", "End-to-end latency"),
    ("queue", "Server queue time (usage)"),
    ("compute", "Server compute time (usage)"),
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
    return _block(title, rows, summary, _LATENCIES)


def format_image_summary(summary: dict, title: str) -> str:
    """The images mode's text block: counts (failures by HTTP status), throughputs, latencies."""
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"])]
    rows += [
        (f"  HTTP {status}" if status != "0" else "  no answer", n) for status, n in summary["failed_by_status"].items()
    ]
    rows += [
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total images", summary["total_images"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Image throughput (images/s)", summary["image_throughput"]),
    ]
    return _block(title, rows, summary, _IMAGE_LATENCIES)


def _block(title: str, rows: list[tuple[str, object]], summary: dict, latencies: Sequence[tuple[str, str]]) -> str:
    lines = [f"{' ' + title + ' ':=^52}"]
    lines += [
        f"{name:<38}{value:>14.2f}" if isinstance(value, float) else f"{name:<38}{value:>14}" for name, value in rows
    ]
    for key, heading in latencies:
        stats = [(stat, value) for stat, value in summary.items() if stat.endswith(f"_{key}_ms")]
        if not stats:
            continue  # e.g. a server that reports no queue times
        lines.append(f"{' ' + heading + ' ':-^52}")
        for stat, value in stats:
            if not stat.startswith("std_"):
                name = stat[: -len(f"_{key}_ms")]
                label = "P" + name[1:].replace("_", ".") if name.startswith("p") else name.title()
                lines.append(f"{label + ' ' + key.upper() + ' (ms)':<38}{value:>14.2f}")
    lines.append("=" * 52)
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def plot_sweep(
    points: Sequence[dict],
    path: str | Path,
    sweep_name: str,
    title: str,
    *,
    x: tuple[str, str] = ("output_throughput", "output throughput (tok/s)"),
    metrics: Sequence[str] = ("ttft", "tpot"),
) -> None:
    """Latency (p50/p99 of each of `metrics`, one panel each) against a throughput (`x`: summary
    key, axis label), one marker per point, labelled with its request rate or concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    x_key, x_label = x
    xs = [p["summary"][x_key] for p in points]
    for axis, metric in zip(axes[0], metrics):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            axis.plot(
                xs,
                [p["summary"][f"{stat}_{metric}_ms"] for p in points],
                style,
                label=f"{'p50' if stat == 'median' else stat} {metric.upper()}",
            )
        for xi, point in zip(xs, points):
            axis.annotate(
                f"{sweep_name}={point['sweep_value']:g}",
                (xi, point["summary"][f"p99_{metric}_ms"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        axis.set_xlabel(x_label)
        axis.set_ylabel(f"{metric.upper()} (ms)")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_png(figure, path, dpi=110)
    plt.close(figure)
