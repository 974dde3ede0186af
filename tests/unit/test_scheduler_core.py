"""The scheduler's decisions, driven through SchedulerCore with no sockets and no clock: each call
gets a message and `now`, and the test checks exactly what it says to send."""

from __future__ import annotations

import pytest

import services.scheduler.failures as failures_module
from common.messages import (
    AbortRequest,
    ClusterStatus,
    DecodeTask,
    DoneReason,
    GenerateTask,
    Heartbeat,
    HeldRequest,
    ImageModelInfo,
    KVPoolInfo,
    KVPoolLoad,
    MigrateRequest,
    Ping,
    Pong,
    PrefillTask,
    PrefixCacheUpdate,
    Registered,
    RegisterWorker,
    RequestDone,
    RequestFailed,
    ScheduleRequest,
    StatusRequest,
    UnknownWorker,
    WorkerKind,
    WorkerRole,
    WorkerStatus,
    WorkerStopped,
)
from common.page_hash import prefix_page_hashes
from common.sampling import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore

T0 = 100.0  # when the core started
TIMEOUT = 5.0  # heartbeat timeout, and the start-up grace window
AFTER_GRACE = T0 + TIMEOUT + 0.5
PAGE = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 reusable pages; 5 pages with one token to generate
DEFAULT = SamplingParams()
TOK, TOK_OUT = b"tok0", "ipc:///tok0-out"  # a tokenizer's identity at the scheduler, and its token address


def new_core(max_queue: int = 256, max_migrations: int = 3) -> SchedulerCore:
    config = SchedulerConfig(
        "ipc:///unused", heartbeat_timeout=TIMEOUT, max_queue=max_queue, max_migrations=max_migrations
    )
    return SchedulerCore(config, "inst-1", T0)


IMAGES = ImageModelInfo(
    sizes=["256x256", "8x8"],
    samplers=["ddim"],
    default_sampler="ddim",
    default_steps=20,
    max_steps=100,
    conditioning="a digit",
)


def register(
    core: SchedulerCore,
    wid: str,
    role: str = "mixed",
    now: float = T0,
    instance: str | None = None,
    held: list[HeldRequest] | None = None,
    kind: WorkerKind = WorkerKind.LLM,
    max_running: int = 8,
):
    kv = KVPoolInfo(page_size=PAGE, num_pages=100, kv_endpoint=f"ipc:///{wid}-kv") if kind == WorkerKind.LLM else None
    msg = RegisterWorker(
        worker_id=wid,
        kind=kind,
        role=role,
        model="m",
        max_running=max_running,
        kv=kv,
        instance=instance or f"{wid}-first",
        held=held,
        images=IMAGES if kind == WorkerKind.DIFFUSION else None,
    )
    return core.handle(wid.encode(), msg, now)


def heartbeat(
    core: SchedulerCore,
    wid: str,
    now: float,
    free_pages: int | None = 100,
    running: int = 0,
    produced: int = 0,
    busy_s: float = 0.0,
):
    kv = (
        None
        if free_pages is None
        else KVPoolLoad(
            free_pages=free_pages, used_pages=100 - free_pages, total_pages=100, bytes_sent=0, bytes_received=0
        )
    )
    msg = Heartbeat(
        worker_id=wid,
        running=running,
        waiting=0,
        time=now,
        requests_finished=0,
        kv=kv,
        produced=produced,
        busy_s=busy_s,
    )
    return core.handle(wid.encode(), msg, now)


def schedule(core: SchedulerCore, rid: str, now: float = T0, sampling: SamplingParams = DEFAULT):
    msg = ScheduleRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, reply_to=TOK_OUT, arrival_time=0.0
    )
    return core.handle(TOK, msg, now)


def done(core: SchedulerCore, wid: str, rid: str, reason: DoneReason, detail: str | None = None, now: float = T0):
    return core.handle(wid.encode(), RequestDone(worker_id=wid, request_id=rid, reason=reason, detail=detail), now)


def failed(rid: str, why: str) -> RequestFailed:
    return RequestFailed(
        request_id=rid,
        status=503,
        error_type="server_error",
        message=f"Request failed: {why}; retry later.",
        param=None,
        code="worker_failure",
    )


