"""The request channel: gateway ⇄ tokenizer ⇄ scheduler, and the tokens workers send back.

gateway ──GenerateRequest──▶ tokenizer ──ScheduleRequest──▶ scheduler ──MigrateRequest──▶ tokenizer
gateway ◀──TextDeltaBatch─── tokenizer ◀──TokenDeltaBatch── worker (one per step)
anyone  ──AbortRequest──▶ ...          anyone ──RequestFailed──▶ gateway / tokenizer

An embedding request takes the same path with a `pooling`: gateway ──EmbedRequest──▶ tokenizer
──ScheduleRequest(pooling)──▶ scheduler ──GenerateTask(pooling)──▶ a prefilling worker, whose
EmbeddingBatch the tokenizer relays to the gateway as it is (no text to make).
"""

from __future__ import annotations

from dataclasses import field

from pagemesh.common.messages.base import FinishReason, Pooling, ProtocolError, check_json_text, message, record
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


@record
class ImageInput:
    """An image in a prompt, as the tokenizer placed it: its file as the client sent it (PNG,
    JPEG, ...; the worker decodes and preprocesses it in its encoder step), the content hash
    that keys the encoder cache and the prefix cache (`digest`, sha256 hex), and the run of
    `length` placeholder tokens from `offset` its embeddings replace. `grid`: the encoder's
    (t, h, w) patch grid where the token count depends on the size (Qwen2-VL), else []."""

    digest: str
    offset: int
    length: int
    data: bytes
    grid: list[int]

    def _check(self) -> None:
        if len(self.digest) != 64:
            raise ProtocolError("ImageInput.digest: a sha256 hex digest (64 characters)")
        if self.length < 1:
            raise ProtocolError("ImageInput.length: must be >= 1")
        if len(self.grid) not in (0, 3):
            raise ProtocolError("ImageInput.grid: [] or (t, h, w)")


def check_images(images: list[ImageInput], num_prompt_tokens: int, where: str) -> None:
    """Images in prompt order, each inside the prompt, none overlapping."""
    end = 0
    for image in images:
        if image.offset < end or image.offset + image.length > num_prompt_tokens:
            raise ProtocolError(f"{where}.images: placeholders out of order or outside the prompt")
        end = image.offset + image.length


@record
class ResumedText:
    """One choice of a request a gateway moves to another tokenizer (its tokenizer was lost
    mid-stream): the token ids its client has received of it, the length of the text made of
    them that the client has received (`text_chars`, characters), and whether it ended."""

    index: int
    output_token_ids: list[int]
    text_chars: int
    finished: bool

    def _check(self) -> None:
        if self.index < 0 or self.text_chars < 0:
            raise ProtocolError("ResumedText: index and text_chars must be >= 0")


@message
class GenerateRequest:
    """Gateway -> tokenizer. Exactly one of prompt_text / prompt_token_ids / messages is set.

    A chat's tool-calling parts travel as JSON text, since a JSON Schema has no shape the codec
    could check: `tools` (the function tools the chat template sees), an assistant message's
    "tool_calls" entry (its calls, arguments as objects), `chat_template_kwargs` (an object of
    extra template variables). `skip_special_tokens=False` keeps special tokens in the text."""

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
    tools: str | None = None
    chat_template_kwargs: str | None = None
    skip_special_tokens: bool = True
    images: list[bytes] = field(default_factory=list)  # image parts' files, in order: each message's
    # content has IMAGE_MARK where its image was (gateway/media.py)
    # moved from a lost tokenizer: what each choice's client has had (none: a new request); the
    # tokenizer continues each choice's text from there (services/tokenizer/resume.py)
    resume: list[ResumedText] = field(default_factory=list)

    def _check(self) -> None:
        if self.images and self.messages is None:
            raise ProtocolError("GenerateRequest: images go with messages only")
        given = [x is not None for x in (self.prompt_text, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ProtocolError("GenerateRequest: exactly one of prompt_text, prompt_token_ids, messages must be set")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise ProtocolError("GenerateRequest: tools and chat_template_kwargs go with messages only")
        check_json_text(self.tools, list, "GenerateRequest.tools")
        check_json_text(self.chat_template_kwargs, dict, "GenerateRequest.chat_template_kwargs")
        for i, m in enumerate(self.messages or ()):
            check_json_text(m.get("tool_calls"), list, f"GenerateRequest.messages[{i}].tool_calls")
        indices = [c.index for c in self.resume]
        if indices != sorted(set(indices)) or any(i >= self.sampling.n for i in indices):
            raise ProtocolError("GenerateRequest.resume: distinct choice indices below n, in order")


@message
class EmbedRequest:
    """Gateway -> tokenizer: one input of an embeddings request (exactly one of prompt_text /
    prompt_token_ids is set). Its answer is an Embedding in an EmbeddingBatch, or a RequestFailed."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    add_special_tokens: bool
    pooling: Pooling
    priority: int
    reply_to: str
    arrival_time: float

    def _check(self) -> None:
        if (self.prompt_text is None) == (self.prompt_token_ids is None):
            raise ProtocolError("EmbedRequest: exactly one of prompt_text, prompt_token_ids must be set")


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
    # the id it goes on under (a stream whose tokenizer replica was lost, sent again through
    # another): the pages a prefill worker kept of it are kept for that id (an exact resume)
    moved_to: str = ""


@record
class ResumedChoice:
    """One unfinished choice of a migrated request of several choices (n > 1): its index and the
    tokens its client has received of it."""

    index: int
    output_token_ids: list[int]

    def _check(self) -> None:
        if self.index < 0:
            raise ProtocolError("ResumedChoice.index: must be >= 0")


def check_resumed_choices(choices: list[ResumedChoice], name: str) -> None:
    """Distinct choice indices, in order (each choice resumes once)."""
    indices = [c.index for c in choices]
    if indices != sorted(set(indices)):
        raise ProtocolError(f"{name}: choice indices must be distinct and in order")


@record
class ResumeState:
    """A request sent again after the worker generating it was lost (request migration): the
    tokens its client has already received, which the next worker recomputes and never streams
    again (they count as output: max_tokens, min_tokens, penalties, the seed's draws), and how
    many times it has been moved (`migrations` >= 1). A request of one choice carries its tokens
    in `output_token_ids`; one of several (n > 1) carries each unfinished choice's in `choices`
    (the finished ones are done: they are not generated again)."""

    output_token_ids: list[int]
    migrations: int
    choices: list[ResumedChoice] = field(default_factory=list)

    def _check(self) -> None:
        if self.migrations < 1:
            raise ProtocolError("ResumeState.migrations: must be >= 1")
        if self.choices and self.output_token_ids:
            raise ProtocolError("ResumeState: output_token_ids (one choice) or choices (several), not both")
        check_resumed_choices(self.choices, "ResumeState.choices")


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
    pooling: Pooling | None = None  # an embedding request (then `sampling` counts for its priority only)
    images: list[ImageInput] = field(default_factory=list)  # a multimodal prompt's images, in order

    def _check(self) -> None:
        check_images(self.images, len(self.prompt_token_ids), "ScheduleRequest")


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


@record
class Embedding:
    """The pooled vector of one embedding request: float32 values, L2-normalised."""

    request_id: str
    values: list[float]
    prompt_tokens: int


@message
class EmbeddingBatch:
    """Worker -> tokenizer: the embedding requests one engine step finished (one per step per
    destination); the tokenizer relays each gateway's to it in one message of the same type."""

    worker_id: str
    embeddings: list[Embedding]
