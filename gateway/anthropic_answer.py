"""A chat completion written as Anthropic's Message, whole or as its stream of events.

    stream:  message_start, ping,
             per content block: content_block_start, content_block_delta (thinking_delta |
             text_delta | input_json_delta)..., content_block_stop,
             message_delta (stop_reason, stop_sequence, usage), message_stop
             | error (after the status line, a failure is an `error` event)

The reasoning the gateway's --reasoning-parser splits off comes first, as a thinking block (with
an empty signature: nothing here signs it); then the text, one text block; each tool call is a
tool_use block after it. Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens
not read from the prefix cache, `cache_read_input_tokens` the ones that were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemesh.gateway.answers import (
    AnswerStream,
    CallArguments,
    CallStart,
    Finish,
    ReasoningPiece,
    TextPiece,
    arguments_object,
    named_event,
    read_chunk,
    tool_calls,
)
from pagemesh.gateway.anthropic import error_body
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.parsing import ParsedRequest
from pagemesh.gateway.responses import ResponseBuilder

# chat finish_reason -> Anthropic stop_reason ("stop" is end_turn or stop_sequence, by what matched).
# A choice the mesh aborted has none.
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


@dataclass(frozen=True)
class MessagesAnswer:
    """How a Messages request is answered; `stop` are its stop_sequences (the chat ran with the
    matched one kept at the end of the text, so it can be named here and cut off)."""

    stop: tuple[str, ...]

    def response(self, builder: ResponseBuilder) -> dict:
        chat = builder.response()
        choice = chat["choices"][0]
        message = choice["message"]
        text, stop_sequence = self.cut_stop(message.get("content") or "", choice["finish_reason"])
        content: list[dict] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        for call in tool_calls(message):
            input_ = arguments_object(call.arguments)
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": input_})
        return {
            **_message_head(builder),
            "content": content,
            "stop_reason": stop_reason(choice["finish_reason"], stop_sequence),
            "stop_sequence": stop_sequence,
            "usage": usage(builder),
        }

    def stream(self, builder: ResponseBuilder) -> AnswerStream:
        return _MessageStream(self, builder)

    def cut_stop(self, text: str, finish_reason: str | None) -> tuple[str, str | None]:
        """The text without the stop sequence it ends with, and that sequence (None if none
        matched). A matched one ends the text (the longest that does is the one that matched)."""
        if finish_reason != "stop":
            return text, None
        ending = max((s for s in self.stop if text.endswith(s)), key=len, default=None)
        return (text[: len(text) - len(ending)], ending) if ending is not None else (text, None)


def messages_answer(body: dict, parsed: ParsedRequest) -> MessagesAnswer:
    """The answer of a Messages request (`body`, checked by parse_messages)."""
    return MessagesAnswer(parsed.sampling.stop)


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str | None:
    if finish_reason == "stop":
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return _STOP_REASONS.get(finish_reason or "")


def usage(builder: ResponseBuilder) -> dict:
    totals = builder.usage()
    cached = totals["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": totals["prompt_tokens"] - cached,
        "output_tokens": totals["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def message_id(builder: ResponseBuilder) -> str:
    """`msg_<hex>`, the hex of the request's id in the mesh (chatcmpl-<hex>)."""
    return "msg_" + builder.id.rpartition("-")[2]


def _message_head(builder: ResponseBuilder) -> dict:
    return {"id": message_id(builder), "type": "message", "role": "assistant", "model": builder.model}


@dataclass
class _MessageStream:
    answer: MessagesAnswer
    builder: ResponseBuilder
    block: int = -1  # index of the open content block (-1: none open)
    block_kind: str | None = None  # "thinking" | "text" | "tool_use"
    calls: dict[int, int] = field(default_factory=dict)  # the chat's tool call index -> its block
    held: str = ""  # the text's last characters, held back while they may be the stop sequence
    finish_reason: str | None = None
    stop_sequence: str | None = None

    def start(self) -> bytes:
        head = {**_message_head(self.builder), "content": [], "stop_reason": None, "stop_sequence": None}
        start = {"type": "message_start", "message": {**head, "usage": {**usage(self.builder), "output_tokens": 0}}}
        return _event(start) + _event({"type": "ping"})

    def chunk(self, chunk: dict) -> bytes:
        out = b""
        for part in read_chunk(chunk):
            if isinstance(part, ReasoningPiece):
                if self.block_kind != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
                out += self._delta(self.block, {"type": "thinking_delta", "thinking": part.text})
            elif isinstance(part, TextPiece):
                self.held += part.text
                keep = max(map(len, self.answer.stop), default=0)  # the end of the text may be the stop
                out += self._text(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
            elif isinstance(part, CallStart):
                out += self._text(self.held)
                self.held = ""
                out += self._open({"type": "tool_use", "id": part.id, "name": part.name, "input": {}}, "tool_use")
                self.calls[part.index] = self.block
            elif isinstance(part, CallArguments) and part.index in self.calls:
                out += self._delta(self.calls[part.index], {"type": "input_json_delta", "partial_json": part.text})
            elif isinstance(part, Finish):
                self.finish_reason = part.reason
        return out

    def end(self) -> bytes:
        text, self.stop_sequence = self.answer.cut_stop(self.held, self.finish_reason)
        out = self._text(text) + self._close()
        reason = stop_reason(self.finish_reason, self.stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": self.stop_sequence}
        out += _event({"type": "message_delta", "delta": delta, "usage": usage(self.builder)})
        return out + _event({"type": "message_stop"})

    def error(self, error: ApiError) -> bytes:
        return _event(error_body(error))

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if self.block_kind == "text" else self._open({"type": "text", "text": ""}, "text")
        return out + self._delta(self.block, {"type": "text_delta", "text": text})

    def _open(self, block: dict, kind: str) -> bytes:
        out = self._close()
        self.block += 1
        self.block_kind = kind
        return out + _event({"type": "content_block_start", "index": self.block, "content_block": block})

    def _close(self) -> bytes:
        if self.block_kind is None:
            return b""
        self.block_kind = None
        return _event({"type": "content_block_stop", "index": self.block})

    def _delta(self, index: int, delta: dict) -> bytes:
        return _event({"type": "content_block_delta", "index": index, "delta": delta})


def _event(payload: dict) -> bytes:
    return named_event(payload["type"], payload)
