"""Request migration in the scheduler's core (no sockets, an injected clock): a lost worker's
requests go back to their tokenizer to move, the resumed request is placed on one decode or mixed
worker that recomputes its tokens (or, handed off from a prefill worker still alive, to a decode
worker paired with that prefill worker, which kept its pages: an exact resume), and what cannot
move (too many moves, no worker left) fails with the OpenAI error."""

from __future__ import annotations

from unittest.mock import ANY

from pagemesh.common.messages import (
    AbortRequest,
    DecodeTask,
    DoneReason,
    GenerateTask,
    MigrateRequest,
    PrefillTask,
    ResumedChoice,
    ResumeState,
    ScheduleRequest,
    WorkerKind,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.scheduler.failures import KEPT_ORPHAN_S
from pagemesh.tests.scheduler_harness import (
    AFTER_GRACE,
    DEFAULT,
    PROMPT,
    T0,
    TIMEOUT,
    TOK,
    TOK_OUT,
    done,
    failed,
    heartbeat,
    new_core,
    refused,
    register,
    schedule,
    status,
)

SILENT = T0 + TIMEOUT + 0.1  # when a worker heard from last at T0 is dropped


def resume(core, rid: str, output: list[int], migrations: int = 1, now: float = T0, sampling=DEFAULT):
    msg = ScheduleRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=sampling,
        reply_to=TOK_OUT,
        arrival_time=0.0,
        resume=ResumeState(output_token_ids=output, migrations=migrations),
    )
    return core.handle(TOK, msg, now)


def resumed_task(rid: str, output: list[int], sampling=DEFAULT) -> GenerateTask:
    return GenerateTask(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, reply_to=TOK_OUT, output_token_ids=output
    )


def keep_alive(core, now: float, *workers: str) -> None:
    for wid in workers:
        assert heartbeat(core, wid, now) == []


def test_a_lost_mixed_workers_request_moves_to_the_other_worker():
    core = new_core()
    register(core, "m0")
    register(core, "m1")
    assert [dest for dest, _ in schedule(core, "r1")] == ["m0"]
    keep_alive(core, T0 + 4, "m1")
    why = "worker m0 stopped responding"
    assert core.tick(SILENT) == [
        (TOK, MigrateRequest(request_id="r1", reason=why, lost_worker_ids=["m0"])),
        ("m0", AbortRequest(request_id="r1", reason=why)),
    ]
    assert core.placed == {} and status(core, SILENT).migrations == 0
    # the tokenizer sends it again with the 3 tokens its client has: recomputed on m1
    assert resume(core, "r1", [5, 6, 7], now=SILENT) == [("m1", resumed_task("r1", [5, 6, 7]))]
    assert core.placed["r1"].holders == {"m1"} and core.placed["r1"].migrations == 1
    assert status(core, SILENT).migrations == 1


def test_a_resumed_request_with_tokens_goes_to_a_decode_worker_without_a_handoff():
    core = new_core()
    register(core, "p0", "prefill")
    register(core, "d0", "decode")
    assert resume(core, "r1", [5]) == [("d0", resumed_task("r1", [5]))]
    assert core.placed["r1"].holders == {"d0"} and core.placed["r1"].prefill is None
    # one that lost its worker before any token starts over: prefilled again, handed off
    out = resume(core, "r2", [])
    assert [(dest, type(msg)) for dest, msg in out] == [("d0", DecodeTask), ("p0", PrefillTask)]


def test_a_prefill_worker_lost_mid_handoff_moves_the_request_and_frees_the_decode_side():
    core = new_core()
    register(core, "p0", "prefill")
    register(core, "p1", "prefill")
    register(core, "d0", "decode")
    out = schedule(core, "r1")
    assert [(dest, type(msg)) for dest, msg in out] == [("d0", DecodeTask), ("p0", PrefillTask)]
    keep_alive(core, T0 + 4, "p1", "d0")
    why = "worker p0 stopped responding"
    out = core.tick(SILENT)
    assert out[0] == (TOK, MigrateRequest(request_id="r1", reason=why, lost_worker_ids=["d0", "p0"]))
    assert set(out[1:]) == {
        ("p0", AbortRequest(request_id="r1", reason=why)),
        ("d0", AbortRequest(request_id="r1", reason=why)),
    }
    assert core.registry.workers["d0"].requests == set()
    out = resume(core, "r1", [], now=SILENT)  # no token had come: prefilled again, on p1
    assert [(dest, type(msg)) for dest, msg in out] == [("d0", DecodeTask), ("p1", PrefillTask)]


