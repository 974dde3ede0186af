"""Simulated requests: arrival times and prompt/output lengths, from distributions or a trace.

Arrivals are Poisson at a rate, or bursty (gamma inter-arrival times with shape `burstiness`,
as vLLM's serving benchmark: 1 is Poisson, below 1 burstier); `rate=inf` sends everything at 0.
Prompts are token ids drawn from the seeded generator; with `shared_prefix` tokens, every prompt
of a group starts with the same tokens (so prefix caches and prefix-aware placement act).
A trace is JSON lines of {"arrival_s", "prompt_len", "output_len"} (`pagemesh bench
--record-trace` writes one) or the per-request JSON that `pagemesh bench --result-json` keeps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 200
    rate: float = 4.0  # requests per second (inf: all at once)
    burstiness: float = 1.0
    input_len: int = 128
    output_len: int = 128
    input_spread: float = 0.0  # lengths uniform in [len·(1-spread), len·(1+spread)]
    output_spread: float = 0.0
    shared_prefix: int = 0  # leading tokens shared by the prompts of one group
    prefix_groups: int = 1
    vocab_size: int = 49152
    seed: int = 0


def _lengths(rng: np.random.Generator, mean: int, spread: float, n: int) -> np.ndarray:
    if spread <= 0:
        return np.full(n, mean, dtype=np.int64)
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.integers(low, high + 1, size=n)


def arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at 0


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    """The same spec and seed give the same requests."""
    rng = np.random.default_rng(spec.seed)
    times = arrivals(rng, spec.num_requests, spec.rate, spec.burstiness)
    ins = _lengths(rng, spec.input_len, spec.input_spread, spec.num_requests)
    outs = _lengths(rng, spec.output_len, spec.output_spread, spec.num_requests)
    prefixes = [rng.integers(0, spec.vocab_size, size=spec.shared_prefix).tolist() for _ in range(spec.prefix_groups)]
    requests = []
    for i in range(spec.num_requests):
        prefix = prefixes[i % spec.prefix_groups] if spec.shared_prefix else []
        rest = rng.integers(0, spec.vocab_size, size=max(1, int(ins[i]) - len(prefix))).tolist()
        requests.append(SimRequest(f"sim-{i}", float(times[i]), tuple(prefix + rest), int(outs[i])))
    return requests


def trace_rows(path: Path) -> list[dict]:
    """{arrival_s, prompt_len, output_len} rows from JSON lines, or from the first point of a
    `pagemesh bench --result-json` file (its requests' send times and lengths)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{") and '"points"' in text[:100_000]:
        requests = json.loads(text)["points"][0]["requests"]
        if "starts" not in requests:
            raise ValueError(f"{path}: this bench result has no send times (written by an older pagemesh bench)")
        return [
            {"arrival_s": start, "prompt_len": n_in, "output_len": n_out}
            for start, n_in, n_out, error in zip(
                requests["starts"], requests["input_lens"], requests["output_lens"], requests["errors"]
            )
            if not error and n_out
        ]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def from_trace(path: Path, vocab_size: int = 49152, seed: int = 0) -> list[SimRequest]:
    """Requests from a trace (see `trace_rows`); prompt ids are drawn, lengths and times kept,
    times shifted so the first request arrives at 0."""
    rng = np.random.default_rng(seed)
    rows = sorted(trace_rows(path), key=lambda r: r["arrival_s"])
    start = rows[0]["arrival_s"] if rows else 0.0
    requests = []
    for i, row in enumerate(rows):
        ids = tuple(rng.integers(0, vocab_size, size=int(row["prompt_len"])).tolist())
        requests.append(SimRequest(f"trace-{i}", float(row["arrival_s"]) - start, ids, int(row["output_len"])))
    return requests
