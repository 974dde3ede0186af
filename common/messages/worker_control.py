"""The worker channel: scheduler ⇄ workers (one ROUTER at the scheduler, a DEALER per worker).

    worker    ──RegisterWorker──▶ scheduler ──Registered / UnknownWorker──▶ worker
    worker    ──Heartbeat / KVEventBatch / RequestDone──▶ scheduler
    scheduler ──KVEventsResync──▶ LLM worker   (a KVEventBatch went missing: send a snapshot)
    worker    ──WorkerStopped──▶ scheduler   (its engine failed, or it drained: drop it now)
    scheduler ──GenerateTask / PrefillTask / DecodeTask / AbortRequest──▶ worker

A worker is of a kind (llm, diffusion, encoder, audio) and, for an LLM worker, a role (another
kind's role is `mixed`: it does the whole request). What only a worker with a
paged KV pool has (pages, its KV endpoint, transfer counters) sits in `KVPoolInfo` /
`KVPoolLoad`, which other kinds leave out.
"""

from __future__ import annotations

from dataclasses import field

from pagemesh.common.messages.base import DoneReason, Pooling, ProtocolError, WorkerKind, WorkerRole, message, record
from pagemesh.common.messages.images import FeatureCacheLoad, ImageModelInfo
from pagemesh.common.messages.lora import LoRALoad
from pagemesh.common.messages.requests import ImageInput, ResumedChoice, check_images, check_resumed_choices
from pagemesh.common.sampling import SamplingParams

MAX_KV_EVENT_BYTES = 16 << 20  # a KVEventBatch's payload; a step's events over it go as a snapshot instead


def _check_skip(name: str, skip_pages: int) -> None:
    if skip_pages < 0:
        raise ProtocolError(f"{name}.skip_pages: must be >= 0")


@message
class GenerateTask:
    """Scheduler -> mixed worker: prefill and decode in the same engine. A migrated request
    (also to a decode worker) brings `output_token_ids`, generated elsewhere and streamed
    already: the engine recomputes them with the prompt and generates on after them; one of
    several choices brings each unfinished choice's (`resumed_choices`).
    With `pooling`, an embedding request, to a mixed or a prefill worker: its prompt is
    prefilled and pooled into one vector (an EmbeddingBatch to `reply_to`), nothing sampled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    queued_s: float = 0.0  # time the request waited in the scheduler
    output_token_ids: list[int] = field(default_factory=list)
    pooling: Pooling | None = None
    images: list[ImageInput] = field(default_factory=list)  # a multimodal prompt's images
    encoder_id: str = ""  # the encoder worker pushing the images' rows here ("": encode them here)
    resumed_choices: list[ResumedChoice] = field(default_factory=list)  # a migrated request of n > 1

    def _check(self) -> None:
        check_images(self.images, len(self.prompt_token_ids), "GenerateTask")
        if self.pooling is not None and (self.output_token_ids or self.resumed_choices):
            raise ProtocolError("GenerateTask: an embedding request (pooling) generates no tokens")
        if self.output_token_ids and self.resumed_choices:
            raise ProtocolError("GenerateTask: output_token_ids (one choice) or resumed_choices (several), not both")
        check_resumed_choices(self.resumed_choices, "GenerateTask.resumed_choices")


@message
class PrefillTask:
    """Scheduler -> prefill worker: run the prompt, send the first token to `reply_to` and the
    KV pages to the decode worker at `decode_kv_endpoint`. A migrated request comes `resumed`
    (an exact resume, docs/architecture.md): the worker sends the pages it kept of this
    request's first prefill (or, if it kept none, prefills again) and reports no token."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    decode_worker_id: str
    decode_kv_endpoint: str
    queued_s: float = 0.0  # time the request waited in the scheduler
    skip_pages: int = 0  # leading prompt pages the decode worker already holds: not sent
    images: list[ImageInput] = field(default_factory=list)  # a multimodal prompt's images
    encoder_id: str = ""  # the encoder worker pushing the images' rows here ("": encode them here)
    resumed: bool = False  # a migrated request: its kept pages sent again, no token reported
    kept_id: str = ""  # the id the worker kept them under, when not request_id (AbortRequest.moved_to)

    def _check(self) -> None:
        _check_skip("PrefillTask", self.skip_pages)
        check_images(self.images, len(self.prompt_token_ids), "PrefillTask")


