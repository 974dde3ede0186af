"""The worker process: one engine behind the mesh's sockets.

    scheduler ──PrefillTask/DecodeTask/GenerateTask/AbortRequest──▶ [control loop] ─┐
    prefill worker ──KVPagesHeader+frames──▶ [kv loop] (decode role) ───────────────┤ inbox
                                                                                     ▼
    [engine loop]  apply inbox → engine.step() (CUDA: in the compute thread) → publish:
        TokenDeltaBatch per destination (one message per step), RequestDone to the scheduler,
        and (prefill role) the KV pages of each prefilled request to its decode worker;
        between steps, PrefixCacheUpdate to the scheduler when prefix-cache pages came or went.
    [heartbeat loop] load report every interval (CUDA: also while a step runs; CPU: between steps).

Prefix reuse across the handoff: the scheduler tells both sides how many leading prompt pages
the decode worker holds (`skip_pages`). The decode worker pins them when the DecodeTask comes
(so eviction cannot take them), the prefill worker sends only the rest, and the import builds
the block table from the pinned pages + the received ones (or refuses if they are gone).

Only the engine loop touches the engine, and only between steps; the other loops queue work
in the inbox, so the asyncio loop keeps serving sockets while a step computes (on CUDA; on a CPU
the zmq I/O threads keep receiving, and the loop takes the messages between steps).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import structlog

from common import protocol as p
from common.liveness import new_instance
from common.messages import (
    MAX_PAGE_HASHES, AbortRequest, DecodeTask, GenerateTask, HeldRequest, Heartbeat, KVPagesAck, KVPagesHeader, PrefillTask,
    PrefixCacheUpdate, Ready, Registered, RegisterWorker, RequestDone, TokenDelta, TokenDeltaBatch, TokenLogprob,
    UnknownWorker, WorkerKind, WorkerRole, KVPoolInfo, KVPoolLoad, RequestStarted, DoneReason, FinishReason,
)
from common.model_files import served_model_name
from common.transport import KV, Dealer, Push, Router
from workers.config import WorkerConfig
from workers.engine.engine import Engine, RequestOutput
from workers.kv_transfer import check_header, pack_pages, write_pages

log = structlog.get_logger()

STALL_WAIT = 0.05  # seconds a stalled engine waits for news before trying again


@dataclass
class _Incoming:
    """Decode role: the two halves of a handoff, which may arrive in either order."""

    task: DecodeTask | None = None
    header: KVPagesHeader | None = None
    frames: list | None = None
    sender: bytes | None = None
    deadline: float = 0.0
    pinned: list[int] = field(default_factory=list)  # our cached pages for the task's skip_pages


@dataclass
class _Outgoing:
    """Prefill role: pages sent, waiting for the decode worker's acknowledgement."""

    frames: list  # kept alive until acknowledged: zero-copy frames point into them
    deadline: float
    sent_at: float = field(default_factory=time.monotonic)


