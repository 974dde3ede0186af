"""How a chat choice's text becomes OpenAI's message: reasoning, content and tool calls.

    text ──▶ reasoning parser ──reasoning──▶ reasoning_content
                              ──content──▶ tool-call parser ──content──▶ content
                                                            ──calls────▶ tool_calls

`ChatOutputSpec` is decided once per request (the gateway's flags and the request's tools);
`ResponseBuilder` gives each choice its own `ChatOutput`, which turns each new piece of text into
a stream delta and, at the end, into the message. The message is what the deltas add up to.
A choice with tool calls that ended normally ends with finish_reason "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagemesh.gateway.chat_options import ChatOptions
from pagemesh.gateway.errors import invalid
from pagemesh.gateway.reasoning import ThinkParser, reasoning_parser
from pagemesh.gateway.tool_calls import (
    KEEP_SPECIAL_TOKENS,
    TOOL_CALL_PARSERS,
    CallDelta,
    NamedCallParser,
    ToolCallParser,
    ToolDelta,
    required_calls,
)

if TYPE_CHECKING:
    from pagemesh.gateway.config import GatewayConfig
    from pagemesh.gateway.parsing import ParsedRequest

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ChatOutputSpec:
    """How every choice of one chat request is read. `tool_choice`: "auto" (then `tool_parser`
    finds the calls), "required", "function" (the grammar wrote them) or "none"."""

    reasoning_parser: str | None = None
    template_kwargs: dict | None = None
    tool_choice: str = "none"
    tool_parser: str | None = None
    function: str | None = None
    parallel_tool_calls: bool = True

    @property
    def keep_special_tokens(self) -> bool:
        """The answer is detokenized with special tokens kept (a call marker may be one)."""
        return self.tool_choice == "auto" and self.tool_parser in KEEP_SPECIAL_TOKENS

    def new(self) -> ChatOutput:
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = reasoning_parser(self.reasoning_parser, self.template_kwargs)
        tools: ToolCallParser | None = None
        if self.tool_choice == "auto":
            tools = TOOL_CALL_PARSERS[self.tool_parser](self.parallel_tool_calls)
        elif self.tool_choice == "required":
            tools = required_calls(self.parallel_tool_calls)
        elif self.tool_choice == "function":
            tools = NamedCallParser(self.function)
        return ChatOutput(reasoning, tools)


def chat_output_spec(parsed: ParsedRequest, config: GatewayConfig) -> ChatOutputSpec | None:
    """How a request's chat answer is read; None for a completion, or when the text is the
    content as it is. A 400 for tool_choice "auto" unless the gateway runs with
    --enable-auto-tool-choice and a --tool-call-parser (as vLLM). An answer a grammar holds to
    JSON has no thinking to split off."""
    if parsed.kind != "chat":
        return None
    options = parsed.chat_options or ChatOptions()
    if options.tool_choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise invalid(AUTO_NEEDS_FLAGS, "tool_choice")
    reasoning = None if parsed.sampling.constrained else config.reasoning_parser
    if reasoning is None and options.tool_choice == "none":
        return None
    return ChatOutputSpec(
        reasoning_parser=reasoning,
        template_kwargs=options.template_kwargs,
        tool_choice=options.tool_choice,
        tool_parser=config.tool_call_parser if options.tool_choice == "auto" else None,
        function=options.function,
        parallel_tool_calls=options.parallel_tool_calls,
    )


class ChatOutput:
    """One choice: `delta(text, final)` for each piece of its text, then `message()`."""

    def __init__(self, reasoning: ThinkParser | None, tools: ToolCallParser | None):
        self.reasoning, self.tools = reasoning, tools
        self.content_parts: list[str] = []  # without a tool-call parser

    def delta(self, text: str, final: bool) -> dict:
        """The stream delta of this piece (`final`: the choice's last): content,
        reasoning_content and tool_calls, each only when it has something."""
        out: dict = {}
        content = text
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final)
            content = split.content
            if split.reasoning:
                out["reasoning_content"] = split.reasoning
        if self.tools is not None:
            found = self.tools.feed(content)
            if final:
                found = _joined(found, self.tools.finish())
            content = found.content
            if found.calls:
                out["tool_calls"] = [call.to_openai() for call in found.calls]
        else:
            self.content_parts.append(content)
        if content:
            out["content"] = content
        return out

    def message(self) -> dict:
        calls = self.tools.calls if self.tools is not None else []
        if self.tools is not None:
            content = self.tools.content
        else:
            content = "".join(self.content_parts)
        message = {"role": "assistant", "content": content or None, "refusal": None}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning.reasoning
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.tools is not None and self.tools.calls:
            return "tool_calls"
        return reason


def _joined(first: ToolDelta, second: ToolDelta) -> ToolDelta:
    """Two deltas as one: a call's fragments in a row become one entry."""
    calls: list[CallDelta] = []
    for call in first.calls + second.calls:
        if calls and calls[-1].index == call.index and call.id is None:
            calls[-1].arguments += call.arguments
        else:
            calls.append(call)
    return ToolDelta(first.content + second.content, calls)
