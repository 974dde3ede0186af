"""Request migration in the tokenizer's core: a MigrateRequest sends the request again with every
token id streamed so far, the text goes on where it stopped (stop strings included), late tokens
of the lost worker are dropped; several choices move each unfinished choice with its own ids."""

from __future__ import annotations

import dataclasses

from pagemesh.common.messages import (
    MigrateRequest,
    RequestStarted,
    ResumedChoice,
    ResumeState,
    ScheduleRequest,
    TokenDeltaBatch,
)
from pagemesh.tests.unit.test_tokenizer_service import GATEWAY_A, core, ids_of, request, tokens


def from_worker(c, worker: str, *deltas, started: tuple[str, ...] = ()):
    begun = [RequestStarted(request_id=rid, num_prompt_tokens=1) for rid in started]
    return c.on_tokens(TokenDeltaBatch(worker_id=worker, deltas=list(deltas), started=begun))


def texts(out) -> str:
    return "".join(d.text for d in out.batches[GATEWAY_A].deltas) if GATEWAY_A in out.batches else ""


def migrate(rid: str = "r1", *lost: str) -> MigrateRequest:
    return MigrateRequest(request_id=rid, reason="worker w0 stopped responding", lost_worker_ids=list(lost or ["w0"]))


def test_a_migrated_request_is_sent_again_with_what_it_streamed_and_its_text_goes_on():
    c = core()
    first = c.admit(request(text="Hi", max_tokens=20, stop=("world",)))
    ids = ids_of(" Hello there, world and more")
    streamed = texts(from_worker(c, "w0", tokens("r1", 0, ids[:2]), started=("r1",)))
    resend = c.on_migrate(migrate())
    assert resend == dataclasses.replace(first, resume=ResumeState(output_token_ids=ids[:2], migrations=1))
    assert c.unstarted() == [resend]  # until a worker takes it, a scheduler restart sends it again
    assert texts(from_worker(c, "w0", tokens("r1", 0, ids[2:3]))) == ""  # a late token of the lost worker
    # the next worker: its tokens carry on the text, and the stop string still ends it
    out = from_worker(c, "w1", *(tokens("r1", 0, [t]) for t in ids[2:]), started=("r1",))
    assert streamed + texts(out) == " Hello there, "
    assert out.batches[GATEWAY_A].deltas[-1].finish_reason == "stop" and len(c) == 0
    assert out.batches[GATEWAY_A].deltas[-1].completion_tokens <= len(ids)


def test_every_move_counts_and_resends_all_ids_so_far():
    c = core()
    c.admit(request(text="Hi", max_tokens=20))
    ids = ids_of(" one two three four")
    from_worker(c, "w0", tokens("r1", 0, ids[:1]), started=("r1",))
    c.on_migrate(migrate("r1", "w0"))
    from_worker(c, "w1", tokens("r1", 0, ids[1:3]), started=("r1",))
    again = c.on_migrate(migrate("r1", "w1"))
    assert isinstance(again, ScheduleRequest)
    assert again.resume == ResumeState(output_token_ids=ids[:3], migrations=2)


def test_a_process_restarted_under_a_lost_id_counts_once_it_starts_the_request_again():
    c = core()
    c.admit(request(text="Hi", max_tokens=20))
    ids = ids_of(" one two three")
    from_worker(c, "w0", tokens("r1", 0, ids[:1]), started=("r1",))
    c.on_migrate(migrate())
    assert texts(from_worker(c, "w0", tokens("r1", 0, ids[1:2]))) == ""  # the old process's late token
    assert texts(from_worker(c, "w0", tokens("r1", 0, ids[1:2]), started=("r1",))) == " two"  # the new one


def test_several_choices_start_over_until_one_has_streamed_then_each_unfinished_one_moves_with_its_ids():
    c = core()
    first = c.admit(request(text="Hi", max_tokens=20, n=3))
    assert c.on_migrate(migrate()) == dataclasses.replace(first, resume=ResumeState(output_token_ids=[], migrations=1))
    one, two = ids_of(" one"), ids_of(" two three")
    from_worker(c, "w1", tokens("r1", 1, one), tokens("r1", 2, two[:1]), started=("r1",))
    from_worker(c, "w1", tokens("r1", 0, two[1:], finish="stop"))  # choice 0 ended: it stays done
    resend = c.on_migrate(migrate("r1", "w1"))
    choices = [ResumedChoice(index=1, output_token_ids=one), ResumedChoice(index=2, output_token_ids=two[:1])]
    assert resend.resume == ResumeState(output_token_ids=[], migrations=2, choices=choices)
    # the next worker's tokens carry on each choice's text
    out = from_worker(c, "w2", tokens("r1", 2, two[1:], finish="length"), started=("r1",))
    assert [(d.index, d.text) for d in out.batches[GATEWAY_A].deltas] == [(2, " three")]
    assert c.on_migrate(migrate("r1", "w2")).resume.choices == [ResumedChoice(index=1, output_token_ids=one)]
