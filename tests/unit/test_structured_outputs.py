"""Structured outputs on llguidance: the grammars (common/structured_outputs.py) on the default
model's vocabulary, a step's masks (workers/engine/grammar_masks.py) and the sampler under them."""

from __future__ import annotations

import json
import random
import re
from typing import Literal

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from pagemesh.common.sampling import SamplingParams
from pagemesh.common.structured_outputs import Grammars, grammar_text, ll_tokenizer
from pagemesh.tests.default_model import tokenizer as default_tokenizer
from pagemesh.workers.engine.grammar_masks import GrammarMasks
from pagemesh.workers.engine.sampler import SampleRow, apply_token_bitmask, argmax_only, sample
from pagemesh.workers.engine.scheduler import ScheduledChunk, StepPlan
from pagemesh.workers.engine.sequence import Sequence


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


KEYWORDS = {  # what the hand-written automaton refused, and the enum / anyOf / $ref it took
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owners": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1, "maxItems": 3},
        "color": {"enum": ["black", "white", "ginger"]},
        "home": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
    },
    "required": ["name", "age", "owners", "color"],
    "additionalProperties": False,
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}}},
}
# for random walks: an email's local part takes most tokens (a walk would wander there), a uuid has an end
WALKED = {
    **KEYWORDS,
    "properties": {
        **KEYWORDS["properties"],
        "owners": {"type": "array", "items": {"type": "string", "format": "uuid"}, "minItems": 1, "maxItems": 3},
    },
}
STRUCTURAL_TAG = {  # vLLM's form: free text, and in it calls whose arguments follow their schema
    "structures": [
        {
            "begin": "<call=f>",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            "end": "</call>",
        }
    ],
    "triggers": ["<call="],
}
TOOL_CALLS = {  # what tool_choice "required" holds the answer to: 1 to 2 calls of declared tools
    "type": "array",
    "minItems": 1,
    "maxItems": 2,
    "items": {
        "type": "object",
        "properties": {"name": {"enum": ["f"]}, "parameters": {"type": "object"}},
        "required": ["name", "parameters"],
    },
}


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(ll_tokenizer(tok))


def schema_params(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0, json_schema=json.dumps(schema))