def test_with_no_prefill_worker_left_a_decode_worker_prefills_the_migrated_request_itself():
    core = new_core()
    register(core, "p0", "prefill")
    register(core, "d0", "decode")
    assert [dest for dest, _ in schedule(core, "r1")] == ["d0", "p0"]
    keep_alive(core, T0 + 4, "d0")
    assert isinstance(core.tick(SILENT)[0][1], MigrateRequest)
    assert not core.can_serve(WorkerKind.LLM, SILENT)  # a new request has no prefill worker...
    assert resume(core, "r1", [], now=SILENT) == [("d0", resumed_task("r1", []))]  # ...a moved one goes on


def test_a_request_that_moved_max_migrations_times_fails_when_it_loses_its_worker_again():
    core = new_core(max_migrations=2)
    register(core, "m0")
    register(core, "m1")
    assert [dest for dest, _ in resume(core, "r1", [5], migrations=2)] == ["m0"]
    keep_alive(core, T0 + 4, "m1")
    why = "worker m0 stopped responding"
    out = core.tick(SILENT)
    assert out == [
        (TOK, failed("r1", f"{why} (the request has moved 2 times already; --max-migrations is 2)")),
        (
            "m0",
            AbortRequest(
                request_id="r1", reason=f"{why} (the request has moved 2 times already; --max-migrations is 2)"
            ),
        ),
    ]


def test_a_request_of_several_choices_goes_to_its_tokenizer_which_knows_if_it_can_move():
    core = new_core()
    register(core, "m0")
    register(core, "m1")
    two = SamplingParams(n=2)
    assert [dest for dest, _ in schedule(core, "r1", sampling=two)] == ["m0"]
    keep_alive(core, T0 + 4, "m1")
    why = "worker m0 stopped responding"
    assert core.tick(SILENT)[0] == (TOK, MigrateRequest(request_id="r1", reason=why, lost_worker_ids=["m0"]))
    assert resume(core, "r1", [], now=SILENT, sampling=two) == [("m1", resumed_task("r1", [], sampling=two))]


def test_with_no_worker_left_the_resumed_request_is_refused():
    core = new_core()
    register(core, "m0")
    keep_alive(core, AFTER_GRACE, "m0")
    assert [dest for dest, _ in schedule(core, "r1", now=AFTER_GRACE)] == ["m0"]
    gone = AFTER_GRACE + TIMEOUT + 0.1
    why = "worker m0 stopped responding, and no workers are available to move it to"
    assert core.tick(gone) == [(TOK, failed("r1", why)), ("m0", AbortRequest(request_id="r1", reason=why))]
    out = resume(core, "r1", [5, 6], now=gone)  # one that was moving already when the last went
    assert out == [(TOK, refused("r1", "no workers are available"))]


def test_with_a_return_wait_a_lost_pools_requests_wait_for_a_worker_to_come_back():
    """--worker-return-wait: the last worker's request moves anyway, a new one queues, and both
    are placed when a worker registers again; after the wait with none back, what waits is refused."""
    core = new_core(worker_return_wait=20.0)
    register(core, "m0")
    keep_alive(core, AFTER_GRACE, "m0")
    assert [dest for dest, _ in schedule(core, "r1", now=AFTER_GRACE)] == ["m0"]
    gone = AFTER_GRACE + TIMEOUT + 0.1
    why = "worker m0 stopped responding"
    assert core.tick(gone)[0] == (TOK, MigrateRequest(request_id="r1", reason=why, lost_worker_ids=["m0"]))
    assert resume(core, "r1", [5, 6], now=gone) == []  # queued: no worker, none refused
    assert schedule(core, "r2", now=gone + 1) == []
    assert core.tick(gone + 19) == []
    back = register(core, "m0", now=gone + 19.5, instance="m0-second")
    placed = {task.request_id for _, task in back if isinstance(task, GenerateTask | PrefillTask)}
    assert placed == {"r1", "r2"} and core.placed["r1"].holders == {"m0"}
    # lost again, and this time nobody comes back within the wait
    later = gone + 19.5 + TIMEOUT + 0.1
    core.tick(later)
    assert schedule(core, "r3", now=later + 1) == []
    out = core.tick(later + 20.5)
    assert (TOK, refused("r3", "no workers are available")) in out


