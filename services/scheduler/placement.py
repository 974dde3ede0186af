"""Where a request runs: a prefill and a decode worker (disaggregated) or one mixed worker.
Pure Python: the policy sees worker loads, not sockets."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.registry import WorkerInfo


@dataclass(frozen=True)
class Placement:
    prefill: WorkerInfo | None  # None for a mixed placement
    worker: WorkerInfo  # the decode (or mixed) worker


def pages_for(prompt_len: int, max_tokens: int, page_size: int) -> int:
    return -(-(prompt_len + max_tokens) // page_size)


def can_take(worker: WorkerInfo, pages_needed: int) -> bool:
    """Room for one more request: below its concurrency cap, and the prompt's pages fit."""
    return worker.load < worker.max_running and pages_needed <= worker.free_pages


def least_loaded(candidates: list[WorkerInfo]) -> WorkerInfo | None:
    """Fewest requests, then most free pages, then id (deterministic)."""
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.load, -w.free_pages, w.worker_id))


def place(prefill: list[WorkerInfo], decode: list[WorkerInfo], mixed: list[WorkerInfo], prompt_len: int) -> Placement | None:
    """Disaggregated when both pools have a worker with room, else mixed; None = none can take
    it now (the caller queues or rejects)."""
    if prefill and decode:
        p = least_loaded([w for w in prefill if can_take(w, pages_for(prompt_len, 0, w.page_size))])
        d = least_loaded([w for w in decode if can_take(w, pages_for(prompt_len, 1, w.page_size))])
        if p is not None and d is not None:
            return Placement(p, d)
    m = least_loaded([w for w in mixed if can_take(w, pages_for(prompt_len, 1, w.page_size))])
    return Placement(None, m) if m is not None else None
