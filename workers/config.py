"""Worker process configuration."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from workers.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # prefill | decode | mixed
    worker_id: str
    scheduler_address: str
    kv_address: str | None  # decode role: where it binds for incoming KV pages
    kv_advertise: str | None  # what prefill workers connect to (default: kv_address)
    ready_address: str | None
    engine: EngineConfig
    heartbeat_interval: float = 0.25
    transfer_timeout: float = 30.0
    threads: int | None = None  # torch CPU threads

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "mixed"):
            raise ValueError("role: must be prefill, decode or mixed")
        if self.role == "decode" and not self.kv_address:
            raise ValueError("kv_address: a decode worker needs one (--kv-address)")


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"
