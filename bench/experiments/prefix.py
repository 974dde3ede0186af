"""Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention): requests that share
a system prompt reuse its KV pages, so only the new part is prefilled and the time to first token
drops. Across workers the cache only helps if requests with the same prefix land on the worker
that holds it: prefix-aware placement (SGLang's cache-aware router, Preble) vs round-robin.

Part 1, one engine: requests sharing one system prompt, one after another, with the prefix cache
on and off; TTFT from the engine's per-step times.
Part 2, a mesh with 2 prefill workers and 1 decode worker: a few distinct system prompts in a
seeded random order, streamed over HTTP, with each placement policy.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pagemesh.bench.experiments.driver import drive
from pagemesh.bench.experiments.mesh import bench
from pagemesh.bench.experiments.report import new_figure
from pagemesh.bench.experiments.workload import Job, fixed_output, random_prompt
from pagemesh.bench.loadgen.datasets import Conversation, Turn, random_segment
from pagemesh.bench.loadgen.metrics import latency_stats
from pagemesh.bench.local_mesh import metrics, per_worker, running_mesh
from pagemesh.common.model_files import resolve_model_path
from pagemesh.common.tokenizer import Tokenizer

PLACEMENTS = ("prefix", "round-robin")


@dataclass(frozen=True)
class Setup:
    num_requests: int
    system_len: int
    user_len: int
    output_len: int
    mesh_requests: int
    mesh_prefixes: int
    mesh_rate: float  # req/s


FULL = Setup(8, 768, 32, 4, 12, 3, 1.0)
QUICK = Setup(3, 64, 8, 2, 3, 2, 4.0)


def engine_ttfts(ctx, setup: Setup, caching: bool) -> dict:
    """One request at a time (the next arrives when the previous finishes), so TTFT is prefill only."""
    engine = ctx.engine(enable_prefix_caching=caching)
    rng = random.Random(ctx.seed)
    vocab = engine.model_config.vocab_size
    system = random_prompt(rng, setup.system_len, vocab)
    jobs = [
        Job(f"p{i}", system + random_prompt(rng, setup.user_len, vocab), fixed_output(setup.output_len))
        for i in range(setup.num_requests)
    ]
    queue = list(jobs[1:])

    def next_job(run, now: float) -> list:
        if queue and all(t.finished is not None for t in run.traces.values()):
            return [queue.pop(0)]
        return []

    result = drive(engine, jobs[:1], inject=next_job)
    ttfts = [result.traces[j.request_id].ttft for j in jobs]
    hit_rate = engine.blocks.prefix_hits / engine.blocks.prefix_queries if engine.blocks.prefix_queries else 0.0
    return {
        "caching": caching,
        "first": ttfts[0],
        "rest": latency_stats("ttft", ttfts[1:], (50.0, 99.0)),
        "hit_rate": hit_rate,
        "ttfts": ttfts,
    }


def mesh_workload(ctx, setup: Setup, tokenizer) -> list[Conversation]:
    rng = random.Random(ctx.seed)
    systems = [random_segment(tokenizer, setup.system_len, rng) for _ in range(setup.mesh_prefixes)]
    return [
        Conversation(
            (Turn(random_segment(tokenizer, setup.user_len, rng), setup.output_len),), system=rng.choice(systems)
        )
        for _ in range(setup.mesh_requests + 1)
    ]


def prefill_counts(url: str, expected: int, timeout: float = 10.0) -> dict[str, float]:
    """Requests each prefill worker finished, once /metrics has caught up with all `expected`
    (workers report them with their heartbeats)."""
    deadline = time.monotonic() + timeout
    while True:
        per = {
            w: v
            for w, v in per_worker(metrics(url), "pagemesh_worker_requests_total").items()
            if w.startswith("prefill")
        }
        if sum(per.values()) >= expected or time.monotonic() > deadline:
            return per
        time.sleep(0.5)


def mesh_points(ctx, setup: Setup) -> tuple[list[dict], str | None]:
    tokenizer = Tokenizer.from_path(resolve_model_path(ctx.model_path))
    workload = mesh_workload(ctx, setup, tokenizer)
    model = ["--model", ctx.model_path] if ctx.model_path else []
    points = []
    for policy in PLACEMENTS:
        flags = [
            "--prefill",
            "2",
            "--decode",
            "1",
            "--threads-per-worker",
            "1",
            "--seed",
            str(ctx.seed),
            "--placement",
            policy,
            *model,
        ]
        with running_mesh(*flags) as url:
            summary, _ = bench(url, workload, tokenizer, setup.mesh_rate, ctx.seed)
            per = prefill_counts(url, expected=len(workload))
        points.append(
            {"policy": policy, "command": "pagemesh up " + " ".join(flags), "summary": summary, "prefill_requests": per}
        )
    return points


def run(ctx):
    setup = QUICK if ctx.quick else FULL
    engine_points = [engine_ttfts(ctx, setup, caching) for caching in (False, True)]
    mesh = mesh_points(ctx, setup)

    report = ctx.report("Prefix caching and prefix-aware placement")
    report.text(__doc__.split("\n\n", 1)[1])
    report.text(
        f"## Part 1: one engine\n\n{setup.num_requests} requests, each a {setup.system_len}-token system prompt "
        f"(the same for all) + {setup.user_len} new tokens, {setup.output_len} output tokens, one at a time."
    )
    rows = [
        (
            "on" if p["caching"] else "off",
            p["first"] * 1000,
            p["rest"]["median_ttft_ms"],
            p["rest"]["p99_ttft_ms"],
            f"{p['hit_rate']:.0%}",
        )
        for p in engine_points
    ]
    report.table(
        (
            "prefix cache",
            "TTFT of the first request (ms)",
            "p50 TTFT of the rest (ms)",
            "p99 TTFT of the rest (ms)",
            "prefix pages hit / looked up",
        ),
        rows,
    )
    figure, (left, right) = new_figure(2)
    for p in engine_points:
        left.plot(
            range(len(p["ttfts"])),
            [t * 1000 for t in p["ttfts"]],
            "o-",
            label=f"cache {'on' if p['caching'] else 'off'}",
        )
    left.set(xlabel="request", ylabel="TTFT (ms)", title="one engine, shared system prompt")
    left.legend()
    x = range(len(mesh))
    right.bar([i - 0.2 for i in x], [p["summary"]["median_ttft_ms"] for p in mesh], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [p["summary"]["p99_ttft_ms"] for p in mesh], 0.4, label="p99")
    right.set_xticks(list(x), [p["policy"] for p in mesh])
    right.set(ylabel="TTFT (ms)", title="mesh, 2 prefill workers")
    right.legend()
    report.figure(
        "ttft", figure, "Left: TTFT per request with the cache off and on. Right: TTFT on the mesh by placement."
    )

    report.text(
        f"## Part 2: placement on a mesh (2 prefill + 1 decode workers)\n\n{setup.mesh_requests} requests "
        f"(+1 unmeasured warm-up), Poisson at {setup.mesh_rate:g} req/s, each one of {setup.mesh_prefixes} "
        f"system prompts of {setup.system_len} tokens (seeded random order) + {setup.user_len} new tokens, "
        f"{setup.output_len} output tokens; token ids streamed over HTTP."
    )
    report.table(
        (
            "placement",
            "command",
            "p50 TTFT (ms)",
            "p99 TTFT (ms)",
            "p50 ITL (ms)",
            "requests per prefill worker (with the warm-up)",
        ),
        [
            (
                p["policy"],
                f"`{p['command']}`",
                p["summary"]["median_ttft_ms"],
                p["summary"]["p99_ttft_ms"],
                p["summary"]["median_itl_ms"],
                ", ".join(f"{w}: {v:.0f}" for w, v in sorted(p["prefill_requests"].items())),
            )
            for p in mesh
        ],
    )
    off, on = engine_points
    cached = setup.system_len // 16 * 16 / (setup.system_len + setup.user_len)
    report.text(
        f"With the cache, every request after the first finds its system prompt's full pages cached ({cached:.0%} of "
        f"its tokens) and prefills only the rest: p50 TTFT {on['rest']['median_ttft_ms']:.0f} ms against "
        f"{off['rest']['median_ttft_ms']:.0f} ms without "
        f"({off['rest']['median_ttft_ms'] / max(on['rest']['median_ttft_ms'], 1e-9):.1f}× "
        f"faster). What remains is the new tokens, attention over the cached prefix, and the fixed cost of a step."
    )
    if len(mesh) == 2:
        a, b = (p["summary"] for p in mesh)
        report.text(
            f"On the mesh, prefix-aware placement gives p50 TTFT {a['median_ttft_ms']:.0f} ms against "
            f"{b['median_ttft_ms']:.0f} ms for round-robin (p99 {a['p99_ttft_ms']:.0f} vs {b['p99_ttft_ms']:.0f} ms): "
            f"round-robin sends each system prompt to both prefill workers, so each of the {setup.mesh_prefixes} "
            f"prefixes is prefilled in full up to twice instead of once (the pools are large enough that nothing is "
            f"evicted). With {setup.mesh_requests} requests that is a few misses more; TTFT also includes queueing "
            f"behind other prefills, which is noisy on a shared CPU."
        )
    key = (
        f"prefix: engine p50 TTFT cache on {on['rest']['median_ttft_ms']:.0f} ms vs off "
        f"{off['rest']['median_ttft_ms']:.0f} ms; "
        f"mesh p50 TTFT " + ", ".join(f"{p['policy']} {p['summary']['median_ttft_ms']:.0f} ms" for p in mesh)
    )
    report.key = key
    return report