def accepts(grammars, tok, params: SamplingParams, text: str) -> bool:
    """The grammar takes `text` (as the tokenizer writes it) whole."""
    matcher = grammars.matcher(params)
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def bitmask_of(matcher, vocab: int) -> torch.Tensor:
    """int32 [ceil(vocab / 32)]: the tokens `matcher` allows next, as llguidance packs them."""
    return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)[: -(-vocab // 32)]


def allowed_mask(matcher, vocab: int) -> torch.Tensor:
    """bool [vocab]: the tokens `matcher` allows next."""
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, [0], bitmask_of(matcher, vocab).unsqueeze(0))
    return logits[0] == 0


def allowed_ids(matcher, vocab: int) -> list[int]:
    return allowed_mask(matcher, vocab).nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def kinds(tok) -> dict[str, torch.Tensor]:
    """bool [vocab] per kind of token: end tokens, whitespace only, closing something (a quote, a
    bracket, a digit)."""
    texts = [tok.token_text(i) for i in range(tok.vocab_size)]
    return {
        "end": torch.tensor([i in tok.eos_token_ids for i in range(tok.vocab_size)]),
        "space": torch.tensor([t != "" and t.isspace() for t in texts]),
        "closing": torch.tensor([any(c in t for c in '"]}0123456789') for t in texts]),
    }


def random_output(matcher, tok, kinds, rng: random.Random, limit: int = 300) -> str | None:
    """A random walk over the masks, steered to an end; the text once an end token is taken (None if
    it never ends). Every mask on the way must allow some token: a grammar has no dead end."""
    ids: list[int] = []
    for step in range(limit):
        allowed = allowed_mask(matcher, tok.vocab_size)
        assert allowed.any(), ("dead end", tok.decode(ids))
        choices = allowed & ~kinds["end"]
        if (allowed & kinds["end"]).any() and (not choices.any() or rng.random() < 0.5):
            return tok.decode(ids)
        for kind in ("space", "closing"):  # steer: past whitespace, then (after a while) to an end
            steered = choices & kinds[kind] if kind == "closing" else choices & ~kinds[kind]
            if steered.any() and (kind == "space" or (step > 20 and rng.random() < 0.8)):
                choices = steered
        candidates = choices.nonzero().flatten().tolist()
        token = candidates[rng.randrange(len(candidates))]
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    return None


# --------------------------------------------------------------------------- the grammars


def test_every_instance_pydantic_writes_is_accepted(grammars, tok):
    params = schema_params(Person.model_json_schema())
    rng = random.Random(1)
    for _ in range(40):
        person = Person(
            name=rng.choice(['x"y', "é✓", "", "🦜"]),
            score=rng.uniform(-5, 5),
            ok=rng.random() < 0.5,
            nick=rng.choice([None, "n"]),
            tags=["a"] * rng.randint(0, 2),
            pets=[Pet(kind=rng.choice(["cat", "dog"]), age=rng.choice([None, 3])) for _ in range(rng.randint(0, 3))],
            extra=rng.choice([{}, {"k": [1, {"z": None}]}]),
        )
        text = person.model_dump_json(indent=rng.choice([None, 2]))
        assert accepts(grammars, tok, params, text), text


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "A", "pets": []}',  # a required property missing
        '{"name": 1, "score": 1, "pets": []}',
        '{"name": "A", "score": 1, "pets": [{"kind": "cow"}]}',
        '{"name": "A", "score": 1, "pets": [{"age": 3}]}',
        '{"name": "A", "score": 1, "pets": [{"kind": "cat", "age": 3.5}]}',
        '{"name": "A", "score": 1, "pets": [],}',
        '{"name": "A", "score": true, "pets": []}',
        '["A"]',
    ],
)
def test_documents_outside_the_schema_are_refused(grammars, tok, text):
    assert not accepts(grammars, tok, schema_params(Person.model_json_schema()), text)


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"name": "Tom", "age": 4, "owners": ["ann@example.com"], "color": "ginger"}', True),
        ('{"name": "Tom", "age": 4, "owners": ["a@b.co"], "color": "black", "home": {"city": "Oslo"}}', True),
        ('{"name": "Tom", "age": 4, "owners": ["a@b.co"], "color": "black", "home": null}', True),
        ('{"name": "tom", "age": 4, "owners": ["a@b.co"], "color": "black"}', False),  # pattern
        ('{"name": "Tom", "age": 31, "owners": ["a@b.co"], "color": "black"}', False),  # maximum
        ('{"name": "Tom", "age": -1, "owners": ["a@b.co"], "color": "black"}', False),  # minimum
        ('{"name": "Tom", "age": 4, "owners": [], "color": "black"}', False),  # minItems
        ('{"name": "Tom", "age": 4, "owners": ["a@b.co", "a@b.co", "a@b.co", "a@b.co"], "color": "black"}', False),
        ('{"name": "Tom", "age": 4, "owners": ["not an email"], "color": "black"}', False),  # format
        ('{"name": "Tom", "age": 4, "owners": ["a@b.co"], "color": "grey"}', False),  # enum
        ('{"name": "Tom", "age": 4, "owners": ["a@b.co"], "color": "black", "x": 1}', False),  # additionalProperties
        (
            '{"name": "Tom", "age": 4, "owners": ["a@b.co"], "color": "black", "home": {"city": "Llanfairpwllgw"}}',
            False,
        ),
    ],
)
def test_the_keywords_the_automaton_refused_are_enforced(grammars, tok, text, ok):
    assert accepts(grammars, tok, schema_params(KEYWORDS), text) is ok
    assert (
        jsonschema.Draft202012Validator(KEYWORDS, format_checker=jsonschema.FormatChecker()).is_valid(json.loads(text))
        is ok
    )  # the grammar agrees with a validator


@pytest.mark.parametrize(
    "schema", [WALKED, TOOL_CALLS, Person.model_json_schema()], ids=["keywords", "tools", "pydantic"]
)
def test_every_output_a_random_walk_over_the_masks_ends_is_valid_against_the_schema(grammars, tok, kinds, schema):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    rng = random.Random(0)
    outputs = [random_output(grammars.matcher(schema_params(schema)), tok, kinds, rng) for _ in range(6)]
    assert sum(o is not None for o in outputs) >= 4
    for text in outputs:
        if text is not None:
            assert validator.is_valid(json.loads(text)), text