def refused(rid: str, why: str) -> RequestFailed:
    return RequestFailed(
        request_id=rid,
        status=503,
        error_type="server_error",
        message=f"Service unavailable: {why}; retry later.",
        param=None,
        code="overloaded",
    )


def generate(rid: str, queued_s: float = 0.0, sampling: SamplingParams = DEFAULT) -> GenerateTask:
    return GenerateTask(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, reply_to=TOK_OUT, queued_s=queued_s)


def disaggregated() -> SchedulerCore:
    core = new_core()
    register(core, "p0", "prefill")
    register(core, "d0", "decode")
    return core


def placed_on_p0_d0(core: SchedulerCore, rid: str = "r1") -> None:
    assert [(dest, type(msg)) for dest, msg in schedule(core, rid)] == [("d0", DecodeTask), ("p0", PrefillTask)]


# --------------------------------------------------------------------------- workers


def test_registration_renewal_and_a_restart_under_a_known_id():
    core = new_core()
    assert register(core, "w0") == [(b"w0", Registered(worker_id="w0"))]
    w0 = core.registry.workers["w0"]
    assert (w0.kind, w0.role, w0.page_size, w0.total_pages, w0.free_pages, w0.kv_endpoint) == (
        WorkerKind.LLM,
        WorkerRole.MIXED,
        PAGE,
        100,
        100,
        "ipc:///w0-kv",
    )
    assert schedule(core, "r1") == [("w0", generate("r1"))]
    # the same process registering again (it lost its Registered, say): renewed, its requests stay
    assert register(core, "w0", now=T0 + 1) == [(b"w0", Registered(worker_id="w0"))]
    assert core.registry.workers["w0"] is w0 and w0.requests == {"r1"} and w0.last_seen == T0 + 1
    # a new process under the id: the old one's requests died with it, and move (migration.py)
    out = register(core, "w0", now=T0 + 2, instance="w0-second")
    assert out == [
        (b"w0", Registered(worker_id="w0")),
        (TOK, MigrateRequest(request_id="r1", reason="worker w0 restarted", lost_worker_ids=["w0"])),
        ("w0", AbortRequest(request_id="r1", reason="worker w0 restarted")),
    ]
    assert core.placed == {} and core.registry.workers["w0"].requests == set()


def test_heartbeats_from_an_unknown_worker_ask_it_to_register_and_known_ones_drain_the_queue():
    core = new_core()
    # to the worker's own socket (by id): its heartbeats come from a send-only socket of their own
    assert heartbeat(core, "ghost", T0) == [("ghost", UnknownWorker(worker_id="ghost"))]
    register(core, "w0")
    assert heartbeat(core, "w0", T0 + 1, free_pages=4) == []  # 4 pages: the request needs 5
    assert schedule(core, "r1", now=T0 + 1) == [] and list(core.queues[WorkerKind.LLM]) == ["r1"]
    assert heartbeat(core, "w0", T0 + 3, free_pages=5) == [("w0", generate("r1", queued_s=2.0))]
    assert core.queues[WorkerKind.LLM] == {} and core.registry.workers["w0"].used_pages == 95


def test_a_worker_that_stops_heartbeating_is_dropped_and_its_requests_fail():
    core = new_core(max_migrations=0)  # no migration: the request fails
    register(core, "p0", "prefill")
    register(core, "d0", "decode")
    register(core, "m0", "mixed")
    placed_on_p0_d0(core, "r1")
    assert heartbeat(core, "p0", T0 + 4) == [] and heartbeat(core, "m0", T0 + 4) == []
    assert core.tick(T0 + TIMEOUT) == []  # silent exactly a timeout: still alive
    out = core.tick(T0 + TIMEOUT + 0.1)  # d0 is gone: its request fails, and is aborted on both
    assert out[0] == (TOK, failed("r1", "worker d0 stopped responding"))
    reason = "worker d0 stopped responding"
    assert set(out[1:]) == {
        ("p0", AbortRequest(request_id="r1", reason=reason)),
        ("d0", AbortRequest(request_id="r1", reason=reason)),
    }
    assert sorted(core.registry.workers) == ["m0", "p0"] and core.placed == {}
    assert core.registry.workers["p0"].requests == set()
    assert schedule(core, "r2", now=T0 + 5.5) == [("m0", generate("r2"))]  # p0 without d0: mixed


