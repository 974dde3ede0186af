"""The scheduler's decisions, driven through SchedulerCore with no sockets and no clock: each call
gets a message and `now`, and the test checks exactly what it says to send. Here: the worker
registry (registration, heartbeats, losses), readiness and the status page, worker kinds.
Admission and placement: test_scheduler_admission.py; endings: test_scheduler_failures.py."""

from __future__ import annotations

from pagemesh.common.messages import (
    AbortRequest,
    ClusterStatus,
    KVPoolLoad,
    MigrateRequest,
    Pong,
    Registered,
    UnknownWorker,
    WorkerKind,
    WorkerRole,
    WorkerStatus,
)
from pagemesh.tests.scheduler_harness import (
    AFTER_GRACE,
    IMAGES,
    PAGE,
    T0,
    TIMEOUT,
    TOK,
    failed,
    generate,
    heartbeat,
    new_core,
    placed_on_p0_d0,
    refused,
    register,
    schedule,
    status,
)

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


# --------------------------------------------------------------------------- status and kinds


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
