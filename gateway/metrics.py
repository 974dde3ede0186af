"""The gateway's Prometheus metrics, written with prometheus-client under vLLM's names.

Request-level series carry vLLM's names and labels (`vllm:` prefix, `model_name`,
`finished_reason`), so the queries of a vLLM Grafana dashboard find them unchanged; the
per-worker and cluster series (gateway/cluster_metrics.py) come under both vLLM's names
(`engine` = the worker id) and pagemesh's own (`pagemesh_...{worker=...}`).

What is measured, and where (all times on the gateway's monotonic clock):
  time_to_first_token      arrival of the HTTP request -> first delta carrying tokens
  inter_token_latency      between successive token-carrying deltas of one choice (one
  (= time_per_output_token) observation per delta; a delta usually holds one engine step's token)
  e2e_request_latency      arrival -> the last choice finished (successful requests only)
  request_queue_time       the wait the worker reports on a request's first delta: in the
                           scheduler's queue plus in its worker's waiting queue
  request_prefill_time     TTFT minus the queue time (so it also holds tokenization and the hops)
  request_decode_time      first token -> last token
  request_inference_time   queue end -> last token
Counters: successful choices by finished_reason, requests the gateway aborted (client gone,
timeout, error) under finished_reason="abort" (vLLM's convention), prompt and generated tokens,
and the prefix cache's queries and hits in tokens (hits = the prompt tokens a worker took from
its prefix cache, `usage.prompt_tokens_details.cached_tokens`). Image requests keep pagemesh
names: vLLM has none for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from pagemesh.common.messages import ClusterStatus, TextDelta
from pagemesh.gateway.cluster_metrics import ClusterCollector

# `_created` series would double the text and no dashboard reads them. Process-wide, on purpose:
# the gateway is the only process that exports metrics.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class GatewayMetrics:
    """Every metric one gateway exports, in its own registry (so tests may build many);
    `request(arrival)` follows one generation request, `render()` is the /metrics text."""

    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.registry = r = CollectorRegistry(auto_describe=False)
        m = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def count(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LATENCY_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_BUCKETS
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the same observations as inter_token_latency).",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent waiting for a first step.", LATENCY_BUCKETS
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "Histogram of time from queue end to first token.", LATENCY_BUCKETS
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds", "Histogram of time from first to last token.", E2E_BUCKETS
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds", "Histogram of time from queue end to last token.", E2E_BUCKETS
        )
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed, per request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed, per request.", TOKEN_BUCKETS
        )
        self.request_max_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Maximum number of generated tokens of one choice, per request.",
            TOKEN_BUCKETS,
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of finished choices, by finished_reason.",
            [*m, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = count("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = count("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = count(
            "vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens of requests that started."
        )
        self.prefix_hits = count("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens taken from the cache.")
        self._aborted = Counter(
            "pagemesh_requests_aborted", "Requests the gateway aborted in the mesh, by reason.", ["reason"], registry=r
        )
        self.image_latency = Histogram(
            "pagemesh_image_request_latency_seconds",
            "Time from arrival to the images of a successful request.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self._image_requests = Counter(
            "pagemesh_image_requests", "Image requests answered, by HTTP status.", ["status"], registry=r
        )
        self.images = Counter("pagemesh_images_generated", "Images generated.", registry=r)
        self.denoising_steps = Counter(
            "pagemesh_denoising_steps", "Denoising steps run, summed over images.", registry=r
        )
        self._diffusion_blocks = Counter(
            "pagemesh_diffusion_blocks",
            "Transformer-block evaluations of image requests (rows x steps x blocks), by outcome: computed, or "
            "skipped by a feature cache.",
            ["outcome"],
            registry=r,
        )
        self._transcriptions = Counter(
            "pagemesh_transcription_requests",
            "Transcription requests answered, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.transcription_latency = Histogram(
            "pagemesh_transcription_latency_seconds",
            "Time from arrival to the text of a successful transcription.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter("pagemesh_transcribed_audio_seconds", "Seconds of audio transcribed.", registry=r)
        self._tokenizer_moves = Counter(
            "pagemesh_tokenizer_moves",
            "Requests sent again through another tokenizer replica (or a restarted one) after theirs was lost.",
            registry=r,
        )
        self._moves_counted = 0
        self.cluster = ClusterCollector(model_name)
        r.register(self.cluster)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's value (None if absent); `model_name` is filled in for `vllm:` series."""
        if name.startswith("vllm:"):
            labels.setdefault("model_name", self.model_name)
        return self.registry.get_sample_value(name, labels)

    def tokenizer_moves(self, total: int) -> None:
        """The mesh client's count of moved requests (gateway/mesh.py), brought up to `total`."""
        if total > self._moves_counted:
            self._tokenizer_moves.inc(total - self._moves_counted)
            self._moves_counted = total

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def aborted(self, reason: str) -> None:
        """A request the gateway stopped in the mesh before it ended (`reason`: a short slug)."""
        self._aborted.labels(reason).inc()
        self.success("abort")

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
        self._image_requests.labels(str(status)).inc()
        if latency is not None:
            self.image_latency.observe(latency)
            self.images.inc(images)
            self.denoising_steps.inc(images * steps)
            if any(blocks):
                self._diffusion_blocks.labels("computed").inc(blocks[0])
                self._diffusion_blocks.labels("skipped").inc(blocks[1])

    def transcription_request(self, status: int, latency: float | None = None, audio_seconds: float = 0.0) -> None:
        """One transcription answered with `status` (its latency and audio's length when it succeeded)."""
        self._transcriptions.labels(str(status)).inc()
        if latency is not None:
            self.transcription_latency.observe(latency)
            self.audio_seconds.inc(audio_seconds)

    def update_cluster(self, status: ClusterStatus | None) -> None:
        """The scheduler's view for the next render; None (no answer) drops those series rather
        than show stale ones."""
        self.cluster.status = status


