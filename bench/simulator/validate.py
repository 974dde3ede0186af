"""The simulator against the real mesh: the same requests both ways.

For each topology (`pagemesh up --mixed 1`, and 1 prefill + 1 decode worker) and each rate:
`pagemesh bench` sends Poisson arrivals of random 128-token prompts for 64 output tokens to the
real mesh and keeps each request's send time; the simulator replays exactly those send times
and lengths (`--trace`). TTFT and TPOT medians and p99 are compared pair by pair, for two cost
models:
- in-process: the CPU model calibrated on the engine alone (`pagemesh simulate calibrate`);
- in-mesh: a model per worker role fitted to every step the mesh's workers ran during this very
  run (PAGEMESH_STEP_TRACE, whole cycles with the host work between steps, the slowdown while
  another worker steps, the jitter, the host's slow seconds; pooled over the rates:
  bench/simulator/role_cost.py), plus a fixed per-request cost measured before the rates: a
  probe of requests sent one at a time, real TTFT minus simulated TTFT. The jitter makes a run
  depend on its seed, so the in-mesh model runs `--sim-seeds` times; the table gives the median
  over seeds.

Each rate runs for about `--seconds-per-rate` (at least `--num-prompts` requests), so that a
p99 rests on more than one request; the p99 table gives the real p99's bootstrap interval
(5-95%) and the simulated p99's range over the seeds beside each other.

    python -m pagemesh.bench.simulator.validate --out bench/results/simulator/validate   # ~7 min on 2 quiet cores

writes into --out (bench/results/ is git-ignored): validation.json (every pair, real and
simulated), calibration-TOPOLOGY.json (the fitted in-mesh model), probe-TOPOLOGY.json and
real-TOPOLOGY-RATE.json (the bench runs), steps-TOPOLOGY/ (the step traces) and sim-*/ (each
simulation); docs/experiments/simulator.md keeps one summary table of the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import numpy as np

from pagemesh.bench.loadgen import main as bench_main
from pagemesh.bench.local_mesh import running_mesh
from pagemesh.bench.simulator.calibrate import fit_trace, read_traces
from pagemesh.bench.simulator.main import main as simulate_main
from pagemesh.bench.simulator.tail import clock_offset
from pagemesh.workers.engine.step_trace import ENV as STEP_TRACE_ENV

TOPOLOGIES = {"mixed": ["--mixed", "1"], "1P+1D": ["--prefill", "1", "--decode", "1"]}
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


PROBE = 12  # requests sent one at a time before the rates: the fixed per-request cost


def bench(url: str, path: Path, rate: float, n: int, output_len: int = 64, concurrency: int | None = None) -> Path:
    bench_main.main(
        [
            "--base-url", url, "--dataset", "random", "--random-input-len", "128",
            "--random-output-len", str(output_len), "--prompt-as-token-ids", "--ignore-eos",
            "--request-rate", str(rate), "--num-prompts", str(n), "--seed", "7",
            "--result-json", str(path), "--no-progress",
            *(["--max-concurrency", str(concurrency)] if concurrency else []),
        ]
    )  # fmt: skip
    return path


def requests_at(rate: float, seconds: float, minimum: int) -> int:
    """Requests for one rate: about `seconds` of arrivals, at least `minimum`."""
    return max(minimum, math.ceil(rate * seconds))


def measure(topology: str, rates: list[float], counts: list[int], out: Path) -> tuple[Path, dict[float, Path]]:
    """The probe's and each rate's results, with every worker step traced to out/steps-TOPOLOGY."""
    os.environ[STEP_TRACE_ENV] = str(out / f"steps-{topology}")  # the mesh's processes inherit it
    try:
        with running_mesh(*TOPOLOGIES[topology], "--no-enable-prefix-caching") as url:
            probe = bench(url, out / f"probe-{topology}.json", math.inf, PROBE, output_len=4, concurrency=1)
            results = {
                rate: bench(url, out / f"real-{topology}-{rate:g}.json", rate, n) for rate, n in zip(rates, counts)
            }
    finally:
        os.environ.pop(STEP_TRACE_ENV)
    return probe, results


RUN_GAP_S = 15.0  # at most this long from one bench run's last token to the next run's first token


def first_sends_on_trace_clock(runs: list[Path], steps: Path) -> list[float]:
    """Each run's first send on the step traces' clock, the runs given in the order they were
    measured (the probe, then the rates, back to back on one mesh): recorded by `pagemesh bench`
    (`clock_origin`, the same perf_counter clock), or, for runs recorded before it was, found by
    the first tokens (each reaches the client a few ms after the step that ended its prompt),
    each run searched for just after the one before it."""
    traced = [s for _, ss in read_traces(steps) for s in ss]
    ends = np.array(sorted(s["start"] + s["seconds"] for s in traced if s["prefill_tokens"]))
    previous_end = min(s["start"] for s in traced) - 1.0
    origins = []
    for path in runs:
        requests = json.loads(path.read_text())["points"][0]["requests"]
        ok = [i for i, error in enumerate(requests["errors"]) if not error]
        if "clock_origin" in requests:
            origin = float(requests["clock_origin"])
        else:
            firsts = np.array(sorted(requests["starts"][i] + requests["ttfts"][i] for i in ok))
            origin = float(clock_offset(firsts, ends, within=(previous_end, previous_end + RUN_GAP_S)))
        origins.append(origin)
        previous_end = origin + max(requests["starts"][i] + requests["latencies"][i] for i in ok)
    return origins


def simulate_trace(topology: str, trace: Path, out: Path, *extra: str, seed: int = 0, tag: str = "mesh") -> dict:
    folder = out / f"sim-{trace.stem}{f'-{tag}-{seed}' if extra else ''}"
    simulate_main(
        [*TOPOLOGIES[topology], "--trace", str(trace), "--no-enable-prefix-caching", "--seed", str(seed)]
        + ["--out", str(folder), *extra]
    )
    return next(iter(json.loads((folder / "simulate.json").read_text()).values()))


def summary(path: Path) -> dict:
    return json.loads(path.read_text())["points"][0]["summary"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", default="1,3,6")
    p.add_argument("--num-prompts", type=int, default=60, help="the fewest requests per rate")
    p.add_argument("--seconds-per-rate", type=float, default=60.0, help="arrivals per rate: about this long")
    p.add_argument("--sim-seeds", type=int, default=5, help="runs of the in-mesh model (its jitter's seeds)")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help=f"some of {', '.join(TOPOLOGIES)}")
    p.add_argument(
        "--reuse", action="store_true", help="measure nothing: compare again the real runs and step traces in --out"
    )
    args = p.parse_args(argv)
    if unknown := set(args.topologies.split(",")) - set(TOPOLOGIES):
        p.error(f"unknown topologies {sorted(unknown)}: choose from {', '.join(TOPOLOGIES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    counts = [requests_at(rate, args.seconds_per_rate, args.num_prompts) for rate in rates]
    rows = []
    for topology in args.topologies.split(","):
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        if args.reuse:
            probe = args.out / f"probe-{topology}.json"
            measured = {rate: args.out / f"real-{topology}-{rate:g}.json" for rate in rates}
            load = "(a recorded run)"
        else:
            probe, measured = measure(topology, rates, counts, args.out)
            load += " → " + " ".join(f"{x:.1f}" for x in os.getloadavg())  # before → after the real runs
        rows += compare(topology, probe, measured, args.out, args.sim_seeds, load)
        # after each topology, so that a run cut short keeps what it measured
        (args.out / "validation.json").write_text(json.dumps(rows, indent=2, default=str))
    print("in-process calibration:\n" + table(rows, "sim"))
    print("\nin-mesh calibration per role + fixed per-request cost (median over seeds):\n" + table(rows, "sim_in_mesh"))
    print("\np99, real bootstrap interval against the simulated range over seeds:\n" + p99_table(rows))
    print(
        "\nin-mesh, the host's slowdown replayed on the run's own clock (median over seeds):\n"
        + table(rows, "sim_aligned")
    )
    print("\np99, aligned:\n" + p99_table(rows, "sim_aligned_seeds"))


def compare(topology: str, probe: Path, measured: dict[float, Path], out: Path, sim_seeds: int, load: str) -> list:
    """Fit the per-role model to the run's traced steps, take the fixed per-request cost from the
    probe, and simulate each rate's requests: one row per rate."""
    calibration = out / f"calibration-{topology}.json"
    fit_trace(out / f"steps-{topology}", calibration)
    in_mesh = ["--calibration", str(calibration)]
    probe_sim = simulate_trace(topology, probe, out, *in_mesh)
    overhead_ms = max(0.0, float(summary(probe)["median_ttft_ms"]) - float(probe_sim["median_ttft_ms"]))
    in_mesh += ["--request-overhead-ms", f"{overhead_ms:.2f}"]
    origins = first_sends_on_trace_clock([probe, *measured.values()], out / f"steps-{topology}")[1:]
    rows = []
    for (rate, path), origin in zip(measured.items(), origins):
        seeds = [simulate_trace(topology, path, out, *in_mesh, seed=seed) for seed in range(sim_seeds)]
        clock = ["--host-clock", f"{origin:.6f}"]
        aligned = [
            simulate_trace(topology, path, out, *in_mesh, *clock, seed=seed, tag="aligned") for seed in range(sim_seeds)
        ]
        rows.append(
            {
                "topology": topology,
                "rate": rate,
                "requests": summary(path)["completed"],
                "load": load,
                "overhead_ms": overhead_ms,
                "real": summary(path),
                "real_p99_interval_ms": p99_intervals(path),
                "sim": simulate_trace(topology, path, out),
                "sim_in_mesh": {m: statistics.median(float(s[m]) for s in seeds) for m in METRICS},
                "sim_in_mesh_seeds": seeds,
                "sim_aligned": {m: statistics.median(float(s[m]) for s in aligned) for m in METRICS},
                "sim_aligned_seeds": aligned,
            }
        )
    return rows