def test_an_array_root_holds_its_item_bounds(grammars, tok):
    """tool_choice "required" writes a list of calls: 1 to 2 items here, each one object."""
    params = schema_params(TOOL_CALLS)
    one = '{"name": "f", "parameters": {}}'
    assert [
        accepts(grammars, tok, params, f"[{body}]") for body in ("", one, f"{one}, {one}", f"{one},{one},{one}")
    ] == [
        False,
        True,
        True,
        False,
    ]
    matcher = grammars.matcher(params)
    [bracket] = tok.encode("[", add_special_tokens=False)
    matcher.consume_token(bracket)
    [close] = tok.encode("]", add_special_tokens=False)
    assert close not in allowed_ids(matcher, tok.vocab_size)  # refused as it is written, not only at the end


@pytest.mark.parametrize(
    "structured, good, bad",
    [
        (("regex", r"[0-9]{3}-[0-9]{4}"), ["555-1234"], ["555-12345", "5551234", "555-123"]),
        (("choice", '["yes", "no", "é \\"quoted\\""]'), ["yes", "no", 'é "quoted"'], ["ye", "yes!", "maybe"]),
        (("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), ["(1)", "(12+3+45)"], ["()", "(1+)", "1+2"]),
        (("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'), ["(1+2)"], ["(1+x)"]),  # Lark
        (
            ("structural_tag", json.dumps(STRUCTURAL_TAG)),
            ["no call at all", 'ok <call=f>{"a": 1}</call> then text'],
            ['ok <call=f>{"a": "x"}</call>', 'ok <call=f>{"b": 1}</call>'],
        ),
    ],
    ids=["regex", "choice", "ebnf", "lark", "structural_tag"],
)
def test_regex_choice_grammar_and_structural_tag_take_exactly_their_language(grammars, tok, structured, good, bad):
    params = SamplingParams(temperature=0, structured=structured)
    for text in good:
        assert accepts(grammars, tok, params, text), text
    for text in bad:
        assert not accepts(grammars, tok, params, text), text


@pytest.mark.parametrize(
    "params, why",
    [
        (schema_params({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "uniqueItems"),
        (schema_params({"not": {"type": "string"}}), "not"),
        (schema_params({"type": "integer", "if": {"minimum": 1}, "then": {"maximum": 2}}), "if"),
        (schema_params({"type": "string", "format": "phone"}), "phone"),
        (schema_params({"type": "string", "pattern": "[a-"}), "unclosed character class"),
        (schema_params({"oneOf": [{"type": "integer"}, {"type": "number"}]}), "oneOf"),
        (SamplingParams(structured=("regex", "(?=a)b")), "look-around"),
        (SamplingParams(structured=("grammar", 'root ::= "a" | b')), "b"),
        (SamplingParams(structured=("choice", "[]")), "non-empty list"),
        (SamplingParams(structured=("structural_tag", '{"structures": [], "triggers": ["<"]}')), "structures"),
        (SamplingParams(structured=("structural_tag", '{"format": {}}')), "vLLM's form"),
        (
            SamplingParams(
                structured=(
                    "structural_tag",
                    '{"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": ["<g"]}',
                )
            ),
            "none of the triggers",
        ),
    ],
)
def test_grammars_it_cannot_enforce_are_refused_naming_the_field_and_the_reason(grammars, params, why):
    with pytest.raises(ValueError, match=f"^{params.constraint_field}: .*{why}"):
        grammars.check(params)


def test_each_grammar_compiles_once_and_the_least_recently_used_goes_first(tok):
    grammars = Grammars(ll_tokenizer(tok), capacity=2)
    first, second, third = (SamplingParams(structured=("regex", f"a{{{i}}}")) for i in (1, 2, 3))
    for params in (first, second, first, first):
        grammars.check(params)
    assert grammars.compiles == 2
    one, other = grammars.matcher(first), grammars.matcher(first)
    [a] = tok.encode("a", add_special_tokens=False)
    assert one.consume_token(a) and other.validate_tokens([a]) == 1  # each sequence has its own copy
    grammars.check(third)  # evicts `second`, used least recently
    grammars.check(first)
    assert grammars.compiles == 3
    grammars.check(second)
    assert grammars.compiles == 4
    assert grammar_text(SamplingParams(json_object=True)) == grammar_text(schema_params({"type": "object"}))


def test_end_tokens_only_once_the_grammar_is_satisfied(grammars, tok):
    ends = sorted(tok.eos_token_ids)
    matcher = grammars.matcher(SamplingParams(json_object=True))
    matcher.consume_tokens(tok.encode('{"a": 1', add_special_tokens=False))
    allowed = allowed_ids(matcher, tok.vocab_size)
    assert not set(ends) & set(allowed) and tok.encode("}", add_special_tokens=False)[0] in allowed
    matcher.consume_tokens(tok.encode("}", add_special_tokens=False))
    assert matcher.is_stopped() and allowed_ids(matcher, tok.vocab_size) == ends


def test_the_constraint_crosses_the_wire_and_a_peers_malformed_one_is_refused():
    from pagemesh.common import protocol
    from pagemesh.common.messages import ScheduleRequest

    for sampling in (
        SamplingParams(structured=("choice", '["yes", "no"]'), n=2),
        SamplingParams(json_schema=json.dumps(KEYWORDS)),
        SamplingParams(json_object=True),
    ):
        msg = ScheduleRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling=sampling, reply_to="t", arrival_time=1.0
        )
        assert protocol.decode(protocol.encode(msg)) == msg
    bad = ScheduleRequest(
        request_id="r", prompt_token_ids=[1], sampling=SamplingParams(), reply_to="t", arrival_time=1.0
    )
    frames = protocol.encode(bad)
    tampered = frames[1].replace(b"\xaastructured\xc0", b"\xaastructured\x92\xa4yaml\xa1x")  # ["yaml", "x"]
    assert tampered != frames[1]
    with pytest.raises(protocol.ProtocolError, match="structured"):
        protocol.decode([frames[0], tampered])


def test_whitespace_between_json_tokens_is_one_line_break_and_an_indent_unless_the_request_says(grammars, tok):
    """A small model that starts writing blank lines may not stop: the default allows one line break
    and up to 32 spaces between two JSON tokens; the request's whitespace options replace it."""
    [newline] = tok.encode("\n", add_special_tokens=False)

    def takes(params: SamplingParams, between: str) -> bool:
        matcher = grammars.matcher(params)
        matcher.consume_tokens(tok.encode("{", add_special_tokens=False))
        ids = [newline if c == "\n" else tok.encode(c, add_special_tokens=False)[0] for c in between] + tok.encode(
            '"a":1}', add_special_tokens=False
        )
        return matcher.validate_tokens(ids) == len(ids)

    pretty = SamplingParams(json_object=True)
    assert [takes(pretty, ws) for ws in ("", " ", "\n", "\n" + " " * 32, "\n\n", "\n" + " " * 33)] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    free = schema_params({"type": "object", "x-guidance": {"whitespace_pattern": "[\\n ]*"}})
    assert takes(free, "\n\n\n   \n")
    none = schema_params({"type": "object", "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}})
    assert [takes(none, ws) for ws in ("", " ")] == [True, False]


# --------------------------------------------------------------------------- the engine's side


def test_the_sampler_takes_only_allowed_tokens(grammars, tok):
    matcher = grammars.matcher(SamplingParams(json_object=True))
    matcher.consume_tokens(tok.encode('{"a": ', add_special_tokens=False))
    bitmask = bitmask_of(matcher, tok.vocab_size).unsqueeze(0)
    allowed = set(allowed_ids(matcher, tok.vocab_size))
    logits = torch.randn(5, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    rows = [
        SampleRow(SamplingParams(temperature=t, seed=s), [], [], torch.Generator().manual_seed(s), allowed=bitmask[0])
        for t, s in ((0, 1), (1.0, 2), (1.5, 3), (0.7, 4))
    ]
    rows.append(SampleRow(SamplingParams(temperature=0), [], [], None))  # unconstrained, beside them
    assert not argmax_only(rows[0])
    results = sample(logits.clone(), rows, torch.Generator())
    assert all(token in allowed for token, _ in results[:4])
    assert results[4][0] == int(logits[4].argmax())


def test_a_bitmask_on_some_rows_leaves_the_others_as_they_were():
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(1))
    packed = torch.zeros(1, 3, dtype=torch.int32)
    packed[0, 0] = (1 << 5) - (1 << 31)  # tokens 5 and 31 (bit 31: the sign of an int32)
    packed[0, 2] = 1 << 3  # token 67 (68, 69 are beyond the vocabulary's 70: ignored)
    masked = logits.clone()
    apply_token_bitmask(masked, [1], packed)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert (masked[1] > float("-inf")).nonzero().flatten().tolist() == [5, 31, 67]


def constrained_seq(grammars, tok, params: SamplingParams, text: str) -> Sequence:
    prompt = [1, 2, 3]
    output = tok.encode(text, add_special_tokens=False)
    seq = Sequence("r", 0, prompt + output, len(prompt), params, num_computed=len(prompt) + len(output) - 1)
    seq.grammar = grammars.matcher(params)
    seq.grammar.consume_tokens(output)
    return seq


@pytest.mark.parametrize("overlap", [True, False])
def test_a_steps_masks_follow_each_rows_drafts_and_leave_the_matchers_where_they_were(tok, overlap):
    masks_of = GrammarMasks(tok, tok.vocab_size, tok.eos_token_ids, overlap=overlap)
    params = SamplingParams(temperature=0, json_object=True)
    plain = constrained_seq(masks_of.grammars, tok, params, '{"a": 1')
    drafting = constrained_seq(masks_of.grammars, tok, params, '{"b": ')
    free = Sequence("f", 0, [1, 2, 3], 2, SamplingParams(temperature=0))
    good = tok.encode('"x"}', add_special_tokens=False)
    drafts = good + tok.encode("}", add_special_tokens=False)  # the last draft breaks the grammar
    plan = StepPlan(
        chunks=[
            ScheduledChunk(plain, plain.num_computed, 1),
            ScheduledChunk(free, 2, 1),
            ScheduledChunk(drafting, drafting.num_computed, 1 + len(drafts), drafts),
        ]
    )
    masks = masks_of.launch(plan).result()
    assert masks.row(free) is None
    expected = constrained_seq(masks_of.grammars, tok, params, '{"a": 1').grammar
    assert torch.equal(masks.row(plain)[0], bitmask_of(expected, tok.vocab_size))
    reference = constrained_seq(masks_of.grammars, tok, params, '{"b": ').grammar
    for j in range(len(good) + 1):  # row j: after drafts[:j]
        mask, stopped = masks.row(drafting, j)
        assert torch.equal(mask, bitmask_of(reference, tok.vocab_size)) and stopped == reference.is_stopped()
        if j < len(good):
            reference.consume_token(good[j])
    assert masks.row(drafting, j)[1]  # the object closed after the good drafts: only an end token
    assert (masks.row(drafting, len(drafts))[0] == -1).all()  # after the refused draft: never used
    assert torch.equal(masks_of.launch(plan).result().bitmask, masks.bitmask)  # the drafts were rolled back


@pytest.fixture(scope="module")
def tiny_engine(tok):
    """A one-layer random model over the default tokenizer's vocabulary: its tokens are noise, so
    only the grammar shapes its answers."""
    from pagemesh.common.model_config import ModelConfig
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.model.loader import build_random_model

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=sorted(tok.eos_token_ids)[0],
    )
    model = build_random_model(cfg, torch.float32, torch.device("cpu"))
    config = EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=4, enable_prefix_caching=False)
    return Engine(config, model=model, tokenizer=tok)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_random_model_under_a_grammar_answers_in_it_whether_masks_come_with_the_step_or_not(
    tiny_engine, tok, pipelined
):
    """`pipelined`: the step is applied without launched masks (a pipeline stage's step), so the
    update fills them itself."""
    from pagemesh.workers.engine.model_input import build_model_input

    engine = tiny_engine
    choices = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, structured=("choice", '["yes", "no"]'))
    digits = SamplingParams(temperature=1.0, seed=4, max_tokens=8, structured=("regex", "[0-9]{4}"))
    engine.add_request("choice", [5, 6, 7], choices)
    engine.add_request("digits", [8, 9], digits)
    texts: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        if pipelined:
            plan = engine.scheduler.schedule()
            outputs = engine.apply_step(plan, plan, engine.runner.execute(build_model_input(plan)), 0.0)
        else:
            outputs = engine.step()
        for out in outputs:
            for so in out.outputs:
                texts.setdefault((out.request_id, so.index), []).extend(so.new_token_ids)
    answers = {key: tok.decode(ids) for key, ids in texts.items()}
    assert sorted(answers) == [("choice", 0), ("choice", 1), ("choice", 2), ("digits", 0)]
    assert all(answers[("choice", i)] in ("yes", "no") for i in range(3)), answers
    assert re.fullmatch("[0-9]{4}", answers[("digits", 0)]), answers
    engine.blocks.check_invariants([])
