"""What the slowest requests of a validation run have in common: the recorded run against its
step traces, request by request (how docs/experiments/simulator.md checked the p99 TPOT gap).

    python -m pagemesh.bench.simulator.tail --run DIR [--topology 1P+1D] [--rates 1,3,6]

DIR is a `pagemesh.bench.simulator.validate --out DIR` folder: real-TOPOLOGY-RATE.json (each request's
send time, TTFT, latency) and steps-TOPOLOGY/ (every worker step, on the system-wide
perf_counter clock). The client's clock is put on the trace's by the first tokens: each one
reaches the client a few ms after a prefill step ends, so the offset is the one that puts the
first tokens nearest after step ends.

Printed, per rate: for the slowest 5% of requests by TPOT, the middle 20% and all, the mean of
what their decode stretch (first token to last) met — the decode steps' ratio of measured time
to the role's model (with its contention term, without jitter or host slowdown), the other
workers' steps' ratio over the same stretch, the share of it another worker was mid-step, the
mean decode batch — and each one's correlation with TPOT over the requests; and whether the two
workers' steps ran slow at the same times (per 2 s window, their mean ratios). Then the decode
steps' cycles by rows and by what overlapped them: nothing, another worker's step throughout,
or the end of a prefill step (a KV handoff arriving).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pagemesh.bench.simulator.calibrate import fit_trace, read_traces, traced_workers
from pagemesh.bench.simulator.role_cost import TracedStep

FEATURES = ("own steps / model", "other worker's steps / model", "other worker busy", "decode rows")
ROWS = ((1, 3), (3, 8), (8, 16), (16, 64))


def requests(path: Path) -> list[dict]:
    """Each completed request's first-token time and end (client clock, s) and TPOT (ms)."""
    r = json.loads(path.read_text())["points"][0]["requests"]
    out = []
    for i, start in enumerate(r["starts"]):
        if r["errors"][i] or r["output_lens"][i] < 2:
            continue
        first, end = start + r["ttfts"][i], start + r["latencies"][i]
        out.append({"first": first, "end": end, "tpot": (end - first) / (r["output_lens"][i] - 1) * 1000})
    return out


FIRST_TOKEN_TRIPS_S = np.arange(0.0, 0.05, 0.002)  # clock_offset: step end to the client, tried
GAP_CAP_S = 0.5  # clock_offset: a first token further than this after every step end counts as this far


def clock_offset(firsts: np.ndarray, step_ends: np.ndarray, within: tuple[float, float] | None = None) -> float:
    """Trace clock minus client clock: the candidate (one per step end, taken as the first
    request's) whose first tokens land nearest after a step end, by the mean gap, each gap
    counted up to GAP_CAP_S (a few late first tokens do not decide it, while a candidate that
    puts half the run among some other run's dense steps pays for the half it leaves far from any
    step). `within`: only step ends in that stretch of the trace's clock are candidates for the
    first request's (where the run is known to have begun)."""
    best, offset = np.inf, 0.0
    candidates = step_ends if within is None else step_ends[(step_ends >= within[0]) & (step_ends <= within[1])]
    # the first request's own first token came some ms after its step ended, and every later one
    # is placed relative to it: try each such trip, or the requests whose trip was shorter would
    # land before their step's end
    for end in (candidates[:, None] + FIRST_TOKEN_TRIPS_S[None, :]).ravel():
        candidate = end - firsts[0]
        at = firsts + candidate
        before = np.searchsorted(step_ends, at + 1e-4) - 1
        gaps = np.where(before >= 0, at - step_ends[np.maximum(before, 0)], 1.0)
        if (score := float(np.minimum(gaps, GAP_CAP_S).mean())) < best:
            best, offset = score, candidate
    return offset


