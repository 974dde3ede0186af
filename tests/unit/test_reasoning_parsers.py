"""The reasoning parsers (gateway/reasoning.py) and their place before the tool-call parser
(gateway/chat_output.py), on answers written out in full: read whole, split at every character
boundary and a character at a time, the deltas add up to the same reasoning and content."""

from __future__ import annotations

import pytest

from pagemesh.gateway.chat_output import ChatOutputSpec
from pagemesh.gateway.reasoning import reasoning_parser

# (parser, chat_template_kwargs, answer, reasoning, content)
CASES = [
    (
        "deepseek_r1",
        None,
        "<think>\nThe sky scatters blue.\n</think>\n\nRayleigh scattering.",
        "\nThe sky scatters blue.\n",
        "\n\nRayleigh scattering.",
    ),  # fmt: skip
    # the template opened <think>: the answer starts inside the thinking (DeepSeek-R1, Qwen3 2507)
    ("deepseek_r1", None, "Blue light scatters more.</think>Rayleigh.", "Blue light scatters more.", "Rayleigh."),
    ("deepseek_r1", None, "Still thinking when max_tokens came", "Still thinking when max_tokens came", None),
    ("deepseek_r1", None, "  <think>a < b</thin", "a < b</thin", None),
    ("deepseek_r1", None, "<think></think>Just the answer.", None, "Just the answer."),
    ("qwen3", None, "<think>\nhmm\n</think>\n\nHello!", "\nhmm\n", "\n\nHello!"),
    ("qwen3", {"enable_thinking": True}, "thinking</think>done", "thinking", "done"),
    # thinking off: the template wrote an empty <think></think> itself, the answer is all content
    ("qwen3", {"enable_thinking": False}, "Hello! No <think> here.", None, "Hello! No <think> here."),
]


def read(parser, chunks: list[str]) -> tuple[str | None, str | None]:
    reasoning, content = "", ""
    for i, chunk in enumerate(chunks):
        delta = parser.feed(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    assert (parser.reasoning or "") == reasoning
    return reasoning or None, content or None


def chunkings(text: str):
    yield [text]
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize("name, kwargs, answer, reasoning, content", CASES)
def test_every_chunking_splits_the_same(name, kwargs, answer, reasoning, content):
    for chunks in chunkings(answer):
        assert read(reasoning_parser(name, kwargs), chunks) == (reasoning, content), chunks


def test_reasoning_comes_out_before_the_end_tag_is_whole():
    parser = reasoning_parser("deepseek_r1", None)
    assert parser.feed("<thi").reasoning == ""  # may be the opening tag
    assert parser.feed("nk>Blue</th").reasoning == "Blue"  # "</th" may be the end tag
    delta = parser.feed("ink> sky")
    assert (delta.reasoning, delta.content) == ("", " sky")


def test_tool_calls_are_read_from_the_content_after_the_thinking():
    output = ChatOutputSpec(reasoning_parser="qwen3", tool_choice="auto", tool_parser="hermes").new()
    answer = 'I should look it up. <tool_call> is how.</think>\n<tool_call>{"name": "w", "arguments": {}}</tool_call>'
    deltas = [output.delta(ch, final=i == len(answer) - 1) for i, ch in enumerate(answer)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should look it up. <tool_call> is how."
    assert not any("content" in d for d in deltas)  # the whitespace before the call was dropped
    message = output.message()
    assert message["content"] is None
    assert message["reasoning_content"] == "I should look it up. <tool_call> is how."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("w", "{}")]
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"