class WorkerService:
    def __init__(self, config: WorkerConfig, engine: Engine):
        self.config = config
        self.engine = engine
        self.role = config.role
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="engine")
        # On a CPU the step runs on the event loop's own thread: a step of a few tens of ms is
        # hundreds of torch/C calls, and handing the GIL and the step's result between two
        # threads cost ~5% of decode throughput at 32 streams here. On CUDA the step stays in
        # the compute thread (a first Triton compile can take seconds; heartbeats go on).
        self.step_inline = engine.device.type == "cpu"
        self.scheduler = Dealer(config.scheduler_address, config.worker_id)
        self.kv_in = Router(config.kv_address, options=KV, allow_wildcard=True) if self.role == "decode" else None
        self.kv_out: dict[str, Dealer] = {}
        self.pushes: dict[str, Push] = {}
        self.reply_to: dict[str, str] = {}
        self.starting: dict[str, list[RequestStarted]] = {}  # reply_to -> start markers for the next batch
        self.incoming: dict[str, _Incoming] = {}
        self.outgoing: dict[str, _Outgoing] = {}
        self.outgoing_endpoints: dict[str, str] = {}  # prefill role: request -> decode KV endpoint
        self.outgoing_skip: dict[str, int] = {}  # prefill role: request -> leading pages not to send
        self.inbox: list[Callable[[], None]] = []
        self.wake = asyncio.Event()
        self.scheduler_queued: dict[str, float] = {}
        self.requests_finished = 0
        self.kv_bytes_sent = 0
        self.kv_bytes_received = 0
        self.log = log.bind(worker=config.worker_id, role=self.role)

    # ---- lifecycle ------------------------------------------------------------------------
    async def run(self) -> None:
        await self._register()
        tasks = [self._control_loop(), self._heartbeat_loop(), self._engine_loop(), self._deadline_loop()]
        if self.kv_in is not None:
            tasks.append(self._kv_loop())
        if self.config.ready_address:
            with Push(self.config.ready_address) as ready:
                await ready.send(Ready(service="worker", name=self.config.worker_id))
        self.log.info("worker ready", kv=self.config.kv_advertise, pages=self.engine.blocks.num_usable_pages)
        await asyncio.gather(*tasks)

    async def _register(self) -> None:
        cfg, blocks = self.config, self.engine.blocks
        path = self.engine.model_path
        # `instance` tells the scheduler this process from an earlier one under the same id
        self.registered_again_at = float("-inf")
        msg = self.registration = RegisterWorker(
            worker_id=cfg.worker_id, kind=WorkerKind.LLM, role=WorkerRole(self.role), model=served_model_name(path) if path else "custom",
            max_running=self.engine.config.max_num_seqs, instance=new_instance(),
            kv=KVPoolInfo(page_size=blocks.page_size, num_pages=blocks.num_usable_pages, kv_endpoint=cfg.kv_advertise or ""),
        )
        while True:  # the scheduler may start after us: register until it answers
            await self.scheduler.send(msg)
            try:
                reply = await asyncio.wait_for(self.scheduler.recv(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            if isinstance(reply, Registered):
                return

    def close(self) -> None:
        for sock in [self.scheduler, self.kv_in, *self.kv_out.values(), *self.pushes.values()]:
            if sock is not None:
                sock.close()
        self.compute.shutdown(wait=False)

    def _post(self, command: Callable[[], None]) -> None:
        self.inbox.append(command)
        self.wake.set()

    # ---- receiving ------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            msg = await self.scheduler.recv()
            if isinstance(msg, (GenerateTask, PrefillTask)):
                self.scheduler_queued[msg.request_id] = msg.queued_s
            if isinstance(msg, GenerateTask):
                self._post(lambda m=msg: self._start(m.request_id, m.prompt_token_ids, m.sampling, m.reply_to, False))
            elif isinstance(msg, PrefillTask):
                self._post(lambda m=msg: self._start(
                    m.request_id, m.prompt_token_ids, m.sampling, m.reply_to, True, m.decode_kv_endpoint, m.skip_pages,
                ))
            elif isinstance(msg, DecodeTask):
                entry = self.incoming.setdefault(msg.request_id, _Incoming())
                entry.task, entry.deadline = msg, time.monotonic() + self.config.transfer_timeout
                self._post(lambda rid=msg.request_id: self._pin_prefix(rid))
            elif isinstance(msg, AbortRequest):
                self._post(lambda rid=msg.request_id: self._abort(rid))
            elif isinstance(msg, Registered):
                pass
            elif isinstance(msg, UnknownWorker):  # a restarted scheduler: register with it again
                # heartbeats queued while it was down all get this answer: register once a second
                if time.monotonic() - self.registered_again_at < 1.0:
                    continue
                self.registered_again_at = time.monotonic()
                self.log.warning("scheduler does not know this worker: registering again")
                # from the engine loop, after the commands already queued (aborts, starts): the
                # requests it lists are the ones it holds then
                self._post(lambda: asyncio.ensure_future(
                    self.scheduler.send(dataclasses.replace(self.registration, held=self._held()))))
                self._post(self.engine.blocks.report_all_again)  # and tell it what the cache holds
            else:
                self.log.warning("unexpected message", type=type(msg).__name__)

    async def _kv_loop(self) -> None:
        while True:
            sender, msg, frames = await self.kv_in.recv_with_frames()
            if not isinstance(msg, KVPagesHeader):
                continue
            entry = self.incoming.setdefault(msg.request_id, _Incoming())
            entry.header, entry.frames, entry.sender = msg, frames, sender
            entry.deadline = max(entry.deadline, time.monotonic() + self.config.transfer_timeout)
            self.kv_bytes_received += sum(memoryview(f).nbytes for f in frames)
            self._post(lambda rid=msg.request_id: self._maybe_import(rid))

    async def _ack_loop(self, dealer: Dealer) -> None:
        while True:
            msg = await dealer.recv()
            if isinstance(msg, KVPagesAck):
                self._post(lambda m=msg: self._acknowledged(m))

    # ---- commands (engine loop, between steps) -------------------------------------------
    def _start(self, request_id, prompt_ids, sampling, reply_to, prefill_only, kv_endpoint=None, skip_pages=0) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, sampling, prefill_only=prefill_only)
        except ValueError as e:
            self.log.warning("request refused", request_id=request_id, error=str(e))
            self._done(request_id, DoneReason.REJECTED, str(e))
            self._send_final(request_id, reply_to, sampling.n, FinishReason.ABORT)
            return
        self.reply_to[request_id] = reply_to
        if kv_endpoint:
            self.outgoing_endpoints[request_id] = kv_endpoint
            self.outgoing_skip[request_id] = skip_pages
        # tell the tokenizer a worker holds it (before any of its tokens, in the next step's
        # batch): a scheduler restart does not fail it from here on
        self.starting.setdefault(reply_to, []).append(RequestStarted(request_id=request_id, num_prompt_tokens=len(prompt_ids)))

    def _held(self) -> list[HeldRequest]:
        """The requests this worker works on (running, or waiting for their KV pages)."""
        held = {rid: HeldRequest(request_id=rid, reply_to=reply_to) for rid, reply_to in self.reply_to.items()}
        for rid, entry in self.incoming.items():
            if entry.task is not None and rid not in held:
                held[rid] = HeldRequest(request_id=rid, reply_to=entry.task.reply_to)
        return list(held.values())

    def _pin_prefix(self, request_id: str) -> None:
        """Decode role, on the DecodeTask: take references on the leading prompt pages the
        scheduler counted on us holding, so that they survive until the pages arrive."""
        entry = self.incoming.get(request_id)
        if entry is None or entry.task is None:
            return
        skip = entry.task.skip_pages
        if skip and not entry.pinned:
            hits = self.engine.blocks.match_prefix(entry.task.prompt_token_ids)
            entry.pinned = hits[:skip]
            self.engine.blocks.free_table(hits[skip:])
            if len(entry.pinned) < skip:
                self.log.warning("prefix pages evicted before the handoff", request_id=request_id, held=len(entry.pinned), expected=skip)
        self._maybe_import(request_id)

    def _maybe_import(self, request_id: str) -> None:
        entry = self.incoming.get(request_id)
        if entry is None or entry.task is None or entry.header is None:
            return
        del self.incoming[request_id]
        task, header = entry.task, entry.header
        error = None
        pinned = entry.pinned  # ours to free until import_prefilled takes them
        try:
            skip = check_header(header, self.engine.runner.kv_cache, len(task.prompt_token_ids))
            if skip > len(pinned):
                raise ValueError(f"kv: {skip} leading pages not sent, but this worker holds {len(pinned)} of them")
            self.engine.blocks.free_table(pinned[skip:])
            del pinned[skip:]
            layers = p.decode_tensor_frames(header, entry.frames)
            prefix, pinned = pinned, []
            self.engine.import_prefilled(
                request_id, list(task.prompt_token_ids), task.sampling, list(header.first_token_ids),
                lambda table: write_pages(self.engine.runner.kv_cache, table, layers), prefix,
            )
            self.reply_to[request_id] = task.reply_to
            if request_id not in self.engine.requests:  # every choice ended on its first token
                self._forget(request_id, DoneReason.FINISHED)
        except Exception as e:  # a bad transfer must not take the worker down
            error = f"{type(e).__name__}: {e}"
            self.log.warning("kv import failed", request_id=request_id, error=error)
            self.engine.blocks.free_table(pinned)
            self._done(request_id, DoneReason.KV_REJECTED)
        asyncio.ensure_future(self.kv_in.send(entry.sender, KVPagesAck(request_id=request_id, ok=error is None, error=error)))

    def _acknowledged(self, ack: KVPagesAck) -> None:
        out = self.outgoing.pop(ack.request_id, None)
        if out is None:
            return
        self.engine.release_prefilled(ack.request_id)
        self._forget(ack.request_id, DoneReason.HANDED_OFF if ack.ok else DoneReason.KV_REJECTED)
        if not ack.ok:
            self.log.warning("decode worker refused pages", request_id=ack.request_id, error=ack.error)

    def _abort(self, request_id: str) -> None:
        reply_to = self.reply_to.get(request_id)
        n = self.engine.requests[request_id].params.n if request_id in self.engine.requests else 1
        known = self.engine.abort(request_id)
        self.outgoing.pop(request_id, None)
        entry = self.incoming.pop(request_id, None)
        if entry is not None:
            self.engine.blocks.free_table(entry.pinned)
        if known and reply_to:
            self._send_final(request_id, reply_to, n, FinishReason.ABORT)
        self._forget(request_id, None)

    def _forget(self, request_id: str, reason: DoneReason | None) -> None:
        self.reply_to.pop(request_id, None)
        self.scheduler_queued.pop(request_id, None)
        self.outgoing_endpoints.pop(request_id, None)
        self.outgoing_skip.pop(request_id, None)
        if reason is not None:
            self._done(request_id, reason)

    def _done(self, request_id: str, reason: DoneReason, detail: str | None = None) -> None:
        self.requests_finished += 1
        asyncio.ensure_future(self.scheduler.send(
            RequestDone(worker_id=self.config.worker_id, request_id=request_id, reason=reason, detail=detail)))

    def _send_final(self, request_id: str, reply_to: str, n: int, reason: FinishReason) -> None:
        deltas = [TokenDelta(request_id=request_id, index=i, token_ids=[], logprobs=None, finish_reason=reason, num_prompt_tokens=0) for i in range(n)]
        asyncio.ensure_future(self._push(reply_to).send(TokenDeltaBatch(worker_id=self.config.worker_id, deltas=deltas)))

    # ---- the engine loop ------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.inbox:
                self.inbox.pop(0)()
            await self._report_prefix_cache()
            if not self.engine.scheduler.has_work():
                self.wake.clear()
                if not self.inbox:
                    await self.wake.wait()
                continue
            if self.step_inline:
                outputs = self.engine.step()
                await asyncio.sleep(0)  # the other loops take their messages between steps
            else:
                outputs = await loop.run_in_executor(self.compute, self.engine.step)
            if self.engine.stalled:  # nothing could run: wait for a message (an ack frees pages)
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), STALL_WAIT)
                except asyncio.TimeoutError:
                    pass
            await self._publish(outputs)

    async def _publish(self, outputs: list[RequestOutput]) -> None:
        starting, self.starting = self.starting, {}
        batches: dict[str, list[TokenDelta]] = {reply_to: [] for reply_to in starting}
        for out in outputs:
            reply_to = self.reply_to.get(out.request_id)
            if reply_to is None:
                continue
            queue_time = None
            if out.queue_time is not None:
                queue_time = out.queue_time + self.scheduler_queued.pop(out.request_id, 0.0)
            prompt_logprobs = None if out.prompt_logprobs is None else _wire_logprobs(out.prompt_logprobs)
            for so in out.outputs:
                batches.setdefault(reply_to, []).append(TokenDelta(
                    request_id=out.request_id, index=so.index, token_ids=so.new_token_ids, logprobs=_wire_logprobs(so.logprobs) or None, finish_reason=so.finish_reason,
                    num_prompt_tokens=out.num_prompt_tokens, queue_time_s=queue_time, prompt_logprobs=prompt_logprobs))
                queue_time = prompt_logprobs = None  # once per request
        for reply_to, deltas in batches.items():  # one message per step per destination
            batch = TokenDeltaBatch(worker_id=self.config.worker_id, deltas=deltas, started=starting.get(reply_to, []))
            await self._push(reply_to).send(batch)
        for out in outputs:
            if out.finished:
                if self.engine.take_prefilled(out.request_id) is not None:
                    await self._send_pages(out.request_id)
                else:
                    self._forget(out.request_id, DoneReason.FINISHED)

    async def _send_pages(self, request_id: str) -> None:
        result = self.engine.take_prefilled(request_id)
        endpoint = self.outgoing_endpoints.get(request_id)
        header, layers = pack_pages(self.engine.runner.kv_cache, result, self.outgoing_skip.get(request_id, 0))
        frames = p.encode_tensor_frames(header, layers)
        dealer = self.kv_out.get(endpoint)
        if dealer is None:
            dealer = self.kv_out[endpoint] = Dealer(endpoint, self.config.worker_id, options=KV)
            asyncio.ensure_future(self._ack_loop(dealer))
        self.outgoing[request_id] = _Outgoing(frames, time.monotonic() + self.config.transfer_timeout)
        await dealer.send_frames(frames)
        self.kv_bytes_sent += sum(t.numel() * t.element_size() for t in layers)

    def _push(self, address: str) -> Push:
        push = self.pushes.get(address)
        if push is None:
            push = self.pushes[address] = Push(address)
        return push

    async def _report_prefix_cache(self) -> None:
        """Tell the scheduler which prefix-cache keys came and went since the last report (in
        bounded messages, sent in order on the one scheduler socket)."""
        while True:
            added, removed = self.engine.blocks.take_cache_changes(MAX_PAGE_HASHES)
            if not added and not removed:
                return
            await self.scheduler.send(PrefixCacheUpdate(worker_id=self.config.worker_id, added=tuple(added), removed=tuple(removed)))

    # ---- timers ---------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            blocks, sched = self.engine.blocks, self.engine.scheduler
            await self.scheduler.send(
                Heartbeat(
                    worker_id=self.config.worker_id, running=len(sched.running), waiting=len(sched.waiting), time=time.time(),
                    requests_finished=self.requests_finished,
                    kv=KVPoolLoad(free_pages=blocks.num_free_pages, used_pages=blocks.num_used_pages, total_pages=blocks.num_usable_pages,
                                  bytes_sent=self.kv_bytes_sent, bytes_received=self.kv_bytes_received),
                )
            )
            await asyncio.sleep(self.config.heartbeat_interval)

    async def _deadline_loop(self) -> None:
        """Transfers that were not acknowledged, and handoff halves whose partner never came,
        give their pages back after `transfer_timeout`."""
        while True:
            await asyncio.sleep(min(1.0, self.config.transfer_timeout / 4))
            now = time.monotonic()
            for rid in [r for r, o in self.outgoing.items() if o.deadline < now]:
                self._post(lambda r=rid: self._expire_outgoing(r))
            for rid in [r for r, i in self.incoming.items() if i.deadline < now]:
                self._post(lambda r=rid: self._expire_incoming(r))

    def _expire_incoming(self, request_id: str) -> None:
        entry = self.incoming.get(request_id)
        if entry is None or entry.deadline >= time.monotonic():  # imported, or its other half came
            return
        del self.incoming[request_id]
        self.engine.blocks.free_table(entry.pinned)
        self.log.warning("handoff expired", request_id=request_id)
        self._done(request_id, DoneReason.KV_TIMEOUT)

    def _expire_outgoing(self, request_id: str) -> None:
        if self.outgoing.pop(request_id, None) is not None:
            self.engine.release_prefilled(request_id)
            self.log.warning("kv transfer timed out", request_id=request_id)
            self._forget(request_id, DoneReason.KV_TIMEOUT)


def _wire_logprobs(logprobs: list) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs) for lp in logprobs]
