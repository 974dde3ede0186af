"""What the engine hands back: per-step outputs, finished results, prefilled requests."""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.common.messages import TokenLogprob


@dataclass
class SeqOutput:
    """What one choice of a request produced since the last step."""

    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[SeqOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None  # on the request's first output: seconds it waited for a step
    prompt_logprobs: list[TokenLogprob] | None = None  # once, with the first token, when asked for
    embedding: list[float] | None = None  # an embedding request's vector (then `outputs` is empty)


@dataclass
class CompletionResult:
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[list[int]]  # one list per choice
    texts: list[str]
    finish_reasons: list[str]
    logprobs: list[list[TokenLogprob]]
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (SamplingParams.prompt_logprobs)


@dataclass
class PrefillResult:
    """A prefill-only request whose first tokens are sampled; its pages wait to be sent."""

    request_id: str
    prompt_token_ids: list[int]
    block_table: list[int]  # the prompt's pages (shared by every choice)
    first_token_ids: list[int]  # one per choice, in choice order
