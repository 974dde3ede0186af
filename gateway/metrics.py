"""Prometheus metrics in the text exposition format (0.0.4), written by hand.

What is measured, and where (all times on the gateway's monotonic clock):
  time_to_first_token   arrival of the HTTP request -> first delta carrying tokens
  inter_token_latency   between successive token-carrying deltas of one choice (one observation
                        per delta; a delta usually holds one engine step's token)
  e2e_request_latency   arrival -> the last choice finished (successful requests only)
  request_queue_time    arrival -> the scheduler placed the request. The mesh does not report
                        placement times yet, so this histogram is declared but stays empty.
  image_request_latency arrival -> the images are back (successful image requests)
Counters count successful choices by finish reason and tokens, image requests by HTTP status,
images made and transformer blocks computed or skipped by feature caches; the per-worker gauges
and the KV transfer total are copied from the scheduler's ClusterStatus at each scrape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from common.messages import ClusterStatus, TextDelta

Labels = tuple[tuple[str, str], ...]


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str):
        self.name, self.help = name, help_text

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        raise NotImplementedError

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{name}{_labels(labels)} {_number(value)}" for name, labels, value in self.samples()]
        return lines


class Counter(_Metric):
    """A monotonically increasing total per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str):
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def mirror(self, values: dict[Labels, float]) -> None:
        """Replace every series with totals counted elsewhere (e.g. by workers)."""
        self.values = dict(values)

    def samples(self):
        return [(self.name, labels, value) for labels, value in self.values.items()]


class Gauge(_Metric):
    """A current value per label set; `replace` swaps in a whole new set (gone series vanish)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str):
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}

    def replace(self, values: dict[Labels, float]) -> None:
        self.values = dict(values)

    def samples(self):
        return [(self.name, labels, value) for labels, value in self.values.items()]


class Histogram(_Metric):
    """Cumulative buckets (upper bounds, `le`), plus +Inf, sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]):
        super().__init__(name, help_text)
        self.bounds = sorted(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self):
        out, running = [], 0
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            running += count
            out.append((f"{self.name}_bucket", (("le", _number(bound)),), running))
        out.append((f"{self.name}_sum", (), self.sum))
        out.append((f"{self.name}_count", (), self.count))
        return out


def render(metrics: Iterable[_Metric]) -> str:
    return "".join(line + "\n" for metric in metrics for line in metric.render())


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape_label(value)}"' for key, value in labels)
    return "{" + inner + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


# --------------------------------------------------------------------------- the gateway's metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class GatewayMetrics:
    """Every metric the gateway exports; `request(arrival)` follows one request."""

    def __init__(self):
        p = "pagemesh_"
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time from the request's arrival at the gateway to its first token.",
            LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between successive token deltas of one choice.",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Time from arrival to the last token of a successful request.",
            E2E_BUCKETS,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Time a request waited before its first step: in the scheduler's queue plus in its worker's waiting queue.",
            LATENCY_BUCKETS,
        )
        self.success = Counter(p + "request_success_total", "Choices finished, by finish reason.")
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of requests that started generating.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.running = Gauge(p + "num_requests_running", "Requests running on each worker.")
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting on each worker.")
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Used KV-cache pages / total pages, per worker.")
        self.kv_bytes = Counter(p + "kv_transfer_bytes_total", "KV-cache bytes sent by all workers.")
        self.scheduler_queued = Gauge(p + "scheduler_queued_requests", "Requests waiting in the scheduler.")
        self.migrations = Counter(
            p + "request_migrations_total",
            "Requests moved to another worker after theirs was lost (scheduler's count).",
        )
        self.worker_requests = Counter(
            p + "worker_requests_total", "Requests each worker has finished (or handed off)."
        )
        self.image_latency = Histogram(
            p + "image_request_latency_seconds", "Time from arrival to the images of a successful request.", E2E_BUCKETS
        )
        self.image_requests = Counter(p + "image_requests_total", "Image requests answered, by HTTP status.")
        self.images = Counter(p + "images_generated_total", "Images generated.")
        self.denoising_steps = Counter(p + "denoising_steps_total", "Denoising steps run, summed over images.")
        self.diffusion_blocks = Counter(
            p + "diffusion_blocks_total",
            "Transformer-block evaluations of image requests (rows x steps x blocks), by outcome: computed, or "
            "skipped by a feature cache.",
        )

    def all(self) -> list[_Metric]:
        return [
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.success,
            self.prompt_tokens,
            self.generation_tokens,
            self.running,
            self.waiting,
            self.kv_usage,
            self.kv_bytes,
            self.scheduler_queued,
            self.migrations,
            self.worker_requests,
            self.image_latency,
            self.image_requests,
            self.images,
            self.denoising_steps,
            self.diffusion_blocks,
        ]

    def render(self) -> str:
        return render(self.all())

    def request(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def image_request(
        self,
        status: int,
        latency: float | None = None,
        images: int = 0,
        steps: int = 0,
        blocks: tuple[int, int] = (0, 0),
    ) -> None:
        """One image request answered with `status` (its latency, images, steps and (blocks computed,
        blocks skipped) when it succeeded)."""
        self.image_requests.inc(status=str(status))
        if latency is not None:
            self.image_latency.observe(latency)
            self.images.inc(images)
            self.denoising_steps.inc(images * steps)
            if any(blocks):
                self.diffusion_blocks.inc(blocks[0], outcome="computed")
                self.diffusion_blocks.inc(blocks[1], outcome="skipped")

    def update_cluster(self, status: ClusterStatus | None) -> None:
        """Copy the scheduler's view; with no answer, drop the series rather than show stale ones."""
        workers = status.workers if status is not None else []
        by_worker = {w.worker_id: w for w in workers}
        self.running.replace({(("worker", i),): w.running for i, w in by_worker.items()})
        self.waiting.replace({(("worker", i),): w.waiting for i, w in by_worker.items()})
        self.kv_usage.replace(
            {
                (("worker", i),): w.kv.used_pages / w.kv.total_pages if w.kv.total_pages else 0.0
                for i, w in by_worker.items()
                if w.kv is not None
            }
        )
        self.kv_bytes.mirror(
            {(): sum(w.kv.bytes_sent for w in workers if w.kv is not None)} if status is not None else {}
        )
        self.scheduler_queued.replace({(): status.queued} if status is not None else {})
        self.migrations.mirror({(): status.migrations} if status is not None else {})
        self.worker_requests.mirror({(("worker", i),): w.requests_finished for i, w in by_worker.items()})


class RequestTimer:
    """One request's timings; feed it every delta with the time it arrived."""

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first_token: float | None = None
        self._last_token: dict[int, float] = {}
        self._started: set[str] = set()  # mesh requests (one per prompt) whose prompt was counted

    def on_delta(self, delta: TextDelta, now: float) -> None:
        m = self.metrics
        if delta.queue_time_s is not None:
            m.queue_time.observe(delta.queue_time_s)
        if delta.token_ids:
            if delta.request_id not in self._started:
                self._started.add(delta.request_id)
                m.prompt_tokens.inc(delta.prompt_tokens)
            if self.first_token is None:
                self.first_token = now
                m.ttft.observe(now - self.arrival)
            elif delta.index in self._last_token:
                m.itl.observe(now - self._last_token[delta.index])
            self._last_token[delta.index] = now
            m.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            m.success.inc(finish_reason=delta.finish_reason)

    def on_finished(self, now: float) -> None:
        self.metrics.e2e.observe(now - self.arrival)
