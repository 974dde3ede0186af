"""How SchedulerCore ends placed requests (services/scheduler/failures.py): handoffs that finish,
failed endings, aborts, requests adopted from a restarted scheduler's workers, and failures kept
for a tokenizer not heard from yet; driven with no sockets and no clock (tests/scheduler_harness.py)."""

from __future__ import annotations

import pytest

import pagemesh.services.scheduler.failures as failures_module
from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    HeldRequest,
    Ping,
    Pong,
    Registered,
    RequestFailed,
    WorkerKind,
)
from pagemesh.tests.scheduler_harness import (
    T0,
    TOK,
    TOK_OUT,
    disaggregated,
    done,
    failed,
    generate,
    heartbeat,
    new_core,
    placed_on_p0_d0,
    register,
    schedule,
)

# --------------------------------------------------------------------------- endings


def test_a_handed_off_request_ends_when_the_decode_worker_finishes():
    core = disaggregated()
    placed_on_p0_d0(core)
    assert done(core, "p0", "r1", DoneReason.HANDED_OFF) == []
    assert core.placed["r1"].holders == {"d0"} and core.registry.workers["p0"].requests == set()
    # p0 kept the pages it sent (for an exact resume) until now: it frees them
    assert done(core, "d0", "r1", DoneReason.FINISHED) == [
        ("p0", AbortRequest(request_id="r1", reason="the request ended"))
    ]
    assert core.placed == {} and core.registry.workers["d0"].requests == set()
    assert done(core, "d0", "r1", DoneReason.FINISHED) == []  # late or repeated: nothing to do


def test_finished_on_the_prefill_worker_before_the_handoff_aborts_the_decode_side():
    core = disaggregated()
    placed_on_p0_d0(core)
    assert done(core, "p0", "r1", DoneReason.FINISHED) == [
        ("d0", AbortRequest(request_id="r1", reason="finished at the first token"))
    ]
    assert core.placed == {} and core.registry.workers["d0"].requests == set()


@pytest.mark.parametrize(
    "reporter, other, reason, detail, why",
    [
        ("d0", "p0", DoneReason.KV_REJECTED, None, "the decode worker refused the KV pages"),
        ("p0", "d0", DoneReason.KV_TIMEOUT, None, "the KV handoff timed out"),
        ("d0", "p0", DoneReason.REJECTED, "prompt: no room in the KV pool", None),
    ],
)
def test_failed_endings_fail_the_request_and_abort_it_on_the_other_holder(reporter, other, reason, detail, why):
    core = disaggregated()
    placed_on_p0_d0(core)
    told = failed("r1", why) if why else invalid("r1", detail, "prompt")
    assert done(core, reporter, "r1", reason, detail) == [
        (TOK, told),
        (other, AbortRequest(request_id="r1", reason=why or detail)),
    ]
    assert core.placed == {} and not any(w.requests for w in core.registry.workers.values())


def test_a_rejection_on_a_mixed_worker_fails_the_request_and_frees_it_for_the_next():
    core = new_core()
    register(core, "m0", max_running=1)
    assert schedule(core, "r1") == [("m0", generate("r1"))]
    assert schedule(core, "r2", now=T0 + 1) == []  # placed requests count before the worker reports them
    assert heartbeat(core, "m0", T0 + 1, running=0) == []
    assert core.queues[WorkerKind.LLM].keys() == {"r2"}
    assert done(core, "m0", "r1", DoneReason.REJECTED, "too long", now=T0 + 2) == [
        (TOK, invalid("r1", "too long", None)),  # a detail naming no field: no param
        ("m0", generate("r2", queued_s=1.0)),
    ]


def invalid(rid: str, message: str, param: str | None) -> RequestFailed:
    """What the request's tokenizer is told when its worker refused it as it is."""
    return RequestFailed(
        request_id=rid, status=400, error_type="invalid_request_error", message=message, param=param, code=None
    )


def test_aborts_of_queued_and_placed_requests():
    core = new_core()
    assert schedule(core, "queued") == []
    assert core.handle(TOK, AbortRequest(request_id="queued", reason="client disconnected"), T0) == []
    assert register(core, "m0") == [(b"m0", Registered(worker_id="m0"))]  # nothing left to place
    core = disaggregated()
    placed_on_p0_d0(core)
    out = core.handle(TOK, AbortRequest(request_id="r1", reason="client disconnected"), T0)
    assert sorted(dest for dest, _ in out) == ["d0", "p0"]
    assert all(msg == AbortRequest(request_id="r1", reason="client disconnected") for _, msg in out)
    assert core.placed == {} and not any(w.requests for w in core.registry.workers.values())


def test_an_abort_naming_a_worker_reaches_it_for_a_request_an_earlier_scheduler_placed():
    core = disaggregated()
    abort = AbortRequest(request_id="lost", reason="unknown to the tokenizer", worker_id="d0")
    assert core.handle(TOK, abort, T0) == [("d0", AbortRequest(request_id="lost", reason="unknown to the tokenizer"))]
    assert core.handle(TOK, AbortRequest(request_id="x", reason="?", worker_id="nobody"), T0) == []
    assert core.handle(TOK, AbortRequest(request_id="x", reason="?"), T0) == []


# --------------------------------------------------------------------------- restarts


def test_held_requests_are_adopted_and_a_prefill_finish_aborts_the_decode_holder():
    core = new_core()
    held = [HeldRequest(request_id="r1", reply_to=TOK_OUT)]
    register(core, "p0", "prefill", held=held)
    register(core, "d0", "decode", held=held)
    placed = core.placed["r1"]
    assert (placed.holders, placed.prefill, placed.reply_to) == ({"p0", "d0"}, "p0", TOK_OUT)
    assert core.registry.workers["d0"].requests == {"r1"}
    assert schedule(core, "r1") == []  # sent again by its tokenizer: it runs already
    assert done(core, "p0", "r1", DoneReason.FINISHED) == [
        ("d0", AbortRequest(request_id="r1", reason="finished at the first token"))
    ]


def test_failures_for_a_tokenizer_not_heard_from_yet_wait_for_its_first_ping(monkeypatch):
    monkeypatch.setattr(failures_module, "MAX_UNREPORTED", 2)
    core = new_core(max_migrations=0)  # failures (migrations wait for the ping the same way)
    register(core, "w0", held=[HeldRequest(request_id=f"r{i}", reply_to=TOK_OUT) for i in range(3)])
    out = register(core, "w0", now=T0 + 1, instance="w0-second")  # restarted: its requests are lost
    assert out[0] == (b"w0", Registered(worker_id="w0"))
    assert sorted(msg.request_id for _, msg in out[1:]) == ["r0", "r1", "r2"]  # aborts only: no tokenizer known
    assert all(dest == "w0" and isinstance(msg, AbortRequest) for dest, msg in out[1:])
    pong = (TOK, Pong(service="scheduler", instance="inst-1"))
    assert core.handle(TOK, Ping(sender="tok0"), T0 + 2) == [pong]  # no address: no failures for it
    out = core.handle(TOK, Ping(sender="tok0", address=TOK_OUT), T0 + 2)
    assert len(out) == 3 and out[-1] == pong  # two kept (the bound), then the Pong
    assert out[:2] == [(TOK, failed(msg.request_id, "worker w0 restarted")) for _, msg in out[:2]]
    assert len({msg.request_id for _, msg in out[:2]} & {"r0", "r1", "r2"}) == 2
    assert core.handle(TOK, Ping(sender="tok0", address=TOK_OUT), T0 + 3) == [pong]  # delivered once
