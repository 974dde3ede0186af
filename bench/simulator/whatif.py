"""GPU-scale what-ifs in simulation: do the papers' headline directions hold on our scheduling code?

sarathi    Llama-3.1-8B on one H100: stall-free chunked prefill (a 512-token step budget)
           against whole prompts in one step (an 8192-token budget), long prompts. Capacity =
           the highest request rate whose p99 time-between-tokens meets an SLO (strict: 5× a
           lone decode step; relaxed: 25×), as Sarathi-Serve measures it.
distserve  Llama-3.1-8B on four H100s: four colocated (mixed) workers, with whole prompts or
           chunked, against 1P+3D, 2P+2D and 3P+1D over NVLink, under TTFT <= 200 ms and TPOT
           <= 15 ms (and <= 25 ms); goodput = the highest rate at which 90% of requests meet
           both, per GPU, as DistServe measures it.

  python -m pagemesh.bench.simulator.whatif --out bench/results/simulator/whatif

writes whatif.json (every curve) and the two plots into --out (bench/results/ is git-ignored);
docs/experiments/simulator.md keeps the plots and the capacity and goodput tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import structlog

from pagemesh.bench.plots import save_png
from pagemesh.bench.simulator.cost import GPUS, RooflineStepCost, StepShape, model_shape
from pagemesh.bench.simulator.run import SimSettings, simulate
from pagemesh.bench.simulator.workload import WorkloadSpec

VOCAB = 128256


def _cost(gpu: str = "h100", model: str = "llama-3.1-8b") -> RooflineStepCost:
    return RooflineStepCost(GPUS[gpu], model_shape(model))


def attainment(summary: dict, n: int) -> float:
    """Share of all requests that met every SLO (goodput × duration / requests)."""
    return (summary["request_goodput"] or 0.0) * summary["duration_s"] / n


def at_rate(settings: SimSettings, rate: float) -> SimSettings:
    return dataclasses.replace(settings, workload=dataclasses.replace(settings.workload, rate=rate))


def highest_rate(ok, low: float, high: float, steps: int = 7) -> float:
    """Bisection for the highest rate in [low, high] with ok(rate) (0 if not even at low)."""
    if not ok(low):
        return 0.0
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def stable_under(summary: dict, tbt_ms: float) -> bool:
    """Sarathi-Serve's capacity test: p99 time-between-tokens within the SLO while the queue
    stays bounded (median scheduling delay, here TTFT, under 2 s)."""
    return summary["p99_itl_ms"] <= tbt_ms and summary["median_ttft_ms"] <= 2000.0


def sarathi(n: int = 200) -> dict:
    cost = _cost()
    kv = int(cost.kv_bytes_per_token)
    decode_step = cost.step_time(StepShape(decode_rows=1, decode_context=2048))
    workload = WorkloadSpec(
        num_requests=n, input_len=2048, input_spread=0.5, output_len=256, output_spread=0.5, vocab_size=VOCAB, seed=1
    )
    base = SimSettings(num_pages=cost.kv_pages(16), max_num_seqs=256, long_prefill_threshold=1 << 30, workload=workload)
    configs = {"chunked, budget 512 (stall-free)": 512, "whole prompts, budget 8192": 8192}
    curves, capacity = {}, {}
    rates = [1, 2, 4, 8, 12, 16, 24, 32]
    for label, budget in configs.items():
        settings = dataclasses.replace(base, max_num_batched_tokens=budget, max_prefill_chunk=budget)

        def run(rate: float, settings=settings) -> dict:
            return simulate(
                dataclasses.replace(settings, workload=dataclasses.replace(workload, rate=rate)), cost.step_time, kv
            )

        curves[label] = {rate: run(rate) for rate in rates}
        capacity[label] = {
            slo: highest_rate(lambda r, ms=ms: stable_under(run(r), ms), 0.5, 64.0)
            for slo, ms in (("strict", 5 * decode_step * 1000), ("relaxed", 25 * decode_step * 1000))
        }
    return {"decode_step_ms": decode_step * 1000, "rates": rates, "curves": curves, "capacity": capacity}


def distserve(n: int = 300, tpot_ms: float = 15.0) -> dict:
    cost = _cost()
    kv = int(cost.kv_bytes_per_token)
    slos = {"ttft": 200.0, "tpot": tpot_ms}
    workload = WorkloadSpec(
        num_requests=n, input_len=1024, input_spread=0.75, output_len=256, output_spread=0.75, vocab_size=VOCAB, seed=2
    )
    base = SimSettings(num_pages=cost.kv_pages(16), max_num_seqs=1024, link="nvlink", workload=workload)
    whole = dict(max_num_batched_tokens=8192, max_prefill_chunk=8192, long_prefill_threshold=1 << 30)
    configs = {
        "4 mixed, whole prompts (vLLM without chunking)": dict(mixed=4, **whole),
        "4 mixed, chunked (Sarathi)": dict(mixed=4),
        "1P+3D": dict(mixed=0, prefill=1, decode=3),
        "2P+2D": dict(mixed=0, prefill=2, decode=2),
        "3P+1D": dict(mixed=0, prefill=3, decode=1),
    }
    rates = [4, 8, 12, 16, 20, 24, 32, 40]
    curves, goodput = {}, {}
    for label, topology in configs.items():
        settings = dataclasses.replace(base, **topology)

        def run(rate: float, settings=settings) -> dict:
            return simulate(at_rate(settings, rate), cost.step_time, kv, slos)

        curves[label] = {rate: attainment(run(rate), n) for rate in rates}
        goodput[label] = highest_rate(lambda r: attainment(run(r), n) >= 0.9, 1.0, 80.0) / 4  # per GPU
    return {"gpus": 4, "slos_ms": slos, "rates": rates, "attainment": curves, "goodput_per_gpu": goodput}


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    s = results["sarathi"]
    for label, curve in s["curves"].items():
        ax.plot(list(curve), [v["p99_itl_ms"] for v in curve.values()], marker="o", label=label)
    for slo, mult in (("strict", 5), ("relaxed", 25)):
        ax.axhline(s["decode_step_ms"] * mult, ls="--", lw=0.8, color="grey")
        ax.text(s["rates"][0], s["decode_step_ms"] * mult * 1.05, f"{slo} SLO", fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("requests/s")
    ax.set_ylabel("p99 time between tokens (ms)")
    ax.set_title("Llama-3.1-8B, 1×H100 (simulated)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "sarathi-tbt.png")
    save_png(fig, paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    d = results["distserve"]
    for label, curve in d["attainment"].items():
        ax.plot(list(curve), [v * 100 for v in curve.values()], marker="o", label=label)
    ax.axhline(90, ls="--", lw=0.8, color="grey")
    ax.set_xlabel(f"requests/s ({d['gpus']} GPUs)")
    ax.set_ylabel("% meeting TTFT and TPOT SLOs")
    ax.set_title(f"Llama-3.1-8B, {d['gpus']}×H100, SLOs {d['slos_ms']} ms (simulated)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "distserve-attainment.png")
    save_png(fig, paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"sarathi": sarathi(), "distserve": distserve(tpot_ms=15.0), "distserve_loose": distserve(tpot_ms=25.0)}
    (args.out / "whatif.json").write_text(json.dumps(results, indent=2, default=str))
    for path in plot(results, args.out):
        print("plot:", path)
    print(json.dumps({name: r.get("capacity") or r.get("goodput_per_gpu") for name, r in results.items()}))


if __name__ == "__main__":
    main()
