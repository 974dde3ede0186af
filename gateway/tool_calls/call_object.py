"""One tool call's JSON object read a character at a time, as a model writes it:

    {"name": "get_weather", "arguments": {"city": "Paris"}}
     ^^^^^^^^^^^^^^^^^^^^^  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
     the name: known once   the arguments: their raw text, a growing prefix while the value is
     its string closes      an object or array; `parameters` is read the same (Llama 3, vLLM's
                            `required` schema), and a JSON string holding JSON is decoded at its end

The scanner tracks only what it needs (string and escape state, nesting depth, the keys and
values of the outermost object); whether the text is valid JSON is the client's to see in the
arguments, as with OpenAI's own tool calls. `feed` stops right after the object's closing brace,
so the caller reads what follows (a closing tag, a comma, another call).
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


class CallObject:
    """The state of one call object; the first character fed must be its `{`."""

    def __init__(self) -> None:
        self.raw = ""  # every character fed so far
        self.depth = 0
        self.done = False  # the outermost object closed
        self.name: str | None = None
        self._in_string = self._escape = False
        self._expect_key = False  # depth 1: the next string is a key
        self._key: str | None = None  # depth 1: the key whose value comes or is being read
        self._key_start: int | None = None  # depth 1: where the key string being read began
        self._value_start: int | None = None  # depth 1: where the value being read began
        self._args: tuple[int, int | None] | None = None  # (start, end) of the arguments' value

    def feed(self, text: str) -> int:
        """Read characters of `text` until the object closes; return how many were read."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            self._step(ch)
        return len(text)

    def arguments(self) -> str | None:
        """The arguments' text as far as it is final (None: nothing to send yet). An object or
        array value grows by its raw characters; another value counts once read whole. A closed
        object without arguments has `{}`."""
        if self._args is None:
            return "{}" if self.done else None
        start, end = self._args
        if self.raw[start] in "{[":
            return self.raw[start:end]
        if end is None:
            return None
        value = self.raw[start:end]
        if value.startswith('"'):
            try:
                return json.loads(value)  # arguments written as a JSON string of JSON
            except ValueError:
                return value
        return value

    # ---- one character

    def _step(self, ch: str) -> None:
        position = len(self.raw)
        self.raw += ch
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self.depth == 1:
                    self._string_closed(position + 1)
            return
        if ch == '"':
            self._in_string = True
            if self.depth == 1:
                if self._expect_key:
                    self._expect_key, self._key_start = False, position
                else:
                    self._start_value(position)
        elif ch in "{[":
            if self.depth == 1:
                self._start_value(position)
            self.depth += 1
            if self.depth == 1:
                self._expect_key = True
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._end_value(position + 1)
            elif self.depth <= 0:
                self._end_value(position)  # a number, true, false or null before the brace
                self.done = True
        elif self.depth == 1:
            if ch == ",":
                self._end_value(position)
                self._expect_key = True
            elif ch in _WHITESPACE:
                self._end_value(position)
            elif ch != ":":
                self._start_value(position)  # a number, true, false or null

    def _string_closed(self, end: int) -> None:
        if self._key_start is not None:  # a key
            try:
                self._key = json.loads(self.raw[self._key_start : end])
            except ValueError:
                self._key = None
            self._key_start = None
        else:
            self._end_value(end)

    def _start_value(self, position: int) -> None:
        if self._value_start is not None:
            return
        self._value_start = position
        if self._key in ARGUMENT_KEYS and self._args is None:
            self._args = (position, None)

    def _end_value(self, end: int) -> None:
        start = self._value_start
        if start is None:
            return
        self._value_start = None
        if self._args is not None and self._args == (start, None):
            self._args = (start, end)
        elif self._key == "name" and self.name is None and self.raw[start] == '"':
            try:
                name = json.loads(self.raw[start:end])
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) and name else None
        self._key = None
