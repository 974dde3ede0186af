"""JSON mode: the grammar (json_grammar) and the token masks built from it (json_mode)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagemesh.common import json_grammar as g
from pagemesh.tests.default_model import tokenizer as default_tokenizer
from pagemesh.workers.engine.json_mode import MAX_WHITESPACE_TOKENS, JsonCursor, JsonMasks


def accepts(text: str) -> bool:
    state = g.run(g.INITIAL, text)
    return state is not None and g.is_complete(state)


@pytest.mark.parametrize(
    "text",
    [
        "{}",
        ' {"a": 1}\n',
        '{"a":[1,2,{"b":null}],"c":"x\\n\\u00e9\\""}',
        '{ "k" : -0.5e+10 , "t": true, "f": false }',
        '{"s": "héllo ✓"}',
        '{"a": {"b": {"c": []}}}',
        '{"n": [0, -0, 10, 1.25, 2E-3, 3e7]}',
    ],
)
def test_valid_objects_are_accepted(text):
    assert accepts(text)
    json.loads(text)  # the reference agrees


@pytest.mark.parametrize(
    "text",
    [
        "[1]",
        '"s"',
        "1",
        "{'a': 1}",
        '{"a": 01}',
        '{"a": 1,}',
        '{"a": tru}',
        '{"a" 1}',
        '{"a": 1}}',
        '{"a": "x\ny"}',
        '{"a": 1.}',
        '{"a": -}',
        '{"a": 1e}',
        '{"a": "\\x"}',
        '{"a": "\\u12g4"}',
        "{,}",
        '{"a": 1} x',
        '{"a": 1}{}',
        '{"a": [1 2]}',
        "{1: 2}",
        '{"a": nul}',
        '{"a": +1}',
        '{"a": .5}',
    ],
)
def test_invalid_text_is_refused_at_once_or_never_completes(text):
    assert not accepts(text)
    try:
        assert not isinstance(json.loads(text), dict)  # the reference: not JSON, or not an object
    except ValueError:
        pass


def random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 3 and r < 0.2:
        return {f'k{i}"\\': random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.35:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.5:
        return rng.choice([True, False, None])
    if r < 0.7:
        return rng.uniform(-1e6, 1e6) if rng.random() < 0.5 else rng.randint(-1000, 1000)
    return "".join(rng.choice('ab \\"/\té✓\n\x01') for _ in range(rng.randint(0, 6)))


def test_surrogate_escapes_are_refused_other_escapes_taken():
    assert accepts('{"a": "\\u00e9\\uD7FF\\ue000"}')
    assert not accepts('{"a": "\\ud800"}') and not accepts('{"a": "\\uDFFF"}')


def test_every_prefix_of_any_dumped_object_stays_valid():
    rng = random.Random(0)
    for _ in range(300):
        text = json.dumps(
            {"x": random_value(rng), "y": random_value(rng)},
            indent=rng.choice([None, 2, "\t"]),
            ensure_ascii=rng.random() < 0.5,
        )
        state = g.INITIAL
        for i, ch in enumerate(text):
            state = g.step(state, ch)
            assert state is not None, (text, i)
        assert g.is_complete(state)


@pytest.fixture(scope="module")
def masks():
    return JsonMasks.for_tokenizer(
        default_tokenizer(), default_tokenizer().vocab_size, set(default_tokenizer().eos_token_ids)
    )


def cursor_after(masks: JsonMasks, text: str) -> JsonCursor:
    cursor = JsonCursor()
    for token in default_tokenizer().encode(text, add_special_tokens=False):
        assert masks.allowed(cursor)[token], (text, default_tokenizer().token_text(token))
        cursor = masks.advance(cursor, token)
    return cursor


@pytest.mark.parametrize("text", ["", "{", '{"na', '{"name":', '{"name": "Jo\\', '{"a": [1, -', '{"a": tr', '{"a": 1}'])
def test_a_token_is_allowed_iff_its_text_keeps_the_json_valid(masks, text):
    cursor = cursor_after(masks, text)
    allowed = masks.allowed(cursor)
    sample = random.Random(len(text)).sample(range(default_tokenizer().vocab_size), 3000)
    for token in sample:
        if token in default_tokenizer().special_token_ids:
            assert bool(allowed[token]) == (cursor.complete and token in default_tokenizer().eos_token_ids)
            continue
        expected = g.run(cursor.state, default_tokenizer().token_text(token)) is not None
        if cursor.whitespace_run >= MAX_WHITESPACE_TOKENS and token in masks.whitespace_only:
            expected = False
        assert bool(allowed[token]) == expected, (text, default_tokenizer().token_text(token))


def test_end_tokens_only_once_the_object_is_closed_and_whitespace_runs_are_capped(masks):
    eos = sorted(default_tokenizer().eos_token_ids)
    assert not masks.allowed(cursor_after(masks, '{"a": 1'))[eos].any()
    done = cursor_after(masks, '{"a": 1}')
    assert done.complete and masks.allowed(done)[eos].all()
    [space] = default_tokenizer().encode(" ", add_special_tokens=False)
    cursor = done
    for _ in range(MAX_WHITESPACE_TOKENS):
        assert masks.allowed(cursor)[space]
        cursor = masks.advance(cursor, space)
    allowed = masks.allowed(cursor)
    assert not allowed[space] and allowed.nonzero().flatten().tolist() == eos  # only the end now
    inside = cursor_after(masks, '{"a": "')
    for _ in range(5):  # inside a string, spaces are text: no cap
        assert masks.allowed(inside)[space]
        inside = masks.advance(inside, space)


def test_the_sampler_takes_only_allowed_tokens(masks):
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.sampler import SampleRow, argmax_only, sample

    cursor = cursor_after(masks, '{"a": ')
    allowed = masks.allowed(cursor)
    logits = torch.randn(4, default_tokenizer().vocab_size, generator=torch.Generator().manual_seed(0))
    rows = [
        SampleRow(SamplingParams(temperature=t, seed=s), [], [], torch.Generator().manual_seed(s), allowed=allowed)
        for t, s in ((0, 1), (1.0, 2), (1.5, 3), (0.7, 4))
    ]
    assert not argmax_only(rows[0])
    for token, _ in sample(logits, rows, torch.Generator()):
        assert allowed[token]


def test_nesting_is_capped_and_deep_stacks_share_masks_without_growing_the_cache(masks):
    deep = '{"a": ' + "[" * (g.MAX_DEPTH - 1)
    assert g.run(g.INITIAL, deep) is not None and g.run(g.INITIAL, deep + "[") is None
    assert json.loads(deep + "]" * (g.MAX_DEPTH - 1) + "}")  # the deepest allowed still loads
    middle = [cursor_after(masks, '{"a": ' + "[" * depth) for depth in (20, 21, 30)]
    assert masks.allowed(middle[0]) is masks.allowed(middle[1]) is masks.allowed(middle[2])  # one entry
    rng = random.Random(1)
    for _ in range(40):  # stacks that differ near the top: new entries, but the cache stays bounded
        text = '{"a": ' + "".join(rng.choice(["[", '{"k": ']) for _ in range(rng.randint(1, 30)))
        masks.allowed(cursor_after(masks, text))
    assert len(masks._cache) <= 512


def test_an_end_token_with_text_waits_for_the_object_to_close():
    texts = ["{", "}", '"', "a", ":", "1", ","]
    comma = 6
    masks = JsonMasks(texts, {comma}, len(texts))  # a vocabulary whose end token is ","
    cursor = JsonCursor()
    for token in (0, 2, 3, 2, 4, 5):  # {"a":1
        cursor = masks.advance(cursor, token)
    assert not masks.allowed(cursor)[comma] and masks.allowed(cursor)[1]
    done = masks.advance(cursor, 1)
    assert masks.allowed(done).nonzero().flatten().tolist() == [comma]
