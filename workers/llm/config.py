"""LLM worker configuration: the shell's, the role, the KV handoff's addresses, the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.common.messages import WorkerRole
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.shell.config import ShellConfig


@dataclass(frozen=True, kw_only=True)
class LLMWorkerConfig:
    shell: ShellConfig
    role: WorkerRole
    engine: EngineConfig
    kv_address: str | None = None  # decode role: where it binds for incoming KV pages
    kv_advertise: str | None = None  # what prefill workers connect to (default: kv_address)
    embeds_address: str | None = None  # where encoder workers push image rows (a multimodal model's prefills)
    transfer_timeout: float = 30.0  # seconds before an unacknowledged KV handoff is dropped
    threads: int | None = None  # torch CPU threads

    def __post_init__(self) -> None:
        if self.role is WorkerRole.DECODE and not self.kv_address:
            raise ValueError("kv_address: a decode worker needs one (--kv-address)")