# --------------------------------------------------------------------------- admission


def test_a_pause_of_the_scheduler_itself_is_not_its_workers_silence():
    """The scheduler SIGSTOPped for longer than the heartbeat timeout (the chaos soak found it):
    on resuming, its expiry tick came before the heartbeats waiting in its socket, and every
    worker was dropped at once and its requests failed. The pause is excused; a worker that
    really stopped is still dropped a heartbeat timeout later."""
    core = new_core(max_migrations=0)
    register(core, "m0", "mixed")
    register(core, "m1", "mixed")
    assert schedule(core, "r1") == [("m0", generate("r1"))]
    core.excuse_silence(TIMEOUT + 2)  # paused from T0 to T0 + TIMEOUT + 2
    assert core.tick(T0 + TIMEOUT + 2) == []  # nobody dropped, nothing failed
    assert heartbeat(core, "m1", T0 + TIMEOUT + 2.1) == []  # m1's queued heartbeats come in
    out = core.tick(T0 + 2 * TIMEOUT + 2.1)  # m0 is silent a whole timeout after the pause
    assert out[0] == (TOK, failed("r1", "worker m0 stopped responding"))
    assert sorted(core.registry.workers) == ["m1"]


def test_a_worker_heartbeating_through_a_long_step_stays_until_the_step_timeout():
    # migration off: the request of a hung worker fails (with it on, it moves: test_scheduler_migration.py)
    config = SchedulerConfig("ipc:///unused", heartbeat_timeout=TIMEOUT, step_timeout=60.0, max_migrations=0)
    core = SchedulerCore(config, "inst-1", T0)
    register(core, "w0")
    assert schedule(core, "r1", now=T0) == [("w0", generate("r1"))]
    for t in range(1, 60):  # one step from T0 + 1 on: the heartbeats go on, each a second busier
        assert heartbeat(core, "w0", T0 + 1 + t, busy_s=float(t)) == []
        assert core.tick(T0 + 1 + t + 0.5) == []  # far past the heartbeat timeout's 5 s of step
    assert core.status(T0 + 61).ready
    assert core.tick(T0 + 61) == []  # in the step exactly the step timeout: still alive
    reason = "worker w0 is stuck in one step"
    assert core.tick(T0 + 61.1) == [  # busy past 60 s: hung, though it heartbeats
        (TOK, failed("r1", reason)),
        ("w0", AbortRequest(request_id="r1", reason=reason)),
    ]
    assert core.registry.workers == {} and not core.status(T0 + 63).ready
    # when its step ends, it heartbeats idle again: unknown now, it is asked to register again
    assert heartbeat(core, "w0", T0 + 64) == [("w0", UnknownWorker(worker_id="w0"))]


def test_a_worker_whose_engine_failed_is_dropped_at_once_and_its_requests_fail_when_no_worker_can_take_them():
    core = disaggregated()
    placed_on_p0_d0(core, "r1")
    stale = WorkerStopped(worker_id="d0", instance="d0-before", error="RuntimeError: boom")
    assert core.handle(b"d0", stale, T0 + 1) == []  # an older process's word: d0 stays
    out = core.handle(b"d0", WorkerStopped(worker_id="d0", instance="d0-first", error="RuntimeError: boom"), T0 + 1)
    # the exception's text stays in the worker's log; with d0 gone no decode worker is left to move r1 to
    reason = "the engine of worker d0 failed, and no workers are available to move it to"
    assert out[0] == (TOK, failed("r1", reason))
    assert set(out[1:]) == {
        ("p0", AbortRequest(request_id="r1", reason=reason)),
        ("d0", AbortRequest(request_id="r1", reason=reason)),
    }
    assert sorted(core.registry.workers) == ["p0"] and core.placed == {}
    assert not core.status(T0 + 1).ready  # no decode worker left: the lost capacity shows at once


