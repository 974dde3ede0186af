"""The simulator against the real mesh: the same requests both ways.

For each topology (`pagemesh up --mixed 1`, and 1 prefill + 1 decode worker) and each rate:
`pagemesh bench` sends Poisson arrivals of random 128-token prompts for 64 output tokens to the
real mesh and keeps each request's send time; the simulator replays exactly those send times
and lengths (`--trace`). TTFT and TPOT medians and p99 are compared pair by pair, for two cost
models:
- in-process: the CPU model calibrated on the engine alone (`pagemesh simulate calibrate`);
- in-mesh: the model fitted to every step the mesh's workers ran during this very run
  (PAGEMESH_STEP_TRACE, whole cycles with the host work between steps; pooled over the rates),
  plus a fixed per-request cost measured before the rates: a probe of requests sent one at a
  time, real TTFT minus simulated TTFT.

    python -m bench.simulator.validate --out /tmp/validate          # ~10 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from bench.loadgen import main as bench_main
from bench.local_mesh import running_mesh
from bench.simulator.calibrate import fit_trace
from bench.simulator.main import main as simulate_main
from workers.engine.step_trace import ENV as STEP_TRACE_ENV

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


def measure(topology: str, rates: list[float], n: int, out: Path) -> tuple[Path, dict[float, Path]]:
    """The probe's and each rate's results, with every worker step traced to out/steps-TOPOLOGY."""
    os.environ[STEP_TRACE_ENV] = str(out / f"steps-{topology}")  # the mesh's processes inherit it
    try:
        with running_mesh(*TOPOLOGIES[topology], "--no-prefix-caching") as url:
            probe = bench(url, out / f"probe-{topology}.json", math.inf, PROBE, output_len=4, concurrency=1)
            results = {rate: bench(url, out / f"real-{topology}-{rate:g}.json", rate, n) for rate in rates}
    finally:
        os.environ.pop(STEP_TRACE_ENV)
    return probe, results


def simulate_trace(topology: str, trace: Path, out: Path, *extra: str) -> dict:
    folder = out / f"sim-{trace.stem}{'-mesh' if extra else ''}"
    simulate_main([*TOPOLOGIES[topology], "--trace", str(trace), "--no-prefix-caching", "--out", str(folder), *extra])
    return next(iter(json.loads((folder / "simulate.json").read_text()).values()))


def summary(path: Path) -> dict:
    return json.loads(path.read_text())["points"][0]["summary"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", default="1,3,6")
    p.add_argument("--num-prompts", type=int, default=48)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for topology in TOPOLOGIES:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        probe, measured = measure(topology, rates, args.num_prompts, args.out)
        calibration = args.out / f"calibration-{topology}.json"
        fit_trace(args.out / f"steps-{topology}", calibration)
        in_mesh = ["--calibration", str(calibration)]
        probe_sim = simulate_trace(topology, probe, args.out, *in_mesh)
        overhead_ms = max(0.0, float(summary(probe)["median_ttft_ms"]) - float(probe_sim["median_ttft_ms"]))
        in_mesh += ["--request-overhead-ms", f"{overhead_ms:.2f}"]
        for rate, path in measured.items():
            rows.append(
                {
                    "topology": topology,
                    "rate": rate,
                    "load": load,
                    "overhead_ms": overhead_ms,
                    "real": summary(path),
                    "sim": simulate_trace(topology, path, args.out),
                    "sim_in_mesh": simulate_trace(topology, path, args.out, *in_mesh),
                }
            )
    (args.out / "validation.json").write_text(json.dumps(rows, indent=2, default=str))
    print("in-process calibration:\n" + table(rows, "sim"))
    print("\nin-mesh calibration + fixed per-request cost:\n" + table(rows, "sim_in_mesh"))


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
