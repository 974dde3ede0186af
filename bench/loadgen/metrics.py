"""Per-request results -> the benchmark summary, with vLLM's serving-benchmark definitions.

Over successful requests:
  TTFT  time to the first output chunk.
  TPOT  (e2e latency - TTFT) / (output tokens - 1), per request with more than one output token.
  ITL   every gap between output chunks (split per token where the chunk's token count is known).
  E2EL  end-to-end latency of the request.
Throughputs divide by the benchmark's wall time: requests, output tokens, input + output tokens.
Goodput counts requests that meet every given SLO (in ms; a one-token request's TPOT counts as 0).
Percentiles interpolate linearly between ranks (numpy's default).

Image requests (`summarize_images`): E2EL per successful request, images and requests per
second of wall time, failures counted by HTTP status (0: no answer), and the server's own queue
and compute times where its `usage` reports them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagemesh.bench.loadgen.stream import RequestResult

if TYPE_CHECKING:
    from pagemesh.bench.loadgen.images import ImageResult

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"goodput: {item!r}: must not be negative")
        slos[name] = ms
    return slos


def _label(p: float) -> str:
    return f"{p:g}".replace(".", "_")


def latency_stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std and percentiles of `seconds`, as `{mean_<name>_ms: ...}` (0 when empty)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0 if len(seconds) else np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        stats[f"p{_label(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def request_tpot(result: RequestResult) -> float | None:
    if (result.output_tokens or 0) <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    count_tokens: Callable[[str], int],
    goodput_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """The summary as a flat dict of numbers. Fills a missing `output_tokens` with
    `count_tokens(text)` (servers that send no usage)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    done = [r for r in results if r.success]
    for r in done:
        if r.output_tokens is None:
            r.output_tokens = count_tokens(r.text)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in map(request_tpot, done) if t is not None]
    good = 0
    if goodput_ms:
        for r in done:
            values = {"ttft": r.ttft, "tpot": request_tpot(r) or 0.0, "e2el": r.latency}
            good += all(values[name] <= ms / 1000.0 for name, ms in goodput_ms.items())
    summary = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if goodput_ms else None,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    summary |= latency_stats("ttft", [r.ttft for r in done], percentiles)
    summary |= latency_stats("tpot", tpots, percentiles)
    summary |= latency_stats("itl", [gap for r in done for gap in r.itl], percentiles)
    summary |= latency_stats("e2el", [r.latency for r in done], percentiles)
    return summary


def summarize_images(
    results: Sequence[ImageResult], duration_s: float, percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict:
    """The summary of image requests as a flat dict (plus `failed_by_status`, status -> count).
    The queue/compute statistics are there only when some successful request reported them."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    done = [r for r in results if r.success]
    images = sum(r.images for r in done)
    by_status = Counter(str(r.status) for r in results if not r.success)
    summary = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "failed_by_status": dict(sorted(by_status.items())),
        "total_images": images,
        "request_throughput": len(done) / duration_s,
        "image_throughput": images / duration_s,
    }
    summary |= latency_stats("e2el", [r.latency for r in done], percentiles)
    for name in ("queue", "compute"):
        reported = [t for r in done if (t := getattr(r, f"{name}_time_s")) is not None]
        if reported:
            summary |= latency_stats(name, reported, percentiles)
    return summary
