"""The scheduler core places transcriptions on audio workers (services/scheduler/audio.py): by
model, least loaded first, in a queue of their own; refusals, failures, aborts and readiness as
for images."""

from __future__ import annotations

from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    GenerateTask,
    ImageParams,
    ImageRequest,
    ImageTask,
    RequestFailed,
    TranscriptionRequest,
    TranscriptionTask,
    WorkerKind,
    WorkerStopped,
)
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.core import SchedulerCore
from pagemesh.tests.scheduler_harness import (
    AFTER_GRACE,
    T0,
    TIMEOUT,
    done,
    failed,
    heartbeat,
    new_core,
    refused,
    register,
    schedule,
    status,
)

GW, GW_OUT = b"gw0", "ipc:///gw0-replies"
AUDIO = b"RIFF-a-wav-file"


def transcribe(core, rid: str, now: float, model: str | None = None, max_tokens: int | None = None):
    msg = TranscriptionRequest(
        request_id=rid, model=model, audio=AUDIO, max_tokens=max_tokens, reply_to=GW_OUT, arrival_time=0.0
    )
    return core.handle(GW, msg, now)


def audio_worker(core, wid: str, now: float, max_running: int = 2, model: str = "whisper"):
    out = register(core, wid, now=now, kind=WorkerKind.AUDIO, max_running=max_running, model=model)
    return out


def task(rid: str, queued_s: float = 0.0, max_tokens: int | None = None) -> TranscriptionTask:
    return TranscriptionTask(request_id=rid, audio=AUDIO, max_tokens=max_tokens, reply_to=GW_OUT, queued_s=queued_s)


def test_a_transcription_goes_to_the_least_loaded_audio_worker_of_its_model():
    core = new_core()
    audio_worker(core, "a0", T0)
    audio_worker(core, "a1", T0)
    audio_worker(core, "b0", T0, model="other")
    assert transcribe(core, "t1", T0, model="whisper", max_tokens=7) == [("a0", task("t1", max_tokens=7))]
    assert transcribe(core, "t2", T0, model="whisper") == [("a1", task("t2"))]  # a0 has one now
    assert transcribe(core, "t3", T0, model="other") == [("b0", task("t3"))]
    assert transcribe(core, "t4", T0) == [("a0", task("t4"))]  # no model: the first registered's
    assert core.registry.workers["a0"].requests == {"t1", "t4"}


def test_an_unknown_model_is_a_404_naming_the_served_ones():
    core = new_core()
    audio_worker(core, "a0", AFTER_GRACE)
    audio_worker(core, "a1", AFTER_GRACE, model="whisper-small")
    [(dest, refusal)] = transcribe(core, "t1", AFTER_GRACE, model="nope")
    assert dest == GW and refusal == RequestFailed(
        request_id="t1",
        status=404,
        error_type="invalid_request_error",
        message="The model `nope` does not exist; audio models served: whisper, whisper-small.",
        param="model",
        code="model_not_found",
    )


def test_transcriptions_wait_in_their_own_queue_and_never_block_images_or_text():
    core = new_core()
    audio_worker(core, "a0", T0, max_running=1)
    register(core, "x0", now=T0, kind=WorkerKind.DIFFUSION)
    register(core, "m0", now=T0)
    assert transcribe(core, "t1", T0) == [("a0", task("t1"))]
    assert transcribe(core, "t2", T0 + 1) == []  # a0 is full: t2 waits
    assert [(d, type(m)) for d, m in schedule(core, "r1", now=T0 + 1)] == [("m0", GenerateTask)]
    image = ImageRequest(
        request_id="i1",
        model=None,
        params=ImageParams(
            prompt="a 3",
            negative_prompt=None,
            n=1,
            width=None,
            height=None,
            num_inference_steps=None,
            guidance_scale=None,
            sampler=None,
            seed=1,
        ),
        reply_to=GW_OUT,
        arrival_time=0.0,
    )
    assert [(d, type(m)) for d, m in core.handle(GW, image, T0 + 1)] == [("x0", ImageTask)]
    assert list(core.queues[WorkerKind.AUDIO]) == ["t2"] and core.queued == 1
    # a0 has room again: t2 goes there, having waited 2 s
    assert done(core, "a0", "t1", DoneReason.FINISHED, now=T0 + 3) == [("a0", task("t2", queued_s=2.0))]
    assert core.registry.workers["a0"].requests == {"t2"} and "t1" not in core.placed


