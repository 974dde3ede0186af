"""Which workers exist, how loaded they are, and which requests each holds. Pure Python.

Workers fall into pools keyed by (kind, role): (llm, prefill), (llm, decode), (llm, mixed), and
(diffusion, mixed), (encoder, mixed), (audio, mixed) for the other kinds. Placement asks for the
live workers of one pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemesh.common.messages import (
    FeatureCacheLoad,
    Heartbeat,
    ImageModelInfo,
    KVPoolLoad,
    LoRALoad,
    RegisterWorker,
    SpeculationLoad,
    WorkerKind,
    WorkerRole,
    WorkerStatus,
)
from pagemesh.services.scheduler.kv_event_index import HeldPages

# what a registration renews on a worker the registry knows (same process); its load figures stay
_RENEWED = (
    "kind",
    "role",
    "model",
    "max_running",
    "last_seen",
    "page_size",
    "total_pages",
    "kv_endpoint",
    "images",
    "ranks",
)


@dataclass
class WorkerInfo:
    """What the scheduler knows of one worker: its registration and its last heartbeat.

    The KV-pool figures (page_size .. kv_bytes_received) are an LLM worker's paged pool, from
    `RegisterWorker.kv` and `Heartbeat.kv`; a worker of another kind has none and keeps zeros."""

    worker_id: str
    kind: WorkerKind
    role: WorkerRole
    model: str
    max_running: int
    last_seen: float
    instance: str = ""  # the registering process's start id (RegisterWorker.instance)
    running: int = 0
    waiting: int = 0
    requests_finished: int = 0
    page_size: int = 1
    total_pages: int = 0
    kv_endpoint: str = ""
    used_pages: int = 0
    free_pages: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    produced: int = 0  # Heartbeat.produced
    requests: set[str] = field(default_factory=set)  # placed here and not yet done
    page_hashes: HeldPages = field(default_factory=HeldPages)  # prefix-cache keys its KV events say it holds
    images: ImageModelInfo | None = None  # a diffusion worker's sizes, samplers, step limits
    ranks: int = 1  # RegisterWorker.ranks
    pipeline_stages: int = 1  # RegisterWorker.pipeline_stages
    embeds_endpoint: str = ""  # RegisterWorker.embeds_endpoint: where encoder workers push image rows
    feature_cache: FeatureCacheLoad | None = None  # a diffusion worker's, from its last heartbeat
    speculation: SpeculationLoad | None = None  # an LLM worker's that speculates, from its last heartbeat
    busy_since: float | None = None  # when its step in progress began (by its last heartbeat)
    lora: LoRALoad | None = None  # an LLM worker's adapters, from its last heartbeat
    lora_known: set[str] = field(default_factory=set)  # the adapters it can run: its heartbeat's, and loads since

    def status(self, alive: bool) -> WorkerStatus:
        """Its last report, as ClusterStatus carries it (`alive`: by the registry's clock)."""
        kv = None
        if self.kind == WorkerKind.LLM:
            kv = KVPoolLoad(
                free_pages=self.free_pages,
                used_pages=self.used_pages,
                total_pages=self.total_pages,
                bytes_sent=self.kv_bytes_sent,
                bytes_received=self.kv_bytes_received,
            )
        return WorkerStatus(
            worker_id=self.worker_id,
            kind=self.kind,
            role=self.role,
            alive=alive,
            running=self.running,
            waiting=self.waiting,
            requests_finished=self.requests_finished,
            kv=kv,
            model=self.model,
            images=self.images,
            ranks=self.ranks,
            produced=self.produced,
            feature_cache=self.feature_cache,
            speculation=self.speculation,
            lora=self.lora,
        )

    def serves_lora(self, name: str | None) -> bool:
        return name is None or name in self.lora_known

    def holds_lora(self, name: str | None) -> bool:
        """The adapter is in one of its slots: a request under it loads nothing there."""
        return name is not None and self.lora is not None and name in self.lora.in_slots

    @classmethod
    def registered(cls, msg: RegisterWorker, now: float) -> WorkerInfo:
        """A worker as it registers; its pool counts as free until its first heartbeat."""
        info = cls(
            worker_id=msg.worker_id,
            kind=msg.kind,
            role=msg.role,
            model=msg.model,
            max_running=msg.max_running,
            last_seen=now,
            instance=msg.instance,
            images=msg.images,
            ranks=msg.ranks,
            pipeline_stages=msg.pipeline_stages,
            embeds_endpoint=msg.embeds_endpoint,
        )
        if msg.kv is not None:
            info.page_size, info.total_pages, info.kv_endpoint = msg.kv.page_size, msg.kv.num_pages, msg.kv.kv_endpoint
            info.free_pages = msg.kv.num_pages
        return info

    @property
    def parallel_shape(self) -> tuple[int, int]:
        """(tensor-parallel size, pipeline stages): what a prefill and a decode worker share to pair."""
        return self.ranks // self.pipeline_stages, self.pipeline_stages

    @property
    def load(self) -> int:
        """Requests on the worker: those it reported plus those placed since its last report."""
        return max(self.running + self.waiting, len(self.requests))


class Registry:
    """Workers by id; a worker not heard from within `timeout` seconds is dead, and so is one
    whose heartbeats say it has been inside one step for more than `step_timeout` seconds (a
    worker heartbeats while it computes: a long step alone does not make it silent)."""

    def __init__(self, timeout: float, step_timeout: float = float("inf")):
        self.timeout = timeout
        self.step_timeout = step_timeout
        self.workers: dict[str, WorkerInfo] = {}
        self.models: dict[WorkerKind, set[str]] = {}  # every model a worker of the kind registered with

    def known_models(self, kind: WorkerKind) -> set[str]:
        """The models this mesh's workers of `kind` serve or served: a model outside them does not
        exist (a 404), whether or not its workers are heard from just now (a 503 is for those)."""
        return self.models.get(kind, set())

    def register(self, info: WorkerInfo) -> WorkerInfo | None:
        """Add or renew a worker. The same process registering again keeps its requests; its
        prefix keys start over (it sends a snapshot of them next: kv_event_index.py). Another
        process under a known id is a restart: returns the entry it replaced, whose requests died
        with the old process."""
        if info.model is not None:
            self.models.setdefault(info.kind, set()).add(info.model)
        old = self.workers.get(info.worker_id)
        if old is not None and old.instance == info.instance:
            for name in _RENEWED:
                setattr(old, name, getattr(info, name))
            old.page_hashes.start_over()
            return None
        self.workers[info.worker_id] = info
        return old

    def heartbeat(self, msg: Heartbeat, now: float) -> bool:
        """Apply a load report; False for a worker it does not know (it must register again)."""
        info = self.workers.get(msg.worker_id)
        if info is None:
            return False
        info.last_seen, info.running, info.waiting = now, msg.running, msg.waiting
        info.requests_finished, info.produced = msg.requests_finished, msg.produced
        info.feature_cache = msg.feature_cache
        info.speculation = msg.speculation
        info.lora = msg.lora
        info.lora_known = set(msg.lora.known) if msg.lora is not None else set()
        info.busy_since = now - msg.busy_s if msg.busy_s > 0 else None
        if msg.kv is not None:
            info.used_pages, info.free_pages = msg.kv.used_pages, msg.kv.free_pages
            info.kv_bytes_sent, info.kv_bytes_received = msg.kv.bytes_sent, msg.kv.bytes_received
        return True

    def lora_changed(self, worker_id: str, op_id: str, op) -> None:
        """A worker loaded or unloaded an adapter (LoRAAdapterDone 200 for `op`, the operation)."""
        info = self.workers.get(worker_id)
        if info is None or op is None:
            return
        if op.op == "load":
            info.lora_known.add(op.name)
        else:
            info.lora_known.discard(op.name)

    def excuse_silence(self, seconds: float) -> None:
        """Count `seconds` of every worker's silence as heard (the scheduler itself was paused)."""
        for info in self.workers.values():
            info.last_seen += seconds

    def alive(self, kind: WorkerKind, role: WorkerRole, now: float) -> list[WorkerInfo]:
        """The live workers of the pool (kind, role)."""
        return [w for w in self.workers.values() if w.kind == kind and w.role == role and self.is_alive(w, now)]

    def serving(self, kind: WorkerKind, model: str | None, now: float) -> list[WorkerInfo]:
        """The live (kind, mixed) workers serving `model`, for a kind whose worker runs the whole
        request (diffusion, audio). None: the kind's default model, the one the first registered
        of its live workers serves (with `--diffusion-student`, the student's workers serve only
        requests that name it)."""
        workers = self.alive(kind, WorkerRole.MIXED, now)
        if model is None and workers:
            model = workers[0].model  # registration order
        return [w for w in workers if w.model == model]

    def expire(self, now: float) -> list[WorkerInfo]:
        """Remove and return the workers whose heartbeats stopped."""
        dead = [w for w in self.workers.values() if not self.is_alive(w, now)]
        for w in dead:
            del self.workers[w.worker_id]
        return dead

    def remove(self, worker_id: str, instance: str) -> WorkerInfo | None:
        """Remove the worker process `instance` (a stopped one); None if another (or none) is there."""
        info = self.workers.get(worker_id)
        if info is None or info.instance != instance:
            return None
        return self.workers.pop(worker_id)

    def is_alive(self, worker: WorkerInfo, now: float) -> bool:
        return now - worker.last_seen <= self.timeout and not self.stuck(worker, now)

    def stuck(self, worker: WorkerInfo, now: float) -> bool:
        """Heartbeating, but inside one step for longer than the step timeout."""
        return worker.busy_since is not None and now - worker.busy_since > self.step_timeout
