"""Structured outputs through the mesh with the official openai client: `pagemesh up`'s default
mesh (one prefill and one decode worker), so every constrained answer crosses the KV handoff with
its grammar's state. Each spelling (response_format, structured_outputs, guided_*), each kind of
grammar, and the 400s of what is refused."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME as MODEL

pytestmark = pytest.mark.slow

CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 20},
        "colors": {"type": "array", "items": {"enum": ["black", "white", "ginger"]}, "minItems": 1, "maxItems": 2},
        "born": {"type": "string", "format": "date"},
    },
    "required": ["name", "age", "colors", "born"],
    "additionalProperties": False,
}
ASK_CAT = [{"role": "user", "content": "Describe a cat as JSON: its name, age, colours and birth date."}]
ASK_YES_NO = [{"role": "user", "content": "Is the sea salty? Answer yes or no."}]


@pytest.fixture(scope="module")
def client():
    with running_mesh("--dtype", "float32") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def test_a_json_schema_with_pattern_minimum_min_items_format_and_enum_holds(client):
    validator = jsonschema.Draft202012Validator(CAT, format_checker=jsonschema.FormatChecker())
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK_CAT,
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    cat = json.loads(r.choices[0].message.content)
    assert validator.is_valid(cat), cat
    sampled = client.chat.completions.create(  # the same schema as vLLM's field, sampled, n = 2, streamed
        model=MODEL,
        messages=ASK_CAT,
        max_tokens=80,
        temperature=0.8,
        seed=3,
        n=2,
        stream=True,
        extra_body={"structured_outputs": {"json": CAT}},
    )
    texts = ["", ""]
    for chunk in sampled:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        assert validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize(
    "extra",
    [{"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}],
    ids=["vllm", "guided"],
)
def test_the_answer_to_a_choice_is_exactly_one_of_them(client, extra):
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK_YES_NO, max_tokens=8, temperature=1.0, seed=1, n=3, extra_body=extra
    )
    assert [c.message.content in ("yes", "no") and c.finish_reason == "stop" for c in chat.choices] == [True] * 3
    completion = client.completions.create(
        model=MODEL, prompt="Is the sea salty? Answer:", max_tokens=8, temperature=0, extra_body=extra
    )
    assert completion.choices[0].text in ("yes", "no")


def test_a_regex_and_an_ebnf_grammar_hold_the_answer(client):
    phone = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text), phone.choices[0].text
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    sum_ = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 12 + 30?"}],
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"The answer is [0-9]+\.", sum_.choices[0].message.content)


@pytest.mark.parametrize(
    "extra, param, why",
    [
        ({"guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
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
        ({"guided_json": {"type": "string", "format": "phone-number"}}, "guided_json", "phone-number"),
        ({"guided_choice": ["yes"], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
        (
            {"structured_outputs": {"json": CAT, "disable_additional_properties": True}},
            "structured_outputs",
            "not supported",
        ),
        ({"structural_tag": "{}"}, "structural_tag", "not supported"),  # vLLM's top-level field: not honoured
        ({"guided_regex": "a", "guided_choice": ["yes"]}, "guided_choice", "only one"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(client, extra, param, why):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK_YES_NO, max_tokens=4, extra_body=extra)
    error = err.value.response.json()["error"]
    assert error["param"] == param and why in error["message"], error