@message
class DecodeTask:
    """Scheduler -> decode worker: allocate pages, await KV from `prefill_worker_id`, decode.
    The first `skip_pages` prompt pages will not come: the worker takes them from its own
    prefix cache (and refuses the transfer if it no longer holds them). A migrated request brings
    `output_token_ids` (or, of several choices, each unfinished choice's: `resumed_choices`),
    streamed already: the worker decodes them again one decode step each, taking each as given
    (nothing reported), then generates on after them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    prefill_worker_id: str
    skip_pages: int = 0
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images: keys its pages, runs a recompute
    output_token_ids: list[int] = field(default_factory=list)  # a migrated request's tokens: replayed, not reported
    resumed_choices: list[ResumedChoice] = field(default_factory=list)  # a migrated request of n > 1

    def _check(self) -> None:
        _check_skip("DecodeTask", self.skip_pages)
        check_images(self.images, len(self.prompt_token_ids), "DecodeTask")
        if self.output_token_ids and self.resumed_choices:
            raise ProtocolError("DecodeTask: output_token_ids (one choice) or resumed_choices (several), not both")
        if any(not c.output_token_ids for c in self.resumed_choices):
            raise ProtocolError("DecodeTask.resumed_choices: each choice brings its tokens")


@record
class HeldRequest:
    """A request a worker holds, as it reports when it registers again with a restarted scheduler."""

    request_id: str
    reply_to: str  # its tokenizer's token address


@record
class KVPoolInfo:
    """The paged KV pool of an LLM worker, as it registers."""

    page_size: int
    num_pages: int
    kv_endpoint: str  # where prefill workers push pages to it ("" unless a decode worker)


@record
class SpeculationLoad:
    """An LLM worker's speculative decoding, ever (counters, in each heartbeat): decode rows
    verified with drafts, draft tokens run, draft tokens accepted. Acceptance rate = accepted /
    drafts; mean accepted length = (accepted + passes) / passes tokens per verifying pass."""

    verify_passes: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: passes that kept draft j (0-based)


@record
class KVPoolLoad:
    """The paged KV pool's state, in each heartbeat (and the scheduler's status)."""

    free_pages: int
    used_pages: int
    total_pages: int
    bytes_sent: int  # KV pages sent to other workers, ever
    bytes_received: int


@message
class RegisterWorker:
    """Worker -> scheduler, first message on its DEALER; answered by Registered."""

    worker_id: str
    kind: WorkerKind
    role: WorkerRole
    model: str
    max_running: int
    kv: KVPoolInfo | None  # LLM workers
    instance: str = ""  # random per process start: a new one under a known worker id is a restart
    held: list[HeldRequest] | None = None  # registering again: the requests it is working on
    images: ImageModelInfo | None = None  # diffusion workers: sizes, samplers, step limits
    ranks: int = 1  # its rank processes: tensor-parallel size × pipeline-parallel size
    embeds_endpoint: str = ""  # an LLM worker of a multimodal model: where encoder workers push image rows
    pipeline_stages: int = 1  # its pipeline-parallel size (ranks / stages = tensor-parallel size)

    def _check(self) -> None:
        if (self.kind == WorkerKind.LLM) != (self.kv is not None):
            raise ProtocolError("RegisterWorker.kv: an LLM worker has a KV pool, others none")
        if (self.kind == WorkerKind.DIFFUSION) != (self.images is not None):
            raise ProtocolError("RegisterWorker.images: a diffusion worker says what it makes, others nothing")
        if not 1 <= self.ranks <= 4096:
            raise ProtocolError("RegisterWorker.ranks: must be in [1, 4096]")
        if not 1 <= self.pipeline_stages <= self.ranks or self.ranks % self.pipeline_stages:
            raise ProtocolError("RegisterWorker.pipeline_stages: must divide ranks")


@message
class Registered:
    """Scheduler -> worker: registration accepted."""

    worker_id: str


@message
class UnknownWorker:
    """Scheduler -> worker: answers a heartbeat from a worker it does not know (the scheduler was
    restarted, or dropped the worker after missed heartbeats): register again."""

    worker_id: str


@message
class Heartbeat:
    """Worker -> scheduler, periodic load report. A worker sends it from a thread of its own (on
    a socket of its own), so a long step does not hold it up; `busy_s` says how long the worker
    has been inside one step, or its event loop has not turned (0 when it is idle), so that a
    step that never ends is still seen (the scheduler's --step-timeout)."""

    worker_id: str
    running: int
    waiting: int
    time: float
    requests_finished: int  # requests that left this worker, ever
    kv: KVPoolLoad | None  # LLM workers
    produced: int = 0  # output made, ever: tokens (LLM workers) or images (diffusion workers)
    feature_cache: FeatureCacheLoad | None = None  # diffusion workers
    busy_s: float = 0.0
    speculation: SpeculationLoad | None = None  # LLM workers with --speculative-config
    lora: LoRALoad | None = None  # LLM workers with --enable-lora

    def _check(self) -> None:
        if not self.busy_s >= 0:
            raise ProtocolError("Heartbeat.busy_s: must be >= 0")


@message
class KVEventBatch:
    """LLM worker -> scheduler: one engine step's prefix-cache events, `payload` an EventBatch in
    vLLM's format (pagemesh.common.kv_events), the same bytes the worker publishes with
    --kv-events-config. `seq` counts the worker's batches to this scheduler; 0 opens a snapshot
    (AllBlocksCleared, then every key held), which the worker sends after each registration and
    when asked (KVEventsResync). The scheduler places requests by the keys and skips sending
    pages a decode worker holds (services/scheduler/kv_event_index.py)."""

    worker_id: str
    seq: int
    payload: bytes

    def _check(self) -> None:
        if self.seq < 0:
            raise ProtocolError("KVEventBatch.seq: must be >= 0")
        if len(self.payload) > MAX_KV_EVENT_BYTES:
            raise ProtocolError(f"KVEventBatch.payload: more than {MAX_KV_EVENT_BYTES} bytes")


@message
class KVEventsResync:
    """Scheduler -> LLM worker: a KVEventBatch was missing or unreadable (its seq skipped one):
    send a snapshot (seq 0); the scheduler ignores the batches before it."""

    worker_id: str


@message
class RequestDone:
    """Worker -> scheduler: the request left the worker."""

    worker_id: str
    request_id: str
    reason: DoneReason
    detail: str | None = None  # REJECTED: why, in words the client may read


@message
class WorkerStopped:
    """Worker -> scheduler: this process serves no more, from now. `error` says why its engine
    failed (its requests end with an error at once, not after the heartbeat timeout); None: it
    stops cleanly (drained). `instance` is the process's start id, so that a late message from
    an old process never drops its restarted successor."""

    worker_id: str
    instance: str
    error: str | None = None
