"""The output of a named tool_choice: the grammar wrote the function's arguments and nothing else,
so the whole text is one call's arguments (whitespace around them dropped)."""

from __future__ import annotations

from pagemesh.gateway.tool_calls.base import CallDelta, ToolCall, ToolCallParser, ToolDelta

_WHITESPACE = " \t\r\n"


class NamedCallParser(ToolCallParser):
    """Every character is argument text of the one call to `name`, announced before the first."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ToolDelta:
        self.pending += text
        out = ToolDelta()
        if not self.calls:
            self.pending = self.pending.lstrip(_WHITESPACE)
            if not self.pending:
                return out
            self.calls.append(ToolCall(self.make_id(), self.name))
            out.calls.append(CallDelta(0, id=self.calls[0].id, name=self.name))
        body = self.pending.rstrip(_WHITESPACE)  # trailing whitespace waits for more
        self.pending = self.pending[len(body) :]
        if body:
            self.calls[0].arguments += body
            if out.calls:
                out.calls[0].arguments = body
            else:
                out.calls.append(CallDelta(0, body))
        return out

    def finish(self) -> ToolDelta:
        if self.calls:
            return ToolDelta()
        self.calls.append(ToolCall(self.make_id(), self.name))  # nothing was written: no arguments
        return ToolDelta(calls=[CallDelta(0, id=self.calls[0].id, name=self.name)])
