"""A stream moved to another tokenizer replica (GenerateRequest.resume): the new replica rebuilds
each choice from the ids and the text its client has had, schedules it as a migration, and the text
goes on exactly where the lost replica left it, held-back stop-string text included."""

from __future__ import annotations

import dataclasses

from pagemesh.common.messages import ResumedChoice, ResumedText, ResumeState, ScheduleRequest
from pagemesh.tests.unit.test_tokenizer_migration import from_worker, texts
from pagemesh.tests.unit.test_tokenizer_service import GATEWAY_A, core, ids_of, request, tokens


def client_view(out) -> tuple[list[int], int, bool]:
    """What a gateway got from one TokenOutputs, for choice 0: ids, characters, finished."""
    deltas = out.batches[GATEWAY_A].deltas if GATEWAY_A in out.batches else []
    return (
        [i for d in deltas for i in d.token_ids],
        sum(len(d.text) for d in deltas),
        any(d.finish_reason for d in deltas),
    )


def streamed_in_steps(c, ids: list[int], worker: str = "w0", rid: str = "r1") -> tuple[str, list[int], int]:
    """Feed ids one step each; the text, ids and characters the gateway received."""
    text, got, chars = "", [], 0
    for n, token in enumerate(ids):
        out = from_worker(c, worker, tokens(rid, 0, [token]), started=(rid,) if n == 0 else ())
        text += texts(out)
        step_ids, step_chars, _ = client_view(out)
        got += step_ids
        chars += step_chars
    return text, got, chars


def test_a_moved_stream_goes_on_with_the_same_text_as_one_replica_gives():
    ids = ids_of(" Hello there, general Kenobi. You are a bold one.")
    one = core()
    one.admit(request(text="Hi", max_tokens=40))
    whole, _, _ = streamed_in_steps(one, ids)
    lost = core()
    lost.admit(request(text="Hi", max_tokens=40))
    before, got, chars = streamed_in_steps(lost, ids[:5])
    moved = request("r1~1", text="Hi", max_tokens=40)
    moved = dataclasses.replace(
        moved, resume=[ResumedText(index=0, output_token_ids=got, text_chars=chars, finished=False)]
    )
    c = core()
    schedule = c.admit(moved)
    assert isinstance(schedule, ScheduleRequest)
    assert schedule.request_id == "r1~1" and schedule.resume == ResumeState(output_token_ids=ids[:5], migrations=1)
    after, _, _ = streamed_in_steps(c, ids[5:], worker="w1", rid="r1~1")
    assert before + after == whole
    last = from_worker(c, "w1", tokens("r1~1", 0, [], finish="length"))
    assert last.batches[GATEWAY_A].deltas[-1].completion_tokens == len(ids)  # the count goes on too


def test_text_the_lost_replica_held_back_for_a_stop_string_is_sent_by_the_new_one():
    ids = ids_of(" one two wor three world")
    lost = core()
    lost.admit(request(text="Hi", max_tokens=20, stop=("world",)))
    before, got, chars = streamed_in_steps(lost, ids[:3])  # " one two wor": "wor" may start "world"
    assert before == " one two "
    moved = dataclasses.replace(
        request("r1~1", text="Hi", max_tokens=20, stop=("world",)),
        resume=[ResumedText(index=0, output_token_ids=got, text_chars=chars, finished=False)],
    )
    c = core()
    c.admit(moved)
    after = texts(from_worker(c, "w1", *(tokens("r1~1", 0, [t]) for t in ids[3:]), started=("r1~1",)))
    assert before + after == " one two wor three "  # " wor" released, then the stop string cut the rest


def test_text_a_client_already_has_is_not_sent_twice():
    ids = ids_of(" one two three")
    c = core()
    c.admit(
        dataclasses.replace(
            request("r1~1", text="Hi", max_tokens=20),
            # the gateway counted one more character than the ids give: it is not sent again
            resume=[ResumedText(index=0, output_token_ids=ids[:1], text_chars=len(" one") + 1, finished=False)],
        )
    )
    assert texts(from_worker(c, "w1", tokens("r1~1", 0, ids[1:]), started=("r1~1",))) == "two three"


def test_a_moved_request_with_nothing_streamed_starts_as_a_new_one():
    c = core()
    schedule = c.admit(dataclasses.replace(request("r1~1", text="Hi", max_tokens=20), resume=[]))
    assert schedule.resume is None


def test_several_choices_move_each_unfinished_one_with_its_ids_and_the_finished_stay_done():
    one, two = ids_of(" one"), ids_of(" two three")
    had = [
        ResumedText(index=0, output_token_ids=two, text_chars=len(" two three"), finished=True),
        ResumedText(index=1, output_token_ids=one, text_chars=len(" one"), finished=False),
    ]  # choice 2: nothing yet
    c = core()
    schedule = c.admit(dataclasses.replace(request("r1~1", text="Hi", max_tokens=20, n=3), resume=had))
    choices = [ResumedChoice(index=1, output_token_ids=one), ResumedChoice(index=2, output_token_ids=[])]
    assert schedule.resume == ResumeState(output_token_ids=[], migrations=1, choices=choices)
    out = from_worker(
        c, "w1", tokens("r1~1", 1, ids_of(" more"), finish="length"), tokens("r1~1", 2, two, finish="length")
    )
    deltas = out.batches[GATEWAY_A].deltas
    assert [(d.index, d.text, d.completion_tokens) for d in deltas] == [(1, " more", 2), (2, " two three", 2)]
    assert len(c) == 0  # every choice done: the request's state is gone
