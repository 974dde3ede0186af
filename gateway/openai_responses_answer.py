"""A chat completion written as OpenAI's Response object, whole or as its stream of events.

    stream:  response.created, response.in_progress,
             the reasoning (with the gateway's --reasoning-parser), as the message but its
                 deltas response.reasoning_text.delta..., response.reasoning_text.done
             the message (when there is text): response.output_item.added,
                 response.content_part.added, response.output_text.delta...,
                 response.output_text.done, response.content_part.done, response.output_item.done
             each function call: response.output_item.added,
                 response.function_call_arguments.delta..., response.function_call_arguments.done,
                 response.output_item.done
             response.completed | response.incomplete (max_output_tokens reached)
             | error, response.failed (after the status line, a failure ends the stream so)

Every event has a `sequence_number` from 0. Item ids come from the request's id in the mesh
(`msg_<hex>`, `fc_<hex>_<k>`), so the streamed items and the final response's agree.
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
    named_event,
    read_chunk,
    tool_calls,
)
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.parsing import ParsedRequest
from pagemesh.gateway.responses import ResponseBuilder

# chat finish reasons of an answer cut short: at max_output_tokens, or aborted by the mesh (no reason given)
_INCOMPLETE = ("length", "abort")


@dataclass(frozen=True)
class ResponsesAnswer:
    """How a Responses request is answered; `echo` holds the request's settings the Response
    object repeats (instructions, max_output_tokens, metadata, temperature, top_p, tools, ...)."""

    echo: dict

    def response(self, builder: ResponseBuilder) -> dict:
        chat = builder.response()
        choice = chat["choices"][0]
        hex_id = _hex(builder)
        output = []
        status = "incomplete" if choice["finish_reason"] in _INCOMPLETE else "completed"
        reasoning = choice["message"].get("reasoning_content")
        if reasoning:
            output.append(_text_item("reasoning", hex_id, reasoning, status))
        text = choice["message"].get("content") or ""
        if text:
            output.append(_text_item("message", hex_id, text, status))
        for k, call in enumerate(tool_calls(choice["message"])):
            output.append(_call_item(hex_id, k, call.id, call.name, call.arguments, "completed"))
        return self.body(builder, output, choice["finish_reason"])

    def stream(self, builder: ResponseBuilder) -> AnswerStream:
        return _ResponseStream(self, builder)

    def body(self, builder: ResponseBuilder, output: list[dict] | None, finish_reason: str | None) -> dict:
        """The Response object: in progress (output None), or finished with `finish_reason`."""
        status = "in_progress" if output is None else "incomplete" if finish_reason in _INCOMPLETE else "completed"
        totals = builder.usage()
        return {
            "id": "resp_" + _hex(builder),
            "object": "response",
            "created_at": builder.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "model": builder.model,
            "output": output or [],
            **self.echo,
            "store": False,
            "previous_response_id": None,
            "reasoning": None,
            "truncation": "disabled",
            "usage": None
            if output is None
            else {
                "input_tokens": totals["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": totals["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": totals["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": totals["total_tokens"],
            },
        }


def responses_answer(body: dict, parsed: ParsedRequest) -> ResponsesAnswer:
    """The answer of a Responses request (`body`, checked by parse_responses)."""
    return ResponsesAnswer(echo_fields(body, parsed.sampling.temperature, parsed.sampling.top_p))


def echo_fields(body: dict, temperature: float, top_p: float) -> dict:
    """What a Response repeats of its request, with the defaults that applied."""
    tools = [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        for t in body.get("tools") or ()
    ]
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": temperature,
        "top_p": top_p,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools,
        "user": body.get("user"),
    }


def _hex(builder: ResponseBuilder) -> str:
    return builder.id.rpartition("-")[2]


def _text_item(kind: str, hex_id: str, text: str, status: str) -> dict:
    """The answer's message (`output_text`), or its reasoning (`reasoning_text`), as an output item."""
    if kind == "reasoning":
        part = {"type": "reasoning_text", "text": text}
        return {"id": "rs_" + hex_id, "type": "reasoning", "summary": [], "content": [part], "status": status}
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": "msg_" + hex_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(hex_id: str, k: int, call_id: str, name: str, arguments: str, status: str) -> dict:
    item_id = f"fc_{hex_id}_{k}"
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


@dataclass
class _ResponseStream:
    answer: ResponsesAnswer
    builder: ResponseBuilder
    sequence: int = 0
    output: list[dict] = field(default_factory=list)  # the items so far (the open one last)
    open_kind: str | None = None  # "reasoning" | "message" | "function_call": the last item is still open
    calls: dict[int, int] = field(default_factory=dict)  # the chat's tool call index -> output index
    finish_reason: str | None = None

    def start(self) -> bytes:
        created = self.answer.body(self.builder, None, None)
        return self._event("response.created", response=created) + self._event("response.in_progress", response=created)

    def chunk(self, chunk: dict) -> bytes:
        out = b""
        for part in read_chunk(chunk):
            if isinstance(part, ReasoningPiece | TextPiece):
                kind = "reasoning" if isinstance(part, ReasoningPiece) else "message"
                if self.open_kind != kind:
                    out += self._close()
                    out += self._add(_text_item(kind, _hex(self.builder), "", "in_progress"), kind)
                    out += self._event("response.content_part.added", **self._where(), part=self._part())
                self._part()["text"] += part.text
                extra = {"logprobs": []} if kind == "message" else {}
                out += self._event(_TEXT_EVENTS[kind] + ".delta", **self._where(), delta=part.text, **extra)
            elif isinstance(part, CallStart):
                out += self._close()
                self.calls[part.index] = len(self.output)
                k = len(self.calls) - 1
                out += self._add(
                    _call_item(_hex(self.builder), k, part.id, part.name, "", "in_progress"), "function_call"
                )
            elif isinstance(part, CallArguments) and part.index in self.calls:
                index = self.calls[part.index]
                self.output[index]["arguments"] += part.text
                item_id = self.output[index]["id"]
                out += self._event(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=part.text
                )
            elif isinstance(part, Finish):
                self.finish_reason = part.reason
        return out

    def end(self) -> bytes:
        out = self._close()
        response = self.answer.body(self.builder, self.output, self.finish_reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)

    def error(self, error: ApiError) -> bytes:
        out = self._event("error", code=error.code or error.type, message=error.message, param=error.param)
        failed = {
            **self.answer.body(self.builder, self.output, None),
            "status": "failed",
            "error": {"code": error.code or error.type, "message": error.message},
        }
        return out + self._event("response.failed", response=failed)

    def _add(self, item: dict, kind: str) -> bytes:
        self.output.append(item)
        self.open_kind = kind
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _close(self) -> bytes:
        """Finish the open item: its done events, with its final state."""
        if self.open_kind is None:
            return b""
        item, kind = self.output[-1], self.open_kind
        self.open_kind = None
        status = "incomplete" if self.finish_reason in _INCOMPLETE and kind != "function_call" else "completed"
        item["status"] = status
        out = b""
        if kind != "function_call":
            part = item["content"][0]
            extra = {"logprobs": []} if kind == "message" else {}
            out += self._event(_TEXT_EVENTS[kind] + ".done", **self._where(), text=part["text"], **extra)
            out += self._event("response.content_part.done", **self._where(), part=part)
        else:
            index = len(self.output) - 1
            done = {"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]}
            out += self._event("response.function_call_arguments.done", **done)
        return out + self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)

    def _part(self) -> dict:
        """The open item's text part."""
        return self.output[-1]["content"][0]

    def _where(self) -> dict:
        """Where the open item's text part is."""
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return named_event(kind, payload)
