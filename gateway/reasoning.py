"""Reasoning parsers (`--reasoning-parser`): a chat answer's thinking, `<think>…</think>`, apart
from its content, as vLLM's `deepseek_r1` and `qwen3` parsers split it.

    [<think>] reasoning … </think> content
    ─────────────────────▶ reasoning_content   (a leading <think> is dropped; a template that
                                                opened <think> itself leaves none to drop)
                          ──────────▶ content

Both parsers read everything before `</think>` as reasoning, so an answer cut off while thinking
is all reasoning (DeepSeek-R1 and Qwen3's newer templates write `<think>` into the prompt: the
output starts inside the thinking). `qwen3` honours the template's switch: with
`chat_template_kwargs: {"enable_thinking": false}` the whole answer is content.

Streaming: text that may be the start of a tag is held back until it is not; fed whole or a
character at a time, a parser gives the same reasoning and content.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.gateway.tool_calls.base import partial_tag_length

START, END = "<think>", "</think>"
_WHITESPACE = " \t\r\n"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ThinkParser:
    """One choice's split. `thinking=False`: the answer is content only (qwen3 with thinking off)."""

    def __init__(self, thinking: bool = True):
        self.state = "start" if thinking else "content"
        self.pending = ""
        self.reasoning_parts: list[str] = []

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) or None

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        self.pending += text
        out = ReasoningDelta()
        if self.state == "start":  # a leading <think> (after whitespace) is dropped
            body = self.pending.lstrip(_WHITESPACE)
            if body.startswith(START):
                self.pending, self.state = body[len(START) :], "reasoning"
            elif final or (body and not START.startswith(body)):
                self.state = "reasoning"
            else:
                return out
        if self.state == "reasoning":
            at = self.pending.find(END)
            if at >= 0:
                out.reasoning, self.pending = self.pending[:at], self.pending[at + len(END) :]
                self.state = "content"
            else:
                keep = 0 if final else partial_tag_length(self.pending, END)
                cut = len(self.pending) - keep
                out.reasoning, self.pending = self.pending[:cut], self.pending[cut:]
        if self.state == "content":
            out.content, self.pending = self.pending, ""
        if out.reasoning:
            self.reasoning_parts.append(out.reasoning)
        return out

    def finish(self) -> ReasoningDelta:
        return self.feed("", final=True)


def reasoning_parser(name: str, template_kwargs: dict | None) -> ThinkParser:
    """A parser for one choice: `name` is one of REASONING_PARSERS."""
    if name == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
        return ThinkParser(thinking=False)
    return ThinkParser()
