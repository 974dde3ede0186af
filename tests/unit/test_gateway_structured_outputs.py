"""Structured outputs at the gateway: each spelling of a constraint (response_format,
structured_outputs, guided_*) on both routes, its 400s, and the grammar check (llguidance)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.parsing import parse_chat, parse_completion
from pagemesh.gateway.structured_outputs import GrammarCheck
from pagemesh.tests.default_model import tokenizer as default_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}, "required": ["a"]}
SCHEMA_TEXT = '{"type":"object","properties":{"a":{"type":"string","pattern":"^x"}},"required":["a"]}'
STRUCTURAL_TAG = {
    "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
    "triggers": ["<f>"],
}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields) -> dict:
    return {"prompt": "hi", **fields}


def constraint(sampling) -> tuple:
    return (sampling.json_object, sampling.json_schema, sampling.structured)


@pytest.mark.parametrize(
    "fields, expected, field",
    [
        ({"response_format": {"type": "text"}}, (False, None, None), None),
        ({"response_format": {"type": "json_object"}}, (True, None, None), "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            (False, SCHEMA_TEXT, None),
            "response_format",
        ),
        (
            {"response_format": {"type": "structural_tag", **STRUCTURAL_TAG}},
            (False, None, ("structural_tag", json.dumps(STRUCTURAL_TAG, separators=(",", ":")))),
            "response_format",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, (False, SCHEMA_TEXT, None), "structured_outputs"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, (False, SCHEMA_TEXT, None), "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, (True, None, None), "structured_outputs"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, (False, None, ("regex", "[0-9]+")), "structured_outputs"),
        (
            {"structured_outputs": {"choice": ["yes", "no"], "disable_fallback": True}},
            (False, None, ("choice", '["yes","no"]')),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            (False, None, ("grammar", 'root ::= "a"')),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}},
            (False, None, ("structural_tag", json.dumps(STRUCTURAL_TAG, separators=(",", ":")))),
            "structured_outputs",
        ),
        ({"guided_json": SCHEMA}, (False, SCHEMA_TEXT, None), "guided_json"),
        ({"guided_regex": "a+", "guided_decoding_backend": "guidance"}, (False, None, ("regex", "a+")), "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, (False, None, ("choice", '["yes","no"]')), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, (False, None, ("grammar", 'root ::= "a"')), "guided_grammar"),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"},
            (False, SCHEMA_TEXT[:-1] + ',"x-guidance":{"whitespace_pattern":"[ ]?"}}', None),
            "guided_json",
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            (False, '{"type":"object","x-guidance":{"whitespace_flexible":false,"whitespace_pattern":null}}', None),
            "structured_outputs",
        ),
        ({"structured_outputs": None, "guided_json": None, "response_format": None}, (False, None, None), None),
    ],
)
def test_each_spelling_sets_the_constraint_on_both_routes(fields, expected, field):
    for parse, body in ((parse_chat, chat(**fields)), (parse_completion, completion(**fields))):
        parsed = parse(body)
        assert constraint(parsed.sampling) == expected
        assert parsed.constraint_field == field


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs.bogus"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": 3}, "guided_grammar"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"response_format": {"type": "regex"}}, "response_format"),
        ({"guided_json": SCHEMA, "ignore_eos": True}, "guided_json"),  # SamplingParams' check, renamed
        ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "guided_regex"),
        ({"guided_regex": "a" * 70000}, "guided_regex"),
    ],
)
def test_a_malformed_constraint_is_a_400_naming_its_field(fields, param):
    for parse, body in ((parse_chat, chat(**fields)), (parse_completion, completion(**fields))):
        with pytest.raises(ApiError) as info:
            parse(body)
        assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_a_forced_tool_call_holds_the_answer_and_takes_no_other_constraint():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    parsed = parse_chat(chat(tools=tools, tool_choice="required"))
    assert parsed.sampling.json_schema is not None and parsed.constraint_field == "tools"
    with pytest.raises(ApiError) as info:
        parse_chat(chat(tools=tools, tool_choice="required", guided_regex="a"))
    assert info.value.param == "guided_regex"


@pytest.fixture(scope="module")
def check():
    return GrammarCheck(default_tokenizer())


@pytest.mark.parametrize(
    "fields, param, why",
    [
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
        ({"structured_outputs": {"grammar": 'root ::= "a" | b'}}, "structured_outputs", "Rule 'b' not found"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        ({"guided_json": {"type": "string", "format": "phone"}}, "guided_json", "phone"),
        ({"guided_json": {"type": "object", "x-guidance": {"lenient": "yes"}}}, "guided_json", "expected a boolean"),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<"]}},
            "response_format",
            "structures",
        ),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(check, fields, param, why):
    parsed = parse_chat(chat(**fields))
    with pytest.raises(ApiError) as info:
        asyncio.run(check.check(parsed))
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"{param}: ") and why in info.value.message


def test_each_grammar_is_compiled_once_by_the_gateway(check):
    async def twice():
        for _ in range(2):
            await check.check(parse_completion(completion(guided_choice=["left", "right"])))
        await check.check(parse_completion(completion()))  # unconstrained: nothing to compile

    asyncio.run(twice())
    before = check.grammars.compiles
    asyncio.run(twice())
    assert check.grammars.compiles == before
