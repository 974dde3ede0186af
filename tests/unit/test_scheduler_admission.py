"""SchedulerCore's admission (the bounded queue, the start-up grace window, requests sent again)
and placement (disaggregated with the prefix pages the decode worker holds, or on a mixed worker),
driven with no sockets and no clock (tests/scheduler_harness.py)."""

from __future__ import annotations

from pagemesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch
from pagemesh.common.messages import (
    AbortRequest,
    DecodeTask,
    KVEventBatch,
    PrefillTask,
    Registered,
    UnknownWorker,
    WorkerKind,
    WorkerStopped,
)
from pagemesh.common.page_hash import prefix_page_hashes
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.core import SchedulerCore
from pagemesh.tests.scheduler_harness import (
    AFTER_GRACE,
    PAGE,
    PROMPT,
    T0,
    TIMEOUT,
    TOK,
    TOK_OUT,
    disaggregated,
    failed,
    generate,
    heartbeat,
    new_core,
    placed_on_p0_d0,
    refused,
    register,
    schedule,
)

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
    snapshot = [AllBlocksCleared(), BlockStored(keys[:3], None, [], PAGE, None, "GPU")]
    for seq, events in enumerate([snapshot, [BlockRemoved([keys[2]], "GPU")]]):
        batch = KVEventBatch(worker_id="d0", seq=seq, payload=encode_batch(EventBatch(1.0, events)))
        assert core.handle(b"d0", batch, T0) == []
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
