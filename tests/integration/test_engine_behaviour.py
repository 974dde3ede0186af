"""Engine behaviour on the real model: memory use, sharing, seeds, bad input, abort."""

import json
import random

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine

pytestmark = pytest.mark.slow


def live_tables(engine):
    return [s.block_table for s in engine.scheduler.live_sequences]


def test_kv_utilization_of_a_mixed_length_run_is_at_least_95_percent():
    engine = Engine(EngineConfig(dtype="auto", max_num_batched_tokens=256, num_pages=2048, enable_prefix_caching=False))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(100, 400))] for _ in range(12)]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(8, 40)) for _ in prompts]
    engine.generate(prompts, params)
    assert engine.stats.steps > 40
    assert engine.stats.mean_kv_utilization >= 0.95
    assert engine.blocks.num_used_pages == 0


def test_parallel_samples_share_the_prompt_pages(engine_fp32):
    prompt = list(range(1000, 1000 + 70))  # 4 full pages + 6 tokens in a shared partial page
    engine_fp32.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
    used_before = engine_fp32.blocks.num_used_pages
    while not any(len(s.token_ids) > len(prompt) for s in engine_fp32.requests["n4"].seqs):
        engine_fp32.step()
    seqs = engine_fp32.requests["n4"].seqs
    assert len(seqs) == 4
    assert len({tuple(s.block_table) for s in seqs}) == 1  # all four share the same 5 pages
    assert engine_fp32.blocks.num_used_pages - used_before == 5
    engine_fp32.blocks.check_invariants(live_tables(engine_fp32))
    engine_fp32.step()  # each writes its first token into the shared partial page: copy-on-write
    tables = [s.block_table for s in seqs]
    assert len({t[:4] for t in map(tuple, tables)}) == 1  # full pages still shared
    assert len({t[4] for t in tables}) == 4  # the partial page now private to each
    engine_fp32.blocks.check_invariants(live_tables(engine_fp32))
    outputs = {}
    while engine_fp32.has_unfinished():
        for out in engine_fp32.step():
            for so in out.outputs:
                outputs.setdefault(so.index, []).extend(so.new_token_ids)
    assert sorted(outputs) == [0, 1, 2, 3]
    assert engine_fp32.blocks.num_used_pages == 0


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch(engine_fp32):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = list(range(500, 540))
    [alone] = engine_fp32.generate([prompt], seeded)
    others = [list(range(2000 + 7 * i, 2030 + 9 * i)) for i in range(5)]
    results = engine_fp32.generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=25)] * 2
        + [seeded]
        + [SamplingParams(temperature=1.0, max_tokens=25)] * 3,
    )
    assert results[2].token_ids == alone.token_ids
    [again] = engine_fp32.generate([prompt], seeded)
    assert again.token_ids == alone.token_ids


