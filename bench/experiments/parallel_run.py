"""One configuration of `pagemesh experiment parallel`, in a process of its own (a process can be
rank 0 of one tensor-parallel group only): an in-process Engine with the given EngineConfig
overrides (its follower ranks are real processes), warmed up, then for each stream count S,
S requests at once of a fixed prompt and output length. Prints one JSON line per S.

    python -m pagemesh.bench.experiments.parallel_run --engine '{"tensor_parallel_size": 3}' --streams 1,8,32
"""

from __future__ import annotations

import argparse
import json
import random
import sys


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagemesh.bench.experiments.parallel_run", description=__doc__)
    p.add_argument("--engine", required=True, help="EngineConfig overrides, JSON")
    p.add_argument("--streams", required=True, help="comma-separated stream counts")
    p.add_argument("--prompt", type=int, required=True, help="prompt tokens per request")
    p.add_argument("--output", type=int, required=True, help="output tokens per request")
    p.add_argument("--threads", type=int, required=True, help="torch threads of the whole worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    import torch

    from pagemesh.bench.experiments.context import warm_up
    from pagemesh.bench.experiments.driver import drive, summarize
    from pagemesh.bench.experiments.workload import Job, fixed_output, random_prompt
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.engine.tensor_parallel import threads_per_rank

    overrides = json.loads(args.engine)
    ranks = overrides.get("tensor_parallel_size", 1) * overrides.get("pipeline_parallel_size", 1)
    torch.set_num_threads(threads_per_rank(ranks, args.threads))  # as `pagemesh worker` shares them out
    engine = Engine(EngineConfig(model=args.model, seed=args.seed, num_pages=1025, max_num_seqs=64, **overrides))
    try:
        warm_up(engine)
        rng = random.Random(args.seed)
        for streams in [int(s) for s in args.streams.split(",")]:
            vocab = engine.model_config.vocab_size
            jobs = [
                Job(f"s{streams}-{i}", random_prompt(rng, args.prompt, vocab), fixed_output(args.output))
                for i in range(streams)
            ]
            run = drive(engine, jobs)
            summary = summarize(run)
            decode_steps = [s.seconds for s in run.steps if s.tokens == s.decodes]
            point = {
                "streams": streams,
                "output_throughput": summary["output_throughput"],
                "median_ttft_ms": summary["median_ttft_ms"],
                "median_itl_ms": summary["median_itl_ms"],
                "decode_step_ms": 1000 * sum(decode_steps) / len(decode_steps) if decode_steps else float("nan"),
            }
            print(json.dumps(point), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
