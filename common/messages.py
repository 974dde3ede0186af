"""Every message that crosses a process boundary: small frozen dataclasses, grouped by channel.

The codec that puts them on the wire and validates them on the way in is `common.protocol`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from common.sampling import SamplingParams

MAX_ID = (1 << 31) - 1  # list[int] fields hold ids and sizes: 0 <= x <= MAX_ID
MAX_PAGE_HASH = (1 << 62) - 1  # prefix-cache page keys (common.page_hash.chain_hash)
MAX_PAGE_HASHES = 4096  # keys per PrefixCacheUpdate list; a worker sends several when it has more
WORKER_ROLES = ("prefill", "decode", "mixed")
KV_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


class ProtocolError(ValueError):
    """A frame list that is not a valid message of this protocol version."""


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the top-k alternatives (k may be 0)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]

    def _check(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ProtocolError("TokenLogprob: top_ids and top_logprobs differ in length")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Gateway -> tokenizer. Exactly one of prompt_text / prompt_token_ids / messages is set."""

    request_id: str
    model: str
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, str]] | None
    sampling: SamplingParams
    stream: bool
    reply_to: str
    arrival_time: float
    include_stop_str_in_output: bool

    def _check(self) -> None:
        given = [x is not None for x in (self.prompt_text, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ProtocolError("GenerateRequest: exactly one of prompt_text, prompt_token_ids, messages must be set")


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Tokenizer -> gateway: new text of one choice (`index`) of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the whole prompt, once
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., once


@dataclass(frozen=True, slots=True)
class TextDeltaBatch:
    """Tokenizer -> gateway: every delta produced from one incoming TokenDeltaBatch."""

    deltas: list[TextDelta]


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """Any service -> gateway: the request ended with an OpenAI-style error."""

    request_id: str
    status: int
    error_type: str
    message: str
    param: str | None
    code: str | None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request everywhere it lives (client gone, stop string hit, failure). `worker_id`
    names a worker known to hold it, for a request the scheduler may not know (placed by a
    scheduler process that was restarted since)."""

    request_id: str
    reason: str
    worker_id: str | None = None


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """Tokenizer -> scheduler: a tokenized request to place on workers."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    arrival_time: float


@dataclass(frozen=True, slots=True)
class PrefillTask:
    """Scheduler -> prefill worker: run the prompt, send the first token to `reply_to` and the
    KV pages to the decode worker at `decode_kv_endpoint`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    decode_worker_id: str
    decode_kv_endpoint: str
    queued_s: float = 0.0  # time the request waited in the scheduler
    skip_pages: int = 0  # leading prompt pages the decode worker already holds: not sent

    def _check(self) -> None:
        if self.skip_pages < 0:
            raise ProtocolError("PrefillTask.skip_pages: must be >= 0")


@dataclass(frozen=True, slots=True)
class DecodeTask:
    """Scheduler -> decode worker: allocate pages, await KV from `prefill_worker_id`, decode.
    The first `skip_pages` prompt pages will not come: the worker takes them from its own
    prefix cache (and refuses the transfer if it no longer holds them)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    prefill_worker_id: str
    skip_pages: int = 0

    def _check(self) -> None:
        if self.skip_pages < 0:
            raise ProtocolError("DecodeTask.skip_pages: must be >= 0")


@dataclass(frozen=True, slots=True)
class GenerateTask:
    """Scheduler -> mixed worker: prefill and decode in the same engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    queued_s: float = 0.0


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request a worker holds, as it reports when it registers again with a restarted scheduler."""

    request_id: str
    reply_to: str  # its tokenizer's token address


@dataclass(frozen=True, slots=True)
class RegisterWorker:
    """Worker -> scheduler, first message on its DEALER; answered by Registered."""

    worker_id: str
    role: str
    model: str
    page_size: int
    num_pages: int
    kv_endpoint: str
    max_running: int
    instance: str = ""  # random per process start: a new one under a known worker id is a restart
    held: list[HeldRequest] | None = None  # registering again: the requests it is working on

    def _check(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ProtocolError(f"RegisterWorker.role: must be one of {WORKER_ROLES}")


@dataclass(frozen=True, slots=True)
class Registered:
    """Scheduler -> worker: registration accepted."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class UnknownWorker:
    """Scheduler -> worker: answers a heartbeat from a worker it does not know (the scheduler was
    restarted, or dropped the worker after missed heartbeats): register again."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Worker -> scheduler, periodic load report."""

    worker_id: str
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    used_pages: int
    time: float
    kv_bytes_sent: int
    kv_bytes_received: int
    requests_finished: int = 0  # requests that left this worker, ever


@dataclass(frozen=True, slots=True)
class PrefixCacheUpdate:
    """Worker -> scheduler: prefix-cache page keys published (`added`) and evicted (`removed`)
    since the previous update. Applied in order, the updates give the keys the worker holds;
    the scheduler places requests by them and skips sending pages a decode worker holds."""

    worker_id: str
    added: tuple[int, ...]
    removed: tuple[int, ...]

    def _check(self) -> None:
        for name in ("added", "removed"):
            keys = getattr(self, name)
            if len(keys) > MAX_PAGE_HASHES:
                raise ProtocolError(f"PrefixCacheUpdate.{name}: more than {MAX_PAGE_HASHES} keys")
            if keys and not (0 <= min(keys) and max(keys) <= MAX_PAGE_HASH):
                raise ProtocolError(f"PrefixCacheUpdate.{name}: keys must be in [0, {MAX_PAGE_HASH}]")


@dataclass(frozen=True, slots=True)
class RequestDone:
    """Worker -> scheduler: the request left the worker (finished, aborted, failed)."""

    worker_id: str
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New token ids of one choice (`index`) of a request after one engine step. A delta with no
    tokens, no logprobs and no finish_reason says that a worker has taken the request."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_prompt_tokens: int
    queue_time_s: float | None = None  # on a request's first delta: scheduler + engine queue time
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (SamplingParams.prompt_logprobs), once


@dataclass(frozen=True, slots=True)
class TokenDeltaBatch:
    """Worker -> tokenizer: one per engine step per destination."""

    worker_id: str
    deltas: list[TokenDelta]


@dataclass(frozen=True, slots=True)
class KVPagesHeader:
    """Prefill -> decode: KV pages of one request, followed by one tensor frame per layer.

    Frame i (0 <= i < layer_end - layer_start) holds layer `layer_start + i` as a C-contiguous
    tensor of shape [num_pages, *page_shape] in `dtype`; its page j is the request's logical page
    `page_indices[j]` (pages the decode worker already holds are skipped). `checksum` is the
    CRC-32 of all tensor frames' bytes in order (see `encode_tensor_frames`). `seq_index` numbers
    the transfers of one request from 0; `last` marks the final one. `first_token_ids` are the
    tokens the prefill worker sampled (one per choice).
    """

    TENSOR_FRAMES: typing.ClassVar[bool] = True

    request_id: str
    seq_index: int
    num_tokens: int
    layer_start: int
    layer_end: int
    num_pages: int
    dtype: str
    page_shape: list[int]
    checksum: int
    first_token_ids: list[int]
    last: bool
    page_indices: list[int]

    @property
    def num_frames(self) -> int:
        return self.layer_end - self.layer_start

    def _check(self) -> None:
        if not 0 <= self.layer_start <= self.layer_end <= MAX_ID:
            raise ProtocolError("KVPagesHeader: need 0 <= layer_start <= layer_end")
        if not 0 <= self.num_pages == len(self.page_indices):
            raise ProtocolError("KVPagesHeader: num_pages must equal len(page_indices)")
        if self.dtype not in KV_DTYPES:
            raise ProtocolError(f"KVPagesHeader.dtype: must be one of {KV_DTYPES}")
        if not 1 <= len(self.page_shape) <= 8 or 0 in self.page_shape:
            raise ProtocolError("KVPagesHeader.page_shape: 1 to 8 positive dimensions")
        if not 0 <= self.checksum <= 0xFFFFFFFF:
            raise ProtocolError("KVPagesHeader.checksum: must be a 32-bit unsigned integer")


@dataclass(frozen=True, slots=True)
class KVPagesAck:
    """Decode -> prefill: the pages of `request_id` were written (ok) or refused (error)."""

    request_id: str
    ok: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class Ready:
    """Any process -> launcher: started and serving."""

    service: str
    name: str


@dataclass(frozen=True, slots=True)
class Ping:
    """Gateway -> tokenizer and tokenizer -> scheduler, every PING_INTERVAL_S: which process is there?
    A tokenizer gives its token address: where the requests whose RequestFailed it must get reply."""

    sender: str
    address: str | None = None


@dataclass(frozen=True, slots=True)
class Pong:
    """The answer to Ping. `instance` is random per process start: a new one means the process
    was restarted and has forgotten the requests the old one held."""

    service: str
    instance: str


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """Gateway -> scheduler: asks for the mesh's state (readiness, per-worker load)."""

    requester: str


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker's last report, as the scheduler knows it."""

    worker_id: str
    role: str
    alive: bool
    running: int
    waiting: int
    used_pages: int
    total_pages: int
    kv_bytes_sent: int
    kv_bytes_received: int
    requests_finished: int = 0


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """Scheduler -> gateway: reply to StatusRequest. `ready` when every needed role has a live
    worker (prefill + decode, or mixed)."""

    ready: bool
    workers: list[WorkerStatus]
    queued: int


MESSAGE_CLASSES: tuple[type, ...] = (
    GenerateRequest, TextDelta, TextDeltaBatch, RequestFailed, AbortRequest, ScheduleRequest,
    PrefillTask, DecodeTask, GenerateTask, HeldRequest, RegisterWorker, Registered, UnknownWorker, Heartbeat, PrefixCacheUpdate,
    RequestDone, TokenDelta, TokenDeltaBatch, KVPagesHeader, KVPagesAck, Ready, Ping, Pong, StatusRequest,
    WorkerStatus, ClusterStatus,
)
Message = typing.Union[MESSAGE_CLASSES]  # noqa: UP007 - built from the tuple above
MESSAGE_TYPES: dict[bytes, type] = {cls.__name__.encode("ascii"): cls for cls in MESSAGE_CLASSES}
TAGS: dict[type, bytes] = {cls: tag for tag, cls in MESSAGE_TYPES.items()}


