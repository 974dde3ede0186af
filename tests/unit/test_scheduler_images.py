"""The scheduler core places image requests on diffusion workers: by model, least loaded first,
in a queue of their own that never blocks LLM requests; refusals and failures reach the gateway."""

from __future__ import annotations

from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    FeatureCacheLoad,
    GenerateTask,
    Heartbeat,
    ImageParams,
    ImageRequest,
    ImageTask,
    RequestFailed,
    WorkerKind,
)
from pagemesh.tests.scheduler_harness import (
    AFTER_GRACE,
    T0,
    TIMEOUT,
    done,
    heartbeat,
    new_core,
    refused,
    register,
    schedule,
    status,
)

GW, GW_OUT = b"gw0", "ipc:///gw0-replies"
PARAMS = ImageParams(
    prompt="a 3",
    negative_prompt=None,
    n=1,
    width=None,
    height=None,
    num_inference_steps=None,
    guidance_scale=None,
    sampler=None,
    seed=1,
)


def image(core, rid: str, now: float, model: str | None = None):
    msg = ImageRequest(request_id=rid, model=model, params=PARAMS, reply_to=GW_OUT, arrival_time=0.0)
    return core.handle(GW, msg, now)


def diffusion(core, wid: str, now: float, max_running: int = 2, model: str = "m"):
    out = register(core, wid, now=now, kind=WorkerKind.DIFFUSION, max_running=max_running, model=model)
    return out


def test_an_image_request_goes_to_the_least_loaded_diffusion_worker_of_its_model():
    core = new_core()
    diffusion(core, "x0", T0)
    diffusion(core, "x1", T0)
    diffusion(core, "y0", T0, model="other")
    first = image(core, "i1", T0, model="m")
    assert [(dest, type(msg)) for dest, msg in first] == [("x0", ImageTask)]
    assert first[0][1].reply_to == GW_OUT and first[0][1].params == PARAMS
    assert [dest for dest, _ in image(core, "i2", T0, model="m")] == ["x1"]  # x0 has one now
    assert [dest for dest, _ in image(core, "i3", T0, model="other")] == ["y0"]


def test_an_unknown_model_is_a_404_naming_the_served_ones():
    core = new_core()
    diffusion(core, "x0", AFTER_GRACE)
    [(dest, failed)] = image(core, "i1", AFTER_GRACE, model="nope")
    assert dest == GW and isinstance(failed, RequestFailed)
    assert (failed.status, failed.code, failed.param) == (404, "model_not_found", "model")
    assert failed.message.endswith("image models served: m.")


def test_an_unknown_model_is_a_404_while_the_workers_are_silent_and_a_known_one_a_503():
    """Whether a model exists does not hang on a heartbeat: a silent worker (a busy machine, or a
    scheduler that read this request before the heartbeats waiting in its socket) leaves its
    model known. CI once got a 503 here."""
    core = new_core()
    diffusion(core, "x0", AFTER_GRACE)
    silent = AFTER_GRACE + TIMEOUT + 1  # x0 is not alive, not yet dropped by a tick
    assert not core.registry.serving(WorkerKind.DIFFUSION, "m", silent)
    [(_, unknown)] = image(core, "i1", silent, model="nope")
    assert (unknown.status, unknown.code) == (404, "model_not_found")
    assert unknown.message.endswith("image models served: m.")
    [(_, unserved)] = image(core, "i2", silent, model="m")
    assert (unserved.status, unserved.code) == (503, "overloaded")


def test_images_wait_in_their_own_queue_and_never_block_text():
    core = new_core()
    diffusion(core, "x0", T0, max_running=1)
    register(core, "m0", now=T0)
    assert [dest for dest, _ in image(core, "i1", T0)] == ["x0"]
    assert image(core, "i2", T0) == []  # x0 is full: i2 waits
    out = schedule(core, "r1", now=T0)  # an LLM request behind it is placed at once
    assert [(dest, type(msg)) for dest, msg in out] == [("m0", GenerateTask)]
    assert list(core.queues[WorkerKind.DIFFUSION]) == ["i2"] and core.queued == 1
    out = done(core, "x0", "i1", DoneReason.FINISHED)  # x0 has room again: i2 goes there
    assert [(dest, type(msg), msg.request_id) for dest, msg in out] == [("x0", ImageTask, "i2")]


def test_a_full_image_queue_is_a_503_and_no_diffusion_worker_refuses_after_the_grace_window():
    core = new_core(max_queue=1)
    diffusion(core, "x0", T0, max_running=1)
    image(core, "i1", T0)
    assert image(core, "i2", T0) == []
    assert image(core, "i3", T0) == [(GW, refused("i3", "the request queue is full"))]
    core = new_core()
    register(core, "m0", now=T0)
    assert image(core, "i1", T0) == []  # within the grace window: a diffusion worker may come
    heartbeat(core, "m0", AFTER_GRACE)
    assert core.tick(AFTER_GRACE) == [(GW, refused("i1", "no workers are available"))]
    assert image(core, "i2", AFTER_GRACE) == [(GW, refused("i2", "no workers are available"))]