def test_a_full_queue_is_a_503_and_no_audio_worker_refuses_after_the_grace_window():
    core = new_core(max_queue=1)
    audio_worker(core, "a0", T0, max_running=1)
    transcribe(core, "t1", T0)
    assert transcribe(core, "t2", T0) == []
    assert transcribe(core, "t3", T0) == [(GW, refused("t3", "the request queue is full"))]
    core = new_core()
    register(core, "m0", now=T0)
    assert transcribe(core, "t1", T0) == []  # within the grace window: an audio worker may come
    heartbeat(core, "m0", AFTER_GRACE)
    assert core.tick(AFTER_GRACE) == [(GW, refused("t1", "no workers are available"))]
    assert transcribe(core, "t2", AFTER_GRACE) == [(GW, refused("t2", "no workers are available"))]


def test_a_lost_audio_workers_transcription_starts_over_on_another_and_an_abort_reaches_the_worker():
    core = new_core()
    audio_worker(core, "a0", T0)
    audio_worker(core, "a1", T0 + TIMEOUT)
    transcribe(core, "t1", T0)  # on a0 (both empty: the lower id)
    transcribe(core, "t2", T0)  # on a1
    heartbeat(core, "a1", T0 + TIMEOUT + 0.5, free_pages=None)
    out = core.tick(T0 + TIMEOUT + 0.5)  # a0 went silent
    why = "worker a0 stopped responding"
    assert out == [("a0", AbortRequest(request_id="t1", reason=why)), ("a1", task("t1", queued_s=TIMEOUT + 0.5))]
    assert core.placed["t1"].holders == {"a1"}
    out = core.handle(GW, AbortRequest(request_id="t2", reason="client disconnected"), T0 + TIMEOUT + 0.6)
    assert out == [("a1", AbortRequest(request_id="t2", reason="client disconnected"))]
    assert core.registry.workers["a1"].requests == {"t1"} and set(core.placed) == {"t1"}


def test_with_max_migrations_0_a_lost_audio_workers_transcription_fails():
    core = new_core(max_migrations=0)
    audio_worker(core, "a0", T0)
    audio_worker(core, "a1", T0 + TIMEOUT)
    transcribe(core, "t1", T0)
    heartbeat(core, "a1", T0 + TIMEOUT + 0.5, free_pages=None)
    why = "worker a0 stopped responding"
    out = core.tick(T0 + TIMEOUT + 0.5)
    assert out == [(GW, failed("t1", why)), ("a0", AbortRequest(request_id="t1", reason=why))]


def test_a_stopped_audio_worker_fails_its_request_at_once_and_an_abort_of_a_queued_one_drops_it():
    core = new_core(max_migrations=0)  # no start over elsewhere
    audio_worker(core, "a0", T0, max_running=1)
    transcribe(core, "t1", T0)
    transcribe(core, "t2", T0)  # queued behind t1
    core.handle(GW, AbortRequest(request_id="t2", reason="client disconnected"), T0)
    assert core.queued == 0
    out = core.handle(b"a0", WorkerStopped(worker_id="a0", instance="a0-first", error="CUDA error"), T0 + 1)
    why = "the engine of worker a0 failed"
    assert out == [(GW, failed("t1", why)), ("a0", AbortRequest(request_id="t1", reason=why))]


def test_a_file_the_worker_could_not_read_ends_without_a_second_error():
    core = new_core()
    audio_worker(core, "a0", T0)
    transcribe(core, "t1", T0)
    assert done(core, "a0", "t1", DoneReason.INVALID, "file: not a WAV file") == []
    assert "t1" not in core.placed and core.registry.workers["a0"].requests == set()


def test_a_mesh_serving_audio_is_ready_once_an_audio_worker_is_live():
    config = SchedulerConfig("ipc:///unused", heartbeat_timeout=TIMEOUT, serves=(WorkerKind.AUDIO,))
    core = SchedulerCore(config, "inst-1", T0)
    register(core, "m0", now=T0)  # an LLM worker does not make an audio mesh ready
    assert not status(core, T0).ready
    audio_worker(core, "a0", T0)
    assert status(core, T0).ready
    assert [(w.worker_id, w.kind, w.model) for w in status(core, T0).workers] == [
        ("m0", WorkerKind.LLM, "m"),
        ("a0", WorkerKind.AUDIO, "whisper"),
    ]
    assert not status(core, T0 + TIMEOUT + 0.5).ready  # its heartbeats stopped


def test_with_no_kinds_configured_a_mesh_of_audio_workers_alone_is_ready_by_theirs():
    core = new_core()  # no --serves: the kinds registered decide
    audio_worker(core, "a0", T0)
    assert status(core, T0).ready
    assert not status(core, T0 + TIMEOUT + 0.5).ready
    register(core, "m0", now=T0 + TIMEOUT + 0.5)  # an LLM worker: its pools decide (a mixed one is live)
    assert status(core, T0 + TIMEOUT + 0.5).ready
