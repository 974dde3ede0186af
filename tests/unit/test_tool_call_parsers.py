"""The tool-call parsers (gateway/tool_calls/) on model output written out in full: each format's
calls, the content around them, and text that only looks like a call. Every case is read whole,
split in two at every character boundary, and a character at a time: the deltas must add up to
the same content and calls every time (the streamed answer is the non-streamed one)."""

from __future__ import annotations

import json

import pytest

from pagemesh.gateway.tool_calls import TOOL_CALL_PARSERS, NamedCallParser, required_calls
from pagemesh.gateway.tool_calls.base import ToolCallParser

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
        "</tool_call>",
        "Let me look.",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"s": "}{\\"</tool_call>"}}</tool_call>\n'
        '<tool_call>{"arguments": {}, "name": "b"}</tool_call> Done.',
        "Done.",
        [("a", '{"s": "}{\\"</tool_call>"}'), ("b", "{}")],
    ),
    (
        "hermes",
        'Checking. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> Ok?',
        "Checking. Ok?",
        [("f", '{"x": 1}')],
    ),
    (
        "hermes",
        'SmolLM style: <tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]</tool_call>',
        "SmolLM style:",
        [("f", '{"x": 1}'), ("g", "{}")],
    ),  # fmt: skip
    ("hermes", "a < b, and <tool_ is no tag", "a < b, and <tool_ is no tag", []),
    ("hermes", "<tool_call>hello</tool_call> there", "<tool_call>hello</tool_call> there", []),
    ("hermes", '<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),
    ("hermes", 'Cut off <tool_call>{"name": "f", "arguments": {"q": "tru', "Cut off", [("f", '{"q": "tru')]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", '{"x": 2}')]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")],
    ),
    ("llama3_json", ' {"name": "f", "arguments": {"a": [1, {"b": null}]}}', None, [("f", '{"a": [1, {"b": null}]}')]),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", "<|python", "<|python", []),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "]"}}]',
        "Sure.",
        [("f", '{"a": 1}'), ("g", '{"b": "]"}')],
    ),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),
    ("mistral", "The [TOOL_ token and [TOOL_CALLS] with no JSON", "The [TOOL_ token and [TOOL_CALLS] with no JSON", []),
]


def read(parser: ToolCallParser, chunks: list[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Feed `chunks`, then finish; put the deltas together as an OpenAI client does. Returns the
    content and calls the deltas add up to, and the call ids, checking them against the parser's
    own account (the non-streamed answer)."""
    content, calls, ids = "", {}, []
    for delta in [*(parser.feed(chunk) for chunk in chunks), parser.finish()]:
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                assert call.index == len(calls) and call.name
                calls[call.index] = [call.name, call.arguments]
                ids.append(call.id)
            else:
                calls[call.index][1] += call.arguments
    found = [tuple(c) for c in calls.values()]
    assert (parser.content or "") == content
    assert [(c.name, c.arguments) for c in parser.calls] == found
    assert [c.id for c in parser.calls] == ids
    return parser.content, found, ids


def chunkings(text: str):
    yield [text]
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_chunking_finds_the_same_calls_and_content(name, text, content, calls):
    for chunks in chunkings(text):
        assert read(TOOL_CALL_PARSERS[name](True), chunks)[:2] == (content, calls), chunks


def test_arguments_stream_as_they_are_written():
    parser = TOOL_CALL_PARSERS["hermes"](True)
    assert parser.feed("Hi <tool_").content == "Hi"  # " <tool_" is held back: it may be a tag
    first = parser.feed('call>{"name": "get_weather", "arguments": {"ci')
    assert first.content == ""
    assert [c.to_openai() for c in first.calls] == [
        {
            "index": 0,
            "id": parser.calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"ci'},
        }
    ]
    assert [c.to_openai() for c in parser.feed('ty": "Paris"}}</tool').calls] == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    ]
    assert not parser.finish()


def test_ids_are_openai_call_ids_and_mistral_ones_fit_its_templates():
    _, _, ids = read(TOOL_CALL_PARSERS["hermes"](True), ['<tool_call>{"name": "f"}</tool_call>'])
    assert ids[0].startswith("call_") and len(ids[0]) == 29
    _, _, ids = read(TOOL_CALL_PARSERS["mistral"](True), ['[TOOL_CALLS][{"name": "f", "arguments": {}}]'])
    assert len(ids[0]) == 9 and ids[0].isalnum()  # Mistral's templates refuse other ids


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_without_parallel_tool_calls_only_the_first_call_is_kept(name):
    text = {
        "hermes": '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "llama3_json": '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
        "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
    }[name]
    for chunks in chunkings(text):
        assert read(TOOL_CALL_PARSERS[name](False), chunks)[:2] == (None, [("f", "{}")])


REQUIRED = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', [("get_weather", '{"city": "Paris"}')]),
    (
        ' [ {"name": "a", "parameters": {}} , {"name": "b", "parameters": {"x": [1]}} ] ',
        [("a", "{}"), ("b", '{"x": [1]}')],
    ),  # fmt: skip
]


@pytest.mark.parametrize("text, calls", REQUIRED)
def test_the_output_of_tool_choice_required_is_read_as_its_calls(text, calls):
    for chunks in chunkings(text):
        assert read(required_calls(True), chunks)[:2] == (None, calls)


def test_the_output_of_a_named_tool_choice_is_its_arguments():
    text = ' {"city": "Paris", "unit": "c  "}\n'
    for chunks in chunkings(text):
        content, calls, _ = read(NamedCallParser("get_weather"), chunks)
        assert (content, calls) == (None, [("get_weather", '{"city": "Paris", "unit": "c  "}')])
        assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "c  "}
    assert read(NamedCallParser("f"), [])[:2] == (None, [("f", "")])  # nothing written: still the call
