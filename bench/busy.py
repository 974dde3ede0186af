"""Decode throughput on a busy machine: the old fixed threads against passive waits and the adaptive count.

    python bench/busy.py [--streams 1,8] [--rounds 3] [--seconds 3] [--quantization gguf] [--policies ...]

Starts one engine process per (policy, streams). Policies (`--policies`, default
fixed,fixed-1,passive,adaptive): `fixed` (PAGEMESH_THREAD_POLICY=fixed: the thread count a
one-worker mesh gets, the usable cores, with OpenMP's default spin-waits: the old default),
`fixed-1` (the same with one thread: `--threads-per-worker 1`), `passive` (the default now:
passive waits, the usable cores), `adaptive` (passive waits and the thread count the step loop
adapts, workers/shell/thread_policy.py), `adaptive-spin` (the same over OpenMP's spin-waits:
`OMP_WAIT_POLICY=ACTIVE`), `spin-N` (fixed count, `GOMP_SPINCOUNT=N`) and `passive-N` (passive
waits, N threads: more than the cores is oversubscribed). Each
process sets itself up as `pagemesh worker` does (`prepare_worker_threads` before torch loads,
then `step_threads_for`) and serves `streams` greedy requests of 128-token prompts. Then, for
each round and each load (quiet; two equal-priority CPU hogs, `python -c "while 1: pass"`; two
`nice -n 19` hogs), it asks every engine in turn (the order alternates by round) for `--seconds`
of decode steps over fresh requests, and prints output tok/s (median over rounds), each load's
share of the quiet figure, adaptive over each other policy, the steps run at each thread count,
the run-queue wait of the engine's threads, and the load average before and after.

"Quiet" is whatever else the machine runs: read the load average. The engines run in-process
(no gateway or tokenizer), so the figures are the engine's, not a client's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter

LOADS = ("quiet", "hogs", "nice hogs")
DEFAULT_POLICIES = "fixed,fixed-1,passive,adaptive"


def policy_setup(name: str) -> tuple[int | None, dict[str, str]]:
    """(threads, None for the usable cores; environment) of a policy's engine."""
    fixed = {"PAGEMESH_THREAD_POLICY": "fixed"}
    if name in ("fixed", "fixed-1"):
        return (1 if name == "fixed-1" else None), fixed
    if name in ("passive", "adaptive"):
        return None, {"PAGEMESH_THREAD_POLICY": name}
    if name == "adaptive-spin":  # the adaptive count over libgomp's spin-waits
        return None, {"PAGEMESH_THREAD_POLICY": "adaptive", "OMP_WAIT_POLICY": "ACTIVE"}
    if name.startswith("spin-"):
        return None, fixed | {"GOMP_SPINCOUNT": str(int(name[5:]))}
    if name.startswith("passive-"):  # passive waits, N threads (more than the cores: oversubscribed)
        return int(name[8:]), {"PAGEMESH_THREAD_POLICY": "passive"}
    raise SystemExit(f"unknown policy {name!r}: fixed, fixed-1, passive, passive-N, adaptive, adaptive-spin or spin-N")


PROMPT_LEN = 128


def hogs(load: str) -> list[subprocess.Popen]:
    if load == "quiet":
        return []
    nice = ["nice", "-n", "19"] if load == "nice hogs" else []
    return [subprocess.Popen([*nice, sys.executable, "-c", "while 1: pass"]) for _ in range(2)]


