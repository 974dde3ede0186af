"""Drive an in-process Engine the way a worker does, with requests arriving in wall-clock time,
and keep the time of every token.

    jobs (arrival times) ──▶ add_request ──▶ step() ... step() ──▶ Trace per request
                                                 └── StepRecord per step (time, tokens, batch)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagemesh.bench.experiments.workload import Job
from pagemesh.bench.loadgen.metrics import latency_stats


@dataclass
class Trace:
    """One request: its arrival and the time of each token of each choice (seconds from start)."""

    request_id: str
    arrival: float
    prompt_len: int
    token_times: dict[int, list[float]] = field(default_factory=dict)
    finished: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_times.values())

    @property
    def ttft(self) -> float | None:
        firsts = [t[0] for t in self.token_times.values() if t]
        return min(firsts) - self.arrival if firsts else None

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def itls(self) -> list[float]:
        """Gaps between consecutive tokens of each choice."""
        return [b - a for times in self.token_times.values() for a, b in zip(times, times[1:])]


@dataclass(frozen=True)
class StepRecord:
    end: float  # seconds from start when the step returned
    seconds: float
    tokens: int  # tokens computed (prefill chunks + decodes)
    decodes: int
    running: int  # sequences running after the step


@dataclass
class Run:
    traces: dict[str, Trace]
    steps: list[StepRecord]
    duration: float  # start to the last finish (or to the stop)

    def finished(self) -> list[Trace]:
        return [t for t in self.traces.values() if t.finished is not None]


def summarize(run: Run, percentiles: Sequence[float] = (50.0, 99.0)) -> dict[str, float]:
    """TTFT, ITL and latency statistics (ms, as `pagemesh bench` names them) and throughputs of
    the finished requests; ITL counts every gap of every choice."""
    done = run.finished()
    out_tokens = sum(t.num_output_tokens for t in done)
    summary = {
        "completed": len(done),
        "duration_s": run.duration,
        "output_throughput": out_tokens / run.duration if run.duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + sum(t.prompt_len for t in done)) / run.duration
        if run.duration > 0
        else 0.0,
    }
    summary |= latency_stats("ttft", [t.ttft for t in done if t.ttft is not None], percentiles)
    summary |= latency_stats("itl", [g for t in done for g in t.itls()], percentiles)
    summary |= latency_stats("e2el", [t.latency for t in done], percentiles)
    normalized = [t.latency / t.num_output_tokens for t in done if t.num_output_tokens]
    summary |= latency_stats("norm_latency", normalized, percentiles)  # ORCA's per-token latency
    return summary


def drive(
    engine,
    jobs: Sequence[Job],
    *,
    on_step: Callable[[object, float], None] | None = None,
    inject: Callable[[Run, float], list[Job]] | None = None,
    until: Callable[[Run], bool] | None = None,
) -> Run:
    """Run `jobs` (added at their arrival times) to completion.

    `on_step(engine, now)` runs after every step; `inject(run, now)` may return more jobs to
    add at once; `until(run)` ends the run early, aborting whatever is left."""
    pending = deque(sorted(jobs, key=lambda j: j.arrival))
    run = Run({}, [], 0.0)
    start = time.perf_counter()

    def add(job: Job, arrival: float) -> None:
        run.traces[job.request_id] = Trace(job.request_id, arrival, job.prompt_len)
        engine.add_request(job.request_id, job.prompt, job.params)

    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:
            job = pending.popleft()
            add(job, job.arrival)
        if not engine.has_unfinished():
            if pending:
                time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - start)))
            continue
        tokens, decodes = engine.stats.tokens, engine.stats.decode_tokens
        began = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter() - start
        run.steps.append(
            StepRecord(
                now,
                time.perf_counter() - began,
                engine.stats.tokens - tokens,
                engine.stats.decode_tokens - decodes,
                len(engine.scheduler.running),
            )
        )
        for out in outputs:
            trace = run.traces[out.request_id]
            for choice in out.outputs:
                trace.token_times.setdefault(choice.index, []).extend([now] * len(choice.new_token_ids))
            if out.finished:
                trace.finished = now
                run.duration = now
        if on_step is not None:
            on_step(engine, now)
        if inject is not None:
            for job in inject(run, now):
                add(job, now)  # injected jobs arrive now, whatever their `arrival` says
        if until is not None and until(run):
            for request_id in list(engine.requests):
                engine.abort(request_id)
            run.duration = now
            break
    return run
