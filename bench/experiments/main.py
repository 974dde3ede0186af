"""`pagemesh experiment NAME --out DIR`: run one experiment, write DIR/NAME.md and its plots,
print the key figure as the last line.

    pagemesh experiment paged-memory --out docs/experiments
    pagemesh experiment list
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from pathlib import Path

from pagemesh.bench.experiments.context import Context, default_threads

EXPERIMENTS = {
    "paged-memory": (
        "pagemesh.bench.experiments.paged_memory",
        "KV utilization and sequences that fit: paged vs contiguous",
    ),
    "orca": ("pagemesh.bench.experiments.orca", "iteration-level vs request-level batching across arrival rates"),
    "sarathi": ("pagemesh.bench.experiments.sarathi", "inter-token latency and throughput across prefill chunk sizes"),
    "disagg": ("pagemesh.bench.experiments.disagg", "disaggregated prefill/decode vs one mixed worker (HTTP)"),
    "prefix": ("pagemesh.bench.experiments.prefix", "prefix caching on/off; prefix-aware vs round-robin placement"),
    "cow": ("pagemesh.bench.experiments.cow", "pages for n=4 sampling and beam search, with and without copy-on-write"),
    "page-size": ("pagemesh.bench.experiments.page_size", "throughput and KV utilization across page sizes"),
    "parallel": (
        "pagemesh.bench.experiments.parallel",
        "tensor parallel: all-reduce, tp1/tp2/tp3 on this CPU, the GPU model",
    ),
    "diffusion-cache": (
        "pagemesh.bench.experiments.diffusion_cache",
        "feature caches vs fewer steps: speed against fidelity",
    ),
    "diffusion-cache-deep": (
        "pagemesh.bench.experiments.diffusion_cache_deep",
        "diffusion-cache's sweeps on a 12-block variant of the digits DiT (where block 0 is a twelfth)",
    ),
    "diffusion-unet-cache": (
        "pagemesh.bench.experiments.diffusion_unet_cache",
        "DeepCache vs fewer steps on the digits U-Net: block fraction and wall time against fidelity",
    ),
    "diffusion-batching": (
        "pagemesh.bench.experiments.diffusion_batching",
        "step-level vs request-level vs serial diffusion batching under Poisson load, caching on and off",
    ),
    "diffusion-samplers": (
        "pagemesh.bench.experiments.diffusion_samplers",
        "digits DiT: steps against quality per sampler (DDPM, DDIM, DPM-Solver++, UniPC, Euler) and the student",
    ),
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagemesh experiment", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("name", choices=[*EXPERIMENTS, "list"], help="experiment to run ('list' shows them)")
    p.add_argument("--out", default="experiments-out", help="folder for NAME.md and NAME_*.png")
    p.add_argument("--quick", action="store_true", help="a much smaller workload (smoke test; figures not meaningful)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per engine (default: all cores if the machine is idle, else 1)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.name == "list":
        for name, (_, what) in EXPERIMENTS.items():
            print(f"  {name:<18} {what}")
        return
    import torch

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    command = "pagemesh experiment " + shlex.join(argv)
    context = Context(
        args.name, Path(args.out), command, quick=args.quick, seed=args.seed, model_path=args.model, threads=threads
    )
    module = importlib.import_module(EXPERIMENTS[args.name][0])
    started = time.monotonic()
    report = module.run(context)
    paths = report.write(args.out)
    print(f"wrote {', '.join(str(p) for p in paths)} in {time.monotonic() - started:.0f} s", flush=True)
    print(report.key, flush=True)


if __name__ == "__main__":
    main()
