"""Calls written after a marker, as one JSON object or a JSON array of them:

    hermes   text <tool_call>{"name": ..., "arguments": {...}}</tool_call> <tool_call>...</tool_call>
    mistral  text [TOOL_CALLS] [{"name": ..., "arguments": {...}}, {...}]
    required [{"name": ..., "parameters": {...}}]    (no marker: the grammar wrote only the array)

States, on the text not yet decided (`pending`):

    TEXT ──marker──▶ OPEN ──'{'──▶ CALL ──closed──▶ AFTER ──end tag / next marker──▶ TEXT
                          ──'['──▶ LIST ◀─closed─┘   (LIST: ',' next call, ']' AFTER)
                          ──else──▶ TEXT (the marker was text)

A marker whose body never gives a call its name (`<tool_call>hello</tool_call>`, a JSON object
without "name") is returned as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

from pagemesh.gateway.tool_calls.base import ToolCallParser, mistral_call_id, openai_call_id, partial_tag_length

_WHITESPACE = " \t\r\n"
TEXT, OPEN, CALL, LIST, AFTER = "text", "open", "call", "list", "after"


class TaggedCallParser(ToolCallParser):
    """`start`: the marker before calls (None: the text starts with them); `end`: the tag that
    closes each marker's calls (None: none)."""

    def __init__(self, start: str | None, end: str | None, parallel: bool = True, make_id=openai_call_id):
        super().__init__(parallel, make_id)
        self.start, self.end = start, end
        self.state = TEXT if start is not None else OPEN
        self.marker_text = ""  # the text since the marker: content again if it held no call
        self.in_list = False
        self.named = False  # a call after the current marker has its name
        self._states = {
            TEXT: self._in_text,
            OPEN: self._in_open,
            CALL: self._in_call,
            LIST: self._in_list,
            AFTER: self._in_after,
        }

    def _parse(self, final: bool) -> None:
        while True:
            before = (self.state, len(self.pending))
            self._states[self.state](final)
            if (self.state, len(self.pending)) == before:
                return

    def _in_text(self, final: bool) -> None:
        if self.start is None:  # no marker: after the calls, the rest is text
            text, self.pending = self.pending, ""
            self._emit_text(text)
            return
        at = self.pending.find(self.start)
        if at < 0:
            keep = 0 if final else partial_tag_length(self.pending, self.start)
            cut = len(self.pending) - keep
            text, self.pending = self.pending[:cut], self.pending[cut:]
            self._emit_text(text)
            return
        self._emit_text(self.pending[:at])
        self.pending = self.pending[at + len(self.start) :]
        self.state, self.marker_text, self.named = OPEN, self.start, False

    def _in_open(self, final: bool) -> None:
        body = self._skip(_WHITESPACE)
        if not body:
            if final:
                self._not_a_call("")
            return
        if body[0] == "[" and not self.in_list:
            self.in_list = True
            self.marker_text += "["
            self.pending = body[1:]
            self.state = LIST
        elif body[0] == "{":
            self._open_call()
            self.state = CALL
        else:
            self._not_a_call("")

    def _in_list(self, final: bool) -> None:
        body = self._skip(_WHITESPACE + ",")
        if not body:
            return
        if body[0] == "{":
            self._open_call()
            self.state = CALL
        else:  # ']' (or anything else) ends the list
            self.in_list = False
            self.pending = body[1:] if body[0] == "]" else body
            self.state = AFTER

    def _in_call(self, final: bool) -> None:
        call = self._read_call()
        if not (call.done or final):
            return
        call = self._end_call()
        if call.name is not None or self.named:  # (a nameless object among calls is dropped)
            self.named = True
            self.state = LIST if self.in_list else AFTER
        else:
            self._not_a_call(call.raw)

    def _in_after(self, final: bool) -> None:
        """After a marker's calls: up to its end tag (or the next marker) is dropped."""
        self.in_list = False
        if self.end is None:
            self.state = TEXT
            return
        found = [at for at in (self.pending.find(self.end), self.pending.find(self.start)) if at >= 0]
        if not found:
            keep = 0 if final else max(partial_tag_length(self.pending, tag) for tag in (self.end, self.start))
            self.pending = self.pending[len(self.pending) - keep :] if keep else ""
            return
        at = min(found)
        if self.pending.startswith(self.end, at):
            at += len(self.end)
        self.pending = self.pending[at:]
        self.state = TEXT

    def _skip(self, characters: str) -> str:
        """`pending` without its leading `characters` (kept in `marker_text`)."""
        body = self.pending.lstrip(characters)
        self.marker_text += self.pending[: len(self.pending) - len(body)]
        self.pending = body
        return body

    def _not_a_call(self, read: str) -> None:
        """The marker's body is no call: it is content, and what follows is read as text again."""
        self._drop_call()
        text = self.marker_text + read
        self.in_list, self.marker_text, self.state = False, "", TEXT
        if self.start is None:  # no marker to look for: all of it is content
            self.pending = text + self.pending
        else:
            self._emit_text(text)


def hermes(parallel: bool = True) -> TaggedCallParser:
    return TaggedCallParser("<tool_call>", "</tool_call>", parallel)


def mistral(parallel: bool = True) -> TaggedCallParser:
    return TaggedCallParser("[TOOL_CALLS]", None, parallel, make_id=mistral_call_id)


def required_calls(parallel: bool = True) -> TaggedCallParser:
    """The output of tool_choice "required": the grammar wrote a JSON array of calls."""
    return TaggedCallParser(None, None, parallel)
