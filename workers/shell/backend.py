"""The interface between the worker shell and a worker kind (LLM, diffusion, ...).

The shell (workers/shell/shell.py) does everything a worker process does whatever it serves:
it registers with the scheduler (again after a scheduler restart), heartbeats, reports READY,
takes the scheduler's messages into an inbox and runs the step loop. A kind plugs in as a
`WorkerBackend`; the shell calls it only from its engine loop, between steps (so a backend's
state has one writer), except `step()`, which on CUDA runs in a compute thread.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from pagemesh.common.messages import (
    DoneReason,
    FeatureCacheLoad,
    HeldRequest,
    ImageModelInfo,
    KVPoolInfo,
    KVPoolLoad,
    LoRALoad,
    Message,
    SpeculationLoad,
    WorkerKind,
    WorkerRole,
)


@dataclass(frozen=True, kw_only=True)
class Registration:
    """What a backend tells the scheduler about itself (RegisterWorker without the process's
    instance id and held requests, which the shell adds)."""

    kind: WorkerKind
    role: WorkerRole
    model: str
    max_running: int
    kv: KVPoolInfo | None = None  # an LLM worker's paged pool
    images: ImageModelInfo | None = None  # a diffusion worker's sizes, samplers, step limits
    ranks: int = 1  # processes it runs on (tensor parallel × pipeline parallel)
    pipeline_stages: int = 1  # of those ranks, how many pipeline stages (the rest is tensor parallel)
    embeds_endpoint: str = ""  # an LLM worker taking image rows from encoder workers


@dataclass(frozen=True, kw_only=True)
class Load:
    """A backend's load, for each heartbeat."""

    running: int
    waiting: int
    kv: KVPoolLoad | None = None
    produced: int = 0  # output made, ever: tokens or images
    feature_cache: FeatureCacheLoad | None = None  # a diffusion worker's
    speculation: SpeculationLoad | None = None  # an LLM worker's that speculates
    lora: LoRALoad | None = None  # an LLM worker's that serves adapters


class WorkerContext(Protocol):
    """What the shell offers a backend: the way out to the mesh, and the way into the inbox."""

    worker_id: str
    log: structlog.typing.FilteringBoundLogger

    def post(self, command: Callable[[], None]) -> None:
        """Run `command` in the engine loop, between steps (from any coroutine of this process)."""

    def to_scheduler(self, msg: Message) -> None:
        """Send a message to the scheduler (in order with the shell's own)."""

    def push(self, address: str, msg: Message) -> Coroutine[Any, Any, None]:
        """Send a message to a PUSH/PULL address (a tokenizer's token address, say); awaitable."""

    def done(self, request_id: str, reason: DoneReason, detail: str | None = None) -> None:
        """The request left this worker: tell the scheduler (and count it)."""


class WorkerBackend(Protocol):
    """A worker kind. Task messages come through `add`, aborts through `abort`; `step()` runs
    one step of work and `publish()` sends what it produced."""

    task_types: tuple[type, ...]  # scheduler -> worker messages `add` takes
    step_inline: bool  # run `step()` on the event loop's thread (CPU) or in a compute thread (CUDA)

    def registration(self) -> Registration: ...
    def add(self, task: Message) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> Any: ...
    def stalled(self) -> bool:
        """The last step could run nothing (it waits for news: an acknowledgement frees pages)."""

    async def publish(self, result: Any) -> None: ...
    async def between_steps(self) -> None:
        """After the inbox ran, before the next step (e.g. prefix-cache reports)."""

    def load(self) -> Load: ...
    def held(self) -> list[HeldRequest]:
        """The requests it works on, for registering again with a restarted scheduler."""

    def registered_again(self) -> None:
        """A restarted scheduler took the registration: resend what it must know (cache keys)."""

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """The kind's own loops (KV transfer, deadlines), run beside the shell's."""

    def close(self) -> None: ...
