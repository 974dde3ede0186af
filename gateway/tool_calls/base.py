"""What every tool-call parser shares: the deltas it returns, the calls it has found, and the rules
for the text around them.

A parser reads one choice's text as it streams (`feed`, then `finish` once). Each call returns a
`ToolDelta`: content to show and tool-call fragments. Fed the whole text at once or a character
at a time, a parser returns the same content and the same calls; the non-streamed answer is the
streamed one put together, so the two never differ.

    content ... <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> ...
    ─content──▶ held back while it may be a tag; a call is announced (index, id, name) once its
                name is read, its arguments go out as their characters come

Text around calls: `content` is the text outside the calls, and None when that is empty; the
whitespace that only separates a call from the text is dropped ("Checking. <call> Done." gives
"Checking. Done.", "Checking.\n<call>" gives "Checking.").
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field

from pagemesh.gateway.tool_calls.call_object import CallObject

_WHITESPACE = " \t\r\n"
_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates refuse a tool_call_id that is not 9 letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class CallDelta:
    """A fragment of call `index`: its first carries the id and name, the rest argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Base of the parsers: `feed(text)` and `finish()` return ToolDeltas; `calls` and `content`
    hold what was found. Subclasses implement `_parse(final)`, which consumes `self.pending`
    as far as it can decide, calling `_emit_text`, `_open_call`, `_read_call`."""

    def __init__(self, parallel: bool = True, make_id=openai_call_id):
        self.parallel = parallel  # False: only the first call is kept (later ones are read and dropped)
        self.make_id = make_id
        self.pending = ""  # text received and not yet decided
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []
        self._held = ""  # trailing whitespace of the content: it goes out once more text does
        self._held_before_call = False  # a call came after it: dropped if no text follows
        self._after_call = False  # whitespace right after a call is dropped
        self._out = ToolDelta()
        self._call: CallObject | None = None  # the call object being read
        self._call_index: int | None = None  # its index in `calls`, once its name is known
        self._sent_arguments = 0

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.calls else None

    def feed(self, text: str) -> ToolDelta:
        self.pending += text
        self._parse(final=False)
        return self._take()

    def finish(self) -> ToolDelta:
        self._parse(final=True)
        if self._call is not None:
            self._end_call()
        self._release_held()
        return self._take()

    def _parse(self, final: bool) -> None:
        raise NotImplementedError

    # ---- helpers for subclasses

    def _emit_text(self, text: str) -> None:
        """Content: whitespace held back until text follows (a call after it drops it)."""
        if self._after_call:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(_WHITESPACE)
        if body:
            self._emit_content(self._held + body)
            self._held, self._held_before_call = "", False
        self._held += text[len(body) :]

    def _open_call(self) -> None:
        self._call = CallObject()

    def _read_call(self) -> CallObject:
        """Feed `pending` to the call being read; consumed text leaves `pending`."""
        call = self._call
        used = call.feed(self.pending)
        self.pending = self.pending[used:]
        self._announce(call)
        return call

    def _end_call(self) -> CallObject:
        """The call object is closed (or the text ended): its last argument text goes out."""
        call, self._call = self._call, None
        self._announce(call)
        if self._call_index is not None:
            self._send_arguments(call, final=True)
        self._call_index, self._sent_arguments = None, 0
        self._after_call = self._after_call or call.name is not None
        return call

    def _drop_call(self) -> None:
        """Stop reading the current call object without reporting it."""
        self._call, self._call_index, self._sent_arguments = None, None, 0

    # ---- internals

    def _announce(self, call: CallObject) -> None:
        if self._call_index is None and call.name is not None:
            if self.calls and not self.parallel:
                return
            self._held_before_call = bool(self._held)
            self._call_index = len(self.calls)
            self.calls.append(ToolCall(self.make_id(), call.name))
            self._out.calls.append(CallDelta(self._call_index, id=self.calls[-1].id, name=call.name))
        if self._call_index is not None:
            self._send_arguments(call, final=False)

    def _send_arguments(self, call: CallObject, final: bool) -> None:
        arguments = call.arguments()
        if arguments is None:
            return
        new = arguments[self._sent_arguments :]
        if not new:
            return
        self._sent_arguments = len(arguments)
        self.calls[self._call_index].arguments += new
        if self._out.calls and self._out.calls[-1].index == self._call_index:
            self._out.calls[-1].arguments += new
        else:
            self._out.calls.append(CallDelta(self._call_index, new))

    def _emit_content(self, text: str) -> None:
        self.content_parts.append(text)
        self._out.content += text

    def _release_held(self) -> None:
        if self._held and not self._held_before_call:
            self._emit_content(self._held)
        self._held, self._held_before_call = "", False

    def _take(self) -> ToolDelta:
        out, self._out = self._out, ToolDelta()
        return out


def partial_tag_length(text: str, tag: str) -> int:
    """The longest suffix of `text` that is a proper prefix of `tag`: text to hold back."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
