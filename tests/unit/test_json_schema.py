"""JSON Schema mode: the schema automaton (common/json_schema.py) against pydantic, the validator
of the schemas it reads, and the token masks built from it."""

from __future__ import annotations

import random
import string
from typing import Literal, Optional

import pytest
from pydantic import BaseModel

from common import json_grammar as g
from common.json_schema import SchemaError, compile_schema
from common.model_files import default_model_path
from common.tokenizer import Tokenizer
from workers.engine.json_mode import JsonMasks


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: Optional[int] = None


class Person(BaseModel):
    name: str
    score: float
    ok: bool = False
    nick: Optional[str] = None
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
        person = Person(name=rng.choice(["x\"y", "é✓", ""]), score=rng.uniform(-5, 5), ok=rng.random() < 0.5,
                        nick=rng.choice([None, "n"]), tags=["a"] * rng.randint(0, 2),
                        pets=[Pet(kind=rng.choice(["cat", "dog"]), age=rng.choice([None, 3])) for _ in range(rng.randint(0, 3))],
                        extra=rng.choice([{}, {"k": [1, {"z": None}]}]))
        text = person.model_dump_json(indent=rng.choice([None, 2]))
        assert accepts(text), text


@pytest.mark.parametrize("text", [
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
])
def test_documents_outside_the_schema_are_refused(text):
    assert not accepts(text)


@pytest.mark.parametrize("schema, why", [
    ({"type": "array"}, "root"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "pattern"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "minimum"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}}, "start differently"),
    ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}}, "recursive"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/x"}}}, "references"),
    ({"type": "object", "properties": {"a": {"enum": [1, 2]}}}, "enum"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "required"),
    ("not a schema", "object"),
])
def test_schemas_it_cannot_enforce_are_refused_with_the_reason(schema, why):
    with pytest.raises(SchemaError, match=why):
        compile_schema(schema)


def test_a_free_object_schema_is_json_object_mode():
    free = compile_schema({"type": "object"})
    for text in ('{}', '{"a": [1, {"b": null}], "c": "x"}'):
        assert accepts(text, free) and g.run(g.INITIAL, text) is not None
    assert not accepts("[1]", free)


def test_schema_masks_allow_exactly_the_tokens_that_keep_the_document_valid():
    tokenizer = Tokenizer.from_path(default_model_path())
    masks = JsonMasks.for_tokenizer(tokenizer, tokenizer.vocab_size, set(tokenizer.eos_token_ids)).for_grammar(GRAMMAR)
    sample = random.Random(2).sample(range(tokenizer.vocab_size), 2000)
    for prefix in ('', '{"na', '{"name": "Al", "sc', '{"name": "Al", "score": 1', '{"name": "A", "score": 1, "pets": [{"kind": "c'):
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
