"""gateway ⇄ scheduler ⇄ LLM workers: LoRA adapters loaded and unloaded while the mesh runs,
and which adapters each worker runs (issue 31; workers/engine/lora_adapters.py).

    gateway ──LoRAAdapterRequest──▶ scheduler ──LoRAAdapterTask──▶ every LLM worker
    gateway ◀──LoRAAdapterReply──── scheduler ◀──LoRAAdapterDone─── every LLM worker

A request's adapter travels in its SamplingParams (`lora`); a worker's heartbeat says which
adapters it knows, holds in slots, runs and has waiting (LoRALoad)."""

from __future__ import annotations

import enum

from pagemesh.common.messages.base import message, record


class LoRAOp(enum.StrEnum):
    LOAD = "load"
    UNLOAD = "unload"


@record
class LoRAAdapter:
    """An adapter the mesh serves: its name (a request's `model`) and its peft folder."""

    name: str
    path: str


@message
class LoRAAdapterRequest:
    """Gateway -> scheduler: load (name, path) on every LLM worker, or unload name everywhere."""

    requester: str  # the gateway's identity (the reply goes back on the same Dealer)
    op_id: str
    op: LoRAOp
    name: str
    path: str = ""


@message
class LoRAAdapterReply:
    """Scheduler -> gateway: `status` 200 (done on every LLM worker), else the HTTP status of the
    first failure (400: the adapter does not fit; 404: no such folder or adapter; 503: no
    worker) and its `message`; a load that failed anywhere is undone where it succeeded."""

    op_id: str
    status: int
    message: str


@message
class LoRAAdapterTask:
    """Scheduler -> LLM worker: load or unload one adapter."""

    op_id: str
    op: LoRAOp
    name: str
    path: str = ""


@message
class LoRAAdapterDone:
    """LLM worker -> scheduler: how a LoRAAdapterTask went (status as LoRAAdapterReply's)."""

    worker_id: str
    op_id: str
    status: int
    message: str = ""


@record
class LoRALoad:
    """An LLM worker's adapters (in its heartbeat): the names it knows, those in its slots, the
    running and waiting requests' adapters (vLLM's lora_requests_info), its slot count, and its
    loads into slots and evictions from them, ever."""

    known: list[str]
    in_slots: list[str]
    running: list[str]
    waiting: list[str]
    max_loras: int
    loads: int = 0
    evictions: int = 0