def p99_intervals(path: Path, resamples: int = 2000) -> dict[str, list[float]]:
    """The 5% and 95% points of the real p99 TTFT and TPOT over bootstrap resamples of the
    requests: how far p99 moves with the luck of which requests met a long step."""
    requests = json.loads(path.read_text())["points"][0]["requests"]
    ok = [i for i, error in enumerate(requests["errors"]) if not error]
    ttft = np.array([requests["ttfts"][i] for i in ok]) * 1000
    latency = np.array([requests["latencies"][i] for i in ok]) * 1000
    tokens = np.array([requests["output_lens"][i] for i in ok])
    tpot = (latency - ttft) / np.maximum(tokens - 1, 1)
    draws = np.random.default_rng(0).integers(0, len(ok), size=(resamples, len(ok)))
    return {
        name: np.percentile(np.percentile(values[draws], 99, axis=1), [5, 95]).tolist()
        for name, values in (("p99_ttft_ms", ttft), ("p99_tpot_ms", tpot))
    }


def p99_table(rows: list[dict], seeds: str = "sim_in_mesh_seeds") -> str:
    lines = [
        "| topology | rate (req/s) | requests | p99 TTFT real [5-95%] | sim [range] "
        "| p99 TPOT real [5-95%] | sim [range] |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        cells = []
        for m in ("p99_ttft_ms", "p99_tpot_ms"):
            low, high = row["real_p99_interval_ms"][m]
            sims = [float(s[m]) for s in row[seeds]]
            cells.append(f"{float(row['real'][m]):.1f} [{low:.0f}-{high:.0f}]")
            cells.append(f"{statistics.median(sims):.1f} [{min(sims):.0f}-{max(sims):.0f}]")
        lines.append(f"| {row['topology']} | {row['rate']:g} | {row['requests']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict], sim: str = "sim") -> str:
    lines = [
        "| topology | rate (req/s) | " + " | ".join(f"{m} real / sim (Δ)" for m in METRICS) + " |",
        "| --- | ---: |" + " ---: |" * len(METRICS),
    ]
    for row in rows:
        cells = []
        for m in METRICS:
            real, simulated = float(row["real"][m]), float(row[sim][m])
            cells.append(f"{real:.1f} / {simulated:.1f} ({(simulated - real) / real:+.0%})" if real else "—")
        lines.append(f"| {row['topology']} | {row['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
