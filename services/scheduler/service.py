"""The scheduler process: worker registry, admission, placement, the prefill→decode handoff's
bookkeeping, and failure handling. One Router serves tokenizers, gateways and workers.

    ScheduleRequest ──▶ admit (queue bound) ──▶ place ──▶ PrefillTask → P, DecodeTask → D
                                                     └──▶ GenerateTask → mixed worker
    PrefixCacheUpdate ──▶ which prefix pages each worker holds (placement, pages D need not get)
    RequestDone / worker death / AbortRequest ──▶ forget, tell the other holders, fail if needed
    Ping ──▶ Pong(instance): tokenizers learn that this process restarted (common/liveness.py);
             a tokenizer's Ping gives its token address, where its requests' failures go
    RegisterWorker.held ──▶ a restarted scheduler takes back the requests workers hold
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import structlog

from common.liveness import new_instance
from common.messages import (
    AbortRequest, ClusterStatus, DecodeTask, GenerateTask, Heartbeat, Ping, Pong, PrefillTask, PrefixCacheUpdate,
    Ready, Registered, RegisterWorker, RequestDone, RequestFailed, ScheduleRequest, StatusRequest, UnknownWorker,
    WorkerStatus, DoneReason, KVPoolInfo, KVPoolLoad,
)
from common.transport import Push, Router, UnknownPeer
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import Placer
from services.scheduler.prefix_index import PromptPages
from services.scheduler.registry import Registry, WorkerInfo

log = structlog.get_logger()

MAX_UNREPORTED = 10_000  # failures kept per tokenizer that has not pinged yet
# RequestDone reasons that end a request with an error for the client
FAILURES = {DoneReason.KV_REJECTED: "the decode worker refused the KV pages", DoneReason.KV_TIMEOUT: "the KV handoff timed out"}


@dataclass
class Placed:
    """A request on workers: who asked (its tokenizer's token address) and which workers hold it."""

    request_id: str
    reply_to: str
    holders: set[str]
    prefill: str | None


class SchedulerService:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.router = Router(config.address, allow_wildcard=True)
        self.registry = Registry(config.heartbeat_timeout)
        self.placer = Placer(config.placement)
        self.queue: deque[tuple[bytes, ScheduleRequest, PromptPages]] = deque()
        self.enqueued_at: dict[str, float] = {}
        self.placed: dict[str, Placed] = {}
        self.tokenizers: dict[str, bytes] = {}  # a tokenizer's token address -> its identity here
        self.unreported: dict[str, list[RequestFailed]] = {}  # failures for tokenizers not heard from yet
        self.instance = new_instance()
        self.started_at = time.monotonic()
        self.log = log.bind(service="scheduler")

    async def run(self) -> None:
        if self.config.ready_address:
            with Push(self.config.ready_address) as ready:
                await ready.send(Ready(service="scheduler", name="scheduler"))
        self.log.info("scheduler ready", address=self.config.address)
        await asyncio.gather(self._receive_loop(), self._expiry_loop())

    def close(self) -> None:
        self.router.close()

    # ---- dispatch -------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        handlers = {
            RegisterWorker: self._on_register,
            Heartbeat: self._on_heartbeat,
            PrefixCacheUpdate: self._on_prefix_update,
            ScheduleRequest: self._on_schedule,
            RequestDone: self._on_done,
            AbortRequest: self._on_abort,
            StatusRequest: self._on_status,
            Ping: self._on_ping,
        }
        while True:
            identity, msg = await self.router.recv()
            handler = handlers.get(type(msg))
            if handler is None:
                self.log.warning("unexpected message", type=type(msg).__name__)
                continue
            try:
                await handler(identity, msg)
            except UnknownPeer as e:  # the peer went away between messages
                self.log.warning("peer gone", error=str(e))

    async def _send(self, identity: bytes | str, msg) -> None:
        if isinstance(identity, str):
            identity = identity.encode()
        try:
            await self.router.send(identity, msg)
        except UnknownPeer:
            self.log.warning("cannot reach peer", peer=identity.decode(errors="replace"), type=type(msg).__name__)

    async def _on_register(self, identity: bytes, msg: RegisterWorker) -> None:
        kv = msg.kv if msg.kv is not None else KVPoolInfo(page_size=1, num_pages=0, kv_endpoint="")
        info = WorkerInfo(
            msg.worker_id, msg.role, msg.model, kv.page_size, kv.num_pages, kv.kv_endpoint, msg.max_running,
            last_seen=time.monotonic(), free_pages=kv.num_pages, instance=msg.instance, kind=msg.kind,
        )
        replaced = self.registry.register(info)
        self.log.info("worker registered", worker=msg.worker_id, kind=msg.kind, role=msg.role, pages=kv.num_pages)
        await self._send(identity, Registered(worker_id=msg.worker_id))
        if replaced is not None:  # a new process under the id: the old one's requests are gone
            self.log.warning("worker restarted", worker=msg.worker_id, requests=len(replaced.requests))
            await self._fail_requests_of(replaced, f"worker {msg.worker_id} restarted")
        for held in msg.held or ():  # placed by an earlier scheduler process: keep them in the books
            placed = self.placed.setdefault(held.request_id, Placed(held.request_id, held.reply_to, set(), None))
            placed.holders.add(msg.worker_id)
            if msg.role == "prefill":
                placed.prefill = msg.worker_id
            self.registry.workers[msg.worker_id].requests.add(held.request_id)
        await self._drain()

    async def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        known = self.registry.heartbeat(
            msg.worker_id, time.monotonic(), msg.running, msg.waiting, *(
                (msg.kv.used_pages, msg.kv.free_pages, msg.kv.bytes_sent, msg.kv.bytes_received) if msg.kv else (0, 0, 0, 0)),
            msg.requests_finished,
        )
        if known:
            await self._drain()
        else:  # this scheduler was restarted, or dropped the worker: it must register again
            await self._send(identity, UnknownWorker(worker_id=msg.worker_id))

    async def _on_prefix_update(self, identity: bytes, msg: PrefixCacheUpdate) -> None:
        self.registry.prefix_update(msg.worker_id, msg.added, msg.removed)

    async def _on_schedule(self, identity: bytes, msg: ScheduleRequest) -> None:
        if msg.request_id in self.placed or msg.request_id in self.enqueued_at:
            return  # sent again by a tokenizer that saw this process start: it has it already
        now = time.monotonic()
        if not self._can_serve(now) and not self._starting(now):
            return await self._reject(identity, msg.request_id, "no workers are available")
        if len(self.queue) >= self.config.max_queue:
            return await self._reject(identity, msg.request_id, "the request queue is full")
        self.tokenizers[msg.reply_to] = identity
        self.queue.append((identity, msg, PromptPages(msg.prompt_token_ids)))
        self.enqueued_at[msg.request_id] = now
        await self._drain()

    async def _reject(self, identity: bytes, request_id: str, why: str) -> None:
        self.log.info("request rejected", request_id=request_id, reason=why)
        await self._send(identity, RequestFailed(request_id=request_id, status=503, error_type="server_error", message=f"Service unavailable: {why}; retry later.", param=None, code="overloaded"))

    async def _drain(self) -> None:
        """Place queued requests, oldest first, while some worker can take them."""
        now = time.monotonic()
        while self.queue:
            origin, req, prompt = self.queue[0]
            placement = self.placer.place(
                self.registry.alive("prefill", now), self.registry.alive("decode", now),
                self.registry.alive("mixed", now), prompt,
            )
            if placement is None:
                return
            self.queue.popleft()
            queued = now - self.enqueued_at.pop(req.request_id, now)
            worker = placement.worker
            handoff = placement.prefill is not None and req.sampling.streams
            if not handoff:
                # mixed worker, or beams / best_of whose state stays in one engine: no handoff
                holders = {worker.worker_id}
                await self._send(worker.worker_id, GenerateTask(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling, reply_to=req.reply_to, queued_s=queued))
            else:
                p = placement.prefill
                holders = {p.worker_id, worker.worker_id}
                skip = placement.skip_pages
                await self._send(worker.worker_id, DecodeTask(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling, reply_to=req.reply_to, prefill_worker_id=p.worker_id, skip_pages=skip))
                await self._send(p.worker_id, PrefillTask(
                    request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling, reply_to=req.reply_to, decode_worker_id=worker.worker_id, decode_kv_endpoint=worker.kv_endpoint, queued_s=queued, skip_pages=skip,
                ))
            for wid in holders:
                self.registry.workers[wid].requests.add(req.request_id)
            self.placed[req.request_id] = Placed(req.request_id, req.reply_to, holders, placement.prefill.worker_id if handoff else None)

    # ---- endings --------------------------------------------------------------------------
    async def _on_done(self, identity: bytes, msg: RequestDone) -> None:
        placed = self.placed.get(msg.request_id)
        self._release(msg.worker_id, msg.request_id)
        if placed is None:
            return
        placed.holders.discard(msg.worker_id)
        if msg.reason.failed:
            await self._fail(placed, FAILURES.get(msg.reason) or f"rejected: {msg.detail}")
        elif msg.reason is DoneReason.FINISHED and msg.worker_id == placed.prefill:
            await self._abort_holders(placed, "finished at the first token")  # no handoff needed
        if not placed.holders:
            self.placed.pop(msg.request_id, None)
        await self._drain()

    async def _on_abort(self, identity: bytes, msg: AbortRequest) -> None:
        self.queue = deque(entry for entry in self.queue if entry[1].request_id != msg.request_id)
        self.enqueued_at.pop(msg.request_id, None)
        placed = self.placed.get(msg.request_id)
        if placed is not None:
            await self._abort_holders(placed, msg.reason)
        elif msg.worker_id in self.registry.workers:  # placed by an earlier scheduler process
            await self._send(msg.worker_id, AbortRequest(request_id=msg.request_id, reason=msg.reason))

    async def _abort_holders(self, placed: Placed, reason: str) -> None:
        rid = placed.request_id
        for wid in list(placed.holders):
            await self._send(wid, AbortRequest(request_id=rid, reason=reason))
            self._release(wid, rid)
        self.placed.pop(rid, None)

    async def _fail(self, placed: Placed, why: str) -> None:
        rid = placed.request_id
        failed = RequestFailed(request_id=rid, status=503, error_type="server_error", message=f"Request failed: {why}; retry later.", param=None, code="worker_failure")
        origin = self.tokenizers.get(placed.reply_to)
        if origin is not None:
            await self._send(origin, failed)
        else:  # its tokenizer has not pinged this scheduler process yet: tell it when it does
            waiting = self.unreported.setdefault(placed.reply_to, [])
            if len(waiting) < MAX_UNREPORTED:
                waiting.append(failed)
        await self._abort_holders(placed, why)

    def _release(self, worker_id: str, request_id: str) -> None:
        info = self.registry.workers.get(worker_id)
        if info is not None:
            info.requests.discard(request_id)

    def _can_serve(self, now: float) -> bool:
        alive = {r: self.registry.alive(r, now) for r in ("prefill", "decode", "mixed")}
        return bool(alive["mixed"] or (alive["prefill"] and alive["decode"]))

    def _starting(self, now: float) -> bool:
        """Within a heartbeat timeout of this process's start, workers may not have registered
        yet (a restarted scheduler): requests wait for them rather than being refused."""
        return now - self.started_at <= self.config.heartbeat_timeout

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_timeout / 4)
            now = time.monotonic()
            for dead in self.registry.expire(now):
                self.log.warning("worker lost", worker=dead.worker_id, requests=len(dead.requests))
                await self._fail_requests_of(dead, f"worker {dead.worker_id} stopped responding")
            if self.queue and not self._can_serve(now) and not self._starting(now):
                waiting, self.queue = self.queue, deque()  # no worker came: refuse what waits
                for identity, request, _ in waiting:
                    self.enqueued_at.pop(request.request_id, None)
                    await self._reject(identity, request.request_id, "no workers are available")

    async def _fail_requests_of(self, gone: WorkerInfo, why: str) -> None:
        """Fail every request placed on a worker process that is gone. The abort also goes to
        the gone worker's id: a worker only silent for a while stops computing them, and a
        process restarted under the id does not know them."""
        for rid in list(gone.requests):
            placed = self.placed.get(rid)
            if placed is not None:
                await self._fail(placed, why)

    # ---- status ---------------------------------------------------------------------------
    async def _on_ping(self, identity: bytes, msg: Ping) -> None:
        if msg.address is not None:
            self.tokenizers[msg.address] = identity
            for failed in self.unreported.pop(msg.address, ()):
                await self._send(identity, failed)
        await self._send(identity, Pong(service="scheduler", instance=self.instance))

    async def _on_status(self, identity: bytes, msg: StatusRequest) -> None:
        now = time.monotonic()
        workers = [
            WorkerStatus(worker_id=w.worker_id, kind=w.kind, role=w.role, alive=self.registry.is_alive(w, now), running=w.running,
                         waiting=w.waiting, requests_finished=w.requests_finished,
                         kv=KVPoolLoad(free_pages=w.free_pages, used_pages=w.used_pages, total_pages=w.total_pages,
                                       bytes_sent=w.kv_bytes_sent, bytes_received=w.kv_bytes_received))
            for w in self.registry.workers.values()
        ]
        alive = {w.role for w in workers if w.alive}
        ready = "mixed" in alive or {"prefill", "decode"} <= alive
        await self._send(identity, ClusterStatus(ready=ready, workers=workers, queued=len(self.queue)))
