"""One load point against a real `pagemesh up` (bench.local_mesh) with `pagemesh bench`'s
runner and metrics (streaming over HTTP, vLLM's metric definitions)."""

from __future__ import annotations

import asyncio

from pagemesh.bench.loadgen.datasets import Conversation
from pagemesh.bench.loadgen.main import first_model
from pagemesh.bench.loadgen.metrics import summarize
from pagemesh.bench.loadgen.runner import LoadPoint, Target, run_point


def bench(base_url: str, conversations: list[Conversation], tokenizer, rate: float, seed: int) -> tuple[dict, list]:
    """Send `conversations` (token-id prompts, streamed) at a Poisson `rate`; returns the summary
    (TTFT, ITL, throughput, ...) and the per-request results. One unmeasured warm-up first."""
    target = Target(
        url=base_url + "/v1/completions",
        model=first_model(base_url, {}),
        prompt_as_token_ids=True,
        progress=False,
        warmup=1,
    )
    load = LoadPoint(request_rate=rate, num_prompts=len(conversations) - 1, seed=seed)
    results, duration = asyncio.run(run_point(target, load, iter(conversations), tokenizer))
    summary = summarize(results, duration, count_tokens=lambda text: len(tokenizer.encode(text, False)))
    return summary, results
