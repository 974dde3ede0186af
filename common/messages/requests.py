"""The request channel: gateway ⇄ tokenizer ⇄ scheduler, and the tokens workers send back.

gateway ──GenerateRequest──▶ tokenizer ──ScheduleRequest──▶ scheduler ──MigrateRequest──▶ tokenizer
gateway ◀──TextDeltaBatch─── tokenizer ◀──TokenDeltaBatch── worker (one per step)
anyone  ──AbortRequest──▶ ...          anyone ──RequestFailed──▶ gateway / tokenizer
"""

from __future__ import annotations

from dataclasses import field

from pagemesh.common.messages.base import FinishReason, ProtocolError, message, record
from pagemesh.common.sampling import SamplingParams


@record
class TokenLogprob:
    """The sampled token's log-probability and the top-k alternatives (k may be 0)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]

    def _check(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ProtocolError("TokenLogprob: top_ids and top_logprobs differ in length")


@message
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


@record
class TextDelta:
    """New text of one choice (`index`) of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the whole prompt, once
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., once
    cached_tokens: int = 0  # prompt tokens the worker took from its prefix cache


@message
class TextDeltaBatch:
    """Tokenizer -> gateway: every delta produced from one incoming TokenDeltaBatch."""

    deltas: list[TextDelta]


@message
class RequestFailed:
    """Any service -> gateway (or scheduler -> tokenizer): the request ended with an
    OpenAI-style error."""

    request_id: str
    status: int
    error_type: str
    message: str
    param: str | None
    code: str | None


@message
class AbortRequest:
    """Stop a request everywhere it lives (client gone, stop string hit, failure). `worker_id`
    names a worker known to hold it, for a request the scheduler may not know (placed by a
    scheduler process that was restarted since)."""

    request_id: str
    reason: str  # free text for logs
    worker_id: str | None = None


@record
class ResumeState:
    """A request sent again after the worker generating it was lost (request migration): the
    tokens its client has already received, which the next worker recomputes and never streams
    again (they count as output: max_tokens, min_tokens, penalties, the seed's draws), and how
    many times it has been moved (`migrations` >= 1)."""

    output_token_ids: list[int]
    migrations: int

    def _check(self) -> None:
        if self.migrations < 1:
            raise ProtocolError("ResumeState.migrations: must be >= 1")


@message
class ScheduleRequest:
    """Tokenizer -> scheduler: a tokenized request to place on workers (`resume`: sent again
    after its worker was lost)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    arrival_time: float
    resume: ResumeState | None = None


@message
class MigrateRequest:
    """Scheduler -> tokenizer: the worker(s) generating the request are gone (`lost_worker_ids`,
    whose late tokens for it are to be ignored); send it again with what it has generated
    (ScheduleRequest.resume), or end it with `reason` if it cannot move."""

    request_id: str
    reason: str  # why its worker is gone, in words a client may read
    lost_worker_ids: list[str]


@record
class TokenDelta:
    """New token ids of one choice (`index`) of a request after one engine step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    queue_time_s: float | None = None  # on a request's first delta: scheduler + engine queue time
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (SamplingParams.prompt_logprobs), once
    num_cached_tokens: int = 0  # prompt tokens this worker found in its prefix cache


@record
class RequestStarted:
    """A worker has taken the request (sent before any of its tokens): from here on a scheduler
    restart does not make its tokenizer send it again."""

    request_id: str
    num_prompt_tokens: int


@message
class TokenDeltaBatch:
    """Worker -> tokenizer: one per engine step per destination. `started` comes before
    `deltas` (a request may start and produce tokens in one step)."""

    worker_id: str
    deltas: list[TokenDelta]
    started: list[RequestStarted] = field(default_factory=list)
