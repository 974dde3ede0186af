"""Offline use of an engine: run a list of prompts to completion together."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from pagemesh.common.messages import TokenLogprob
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.outputs import CompletionResult

if TYPE_CHECKING:
    from pagemesh.workers.engine.engine import Engine


def generate(
    engine: Engine,
    prompts: Seq[str | Seq[int]],
    sampling_params: SamplingParams | Seq[SamplingParams],
    loras: Seq[str | None] | None = None,
) -> list[CompletionResult]:
    """Add every prompt, step until all are done, collect each choice's tokens in prompt order.
    `loras`: each prompt's LoRA adapter (None: the base model)."""
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, params, lora in zip(ids, prompts, sampling_params, loras or [None] * len(prompts)):
        engine.add_request(rid, prompt, params if lora is None else dataclasses.replace(params, lora=lora))
    collected: dict[str, dict[int, tuple[list[int], list[TokenLogprob], str | None]]] = {r: {} for r in ids}
    prompt_ids = {rid: list(engine.requests[rid].seqs[0].token_ids) for rid in ids}
    pending = set(ids)
    prompt_logprobs: dict[str, list[TokenLogprob]] = {}
    while pending:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = out.prompt_logprobs
            for so in out.outputs:
                toks, lps, _ = collected[out.request_id].get(so.index, ([], [], None))
                collected[out.request_id][so.index] = (toks + so.new_token_ids, lps + so.logprobs, so.finish_reason)
            if out.finished:
                pending.discard(out.request_id)
    results = []
    for rid in ids:
        choices = [collected[rid][i] for i in sorted(collected[rid])]
        texts = [engine.tokenizer.decode(c[0]) if engine.tokenizer else "" for c in choices]
        results.append(
            CompletionResult(
                rid,
                prompt_ids[rid],
                [c[0] for c in choices],
                texts,
                [c[2] for c in choices],
                [c[1] for c in choices],
                prompt_logprobs.get(rid),
            )
        )
    return results
