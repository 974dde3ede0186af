"""What the scheduler core's tests share: a SchedulerCore with a short heartbeat timeout, and
the messages its peers send it (a worker's registration and heartbeats, a tokenizer's request, a
worker's RequestDone), each handled at a `now` the test gives; and what the core answers
(`failed`, `refused`, `generate`, `status`)."""

from __future__ import annotations

from pagemesh.common.messages import (
    ClusterStatus,
    DecodeTask,
    DoneReason,
    GenerateTask,
    Heartbeat,
    HeldRequest,
    ImageModelInfo,
    KVPoolInfo,
    KVPoolLoad,
    PrefillTask,
    RegisterWorker,
    RequestDone,
    RequestFailed,
    ScheduleRequest,
    StatusRequest,
    WorkerKind,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.core import SchedulerCore

T0 = 100.0  # when the core started
TIMEOUT = 5.0  # heartbeat timeout, and the start-up grace window
AFTER_GRACE = T0 + TIMEOUT + 0.5
PAGE = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 reusable pages; 5 pages with one token to generate
DEFAULT = SamplingParams()
TOK, TOK_OUT = b"tok0", "ipc:///tok0-out"  # a tokenizer's identity at the scheduler, and its token address


def new_core(max_queue: int = 256, max_migrations: int = 3, worker_return_wait: float = 0.0) -> SchedulerCore:
    """A core whose requests are refused at once when no worker can take them, unless a test
    gives `worker_return_wait` (the flag's default waits 30 s for a lost worker's return)."""
    config = SchedulerConfig(
        "ipc:///unused",
        heartbeat_timeout=TIMEOUT,
        max_queue=max_queue,
        max_migrations=max_migrations,
        worker_return_wait=worker_return_wait,
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
    model: str = "m",
):
    kv = KVPoolInfo(page_size=PAGE, num_pages=100, kv_endpoint=f"ipc:///{wid}-kv") if kind == WorkerKind.LLM else None
    msg = RegisterWorker(
        worker_id=wid,
        kind=kind,
        role=role,
        model=model,
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
    """What the request's tokenizer is told when its worker failed it."""
    return _unavailable(rid, f"Request failed: {why}; retry later.", "worker_failure")


def refused(rid: str, why: str) -> RequestFailed:
    """What a request's sender is told when the scheduler cannot take it."""
    return _unavailable(rid, f"Service unavailable: {why}; retry later.", "overloaded")


def _unavailable(rid: str, message: str, code: str) -> RequestFailed:
    return RequestFailed(request_id=rid, status=503, error_type="server_error", message=message, param=None, code=code)


def generate(rid: str, queued_s: float = 0.0, sampling: SamplingParams = DEFAULT) -> GenerateTask:
    return GenerateTask(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, reply_to=TOK_OUT, queued_s=queued_s)


def disaggregated() -> SchedulerCore:
    core = new_core()
    register(core, "p0", "prefill")
    register(core, "d0", "decode")
    return core


def placed_on_p0_d0(core: SchedulerCore, rid: str = "r1") -> None:
    assert [(dest, type(msg)) for dest, msg in schedule(core, rid)] == [("d0", DecodeTask), ("p0", PrefillTask)]


def status(core: SchedulerCore, now: float) -> ClusterStatus:
    [(dest, msg)] = core.handle(b"gw0", StatusRequest(requester="gw0"), now)
    assert dest == b"gw0"
    return msg