def test_a_dead_diffusion_workers_image_starts_over_on_another_up_to_max_migrations_times():
    core = new_core(max_migrations=2)
    diffusion(core, "x0", T0)
    diffusion(core, "x1", T0)
    image(core, "i1", T0)  # on x0
    lost = T0 + TIMEOUT + 0.5
    heartbeat(core, "x1", lost, free_pages=None)
    out = core.tick(lost)  # x0 went silent: on x1, from the start
    assert [(dest, type(msg)) for dest, msg in out] == [("x0", AbortRequest), ("x1", ImageTask)]
    assert out[1][1].request_id == "i1" and out[1][1].params == PARAMS and core.placed["i1"].holders == {"x1"}
    register(core, "x0", now=lost, kind=WorkerKind.DIFFUSION, instance="x0-second")  # restarted
    again = lost + TIMEOUT + 0.5
    heartbeat(core, "x0", again, free_pages=None)
    out = core.tick(again)  # x1 went silent too: back on x0
    assert [(dest, type(msg)) for dest, msg in out] == [("x1", AbortRequest), ("x0", ImageTask)]
    register(core, "x1", now=again, kind=WorkerKind.DIFFUSION, instance="x1-second")
    heartbeat(core, "x1", again + TIMEOUT + 0.5, free_pages=None)
    out = core.tick(again + TIMEOUT + 0.5)  # x0 again: a third loss, after 2 restarts (--max-migrations)
    assert [(dest, type(msg)) for dest, msg in out] == [(GW, RequestFailed), ("x0", AbortRequest)]


def test_a_dead_diffusion_worker_fails_its_requests_to_the_gateway_and_an_abort_reaches_the_worker():
    core = new_core(max_migrations=0)  # no start over elsewhere
    diffusion(core, "x0", T0)
    diffusion(core, "x1", T0 + TIMEOUT)
    image(core, "i1", T0)  # on x0 (both empty: the lower id)
    image(core, "i2", T0)  # on x1
    heartbeat(core, "x1", T0 + TIMEOUT + 0.5, free_pages=None)
    out = core.tick(T0 + TIMEOUT + 0.5)  # x0 went silent
    failed = [msg for dest, msg in out if dest == GW]
    assert [(f.request_id, f.status, f.code) for f in failed] == [("i1", 503, "worker_failure")]
    out = core.handle(GW, AbortRequest(request_id="i2", reason="client disconnected"), T0 + TIMEOUT + 0.6)
    assert out == [("x1", AbortRequest(request_id="i2", reason="client disconnected"))]
    assert core.registry.workers["x1"].requests == set()


def test_a_request_the_worker_found_invalid_ends_without_a_second_error():
    core = new_core()
    diffusion(core, "x0", T0)
    image(core, "i1", T0)
    assert done(core, "x0", "i1", DoneReason.INVALID, "size: must be one of 8x8") == []
    assert "i1" not in core.placed and core.registry.workers["x0"].requests == set()


def test_a_request_naming_no_model_goes_to_the_first_registered_image_model():
    core = new_core()
    diffusion(core, "x0", T0)
    diffusion(core, "s0", T0, model="student")
    diffusion(core, "x1", T0)
    assert [dest for dest, _ in image(core, "i1", T0)] == ["x0"]
    assert [dest for dest, _ in image(core, "i2", T0)] == ["x1"]
    assert [dest for dest, _ in image(core, "i3", T0)] == ["x0"]  # never the student's worker
    assert [dest for dest, _ in image(core, "i4", T0, model="student")] == ["s0"]


def test_a_diffusion_workers_feature_cache_bytes_reach_the_status_from_its_last_heartbeat():
    core = new_core()
    diffusion(core, "x0", T0)
    heartbeat(core, "x0", T0, free_pages=None)  # none reported yet
    assert [w.feature_cache for w in status(core, T0).workers] == [None]
    for held, peak in ((3072, 3072), (0, 3072)):  # a request's cache, then freed when it finished
        cache = FeatureCacheLoad(bytes=held, peak_bytes=peak, budget_bytes=2**20)
        msg = Heartbeat(
            worker_id="x0", running=0, waiting=0, time=T0, requests_finished=0, kv=None, feature_cache=cache
        )
        core.handle(b"x0", msg, T0)
        assert [w.feature_cache for w in status(core, T0).workers] == [cache]
