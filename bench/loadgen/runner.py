"""One load point: warm-up requests, then conversations launched at arrival times under an
optional concurrency cap, until `num_prompts` conversations have been launched or `duration_s`
has passed (requests in flight then finish; later turns of a conversation are not started).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from pagemesh.bench.loadgen.arrivals import arrival_times
from pagemesh.bench.loadgen.client import new_session, stream_request
from pagemesh.bench.loadgen.datasets import Conversation, Prompt, build_prompt
from pagemesh.bench.loadgen.progress import progress_bar
from pagemesh.bench.loadgen.stream import RequestResult
from pagemesh.common.tokenizer import Tokenizer

T = TypeVar("T")


class BenchError(RuntimeError):
    """The benchmark cannot run (e.g. the warm-up request failed)."""


@dataclass(frozen=True)
class LoadPoint:
    """How requests are sent: arrivals, concurrency cap and bounds."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = 100  # conversations (one request each, except multi-turn)
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts is None and self.duration_s is None:
            raise ValueError("give --num-prompts or --duration")
        if self.num_prompts is None and math.isinf(self.request_rate) and not self.max_concurrency:
            raise ValueError("--duration with an infinite request rate needs --max-concurrency")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max-concurrency: must be >= 1")


@dataclass(frozen=True)
class Target:
    """The server and what each request asks of it."""

    url: str  # base URL + endpoint
    model: str
    prompt_as_token_ids: bool = False
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    fresh_connection: bool = False
    timeout_s: float = 600.0
    warmup: int = 1
    progress: bool = True

    @property
    def chat_endpoint(self) -> bool:
        return self.url.rstrip("/").endswith("/chat/completions")


def request_body(target: Target, prompt: Prompt, output_len: int) -> dict:
    """The JSON body: streamed, usage requested, output length forced when `ignore_eos`."""
    body = {
        "model": target.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": output_len,
        "temperature": target.temperature,
    }
    if prompt.messages is not None:
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.ids if prompt.ids is not None else prompt.text
    if target.ignore_eos:
        body |= {"ignore_eos": True, "min_tokens": output_len}
    return body | target.extra_body


class _Run:
    def __init__(self, target: Target, tokenizer: Tokenizer, session, deadline: float | None):
        self.target, self.tokenizer, self.session, self.deadline = target, tokenizer, session, deadline

    async def request(self, conversation: Conversation, turn: int, replies: list[str]) -> RequestResult:
        prompt = build_prompt(
            conversation,
            turn,
            replies,
            self.tokenizer,
            chat_endpoint=self.target.chat_endpoint,
            as_token_ids=self.target.prompt_as_token_ids,
        )
        output_len = conversation.turns[turn].output_len
        result = RequestResult(prompt_len=prompt.prompt_len, output_len=output_len)
        body = request_body(self.target, prompt, output_len)
        return await stream_request(self.session, self.target.url, body, result, self.target.headers)

    async def conversation(self, conversation: Conversation, bar) -> list[RequestResult]:
        results, replies = [], []
        for turn in range(len(conversation.turns)):
            if turn and self.deadline is not None and time.perf_counter() >= self.deadline:
                break
            result = await self.request(conversation, turn, replies)
            results.append(result)
            bar.update(1)
            if not result.success:
                break
            replies.append(result.text)
        return results


async def launch_at_arrivals(load: LoadPoint, start: float, job: Callable[[], Awaitable[T]]) -> list[T]:
    """Starts `job()` at each arrival time after `start` (perf_counter), at most
    `max_concurrency` at once, until `num_prompts` have started or `duration_s` has passed;
    returns every started job's result, in launch order, once all have finished."""
    deadline = start + load.duration_s if load.duration_s is not None else None
    slot = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def held() -> T:
        try:
            return await job()
        finally:
            if slot is not None:
                slot.release()

    tasks = []
    times = arrival_times(load.request_rate, load.burstiness, random.Random(load.seed))
    for _ in range(load.num_prompts) if load.num_prompts is not None else itertools.count():
        at = start + next(times)
        if deadline is not None and at >= deadline:
            break
        if at > time.perf_counter():
            await asyncio.sleep(at - time.perf_counter())
        if slot is not None:
            await slot.acquire()
        if deadline is not None and time.perf_counter() >= deadline:
            if slot is not None:
                slot.release()
            break
        tasks.append(asyncio.create_task(held()))
    return await asyncio.gather(*tasks)


async def run_point(
    target: Target, load: LoadPoint, conversations: Iterator[Conversation], tokenizer: Tokenizer, desc: str = "bench"
) -> tuple[list[RequestResult], float]:
    """Send the load; returns every measured request's result and the wall time in seconds."""
    warmups = [next(conversations) for _ in range(target.warmup)]
    total = None
    if load.num_prompts is not None:  # made before the clock starts, so generating costs nothing
        measured = [next(conversations) for _ in range(load.num_prompts)]
        total = sum(len(c.turns) for c in measured)
        conversations = iter(measured)
    async with new_session(fresh_connection=target.fresh_connection, timeout_s=target.timeout_s) as session:
        run = _Run(target, tokenizer, session, None)
        for conversation in warmups:
            warm = await run.request(conversation, 0, [])
            if not warm.success:
                raise BenchError(f"warm-up request failed: {warm.error}")
        bar = progress_bar(total, desc, target.progress)
        start = time.perf_counter()
        run.deadline = start + load.duration_s if load.duration_s is not None else None
        per_conversation = await launch_at_arrivals(load, start, lambda: run.conversation(next(conversations), bar))
        duration = time.perf_counter() - start
        bar.close()
    return [r for results in per_conversation for r in results], duration