def test_stop_tokens_min_tokens_and_max_tokens(engine_fp32):
    prompt = list(range(300, 330))
    [free] = engine_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_at = free.token_ids[0][4]
    first = free.token_ids[0].index(stop_at)
    [stopped] = engine_fp32.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    )
    assert stopped.token_ids[0] == free.token_ids[0][: first + 1] and stopped.finish_reasons == ["stop"]
    [held] = engine_fp32.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,), min_tokens=first + 2),
    )
    assert stop_at not in held.token_ids[0][: first + 2]
    assert len(free.token_ids[0]) == 12 and free.finish_reasons == ["length"]


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([5, 49152], SamplingParams(), "prompt"),
        ([-1], SamplingParams(), "prompt"),
        ([1] * 1024, SamplingParams(), "prompt"),
        ([1] * 1000, SamplingParams(max_tokens=100), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field_and_the_engine_keeps_serving(engine_fp32, prompt, params, field):
    engine_fp32.add_request("good", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine_fp32.step()
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine_fp32.add_request("bad", prompt, params)
    assert "bad" not in engine_fp32.requests
    done = False
    while not done:
        done = any(o.finished for o in engine_fp32.step())
    assert engine_fp32.blocks.num_used_pages == 0
    engine_fp32.blocks.check_invariants([])


def test_abort_frees_pages_mid_generation(engine_fp32):
    engine_fp32.add_request("a", list(range(100, 180)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine_fp32.add_request("b", list(range(200, 230)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(4):
        engine_fp32.step()
    assert engine_fp32.abort("a") and not engine_fp32.abort("a")
    outs = []
    while engine_fp32.has_unfinished():
        outs += engine_fp32.step()
    assert all(o.request_id == "b" for o in outs)
    assert engine_fp32.blocks.num_used_pages == 0
    engine_fp32.blocks.check_invariants([])


def test_prefix_cache_reuses_pages_of_an_earlier_prompt(engine_fp32):
    shared = list(range(5000, 5000 + 64))
    engine_fp32.generate([shared + [7, 8, 9]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine_fp32.add_request("again", shared + [10, 11], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outs = []
    while engine_fp32.has_unfinished():
        outs += engine_fp32.step()
    assert outs[-1].num_cached_tokens == 64


def test_each_parallel_sample_continues_its_own_first_token(engine_fp32):
    """Regression: forks were made after the parent took its token, so every sibling carried
    the parent's first token in front of its own."""
    prompt = list(range(700, 720))
    engine_fp32.add_request("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True))
    streamed: dict[int, list[int]] = {}
    seqs = []
    while engine_fp32.has_unfinished():
        if "n3" in engine_fp32.requests:
            seqs = list(engine_fp32.requests["n3"].seqs)
        for out in engine_fp32.step():
            for so in out.outputs:
                streamed.setdefault(so.index, []).extend(so.new_token_ids)
    assert sorted(streamed) == [0, 1, 2] and len(seqs) == 3
    for seq in seqs:
        assert seq.token_ids == prompt + streamed[seq.index]


def takes_whole(engine, params: SamplingParams, token_ids: list[int]) -> bool:
    """A fresh matcher of the request's grammar takes every token it generated (an end token aside)."""
    matcher = engine.grammar_masks.grammars.matcher(params)
    ids = [t for t in token_ids if t not in engine.eos_token_ids]
    return matcher.validate_tokens(ids) == len(ids)


def test_json_mode_outputs_are_json_objects_or_valid_prefixes_of_one(engine_fp32):
    tok = engine_fp32.tokenizer
    asks = [
        "Give me a JSON object describing a cat with its name and age.",
        "List three fruits as JSON.",
        "What is the capital of France?",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": a}]) for a in asks]
    greedy = SamplingParams(temperature=0, max_tokens=80, json_object=True)
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=80, json_object=True)
    results = [(greedy, r) for r in engine_fp32.generate(prompts, greedy)]
    results += [(sampled, r) for r in engine_fp32.generate(prompts, sampled)]
    finished = 0
    for params, r in results:
        for text, ids, reason in zip(r.texts, r.token_ids, r.finish_reasons):
            if reason == "stop":  # an end token, allowed only once the object closed
                assert isinstance(json.loads(text), dict), text
                finished += 1
            else:
                assert reason == "length" and takes_whole(engine_fp32, params, ids), text
    assert finished >= 3
    plain = engine_fp32.generate(prompts[2:], SamplingParams(temperature=0, max_tokens=20))[0].texts[0]
    assert not plain.lstrip().startswith("{")  # without JSON mode the model answers in prose
    engine_fp32.blocks.check_invariants([])


def test_json_mode_goes_on_after_a_handoff_from_the_first_token(engine_fp32):
    """The decode side of 1P+1D: the grammar resumes after the prefill worker's first token. The
    pages are not written here (they hold whatever they held), so only the grammar keeps the output JSON."""
    tok = engine_fp32.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a cat."}])
    [brace] = tok.encode("{", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, json_object=True)
    engine_fp32.import_prefilled("handed-off", prompt, params, [brace], lambda pages: None)
    ids = [brace]
    while engine_fp32.has_unfinished():
        for out in engine_fp32.step():
            ids += [t for so in out.outputs for t in so.new_token_ids]
    assert len(ids) > 1 and takes_whole(engine_fp32, params, ids)


def test_json_schema_outputs_validate_against_the_schema(engine_fp32):
    from typing import Annotated, Literal

    import jsonschema
    from pydantic import BaseModel, ConfigDict, Field, StringConstraints

    class Cat(BaseModel):
        model_config = ConfigDict(extra="forbid")  # additionalProperties false: else any other key may follow
        name: str = Field(pattern="^[A-Z][a-z]+$")
        age: int = Field(ge=0, le=30)
        color: Literal["black", "white", "ginger"]
        toys: list[Annotated[str, StringConstraints(max_length=12)]] = Field(min_length=1, max_length=3)
        owner: Annotated[str, StringConstraints(max_length=20)] | None = None

    tok = engine_fp32.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a cat."}])
    params = SamplingParams(
        temperature=0.9, seed=7, n=3, max_tokens=80, json_schema=json.dumps(Cat.model_json_schema())
    )
    [result] = engine_fp32.generate([prompt], params)
    finished = [text for text, reason in zip(result.texts, result.finish_reasons) if reason == "stop"]
    assert finished, list(zip(result.texts, result.finish_reasons))
    for text in finished:
        Cat.model_validate_json(text, strict=True)
        jsonschema.validate(json.loads(text), Cat.model_json_schema())
    with pytest.raises(ValueError, match="^json_schema: .*uniqueItems"):
        engine_fp32.add_request(
            "bad-schema",
            prompt,
            SamplingParams(json_schema=json.dumps({"type": "array", "uniqueItems": True})),
        )
    assert "bad-schema" not in engine_fp32.requests


def test_regex_choice_and_grammar_outputs_are_in_their_language(engine_fp32):
    import re

    tok = engine_fp32.tokenizer
    ask = [tok.encode_chat([{"role": "user", "content": q}]) for q in ("Is the sky blue?", "What is 12 + 30?")]
    runs = {
        "regex": SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=12, structured=("regex", r"[0-9]{2,3}")),
        # min_tokens cannot hold the output past the grammar's end: the end token comes after the choice
        "choice": SamplingParams(temperature=0, max_tokens=12, min_tokens=8, structured=("choice", '["yes", "no"]')),
        "grammar": SamplingParams(
            temperature=0, max_tokens=24, structured=("grammar", 'root ::= [0-9]+ " + " [0-9]+ " = " [0-9]+')
        ),
    }
    results = {kind: engine_fp32.generate(ask, params) for kind, params in runs.items()}
    for r in results["regex"]:
        for text, reason in zip(r.texts, r.finish_reasons):
            assert reason == "stop" and re.fullmatch(r"[0-9]{2,3}", text), text
    for r in results["choice"]:
        assert r.texts[0] in ("yes", "no") and r.finish_reasons == ["stop"], r.texts
    for r in results["grammar"]:
        assert re.fullmatch(r"[0-9]+ \+ [0-9]+ = [0-9]+", r.texts[0]) or r.finish_reasons == ["length"], r.texts
    engine_fp32.blocks.check_invariants([])