class RequestTimer:
    """One request's timings; feed it every delta with the time it arrived."""

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.queue_time: float | None = None
        self._last_token: dict[int, float] = {}  # choice -> when its last tokens came
        self._tokens: dict[int, int] = {}  # choice -> tokens so far
        self._prompts: dict[str, int] = {}  # mesh request (one per prompt) -> its prompt's length

    def on_delta(self, delta: TextDelta, now: float) -> None:
        m = self.metrics
        if delta.queue_time_s is not None and self.queue_time is None:
            self.queue_time = delta.queue_time_s
            m.queue_time.observe(delta.queue_time_s)
        if delta.token_ids:
            if delta.request_id not in self._prompts:
                self._prompts[delta.request_id] = delta.prompt_tokens
                m.prompt_tokens.inc(delta.prompt_tokens)
                m.request_prompt_tokens.observe(delta.prompt_tokens)
                m.prefix_queries.inc(delta.prompt_tokens)
                m.prefix_hits.inc(delta.cached_tokens or 0)
            if self.first_token is None:
                self.first_token = now
                m.ttft.observe(now - self.arrival)
                if self.queue_time is not None:
                    m.prefill_time.observe(max(now - self.arrival - self.queue_time, 0.0))
            elif delta.index in self._last_token:
                m.itl.observe(now - self._last_token[delta.index])
                m.tpot.observe(now - self._last_token[delta.index])
            self._last_token[delta.index] = self.last_token = now
            self._tokens[delta.index] = self._tokens.get(delta.index, 0) + len(delta.token_ids)
            m.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            m.success(delta.finish_reason)

    def on_finished(self, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - self.arrival)
        m.request_generation_tokens.observe(sum(self._tokens.values()))
        m.request_max_generation_tokens.observe(max(self._tokens.values(), default=0))
        if self.first_token is not None:
            m.decode_time.observe(now - self.first_token)
            queue_end = self.arrival + (self.queue_time or 0.0)
            m.inference_time.observe(max(now - queue_end, 0.0))
