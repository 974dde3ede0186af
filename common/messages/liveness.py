"""Liveness and status: READY to the launcher, Ping/Pong between neighbours, the mesh's state.

any process ──Ready──▶ launcher                (once serving)
gateway ──Ping──▶ tokenizer ──Ping──▶ scheduler (every second; Pong says which process answers)
gateway ──StatusRequest──▶ scheduler ──ClusterStatus──▶ gateway (/ready, /metrics, /status)
"""

from __future__ import annotations

from dataclasses import field

from pagemesh.common.messages.base import WorkerKind, WorkerRole, message, record
from pagemesh.common.messages.images import FeatureCacheLoad, ImageModelInfo
from pagemesh.common.messages.lora import LoRAAdapter, LoRALoad
from pagemesh.common.messages.worker_control import KVPoolLoad, SpeculationLoad


@message
class Ready:
    """Any process -> launcher: started and serving."""

    service: str
    name: str


@message
class Ping:
    """Gateway -> tokenizer and tokenizer -> scheduler, every PING_INTERVAL_S: which process is there?
    A tokenizer gives its token address: where the requests whose RequestFailed it must get reply."""

    sender: str
    address: str | None = None


@message
class Pong:
    """The answer to Ping. `instance` is random per process start: a new one means the process
    was restarted and has forgotten the requests the old one held."""

    service: str
    instance: str


@message
class StatusRequest:
    """Gateway -> scheduler: asks for the mesh's state (readiness, per-worker load)."""

    requester: str


@record
class WorkerStatus:
    """One worker's last report, as the scheduler knows it."""

    worker_id: str
    kind: WorkerKind
    role: WorkerRole
    alive: bool
    running: int
    waiting: int
    requests_finished: int
    kv: KVPoolLoad | None
    model: str = ""
    images: ImageModelInfo | None = None  # diffusion workers
    ranks: int = 1  # RegisterWorker.ranks
    produced: int = 0  # Heartbeat.produced: tokens or images made, ever (a rate is its slope)
    feature_cache: FeatureCacheLoad | None = None  # diffusion workers: their last heartbeat's
    speculation: SpeculationLoad | None = None  # Heartbeat.speculation: LLM workers that speculate
    lora: LoRALoad | None = None  # Heartbeat.lora: LLM workers that serve adapters


@message
class ClusterStatus:
    """Scheduler -> gateway: reply to StatusRequest. `ready` when every needed role has a live
    worker (prefill + decode, or mixed)."""

    ready: bool
    workers: list[WorkerStatus]
    queued: int
    migrations: int = 0  # requests re-placed after their worker was lost, since the scheduler started
    lora_adapters: list[LoRAAdapter] = field(default_factory=list)  # the adapters the mesh serves
    kv_event_batches: int = 0  # KVEventBatch messages the scheduler's prefix index applied, ever
    kv_event_malformed: int = 0  # ... it could not read (each dropped that worker's keys and asked again)
    kv_event_resyncs: int = 0  # snapshots it asked a worker for (a gap in the sequence, or unreadable)
