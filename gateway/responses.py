"""OpenAI response bodies, stream chunks and SSE framing, built from the tokenizer's TextDeltas.

`ResponseBuilder` follows one request: `add(delta)` records a choice's new text, token count
and logprobs, and returns the stream chunk for it (None when there is nothing to send);
`response()` is the non-streaming body once every choice has finished.

Logprob token texts come from the gateway's own Tokenizer (`token_text(id)`): the wire carries
ids only. A logprob of -inf (or NaN) is sent as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pagemesh.common.messages import TextDelta, TokenLogprob
from pagemesh.gateway.chat_output import ChatOutput, ChatOutputSpec

LOGPROB_FLOOR = -9999.0
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + to_json(payload) + b"\n\n"


def to_json(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # chat: content entries; completions: (token, lp, top) triples
    text_offset: int = 0  # completions: characters of token text so far
    echoed: bool = False  # echo: the prompt went out in front of the choice's first text
    output: ChatOutput | None = None  # chat: reasoning and tool calls read from the text


class ResponseBuilder:
    """Builds one request's response (kind "completion" or "chat") from its deltas."""

    def __init__(
        self,
        *,
        kind: str,
        request_id: str,
        model: str,
        created: int,
        n: int,
        logprobs: int | None,
        include_usage: bool,
        token_text: Callable[[int], str],
        choices_per_prompt: int | None = None,
        echo: list[str] | None = None,
        chat_output: ChatOutputSpec | None = None,
    ):
        self.kind, self.model, self.created = kind, model, created
        # Request ids are "cmpl-<hex>"; chat responses are named "chatcmpl-<hex>".
        self.id = request_id if kind == "completion" else "chat" + request_id
        self.logprobs_on = logprobs is not None
        self.include_usage = include_usage
        self.token_text = token_text
        # chat_output: how each choice's text splits into reasoning, content and tool calls
        self.choices = [_Choice(output=chat_output.new() if chat_output else None) for _ in range(n)]
        # a batch of prompts: choices i*k .. i*k+k-1 answer prompt i (k = n per prompt)
        self.choices_per_prompt = choices_per_prompt or n
        self._prompt_tokens: dict[int, int] = {}  # prompt index -> its length
        # prompt index -> its tokens found in a prefix cache, as the first worker that ran it said
        self._cached_tokens: dict[int, int] = {}
        self.echo = echo  # completions with echo: each prompt's text, put in front of its choices'
        self._prompt_logprobs: dict[int, tuple[list[int], list[TokenLogprob]]] = {}  # prompt index -> ids, logprobs

    @property
    def prompt_tokens(self) -> int:
        return sum(self._prompt_tokens.values())

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def choices_finished(self, first: int, count: int) -> bool:
        return all(c.finish_reason is not None for c in self.choices[first : first + count])

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, sum(self._cached_tokens.values()))

    # ---- streaming

    def add(self, delta: TextDelta) -> dict | None:
        """Record a delta; return its stream chunk, or None if it carries nothing to show."""
        if not 0 <= delta.index < len(self.choices):
            return None
        choice = self.choices[delta.index]
        if choice.finish_reason is not None:
            return None
        prompt = delta.index // self.choices_per_prompt
        self._prompt_tokens[prompt] = delta.prompt_tokens
        if delta.token_ids:  # a disaggregated decode worker reports its own (later) cache hits
            self._cached_tokens.setdefault(prompt, delta.cached_tokens)
        if delta.prompt_logprobs is not None and delta.prompt_token_ids is not None:
            self._prompt_logprobs[prompt] = (delta.prompt_token_ids, delta.prompt_logprobs)
        choice.completion_tokens = delta.completion_tokens
        choice.finish_reason = delta.finish_reason
        text, entries = delta.text, []
        if self.echo is not None and not choice.echoed:
            choice.echoed = True
            text = self.echo[prompt] + text
            if self.logprobs_on:
                entries = self._prompt_entries(choice, prompt)
        choice.text.append(text)
        logprobs = None
        if self.logprobs_on:
            entries += self._logprob_entries(choice, delta.logprobs or [])
            choice.logprobs.extend(entries)
            logprobs = self._logprobs_body(entries) if entries else None
        message = {"content": text} if text else {}
        finish_reason = delta.finish_reason
        if choice.output is not None:
            message = choice.output.delta(text, finish_reason is not None)
            finish_reason = choice.output.finish_reason(finish_reason)
        if not message and logprobs is None and finish_reason is None:
            return None
        if self.kind == "completion":
            body = {"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            body = {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk([body])

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role; completions have no opener."""
        if self.kind == "completion":
            return []
        return [
            self._chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(len(self.choices))
        ]

    def usage_chunk(self) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the request's usage."""
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {
            "id": self.id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    # ---- whole response

    def response(self) -> dict:
        choices = []
        for index, c in enumerate(self.choices):
            logprobs = self._logprobs_body(c.logprobs) if self.logprobs_on else None
            text = "".join(c.text)
            if self.kind == "completion":
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                message = {"role": "assistant", "content": text, "refusal": None}
                finish_reason = c.finish_reason
                if c.output is not None:
                    message, finish_reason = c.output.message(), c.output.finish_reason(finish_reason)
                choices.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
                )
        return {
            "id": self.id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # ---- logprobs

    def _logprob_entries(self, choice: _Choice, logprobs: list[TokenLogprob]) -> list:
        if self.kind == "chat":
            return [
                {
                    **self._token_entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._token_entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)],
                }
                for lp in logprobs
            ]
        entries = []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            # As OpenAI's legacy API: the k most likely tokens, plus the sampled one (up to k + 1).
            top = {self.token_text(i): _finite(v) for i, v in zip(lp.top_ids, lp.top_logprobs)}
            top.setdefault(text, _finite(lp.logprob))
            entries.append((text, _finite(lp.logprob), top, choice.text_offset))
            choice.text_offset += len(text)
        return entries

    def _prompt_entries(self, choice: _Choice, prompt: int) -> list:
        """Completions with echo and logprobs: the prompt's tokens, the first without a logprob
        (nothing predicts it), as OpenAI's legacy API."""
        ids, logprobs = self._prompt_logprobs.get(prompt, ([], []))
        if not ids:
            return []
        text = self.token_text(ids[0])
        entries = [(text, None, None, choice.text_offset)]
        choice.text_offset += len(text)
        return entries + self._logprob_entries(choice, logprobs)

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def _logprobs_body(self, entries: list) -> dict:
        if self.kind == "chat":
            return {"content": entries}
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": [e[3] for e in entries],
        }


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)
