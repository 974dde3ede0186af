"""Steps in flight in a pipeline-parallel engine: launched, their output not yet applied.

Pure Python (no torch, no zmq: tests/unit/test_purity.py). With M pipeline stages the engine keeps
up to M steps in flight (as vLLM V1's batch queue), so that stage 0 runs step k+1 while stage 1
runs step k. A sequence's next step needs the token its current step samples, hence the rules:

    launch k     plan k's requests become busy: the scheduler plans none of their sequences
                 (a request's sequences, n > 1 or beams, stay together in one step)
    launch k+1   planned from the other requests, each plan at most ~1/M of the live sequences
                 (`batch_cap`): the running sequences fall into M micro-batches that take turns
    apply k      in launch order; its requests are free again. A sequence that ended while in
                 flight (an abort) kept its pages until now (the stages may still write them):
                 the scheduler frees them, and its rows of the step's output are dropped
                 (`surviving_rows`). Full pages are published to the prefix cache only here,
                 so no later step can match a page whose K/V is still being computed.

Preemption never picks a busy sequence as its victim (`Scheduler`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.engine.scheduler import StepPlan
    from pagemesh.workers.engine.sequence import Sequence


@dataclass
class LaunchedStep:
    """A step on its way through the stages: its plan, the runner's handle on its logits (an
    `InFlightStep`: opaque here) and its perf_counter time of launch."""

    plan: StepPlan
    handle: Any
    started: float


class StepsInFlight:
    """The engine's launched steps in launch order (at most `depth`), the requests and
    sequences they hold, and counters: `launched` steps, `overlapped` (launched while another
    step was in flight: >0 only if the pipeline ever held two), `peak` steps in flight at once,
    `wait_seconds` rank 0 spent waiting for logits (the engine adds it: stage 0's bubble)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError("steps in flight: depth must be >= 1")
        self.depth = depth
        self.steps: deque[LaunchedStep] = deque()
        self.busy_requests: dict[str, int] = {}  # request id -> steps in flight holding it
        self.busy_seqs: set[int] = set()
        self.launched = 0
        self.overlapped = 0
        self.peak = 0
        self.wait_seconds = 0.0

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.depth

    def is_busy(self, seq: Sequence) -> bool:
        """`seq`'s request has a step in flight: none of its sequences can be planned."""
        return seq.request_id in self.busy_requests

    def holds(self, seq: Sequence) -> bool:
        """`seq` itself runs in a step in flight (its pages must outlive that step)."""
        return seq.seq_id in self.busy_seqs

    def batch_cap(self, live: int) -> int:
        """Sequences one plan may take when `live` sequences run or wait: a share of 1/depth,
        so that the live sequences fill `depth` micro-batches instead of one."""
        return max(1, -(-live // self.depth))

    def launch(self, plan: StepPlan, handle: Any, started: float) -> None:
        self.overlapped += bool(self.steps)
        self.launched += 1
        self.steps.append(LaunchedStep(plan, handle, started))
        self.peak = max(self.peak, len(self.steps))
        for chunk in plan.chunks:
            rid = chunk.seq.request_id
            self.busy_requests[rid] = self.busy_requests.get(rid, 0) + 1
            self.busy_seqs.add(chunk.seq.seq_id)

    def oldest(self) -> LaunchedStep:
        """Take the first step launched (its output is the next to apply); its requests are
        plannable again."""
        step = self.steps.popleft()
        for chunk in step.plan.chunks:
            rid = chunk.seq.request_id
            left = self.busy_requests[rid] - 1
            if left:
                self.busy_requests[rid] = left
            else:
                del self.busy_requests[rid]
            self.busy_seqs.discard(chunk.seq.seq_id)
        return step


def surviving_rows(plan: StepPlan) -> tuple[StepPlan, list[int]] | None:
    """The plan less the chunks of sequences that ended while it was in flight, and the logit
    rows that stay (sampled rows, then prompt-logprob rows, as `build_model_input` lays them
    out); None when every chunk's sequence is still live (the usual case: nothing to drop)."""
    if not any(c.seq.finished for c in plan.chunks):
        return None
    sampled: list[int] = []
    prompt: list[int] = []
    kept = []
    num_decodes = num_sampled = num_prompt = 0
    for i, chunk in enumerate(plan.chunks):
        n_sampled = 1 + len(chunk.drafts) if chunk.samples else 0
        n_prompt = 0 if chunk.drafts else len(chunk.seq.prompt_logprob_positions(chunk.start, chunk.num_tokens))
        if not chunk.seq.finished:
            kept.append(chunk)
            num_decodes += i < plan.num_decodes
            sampled += range(num_sampled, num_sampled + n_sampled)
            prompt += range(num_prompt, num_prompt + n_prompt)
        num_sampled += n_sampled
        num_prompt += n_prompt
    rows = sampled + [num_sampled + r for r in prompt]
    return replace(plan, chunks=kept, num_decodes=num_decodes), rows


def pipelined_step(engine: Engine) -> list:
    """`Engine.step` with pipeline stages: launch the next micro-batch while there is room in
    the pipe and something to plan (returning nothing yet), else wait for the oldest step in
    flight and apply its output (its `RequestOutput`s)."""
    steps = engine.scheduler.in_flight
    engine.stalled = False
    if not steps.full:
        plan = engine.scheduler.schedule()
        if not plan.empty:
            started = time.perf_counter()
            steps.launch(plan, engine.runner.launch(engine.images.model_input(plan)), started)
            if not steps.full:
                return []
        elif plan.swap_out or plan.swap_discard:  # preempted with nothing to run: the moves still happen
            engine.runner.launch(engine.images.model_input(plan))
        engine.stalled = plan.empty and not steps  # nothing runs and nothing fits
    if not steps:
        return []
    step = steps.oldest()
    waiting = time.perf_counter()
    logits = step.handle.result()
    steps.wait_seconds += time.perf_counter() - waiting
    engine.scheduler.step_returned(step.plan)
    plan = step.plan
    survivors = surviving_rows(plan)  # an abort while in flight: its rows are dropped
    if survivors is not None:
        plan, rows = survivors
        logits = logits[rows]
    return engine.apply_step(step.plan, plan, logits, step.started)