def test_with_a_return_wait_a_request_waits_for_a_worker_gone_silent_before_its_loss_is_noted():
    core = new_core(worker_return_wait=20.0)
    register(core, "m0")
    silent = T0 + TIMEOUT + 1  # past the heartbeat timeout, before the tick that drops it
    assert schedule(core, "r1", now=silent) == [] and core.queued == 1  # waits, not refused
    assert core.tick(silent + 0.5) == []  # its loss noted: the wait counts from here
    assert core.tick(silent + 21) == [(TOK, refused("r1", "no workers are available"))]


def test_a_worker_restarted_under_its_id_gets_the_request_back_to_recompute():
    core = new_core()
    register(core, "m0")
    assert [dest for dest, _ in schedule(core, "r1")] == ["m0"]
    out = register(core, "m0", now=T0 + 1, instance="m0-second")
    assert out[1] == (TOK, MigrateRequest(request_id="r1", reason="worker m0 restarted", lost_worker_ids=["m0"]))
    assert resume(core, "r1", [9], now=T0 + 1) == [("m0", resumed_task("r1", [9]))]


def handed_off_on_p0(core, rid: str = "r1") -> tuple[str, str]:
    """Place `rid` disaggregated (p0 and a decode worker) and finish its handoff: p0 keeps its
    pages. Returns (its decode worker, the other decode worker)."""
    out = schedule(core, rid)
    assert [(dest, type(msg)) for dest, msg in out][1] == ("p0", PrefillTask)
    holder = out[0][0]
    assert done(core, "p0", rid, DoneReason.HANDED_OFF) == []
    assert core.requests.kept == {rid: "p0"}
    return holder, ({"d0", "d1"} - {holder}).pop()


def test_a_handed_off_request_resumes_from_the_prefill_worker_that_kept_its_pages():
    core = new_core()
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        register(core, wid, role)
    victim, other = handed_off_on_p0(core)
    keep_alive(core, T0 + 4, "p0", other)
    out = core.tick(SILENT)
    assert isinstance(out[0][1], MigrateRequest) and out[1:] == [(victim, AbortRequest(request_id="r1", reason=ANY))]
    assert core.requests.kept == {"r1": "p0"}  # not freed: the request moves
    out = resume(core, "r1", [5, 6, 7], now=SILENT)
    (d_dest, decode), (p_dest, prefill) = out
    assert (d_dest, p_dest) == (other, "p0")
    assert isinstance(decode, DecodeTask) and isinstance(prefill, PrefillTask)
    assert decode.output_token_ids == [5, 6, 7] and prefill.resumed
    assert decode.skip_pages == prefill.skip_pages == 0  # every kept page travels
    assert (decode.prefill_worker_id, prefill.decode_worker_id) == ("p0", other)
    # handed off again, then finished: p0 frees what it kept
    assert done(core, "p0", "r1", DoneReason.HANDED_OFF, now=SILENT) == []
    out = done(core, other, "r1", DoneReason.FINISHED, now=SILENT)
    assert out == [("p0", AbortRequest(request_id="r1", reason="the request ended"))]
    assert core.requests.kept == {} and core.placed == {}


def test_each_unfinished_choice_of_a_handed_off_request_resumes_from_the_keeper():
    core = new_core()
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        register(core, wid, role)
    sampling = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=16)
    out = schedule(core, "r1", sampling=sampling)
    victim = out[0][0]
    assert done(core, "p0", "r1", DoneReason.HANDED_OFF) == []
    keep_alive(core, T0 + 4, "p0", ({"d0", "d1"} - {victim}).pop())
    assert isinstance(core.tick(SILENT)[0][1], MigrateRequest)
    msg = ScheduleRequest(
        request_id="r1",
        prompt_token_ids=PROMPT,
        sampling=sampling,
        reply_to=TOK_OUT,
        arrival_time=0.0,
        resume=ResumeState(
            output_token_ids=[], migrations=1, choices=[ResumedChoice(index=1, output_token_ids=[4, 2])]
        ),
    )
    (_, decode), (p_dest, prefill) = core.handle(TOK, msg, SILENT)
    assert p_dest == "p0" and prefill.resumed and decode.skip_pages == 0
    assert decode.resumed_choices == [ResumedChoice(index=1, output_token_ids=[4, 2])] and decode.output_token_ids == []


