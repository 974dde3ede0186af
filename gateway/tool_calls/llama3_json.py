"""Llama 3's JSON tool calls: the answer is one or more JSON objects, separated by `;`,
optionally after `<|python_tag|>`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Only an answer that starts so (after whitespace) holds calls; any other answer is all content,
as is an object that turns out to have no "name", and whatever follows the last call.
"""

from __future__ import annotations

from pagemesh.gateway.tool_calls.base import ToolCallParser

PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"
START, CALL, NEXT, TEXT = "start", "call", "next", "text"


class Llama3JsonParser(ToolCallParser):
    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self.state = START
        self.head = ""  # what START read (whitespace, the python tag): content if no call follows

    def _parse(self, final: bool) -> None:
        while True:
            before = (self.state, len(self.pending))
            getattr(self, f"_in_{self.state}")(final)
            if (self.state, len(self.pending)) == before:
                return

    def _in_start(self, final: bool) -> None:
        body = self.pending.lstrip(_WHITESPACE)
        self.head += self.pending[: len(self.pending) - len(body)]
        self.pending = body
        if body.startswith(PYTHON_TAG):
            self.head += PYTHON_TAG
            self.pending = body[len(PYTHON_TAG) :]
        elif body.startswith("{"):
            self._open_call()
            self.state = CALL
        elif body and not PYTHON_TAG.startswith(body) or final:
            self._all_text()

    def _in_call(self, final: bool) -> None:
        call = self._read_call()
        if not (call.done or final):
            return
        call = self._end_call()
        if call.name is None and not self.calls:
            self.pending = call.raw + self.pending
            self._all_text()
        else:
            self.state = NEXT

    def _in_next(self, final: bool) -> None:
        body = self.pending.lstrip(_WHITESPACE + ";")
        self.pending = body
        if body.startswith("{"):
            self._open_call()
            self.state = CALL
        elif body:
            self.state = TEXT

    def _in_text(self, final: bool) -> None:
        text, self.pending = self.pending, ""
        self._emit_text(text)

    def _all_text(self) -> None:
        self.pending = self.head + self.pending
        self.head = ""
        self.state = TEXT
