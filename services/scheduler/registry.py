"""Which workers exist, how loaded they are, and which requests each holds. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class WorkerInfo:
    """What the scheduler knows of one worker: its registration and its last heartbeat."""

    worker_id: str
    role: str
    model: str
    page_size: int
    total_pages: int
    kv_endpoint: str
    max_running: int
    last_seen: float
    instance: str = ""  # the registering process's start id (RegisterWorker.instance)
    running: int = 0
    waiting: int = 0
    used_pages: int = 0
    free_pages: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    requests_finished: int = 0
    kind: str = "llm"  # WorkerKind
    requests: set[str] = field(default_factory=set)  # placed here and not yet done
    page_hashes: set[int] = field(default_factory=set)  # prefix-cache keys it reported holding

    @property
    def load(self) -> int:
        """Requests on the worker: those it reported plus those placed since its last report."""
        return max(self.running + self.waiting, len(self.requests))


class Registry:
    """Workers by id; a worker not heard from within `timeout` seconds is dead."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.workers: dict[str, WorkerInfo] = {}

    def register(self, info: WorkerInfo) -> WorkerInfo | None:
        """Add or renew a worker. The same process registering again keeps its requests and
        prefix keys; another process under a known id is a restart: returns the entry it
        replaced, whose requests died with the old process."""
        old = self.workers.get(info.worker_id)
        if old is not None and old.instance == info.instance:  # renew; its load figures stay
            for name in ("role", "model", "page_size", "total_pages", "kv_endpoint", "max_running", "last_seen"):
                setattr(old, name, getattr(info, name))
            return None
        self.workers[info.worker_id] = info
        return old

    def heartbeat(self, worker_id: str, now: float, running: int, waiting: int, used: int, free: int, sent: int, received: int, finished: int = 0) -> bool:
        info = self.workers.get(worker_id)
        if info is None:
            return False  # unknown: it must register (again)
        info.last_seen, info.running, info.waiting = now, running, waiting
        info.used_pages, info.free_pages = used, free
        info.kv_bytes_sent, info.kv_bytes_received = sent, received
        info.requests_finished = finished
        return True

    def prefix_update(self, worker_id: str, added: Iterable[int], removed: Iterable[int]) -> bool:
        """Apply a worker's PrefixCacheUpdate (a key is never in both lists of one update)."""
        info = self.workers.get(worker_id)
        if info is None:
            return False
        info.page_hashes.difference_update(removed)
        info.page_hashes.update(added)
        return True

    def alive(self, role: str, now: float) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role and now - w.last_seen <= self.timeout]

    def expire(self, now: float) -> list[WorkerInfo]:
        """Remove and return the workers whose heartbeats stopped."""
        dead = [w for w in self.workers.values() if now - w.last_seen > self.timeout]
        for w in dead:
            del self.workers[w.worker_id]
        return dead

    def is_alive(self, worker: WorkerInfo, now: float) -> bool:
        return now - worker.last_seen <= self.timeout
