"""The simulator against the real mesh: the same requests both ways.

For each topology (`pagemesh up --mixed 1`, and 1 prefill + 1 decode worker) and each rate:
`pagemesh bench` sends Poisson arrivals of random 128-token prompts for 64 output tokens to the
real mesh and keeps each request's send time; the simulator replays exactly those send times
and lengths (`--trace`) on the CPU cost model calibrated for that worker's thread count. TTFT
and TPOT medians and p99 are compared pair by pair.

    python -m bench.simulator.validate --out /tmp/validate          # ~10 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.loadgen import main as bench_main
from bench.local_mesh import running_mesh
from bench.simulator.main import main as simulate_main

TOPOLOGIES = {"mixed": ["--mixed", "1"], "1P+1D": ["--prefill", "1", "--decode", "1"]}
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def measure(topology: str, rates: list[float], n: int, out: Path) -> dict[float, Path]:
    results = {}
    with running_mesh(*TOPOLOGIES[topology], "--no-prefix-caching") as url:
        for rate in rates:
            path = out / f"real-{topology}-{rate:g}.json"
            bench_main.main(
                [
                    "--base-url", url, "--dataset", "random", "--random-input-len", "128",
                    "--random-output-len", "64", "--prompt-as-token-ids", "--ignore-eos",
                    "--request-rate", str(rate), "--num-prompts", str(n), "--seed", "7",
                    "--result-json", str(path), "--no-progress",
                ]
            )  # fmt: skip
            results[rate] = path
    return results


def simulate_trace(topology: str, trace: Path, out: Path) -> dict:
    folder = out / f"sim-{trace.stem}"
    simulate_main([*TOPOLOGIES[topology], "--trace", str(trace), "--no-prefix-caching", "--out", str(folder)])
    return next(iter(json.loads((folder / "simulate.json").read_text()).values()))


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
        for rate, path in measure(topology, rates, args.num_prompts, args.out).items():
            real = json.loads(path.read_text())["points"][0]["summary"]
            sim = simulate_trace(topology, path, args.out)
            rows.append({"topology": topology, "rate": rate, "load": load, "real": real, "sim": sim})
    (args.out / "validation.json").write_text(json.dumps(rows, indent=2, default=str))
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = [
        "| topology | rate (req/s) | " + " | ".join(f"{m} real / sim (Δ)" for m in METRICS) + " |",
        "| --- | ---: |" + " ---: |" * len(METRICS),
    ]
    for row in rows:
        cells = []
        for m in METRICS:
            real, sim = float(row["real"][m]), float(row["sim"][m])
            cells.append(f"{real:.1f} / {sim:.1f} ({(sim - real) / real:+.0%})" if real else "—")
        lines.append(f"| {row['topology']} | {row['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
