"""How a generation's answer is written. Every text route runs as a chat (or text) completion in
the mesh; an `Answer` writes the route's body and stream from what `ResponseBuilder` makes:

    ResponseBuilder.response() ──chat completion──▶ Answer.response() ──▶ the route's JSON body
    ResponseBuilder.add(delta) ──chat chunks──────▶ AnswerStream.chunk() ──▶ the route's SSE bytes

`OpenAIAnswer` writes OpenAI's chat and completion shapes as they are; Anthropic's Messages
(`pagemesh.gateway.anthropic`) and OpenAI's Responses (`pagemesh.gateway.openai_responses`)
translate them. `read_chunk` and `tool_calls` read the chat shapes those translations start from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.parsing import ParsedRequest
from pagemesh.gateway.responses import SSE_DONE, ResponseBuilder, sse_event, to_json


class AnswerStream(Protocol):
    """One streamed answer. `start()` is called once the first reply is applied (the prompt's
    length is known), then `chunk()` for each chat chunk, then `end()` or, once, `error()`; each
    returns the bytes to send."""

    def start(self) -> bytes: ...

    def chunk(self, chunk: dict) -> bytes: ...

    def end(self) -> bytes: ...

    def error(self, error: ApiError) -> bytes: ...


class Answer(Protocol):
    """A route's way of writing one request's answer."""

    def response(self, builder: ResponseBuilder) -> dict: ...

    def stream(self, builder: ResponseBuilder) -> AnswerStream: ...


def openai_answer(body: dict, parsed: ParsedRequest) -> Answer:
    """Chat and text completions are answered in their own shapes."""
    return OpenAIAnswer()


class OpenAIAnswer:
    """Chat and text completions: the builder's own body and chunks, `data: [DONE]` at the end."""

    def response(self, builder: ResponseBuilder) -> dict:
        return builder.response()

    def stream(self, builder: ResponseBuilder) -> AnswerStream:
        return _OpenAIStream(builder)


@dataclass
class _OpenAIStream:
    builder: ResponseBuilder

    def start(self) -> bytes:
        return b"".join(sse_event(chunk) for chunk in self.builder.first_chunks())

    def chunk(self, chunk: dict) -> bytes:
        return sse_event(chunk)

    def end(self) -> bytes:
        return (sse_event(self.builder.usage_chunk()) if self.builder.include_usage else b"") + SSE_DONE

    def error(self, error: ApiError) -> bytes:
        return sse_event(error.body()) + SSE_DONE


def named_event(name: str, payload: dict) -> bytes:
    """A server-sent event with an `event:` line, as Anthropic's and the Responses API's streams have."""
    return b"event: " + name.encode() + b"\ndata: " + to_json(payload) + b"\n\n"


# ---- reading the chat shapes


@dataclass(frozen=True)
class ToolCall:
    """A chat tool call: `arguments` is the JSON text of its input."""

    id: str
    name: str
    arguments: str


def tool_calls(message: dict) -> list[ToolCall]:
    """The tool calls of a chat completion's message."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append(ToolCall(call.get("id") or "", function.get("name") or "", function.get("arguments") or ""))
    return calls


def arguments_object(arguments: str) -> dict:
    """A tool call's arguments as an object ({} when empty); anything else is the model's error,
    kept as the raw text under `"arguments"` rather than dropped."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class ReasoningPiece:
    """Text of the answer's reasoning part (the gateway's --reasoning-parser split it off)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among the answer's tool calls
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


@dataclass(frozen=True)
class Finish:
    reason: str


ChunkPart = ReasoningPiece | TextPiece | CallStart | CallArguments | Finish


def read_chunk(chunk: dict) -> Iterator[ChunkPart]:
    """A chat chunk of a one-choice request as what it says, in order: reasoning, text, a tool
    call's start (its first delta carries its id and name) and pieces of its arguments, the
    finish reason."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            yield ReasoningPiece(delta["reasoning_content"])
        if delta.get("content"):
            yield TextPiece(delta["content"])
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):
                yield CallStart(call.get("index", 0), call["id"], function.get("name") or "")
            if function.get("arguments"):
                yield CallArguments(call.get("index", 0), function["arguments"])
        if choice.get("finish_reason"):
            yield Finish(choice["finish_reason"])
