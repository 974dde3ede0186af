"""JSON Schema mode: the schema automaton (common/json_schema.py) against pydantic, the validator
of the schemas it reads, and the token masks built from it."""

from __future__ import annotations

import random
import string
from typing import Literal

import pytest
from pydantic import BaseModel

from pagemesh.common import json_grammar as g
from pagemesh.common.json_schema import SchemaError, compile_schema
from pagemesh.tests.default_model import tokenizer as default_tokenizer
from pagemesh.workers.engine.json_mode import JsonMasks


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int | None = None


class Person(BaseModel):
    name: str
    score: float
    ok: bool = False
    nick: str | None = None
    pets: list[Pet]
    tags: list[str] = []
    extra: dict = {}


GRAMMAR = compile_schema(Person.model_json_schema())
ALPHABET = string.ascii_letters + string.digits + ' {}[]",:.-+\\/\n'


def accepts(text: str, grammar=GRAMMAR) -> bool:
    state = grammar.run(grammar.INITIAL, text)
    return state is not None and grammar.is_complete(state)


def random_document(rng: random.Random) -> str | None:
    """A random walk through the automaton, one allowed character at a time, steered to an end."""
    state, out = GRAMMAR.INITIAL, []
    for i in range(2000):
        if GRAMMAR.is_complete(state):
            return "".join(out)
        choices = [c for c in ALPHABET if GRAMMAR.step(state, c) is not None]
        assert choices, ("no way on", "".join(out))
        closing = [c for c in choices if c in '"]}0123456789elu']
        if i > 60 and closing and rng.random() < 0.8:
            choices = closing
        ch = rng.choice(choices)
        out.append(ch)
        state = GRAMMAR.step(state, ch)
    return None


def test_every_document_the_automaton_completes_is_valid_for_pydantic():
    rng = random.Random(0)
    documents = [d for d in (random_document(rng) for _ in range(300)) if d is not None]
    assert len(documents) > 250
    for d in documents:
        Person.model_validate_json(d, strict=True)


def test_every_instance_pydantic_writes_is_accepted():
    rng = random.Random(1)
    for _ in range(200):
        person = Person(
            name=rng.choice(['x"y', "é✓", ""]),
            score=rng.uniform(-5, 5),
            ok=rng.random() < 0.5,
            nick=rng.choice([None, "n"]),
            tags=["a"] * rng.randint(0, 2),
            pets=[Pet(kind=rng.choice(["cat", "dog"]), age=rng.choice([None, 3])) for _ in range(rng.randint(0, 3))],
            extra=rng.choice([{}, {"k": [1, {"z": None}]}]),
        )
        text = person.model_dump_json(indent=rng.choice([None, 2]))
        assert accepts(text), text


@pytest.mark.parametrize(
    "text",
    [
        '{"score": 1, "name": "A", "pets": []}',  # out of the declared order
        '{"name": "A", "pets": []}',  # a required property missing
        '{"name": 1, "score": 1, "pets": []}',
        '{"name": "A", "score": 1, "pets": [{"kind": "cow"}]}',
        '{"name": "A", "score": 1, "pets": [{"age": 3}]}',
        '{"name": "A", "score": 1, "pets": [{"kind": "cat", "age": 3.5}]}',
        '{"name": "A", "score": 1, "pets": [], "zzz": 1}',
        '{"name": "A", "score": 1, "pets": [],}',
        '{"name": "A", "score": true, "pets": []}',
        '["A"]',
    ],
)
def test_documents_outside_the_schema_are_refused(text):
    assert not accepts(text)


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"type": "array"}, "root"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "pattern"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "minimum"),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}},
            "start differently",
        ),
        (
            {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}},
            "recursive",
        ),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/x"}}}, "references"),
        ({"type": "object", "properties": {"a": {"enum": [1, 2]}}}, "enum"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "required"),
        ("not a schema", "object"),
        ({}, "root"),
        ({"anyOf": [{}]}, "root"),
        ({"type": "object", "$defs": []}, r"\$defs"),
        ({"type": "object", "properties": {"a": {}}, "required": [["a"]]}, "required"),
        ({"type": "object", "required": ["a"]}, "needs properties"),
        ({"type": "object", "additionalProperties": False}, "needs properties"),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, "additionalProperties"),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/S", "maxLength": 1}},
                "$defs": {"S": {"type": "string"}},
            },
            "beside",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}], "enum": ["x", None]}},
            },
            "beside",
        ),
        ({"type": "object", "properties": {"a": {"type": "integer", "enum": ["x"]}}}, "under type"),
        ({"type": "object", "properties": {"a": {"properties": {"b": {"type": "integer"}}}}}, "without a type"),
        ({"type": "object", "properties": {"a": {"type": []}}}, "no alternative"),
        ({"type": "object", "properties": {"a": {"enum": ["\ud800"]}}}, "surrogate"),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/S/properties/b"}},
                "$defs": {"S": {"type": "object", "properties": {"b": {"type": "integer"}}}, "b": {"type": "string"}},
            },
            "references",
        ),
        ({"type": "object", "properties": {"a": {"type": "array", "items": False}}}, "items"),
    ],
)
def test_schemas_it_cannot_enforce_are_refused_with_the_reason(schema, why):
    with pytest.raises(SchemaError, match=why):
        compile_schema(schema)