def test_a_full_queue_refuses_with_503_overloaded():
    core = new_core(max_queue=1)
    register(core, "w0")
    heartbeat(core, "w0", T0, free_pages=0)
    assert schedule(core, "r1") == []
    assert schedule(core, "r2") == [(TOK, refused("r2", "the request queue is full"))]
    assert schedule(core, "r1") == []  # the same request sent again is not a second one
    assert list(core.queues[WorkerKind.LLM]) == ["r1"]


def test_without_workers_requests_wait_through_the_start_up_grace_window_then_are_refused():
    core = new_core()
    assert schedule(core, "early", now=T0 + 1) == []
    assert register(core, "w0", now=T0 + 3) == [(b"w0", Registered(worker_id="w0")), ("w0", generate("early", 2.0))]
    core = new_core()
    assert schedule(core, "r1", now=T0 + 1) == [] and schedule(core, "r2", now=T0 + 2) == []
    assert core.tick(T0 + TIMEOUT) == []  # the window includes its end
    assert core.tick(T0 + TIMEOUT + 0.1) == [
        (TOK, refused("r1", "no workers are available")),
        (TOK, refused("r2", "no workers are available")),
    ]
    assert core.queues[WorkerKind.LLM] == {}
    assert schedule(core, "late", now=AFTER_GRACE) == [(TOK, refused("late", "no workers are available"))]


def test_a_request_known_already_is_ignored_when_sent_again():
    core = new_core()
    register(core, "w0")
    assert schedule(core, "r1") == [("w0", generate("r1"))]
    assert schedule(core, "r1") == [] and list(core.placed) == ["r1"]


# --------------------------------------------------------------------------- placement


def test_disaggregated_placement_sends_both_tasks_and_skips_the_pages_the_decode_worker_holds():
    core = disaggregated()
    keys = prefix_page_hashes(PROMPT, PAGE)
    assert core.handle(b"d0", PrefixCacheUpdate(worker_id="d0", added=tuple(keys[:3]), removed=()), T0) == []
    assert core.handle(b"d0", PrefixCacheUpdate(worker_id="d0", added=(), removed=(keys[2],)), T0) == []
    assert schedule(core, "r1", now=T0 + 1) == [
        (
            "d0",
            DecodeTask(
                request_id="r1",
                prompt_token_ids=PROMPT,
                sampling=SamplingParams(),
                reply_to=TOK_OUT,
                prefill_worker_id="p0",
                skip_pages=2,
            ),
        ),
        (
            "p0",
            PrefillTask(
                request_id="r1",
                prompt_token_ids=PROMPT,
                sampling=SamplingParams(),
                reply_to=TOK_OUT,
                decode_worker_id="d0",
                decode_kv_endpoint="ipc:///d0-kv",
                queued_s=0.0,
                skip_pages=2,
            ),
        ),
    ]
    placed = core.placed["r1"]
    assert (placed.holders, placed.prefill, placed.reply_to) == ({"p0", "d0"}, "p0", TOK_OUT)
    assert core.registry.workers["p0"].requests == core.registry.workers["d0"].requests == {"r1"}


def test_mixed_placement_and_no_handoff_for_outputs_chosen_at_the_end():
    core = new_core()
    register(core, "m0")
    assert schedule(core, "r1") == [("m0", generate("r1"))]
    assert (core.placed["r1"].holders, core.placed["r1"].prefill) == ({"m0"}, None)
    core = disaggregated()
    chosen_at_the_end = [("best", SamplingParams(n=1, best_of=2)), ("beam", SamplingParams(n=2, use_beam_search=True))]
    for rid, sampling in chosen_at_the_end:
        # the n outputs are picked from the engine's whole state at the end: one worker runs it all
        assert schedule(core, rid, sampling=sampling) == [("d0", generate(rid, sampling=sampling))]
        assert (core.placed[rid].holders, core.placed[rid].prefill) == ({"d0"}, None)
    assert core.registry.workers["p0"].requests == set()


# --------------------------------------------------------------------------- endings


