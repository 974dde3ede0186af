"""The live status page: `GET /` (one static HTML file) and `GET /status` (the JSON it polls).

    browser ──GET / ──────▶ gateway/static/status.html (plain HTML + vanilla JS, no build step)
    browser ──GET /status ─▶ StatusPage ──StatusRequest──▶ scheduler ──ClusterStatus──▶ JSON
                   (every second)   + the gateway's own recent requests (TTFT, TPOT)

The scheduler knows the workers (registry + heartbeats); the gateway knows the requests it
served. Rates (tokens/s, images/s) are the slope of each worker's `produced` counter over the
last RATE_WINDOW_S seconds of polls, so they need no clock shared between processes. Pure logic
here except `StatusPage`'s two handlers; `status_document` is what the tests call.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from pagemesh.common.messages import ClusterStatus, TextDelta, WorkerKind, WorkerStatus

PAGE = Path(__file__).parent / "static" / "status.html"
RECENT_REQUESTS = 50  # rows the page shows
RATE_WINDOW_S = 5.0  # heartbeats come every 0.25 s: a few seconds smooth a rate out


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One finished request as the page lists it. Times in seconds; TPOT is the mean time per
    output token after the first (vLLM's definition), None for a single token."""

    request_id: str
    kind: str  # "completion" or "chat"
    finished_at: float  # wall clock (time.time())
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    outcome: str  # "ok" or the error code that ended it

    def to_json(self) -> dict:
        return {
            "id": self.request_id,
            "kind": self.kind,
            "finished_at": self.finished_at,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "e2e_s": _round(self.e2e_s),
            "outcome": self.outcome,
        }


class RequestTrace:
    """One request's timings on the gateway's monotonic clock; feed it every delta."""

    def __init__(self, request_id: str, kind: str, arrival: float):
        self.request_id, self.kind, self.arrival = request_id, kind, arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = 0
        self.tokens: dict[int, int] = {}  # choice index -> tokens so far
        self._prompted: set[str] = set()

    def on_delta(self, delta: TextDelta, now: float) -> None:
        if not delta.token_ids:
            return
        if delta.request_id not in self._prompted:  # one mesh request per prompt of a batch
            self._prompted.add(delta.request_id)
            self.prompt_tokens += delta.prompt_tokens
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens[delta.index] = self.tokens.get(delta.index, 0) + len(delta.token_ids)

    def record(self, now: float, outcome: str = "ok") -> RequestRecord:
        longest = max(self.tokens.values(), default=0)  # TPOT of the longest choice
        tpot = None
        if longest > 1 and self.first_token is not None and self.last_token is not None:
            tpot = (self.last_token - self.first_token) / (longest - 1)
        return RequestRecord(
            request_id=self.request_id,
            kind=self.kind,
            finished_at=time.time(),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=sum(self.tokens.values()),
            ttft_s=None if self.first_token is None else self.first_token - self.arrival,
            tpot_s=tpot,
            e2e_s=now - self.arrival,
            outcome=outcome,
        )


class RateMeter:
    """Per-worker rate of a monotonically increasing counter, from the samples seen in the last
    `window` seconds. A counter that goes down (the worker restarted) starts over."""

    def __init__(self, window: float = RATE_WINDOW_S):
        self.window = window
        self.samples: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, key: str, now: float, value: int) -> float:
        samples = self.samples.setdefault(key, deque())
        if samples and value < samples[-1][1]:
            samples.clear()
        samples.append((now, value))
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()  # keep one sample at or before the window's start
        (t0, v0), (t1, v1) = samples[0], samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0

    def keep_only(self, keys: set[str]) -> None:
        for key in self.samples.keys() - keys:
            del self.samples[key]


def worker_state(w: WorkerStatus) -> str:
    """What the page says a worker is doing: a worker whose heartbeats stopped is `lost`."""
    if not w.alive:
        return "lost"
    return "busy" if w.running or w.waiting else "idle"


_UNITS = {WorkerKind.DIFFUSION: "images", WorkerKind.ENCODER: "images encoded", WorkerKind.AUDIO: "tokens transcribed"}


def worker_json(w: WorkerStatus, rate: float) -> dict:
    kv = w.kv
    row = {
        "id": w.worker_id,
        "kind": str(w.kind),
        "role": str(w.role),
        "pool": {WorkerKind.DIFFUSION: "diffusion", WorkerKind.AUDIO: "audio"}.get(w.kind, str(w.role)),
        "model": w.model,
        "state": worker_state(w),
        "running": w.running,
        "waiting": w.waiting,
        "requests_finished": w.requests_finished,
        "produced": w.produced,
        "unit": _UNITS.get(w.kind, "tokens"),
        "rate_per_s": round(rate, 2),
        "kv": None,
    }
    if w.ranks > 1:  # the page shows "llm (3 ranks)"
        row["ranks"] = w.ranks
    if kv is not None:
        row["kv"] = {
            "used_pages": kv.used_pages,
            "total_pages": kv.total_pages,
            "usage": round(kv.used_pages / kv.total_pages, 4) if kv.total_pages else 0.0,
            "bytes_sent": kv.bytes_sent,
            "bytes_received": kv.bytes_received,
        }
    return row


def status_document(
    status: ClusterStatus | None, rates: RateMeter, recent: deque[RequestRecord], model: str, now: float
) -> dict:
    """The JSON of `GET /status`. With no answer from the scheduler: `scheduler: false` and no
    workers (stale figures would mislead)."""
    workers = []
    if status is not None:
        for w in sorted(status.workers, key=lambda w: (worker_json(w, 0)["pool"], w.worker_id)):
            workers.append(worker_json(w, rates.observe(w.worker_id, now, w.produced)))
        rates.keep_only({w.worker_id for w in status.workers})
    return {
        "time": time.time(),
        "model": model,
        "scheduler": status is not None,
        "ready": bool(status is not None and status.ready),
        "queued": status.queued if status is not None else None,
        "workers": workers,
        "tokens_per_s": round(sum(w["rate_per_s"] for w in workers if w["unit"] == "tokens"), 2),
        "images_per_s": round(sum(w["rate_per_s"] for w in workers if w["unit"] == "images"), 2),
        "recent_requests": [r.to_json() for r in reversed(recent)],
    }


class StatusPage:
    """The two handlers, over a function that asks the scheduler for its ClusterStatus."""

    def __init__(self, ask: Callable, model: str):
        self.ask, self.model = ask, model
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self.rates = RateMeter()

    def trace(self, request_id: str, kind: str, arrival: float) -> RequestTrace:
        return RequestTrace(request_id, kind, arrival)

    def finished(self, trace: RequestTrace, now: float, outcome: str = "ok") -> None:
        self.recent.append(trace.record(now, outcome))

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def status(self, request: web.Request) -> web.Response:
        doc = status_document(await self.ask(), self.rates, self.recent, self.model, time.monotonic())
        return web.json_response(doc, headers={"Cache-Control": "no-store"})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