def nested(depth: int) -> dict:
    schema = inner = {"type": "object", "properties": {}}
    for _ in range(depth - 1):
        inner["properties"]["a"] = {"type": "object", "properties": {}}
        inner = inner["properties"]["a"]
    return schema


def test_nesting_beyond_the_automaton_depth_is_refused_up_front():
    compile_schema(nested(g.MAX_DEPTH))
    with pytest.raises(SchemaError, match="nesting"):
        compile_schema(nested(g.MAX_DEPTH + 1))
    # one definition used near the top (compiled there) and again 25 levels down: 1 + 25 + 40 > 64
    chain = inner = nested(25)
    while inner["properties"]:
        inner = inner["properties"]["a"]
    inner["properties"]["z"] = {"$ref": "#/$defs/Deep"}
    shared = {
        "$defs": {"Deep": nested(40)},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/Deep"}, "y": chain},
    }
    with pytest.raises(SchemaError, match="nesting"):
        compile_schema(shared)
    compile_schema({**shared, "$defs": {"Deep": nested(30)}})


def test_definitions_compile_once_and_the_work_is_bounded():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}
    middle = {"type": "object", "properties": {f"b{i}": {"$ref": "#/$defs/A"} for i in range(50)}}
    root = {
        "type": "object",
        "properties": {f"r{i}": {"$ref": "#/$defs/B"} for i in range(50)},
        "$defs": {"A": wide, "B": middle},
    }
    assert len(compile_schema(root).nodes) < 60  # 50 * 50 * 50 leaves if each use were expanded
    root["$defs"]["A"] = {"type": "object", "properties": {f"p{i}": {} for i in range(5000)}}
    with pytest.raises(SchemaError, match="schema parts"):
        compile_schema(root)


def test_a_free_object_schema_is_json_object_mode():
    free = compile_schema({"type": "object"})
    for text in ("{}", '{"a": [1, {"b": null}], "c": "x"}'):
        assert accepts(text, free) and g.run(g.INITIAL, text) is not None
    assert not accepts("[1]", free)


def test_schema_masks_allow_exactly_the_tokens_that_keep_the_document_valid():
    tokenizer = default_tokenizer()
    plain = JsonMasks.for_tokenizer(tokenizer, tokenizer.vocab_size, set(tokenizer.eos_token_ids))
    masks = plain.for_grammar(GRAMMAR)
    assert masks._cache is plain._cache  # one bound for every schema's masks
    sample = random.Random(2).sample(range(tokenizer.vocab_size), 2000)
    for prefix in (
        "",
        '{"na',
        '{"name": "Al", "sc',
        '{"name": "Al", "score": 1',
        '{"name": "A", "score": 1, "pets": [{"kind": "c',
    ):
        cursor = masks.start()
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert masks.allowed(cursor)[token], (prefix, tokenizer.token_text(token))
            cursor = masks.advance(cursor, token)
        allowed = masks.allowed(cursor)
        for token in sample:
            if token in tokenizer.special_token_ids:
                continue
            expected = GRAMMAR.run(cursor.state, tokenizer.token_text(token)) is not None
            if cursor.whitespace_run >= 2 and token in masks.whitespace_only:
                expected = False
            assert bool(allowed[token]) == expected, (prefix, tokenizer.token_text(token))


def random_schema(rng: random.Random, depth: int = 0):
    scalars = [
        "object",
        "array",
        "string",
        "integer",
        "number",
        "boolean",
        "null",
        "x",
        "#/$defs/A",
        "#/$defs/B",
        None,
        True,
        False,
        0,
        1.5,
        "",
        {},
        [],
        {"type": "string"},
    ]
    if depth > 4 or rng.random() < 0.2:
        return rng.choice(scalars)
    if rng.random() < 0.2:
        return [random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    schema = {}
    for key in rng.sample(
        [
            "type",
            "properties",
            "required",
            "items",
            "enum",
            "const",
            "anyOf",
            "oneOf",
            "$ref",
            "$defs",
            "additionalProperties",
            "title",
        ],
        rng.randint(0, 4),
    ):
        if key == "properties":
            schema[key] = {rng.choice("abc"): random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))}
        elif key == "required":
            schema[key] = rng.sample(list("abcd"), rng.randint(0, 2))
        elif key == "$defs":
            schema[key] = {name: random_schema(rng, depth + 1) for name in rng.sample(["A", "B"], rng.randint(0, 2))}
        elif key in ("anyOf", "oneOf", "enum"):
            schema[key] = [random_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        elif key == "type":
            schema[key] = rng.choice(scalars[:8] + [["string", "null"], ["object", "null"], []])
        else:
            schema[key] = random_schema(rng, depth + 1)
    return schema


def test_random_schemas_compile_or_are_refused_and_never_leave_a_dead_end():
    rng = random.Random(3)
    compiled = 0
    for _ in range(3000):
        schema = random_schema(rng)
        if isinstance(schema, dict) and rng.random() < 0.7:
            schema["type"] = "object"
        try:
            grammar = compile_schema(schema)
        except SchemaError:
            continue
        compiled += 1
        state = grammar.INITIAL
        for _ in range(300):  # a walk from the start: some character must always lead on
            if grammar.is_complete(state):
                break
            choices = [c for c in string.printable if grammar.step(state, c) is not None]
            assert choices, (schema, state)
            closing = [c for c in choices if c in '"]}0123456789elu']
            state = grammar.step(state, rng.choice(closing if closing and rng.random() < 0.8 else choices))
    assert compiled > 300