def test_a_handed_off_request_ends_when_the_decode_worker_finishes():
    core = disaggregated()
    placed_on_p0_d0(core)
    assert done(core, "p0", "r1", DoneReason.HANDED_OFF) == []
    assert core.placed["r1"].holders == {"d0"} and core.registry.workers["p0"].requests == set()
    assert done(core, "d0", "r1", DoneReason.FINISHED) == []
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
        ("d0", "p0", DoneReason.REJECTED, "no room for the prompt", "rejected: no room for the prompt"),
    ],
)
def test_failed_endings_fail_the_request_and_abort_it_on_the_other_holder(reporter, other, reason, detail, why):
    core = disaggregated()
    placed_on_p0_d0(core)
    assert done(core, reporter, "r1", reason, detail) == [
        (TOK, failed("r1", why)),
        (other, AbortRequest(request_id="r1", reason=why)),
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
        (TOK, failed("r1", "rejected: too long")),
        ("m0", generate("r2", queued_s=1.0)),
    ]


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


# --------------------------------------------------------------------------- status and kinds


def status(core: SchedulerCore, now: float) -> ClusterStatus:
    [(dest, msg)] = core.handle(b"gw0", StatusRequest(requester="gw0"), now)
    assert dest == b"gw0"
    return msg


def test_readiness_needs_an_llm_mixed_worker_or_an_llm_prefill_and_decode_pair():
    core = new_core()
    assert status(core, T0) == ClusterStatus(ready=False, workers=[], queued=0)
    register(core, "p0", "prefill")
    assert not status(core, T0).ready
    register(core, "d0", "decode", now=T0 + 1)
    assert status(core, T0 + 1).ready
    assert not status(core, T0 + TIMEOUT + 0.5).ready  # p0 is silent too long (d0 is not yet)
    core = new_core()
    register(core, "m0")
    heartbeat(core, "m0", T0 + 1, free_pages=60, running=2, produced=57)
    load = KVPoolLoad(free_pages=60, used_pages=40, total_pages=100, bytes_sent=0, bytes_received=0)
    assert status(core, T0 + 2) == ClusterStatus(
        ready=True,
        queued=0,
        workers=[
            WorkerStatus(
                worker_id="m0",
                kind=WorkerKind.LLM,
                role=WorkerRole.MIXED,
                alive=True,
                running=2,
                waiting=0,
                requests_finished=0,
                kv=load,
                model="m",
                produced=57,  # tokens it made, ever: the status page's tokens/s
            )
        ],
    )


def test_a_diffusion_worker_registers_and_reports_but_never_serves_llm_requests():
    core = new_core()
    assert register(core, "img0", kind=WorkerKind.DIFFUSION) == [(b"img0", Registered(worker_id="img0"))]
    assert heartbeat(core, "img0", T0 + 1, free_pages=None) == []
    assert status(core, T0 + 1) == ClusterStatus(
        ready=True,  # a mesh of diffusion workers only is ready when they are
        queued=0,
        workers=[
            WorkerStatus(
                worker_id="img0",
                kind=WorkerKind.DIFFUSION,
                role=WorkerRole.MIXED,
                alive=True,
                running=0,
                waiting=0,
                requests_finished=0,
                kv=None,
                model="m",
                images=IMAGES,
            )
        ],
    )
    assert core.registry.alive(WorkerKind.LLM, WorkerRole.MIXED, T0 + 1) == []
    assert [w.worker_id for w in core.registry.alive(WorkerKind.DIFFUSION, WorkerRole.MIXED, T0 + 1)] == ["img0"]
    assert schedule(core, "r1", now=T0 + 1) == []  # waits (grace window) for an LLM worker
    assert [dest for dest, _ in core.tick(AFTER_GRACE)] == [TOK]  # then is refused
    heartbeat(core, "img0", AFTER_GRACE, free_pages=None)
    assert schedule(core, "r2", now=AFTER_GRACE) == [(TOK, refused("r2", "no workers are available"))]
    register(core, "llm0", now=AFTER_GRACE)
    heartbeat(core, "llm0", AFTER_GRACE, running=7)  # busier than the idle diffusion worker, still with room
    assert status(core, AFTER_GRACE).ready
    assert schedule(core, "r3", now=AFTER_GRACE) == [("llm0", generate("r3"))]
    assert core.registry.workers["img0"].requests == set()


def test_unexpected_messages_are_dropped():
    core = new_core()
    assert core.handle(TOK, Pong(service="x", instance="y"), T0) == []
