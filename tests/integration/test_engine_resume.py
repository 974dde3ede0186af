"""A request resumed on an engine after its worker was lost (request migration): with the tokens it
generated before, it generates on exactly as the first engine would have, reports none of them
again, and counts them as output (max_tokens, min_tokens, penalties, the seed's draws)."""

from __future__ import annotations

import pytest

from pagemesh.common.sampling import SamplingParams

PROMPT = list(range(700, 737))


def run(engine, request_id: str, params: SamplingParams, output_token_ids=()) -> tuple[list[int], str | None]:
    """One request to its end: the tokens it reported and its finish reason."""
    engine.add_request(request_id, PROMPT, params, output_token_ids=output_token_ids)
    tokens: list[int] = []
    reason = None
    while request_id in engine.requests:
        for out in engine.step():
            if out.request_id == request_id:
                for so in out.outputs:
                    tokens += so.new_token_ids
                    reason = so.finish_reason or reason
    return tokens, reason


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, presence_penalty=1.0, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "seeded with a frequency penalty", "greedy with penalties"],
)
@pytest.mark.parametrize("cut", [1, 23])
def test_a_resumed_request_continues_as_the_fault_free_run(engine_fp32, params, cut):
    whole, reason = run(engine_fp32, "whole", params)
    assert len(whole) == 24 and reason == "length"
    rest, rest_reason = run(engine_fp32, "resumed", params, output_token_ids=whole[:cut])
    assert rest == whole[cut:]  # nothing repeated, nothing lost, the same tokens
    assert rest_reason == "length"  # max_tokens counted the resumed tokens as output
    assert engine_fp32.blocks.num_used_pages == 0
    engine_fp32.blocks.check_invariants([])


def test_min_tokens_counts_the_tokens_generated_before(engine_fp32):
    free, _ = run(engine_fp32, "free", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_at = free[6]
    first = free.index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    # resumed after `first` tokens, with min_tokens just past them: the stop token is held back
    # one more token only if the earlier tokens count towards min_tokens
    held = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,), min_tokens=first + 1
    )
    stopped, reason = run(engine_fp32, "stops", params, output_token_ids=free[:first])
    assert stopped == [stop_at] and reason == "stop"
    later, _ = run(engine_fp32, "held", held, output_token_ids=free[:first])
    assert later[0] != stop_at


@pytest.mark.parametrize(
    "params, output, field",
    [
        (SamplingParams(max_tokens=4), [1, 2, 3, 4], "output_token_ids"),
        (SamplingParams(max_tokens=8, n=2), [1], "output_token_ids"),
        (SamplingParams(max_tokens=8), [49152], "output_token_ids"),
    ],
)
def test_a_resume_that_cannot_be_is_a_value_error(engine_fp32, params, output, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine_fp32.add_request("bad", PROMPT, params, output_token_ids=output)
    assert "bad" not in engine_fp32.requests


def run_choices(engine, request_id: str, params: SamplingParams, resumed_choices=()) -> dict[int, list[int]]:
    """A request of several choices to its end: the tokens each choice reported, by index."""
    engine.add_request(request_id, PROMPT, params, resumed_choices=resumed_choices)
    tokens: dict[int, list[int]] = {}
    while request_id in engine.requests:
        for out in engine.step():
            if out.request_id == request_id:
                for so in out.outputs:
                    tokens.setdefault(so.index, []).extend(so.new_token_ids)
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=77, max_tokens=16, ignore_eos=True),
        SamplingParams(n=3, temperature=0.8, max_tokens=16, ignore_eos=True, seed=5, presence_penalty=1.0),
    ],
    ids=["seeded", "seeded with a penalty"],
)
def test_each_unfinished_choice_of_several_continues_as_the_fault_free_run(engine_fp32, params):
    """Choices 0 and 2 resumed after 5 and 11 tokens (choice 1 had ended: it is not asked for):
    each goes on with its own seed's draws (seed + index) as in the run without the fault."""
    whole = run_choices(engine_fp32, "several", params)
    assert sorted(whole) == [0, 1, 2] and all(len(t) == 16 for t in whole.values())
    assert len({tuple(t) for t in whole.values()}) == 3  # three different choices
    rest = run_choices(engine_fp32, "several-resumed", params, [(0, whole[0][:5]), (2, whole[2][:11])])
    assert rest == {0: whole[0][5:], 2: whole[2][11:]}
    assert engine_fp32.blocks.num_used_pages == 0
    engine_fp32.blocks.check_invariants([])
