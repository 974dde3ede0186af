"""Embedding requests in the scheduler (ScheduleRequest.pooling): placed whole on one worker that
prefills (prefill or mixed, one pipeline stage), never on a decode worker; ended by that worker's
RequestDone; moved like any request when the worker is lost."""

from __future__ import annotations

from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    GenerateTask,
    KVPoolInfo,
    MigrateRequest,
    Pooling,
    RegisterWorker,
    RequestFailed,
    ResumeState,
    ScheduleRequest,
    WorkerKind,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.scheduler_harness import (
    AFTER_GRACE,
    PAGE,
    PROMPT,
    T0,
    TIMEOUT,
    TOK,
    TOK_OUT,
    disaggregated,
    done,
    heartbeat,
    new_core,
    refused,
    register,
)

EMBED = SamplingParams(temperature=0.0, max_tokens=1)


def embed(core, rid: str, now: float = T0, prompt: list[int] = PROMPT, resume: ResumeState | None = None):
    msg = ScheduleRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=EMBED,
        reply_to=TOK_OUT,
        arrival_time=0.0,
        resume=resume,
        pooling=Pooling.MEAN,
    )
    return core.handle(TOK, msg, now)


def task(rid: str, prompt: list[int] = PROMPT, queued_s: float = 0.0) -> GenerateTask:
    return GenerateTask(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=EMBED,
        reply_to=TOK_OUT,
        queued_s=queued_s,
        pooling=Pooling.MEAN,
    )


def test_an_embedding_runs_on_the_prefill_worker_alone_and_ends_with_its_done():
    core = disaggregated()
    assert embed(core, "e1") == [("p0", task("e1"))]
    assert core.placed["e1"].holders == {"p0"} and core.placed["e1"].prefill is None
    assert core.registry.workers["d0"].requests == set() and core.registry.workers["p0"].requests == {"e1"}
    assert done(core, "p0", "e1", DoneReason.FINISHED) == []  # no decode side to abort
    assert core.placed == {} and core.registry.workers["p0"].requests == set()


def test_an_embedding_takes_a_mixed_worker_and_never_a_decode_worker():
    core = new_core()
    register(core, "d0", "decode")
    assert embed(core, "e1", now=T0 + 1) == []  # waits: a worker that prefills may still register
    assert embed(core, "e2", now=AFTER_GRACE) == [(TOK, refused("e2", "no workers are available"))]
    register(core, "m0", "mixed", now=AFTER_GRACE)  # the queued one goes there as it registers
    assert core.placed["e1"].holders == {"m0"}
    assert embed(core, "e3", now=AFTER_GRACE) == [("m0", task("e3"))]


def test_an_embedding_waits_for_pages_and_is_placed_when_a_heartbeat_shows_them():
    core = disaggregated()
    heartbeat(core, "p0", T0 + 1, free_pages=4)  # the prompt's 17 tokens need 5 pages of 4
    assert embed(core, "e1", now=T0 + 1) == []
    assert heartbeat(core, "p0", T0 + 2, free_pages=5) == [("p0", task("e1", queued_s=1.0))]


def test_no_embedding_on_pipeline_stages():
    """Their last stage holds the final norm, and only logits travel back to rank 0."""
    core = new_core()
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        msg = RegisterWorker(
            worker_id=wid,
            kind=WorkerKind.LLM,
            role=role,
            model="m",
            max_running=8,
            kv=KVPoolInfo(page_size=PAGE, num_pages=100, kv_endpoint=f"ipc:///{wid}-kv"),
            ranks=2,
            pipeline_stages=2,
        )
        core.handle(wid.encode(), msg, T0)
    assert core.is_ready(T0)  # it serves generation
    assert embed(core, "e1", now=AFTER_GRACE) == [(TOK, refused("e1", "no workers are available"))]


def test_an_embedding_longer_than_any_prefilling_pool_is_a_400():
    core = disaggregated()
    long_prompt = list(range(400))  # 100 pages of 4 tokens hold 400, but not one more
    [(dest, failure)] = embed(core, "e1", prompt=long_prompt)
    assert dest == TOK and isinstance(failure, RequestFailed) and failure.status == 400
    assert failure.message.startswith("prompt: 400 tokens and one more do not fit any worker's KV pool")


def test_a_lost_worker_s_embedding_moves_and_is_placed_again_on_a_worker_that_prefills():
    core = disaggregated()
    embed(core, "e1")
    register(core, "p1", "prefill", now=T0 + TIMEOUT)
    heartbeat(core, "d0", T0 + TIMEOUT)
    heartbeat(core, "p1", T0 + TIMEOUT)
    lost = "worker p0 stopped responding"
    assert core.tick(T0 + TIMEOUT + 1) == [
        (TOK, MigrateRequest(request_id="e1", reason=lost, lost_worker_ids=["p0"])),
        ("p0", AbortRequest(request_id="e1", reason=lost)),
    ]
    again = embed(core, "e1", now=T0 + TIMEOUT + 1, resume=ResumeState(output_token_ids=[], migrations=1))
    assert again == [("p1", task("e1"))]
    assert core.placed["e1"].migrations == 1