def test_kept_pages_are_freed_when_the_request_is_aborted_and_forgotten_when_their_keeper_is_lost():
    core = new_core()
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        register(core, wid, role)
    holder, _ = handed_off_on_p0(core, "r1")
    out = core.handle(TOK, AbortRequest(request_id="r1", reason="client gone"), T0)
    assert set(out) == {(w, AbortRequest(request_id="r1", reason="client gone")) for w in (holder, "p0")}
    assert core.requests.kept == {}
    # r2's keeper is lost (p0 silent): its decode worker lost next, r2 is recomputed on the other
    victim, other = handed_off_on_p0(core, "r2")
    keep_alive(core, T0 + 4, "d0", "d1")
    assert core.tick(SILENT) == []  # p0 held no request any more: nothing moves, what it kept is gone
    assert core.requests.kept == {}
    keep_alive(core, SILENT + 4, other)
    assert isinstance(core.tick(SILENT + TIMEOUT + 0.1)[0][1], MigrateRequest)
    later = SILENT + TIMEOUT + 0.1
    assert resume(core, "r2", [5], now=later) == [(other, resumed_task("r2", [5]))]


def test_a_moved_request_that_does_not_come_back_or_is_refused_has_its_kept_pages_freed():
    core = new_core(worker_return_wait=60.0)  # a lost pool's requests move and wait
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        register(core, wid, role)
    _, other = handed_off_on_p0(core, "r1")
    keep_alive(core, T0 + 4, "p0", other)
    assert isinstance(core.tick(SILENT)[0][1], MigrateRequest)  # its tokenizer never sends it again
    now = SILENT
    while now <= SILENT + KEPT_ORPHAN_S:
        now += TIMEOUT / 2
        keep_alive(core, now, "p0", other)
        freed = ("p0", AbortRequest(request_id="r1", reason="the request did not come back"))
        out = core.tick(now)
        assert (freed in out) == (now - SILENT > KEPT_ORPHAN_S)
    assert core.requests.kept == {}
    # a request that moved before its first token is prefilled again as a new one (nothing kept asked for)
    out = resume(core, "r2", [], now=now)
    assert [type(m) for _, m in out] == [DecodeTask, PrefillTask] and not out[1][1].resumed
    assert out[0][1].output_token_ids == [] and out[0][1].resumed_choices == []
    # r3's decode worker is lost, and r3 comes back refused (its adapter is gone): what p0 kept
    # of it is freed at once
    holder, _ = handed_off_on_p0(core, "r3")
    keep_alive(core, now + 1, "p0")
    assert isinstance(core.tick(now + TIMEOUT + 0.5)[0][1], MigrateRequest)
    out = resume(core, "r3", [5], now=now + TIMEOUT + 0.5, sampling=SamplingParams(temperature=0, lora="gone"))
    assert ("p0", AbortRequest(request_id="r3", reason="The model `gone` does not exist.")) in out
    assert "r3" not in core.requests.kept


def test_a_stream_sent_again_under_a_new_id_resumes_from_the_pages_kept_under_its_old_one():
    """Its tokenizer replica was lost: the gateway aborts the old id naming the new one
    (AbortRequest.moved_to) and sends it again through another replica under the new id."""
    core = new_core()
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        register(core, wid, role)
    holder, _ = handed_off_on_p0(core, "r1")
    out = core.handle(TOK, AbortRequest(request_id="r1", reason="its tokenizer was lost", moved_to="r1~1"), T0)
    assert out == [(holder, AbortRequest(request_id="r1", reason="its tokenizer was lost"))]  # not p0's pages
    assert core.requests.kept == {"r1~1": "p0"} and core.requests.kept_ids == {"r1~1": "r1"}
    (d_dest, decode), (p_dest, prefill) = resume(core, "r1~1", [5, 6])
    assert p_dest == "p0" and (prefill.resumed, prefill.kept_id) == (True, "r1")
    assert decode.output_token_ids == [5, 6] and decode.prefill_worker_id == "p0"
    assert done(core, "p0", "r1~1", DoneReason.HANDED_OFF) == []
    assert core.requests.kept_ids == {}  # p0 keeps them under the new id now
    assert done(core, d_dest, "r1~1", DoneReason.FINISHED) == [
        ("p0", AbortRequest(request_id="r1~1", reason="the request ended"))
    ]