def analyse(run: Path, topology: str, rates: list[float]) -> str:
    model = fit_trace(run / f"steps-{topology}", host_window_s=None)
    workers = traced_workers(run / f"steps-{topology}")
    if {role for role, _ in workers} != {"prefill", "decode"}:
        # a mixed worker's first tokens come from steps that also decode: the clocks cannot be matched
        raise SystemExit(f"pagemesh.bench.simulator.tail: {topology} has no prefill and decode worker to compare")
    decode_role = "decode"
    own = [s for role, ss in workers if role == decode_role for s in ss]
    others = [(role, s) for role, ss in workers if role != decode_role for s in ss]

    def ratio(role: str, s: TracedStep) -> float:
        return s.seconds / model.for_role(role).step_time(s.shape, s.others_busy)

    own_t = np.array([s.start for s in own])
    own_r = np.array([ratio(decode_role, s) for s in own])
    own_rows = np.array([s.shape.decode_rows for s in own])
    own_busy = np.array([s.others_busy for s in own])
    other_t = np.array([s.start for _, s in others])
    other_r = np.array([ratio(role, s) for role, s in others])
    # where the steps that sample first tokens ended (the traced step alone, not its cycle)
    raw = read_traces(run / f"steps-{topology}")
    step_ends = np.sort([s["start"] + s["seconds"] for role, ss in raw if role == "prefill" for s in ss])
    lines = []
    for rate in rates:
        reqs = requests(run / f"real-{topology}-{rate:g}.json")
        offset = clock_offset(np.array([q["first"] for q in reqs]), step_ends)
        rows = []
        for q in reqs:
            a, b = q["first"] + offset, q["end"] + offset
            mine = (own_t >= a) & (own_t < b)
            theirs = (other_t >= a) & (other_t < b)
            if not mine.any():
                continue
            rows.append(
                [
                    q["tpot"],
                    float(np.median(own_r[mine])),
                    float(np.median(other_r[theirs])) if theirs.any() else np.nan,
                    float(own_busy[mine].mean()),
                    float(own_rows[mine].mean()),
                ]
            )
        table = np.array(sorted(rows, key=lambda r: r[0]))
        n = len(table)
        groups = {
            "slowest 5%": table[n - max(1, n // 20) :],
            "middle 20%": table[int(n * 0.4) : max(int(n * 0.6), int(n * 0.4) + 1)],
            "all": table,
        }
        lines.append(f"\n{topology} at {rate:g} req/s: {n} requests (clock offset {offset:.3f} s)")
        lines.append("| requests | TPOT ms | " + " | ".join(FEATURES) + " |")
        lines.append("| --- | ---: |" + " ---: |" * len(FEATURES))
        for name, g in groups.items():
            lines.append(f"| {name} | " + " | ".join(f"{np.nanmean(g[:, k]):.2f}" for k in range(5)) + " |")
        corr = []
        for k in range(1, 5):
            ok = ~np.isnan(table[:, k])
            corr.append(f"{np.corrcoef(table[ok, 0], table[ok, k])[0, 1]:+.2f}" if ok.sum() > 2 else "—")
        lines.append("| correlation with TPOT | | " + " | ".join(corr) + " |")
        span = (min(q["first"] for q in reqs) + offset, max(q["end"] for q in reqs) + offset)
        together, windows = window_correlation((own_t, own_r), (other_t, other_r), *span)
        lines.append(
            f"per {WINDOW_S:g} s window ({windows} with steps of both workers): "
            f"their mean step/model ratios correlate {together:+.2f}"
        )
    lines.append(f"\n{decode_role} step cycles (median ms) by what overlapped them:")
    lines.append(overlap_table(own, step_ends))
    return "\n".join(lines)


WINDOW_S = 2.0  # the windows in which the two workers' slowdowns are compared


def window_correlation(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], t0: float, t1: float
) -> tuple[float, int]:
    """Correlation, over the WINDOW_S windows from t0 to t1 in which both (start times, ratios)
    have steps, of their mean ratios (whether the two workers slow down together), and how many
    windows that was."""
    pairs = []
    for t in np.arange(t0, t1, WINDOW_S):
        x = a[1][(a[0] >= t) & (a[0] < t + WINDOW_S)]
        y = b[1][(b[0] >= t) & (b[0] < t + WINDOW_S)]
        if len(x) and len(y):
            pairs.append((x.mean(), y.mean()))
    return (float(np.corrcoef(np.array(pairs).T)[0, 1]) if len(pairs) > 2 else float("nan")), len(pairs)


def overlap_table(steps: list[TracedStep], prefill_ends: np.ndarray) -> str:
    start = np.array([s.start for s in steps])
    cycle = np.array([s.seconds for s in steps]) * 1000
    rows = np.array([s.shape.decode_rows for s in steps])
    busy = np.array([s.others_busy for s in steps])
    handoff = np.searchsorted(prefill_ends, start + cycle / 1000) > np.searchsorted(prefill_ends, start)
    kinds = {
        "alone": (busy < 0.01) & ~handoff,
        "another worker's step throughout": (busy >= 0.9) & ~handoff,
        "a prefill step ended in it (a handoff)": handoff,
    }
    head = "| decode step | " + " | ".join(f"{lo}-{hi - 1} rows" for lo, hi in ROWS) + " |"
    lines = [head, "| --- |" + " ---: |" * len(ROWS)]
    for name, mask in kinds.items():
        cells = []
        for lo, hi in ROWS:
            m = mask & (rows >= lo) & (rows < hi)
            cells.append(f"{np.median(cycle[m]):.1f} ({m.sum()})" if m.any() else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a bench.simulator.validate --out folder")
    p.add_argument("--topology", default="1P+1D", help="a prefill + decode topology of the run")
    p.add_argument("--rates", default="1,3,6")
    args = p.parse_args(argv)
    print(analyse(args.run, args.topology, [float(r) for r in args.rates.split(",")]))


if __name__ == "__main__":
    main()