def child(streams: int, threads: int | None, quantization: str) -> None:
    """One engine, set up as a worker sets itself up; answers `seconds` lines on stdin with a JSON
    line: output tok/s and the steps run at each thread count."""
    from pagemesh.common.cpu_threads import prepare_worker_threads, usable_cores

    prepare_worker_threads()
    import torch

    torch.set_num_threads(threads or usable_cores())  # what `pagemesh up` gives its one worker
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.shell.step_threads import process_run_delay, step_threads_for

    engine = Engine(
        EngineConfig(quantization=quantization, max_num_seqs=streams, enable_prefix_caching=False, num_pages=2048)
    )
    adaptive = step_threads_for(engine.device)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    counts: Counter[int] = Counter()

    def step() -> None:
        if adaptive is None:
            engine.step()
            counts[torch.get_num_threads()] += 1
        else:
            counts[adaptive.current] += 1
            adaptive.run(engine.step, lambda: engine.stats.tokens)

    running: list[str] = []
    print("ready", flush=True)
    for line in sys.stdin:
        for request_id in running:
            engine.abort(request_id)
        running = [f"{time.monotonic_ns()}-{i}" for i in range(streams)]
        for request_id in running:
            engine.add_request(request_id, [rng.randrange(100, 49000) for _ in range(PROMPT_LEN)], params)
        before = engine.stats.decode_tokens
        while engine.stats.decode_tokens < before + 2 * streams:
            step()  # the prompts, and every stream decoding
        counts.clear()
        decoded, started, delay = engine.stats.decode_tokens, time.perf_counter(), process_run_delay() or 0.0
        while time.perf_counter() - started < float(line):
            step()
        elapsed = time.perf_counter() - started
        rate, waited = (
            (engine.stats.decode_tokens - decoded) / elapsed,
            ((process_run_delay() or 0.0) - delay) / elapsed,
        )
        print(json.dumps({"tok_s": rate, "threads": dict(counts), "waited": waited}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.threads, args.quantization)
    streams = [int(s) for s in args.streams.split(",")]
    engines = {}
    policies = args.policies.split(",")
    for policy in policies:
        count, policy_env = policy_setup(policy)
        for n in streams:
            env = {**os.environ, **policy_env}
            argv = [sys.executable, "-P", __file__, "--child", str(n), "--quantization", args.quantization]
            argv += ["--threads", str(count)] if count else []
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"engine {policy}/{n} did not start")
            engines[policy, n] = proc
    load_before = open("/proc/loadavg").read().strip()
    rates: dict[tuple, list[float]] = {}
    threads: dict[tuple, Counter] = {}
    waits: dict[tuple, list[float]] = {}
    try:
        for r in range(args.rounds):
            for load in LOADS:
                hog_procs = hogs(load)
                time.sleep(0.3)
                order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
                for key, proc in order:
                    proc.stdin.write(f"{args.seconds}\n")
                    proc.stdin.flush()
                    got = json.loads(proc.stdout.readline())
                    rates.setdefault((*key, load), []).append(got["tok_s"])
                    threads.setdefault((*key, load), Counter()).update({int(k): v for k, v in got["threads"].items()})
                    waits.setdefault((*key, load), []).append(got["waited"])
                for hog in hog_procs:
                    hog.kill()
                    hog.wait()
    finally:
        for proc in engines.values():
            proc.stdin.close()
            proc.wait()
    print_table(rates, threads, policies, streams, args, load_before)
    print("run-queue wait of the engine's threads, seconds per second (median):")
    for key in sorted({k[:2] for k in waits}):
        print(
            f"  {key[0]}/{key[1]}: "
            + ", ".join(f"{load} {statistics.median(waits[(*key, load)]):.2f}" for load in LOADS)
        )


def print_table(rates, threads, policies, streams, args, load_before: str) -> None:
    median = {key: statistics.median(v) for key, v in rates.items()}
    rounds = f"median of {args.rounds} rounds of {args.seconds} s"
    print(f"\noutput tok/s, {args.quantization}, {os.cpu_count()} cores, {rounds}")
    print("| policy | streams | " + " | ".join(LOADS) + " | hogs/quiet | nice/quiet | steps at each thread count |")
    print("| --- | ---: | " + " | ".join("---:" for _ in LOADS) + " | ---: | ---: | --- |")
    for policy in policies:
        for n in streams:
            m = [median[policy, n, load] for load in LOADS]
            share = Counter()
            for load in LOADS:
                share.update(threads[policy, n, load])
            used = ", ".join(f"{share[t]} at {t}" for t in sorted(share))
            figures = " | ".join(f"{x:.1f}" for x in m)
            print(f"| {policy} | {n} | {figures} | {m[1] / m[0]:.2f}x | {m[2] / m[0]:.2f}x | {used} |")
    for baseline in [p for p in policies if p != "adaptive" and "adaptive" in policies]:
        for n in streams:
            ratio = {load: median["adaptive", n, load] / median[baseline, n, load] for load in LOADS}
            ratios = ", ".join(f"{load} {r:.2f}x" for load, r in ratio.items())
            print(f"adaptive / {baseline} at {n} stream(s): {ratios}")
    print("every round:", {f"{k[0]}/{k[1]}/{k[2]}": [round(x) for x in v] for k, v in rates.items()})
    print(f"loadavg before: {load_before}; after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
