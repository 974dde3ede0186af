"""The prefill→decode handoff of KV pages: the one owner of a handoff's page lifecycle.

    prefill side (HandoffOut)                         decode side (HandoffIn)
    PrefillTask ─expect(endpoint, skip)               DecodeTask ─task(): pin the `skip_pages`
    prefill done ─send(): pages held by the engine         leading prompt pages it holds
       ─pack─▶ KVPagesHeader + frames ══════════════▶ pages(): header + frames arrive
                                                        both halves here ─▶ import: write the
    ack ◀─────────────────────── KVPagesAck ◀────────── pages into new ones, start decoding
    acknowledged(): engine frees the pages;            (or refuse: free the pinned pages)
      done(HANDED_OFF | KV_REJECTED)
    deadline passed: free, done(KV_TIMEOUT)            deadline passed: free pinned, done(KV_TIMEOUT)

The scheduler tells both sides how many leading prompt pages the decode worker holds
(`skip_pages`): the decode side pins them when its task comes (eviction cannot take them), the
prefill side sends only the rest, and the import builds the block table from the pinned pages
plus the received ones (or refuses if they are gone). Tensor- and pipeline-parallel workers send
one `KVPagesHeader` per rank (rank r's KV heads of its stage's layers, for the decode worker's
rank r); the decode side imports once every tp rank's parts cover all the layers, and both
sides' rank 0 relays its followers' shards (workers/engine/kv_relay.py). Shapes (tp, pp) must
match: the scheduler never pairs workers of different shapes, and a mismatched transfer is
refused (KV_REJECTED), never resharded. A rank that dies mid-transfer takes its worker down
(tensor_parallel.FollowerRanks); the other side's deadline frees what it held (KV_TIMEOUT).
Every method runs in the shell's engine loop, between steps; the socket loops only post commands.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagemesh.common import protocol as p
from pagemesh.common.messages import DecodeTask, DoneReason, HeldRequest, KVPagesAck, KVPagesHeader
from pagemesh.common.transport import KV, Dealer, Router, UnknownPeer
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.kv_relay import rank_layers
from pagemesh.workers.llm.kv_pages import check_header, pack_rank_pages, parts_cover, rank_parts, write_rank_pages
from pagemesh.workers.shell.backend import WorkerContext
from pagemesh.workers.shell.faults import kv_send_delay_s


@dataclass
class _Outgoing:
    """Prefill side: pages sent, waiting for the decode worker's acknowledgement."""

    frames: list  # kept alive until acknowledged: zero-copy frames point into them (every rank's)
    deadline: float


class HandoffOut:
    """Prefill side: sends each prefilled request's pages to its decode worker and frees them
    when the decode worker acknowledges (or the deadline passes)."""

    def __init__(self, ctx: WorkerContext, engine: Engine, timeout: float, on_done: Callable[[str, DoneReason], None]):
        self.ctx, self.engine, self.timeout = ctx, engine, timeout
        self.on_done = on_done  # the request left this worker: handed off, refused or timed out
        self.targets: dict[str, tuple[str, int]] = {}  # request -> (decode KV endpoint, pages not to send)
        self.outgoing: dict[str, _Outgoing] = {}
        self.dealers: dict[str, Dealer] = {}
        self.bytes_sent = 0
        self.send_delay_s = kv_send_delay_s()  # test-only; 0 unless a test sets it

    def expect(self, request_id: str, endpoint: str, skip_pages: int) -> None:
        self.targets[request_id] = (endpoint, skip_pages)

    def has_pages(self, request_id: str) -> bool:
        """The engine holds this finished request's pages for the transfer."""
        return self.engine.take_prefilled(request_id) is not None

    async def send(self, request_id: str) -> None:
        endpoint, skip = self.targets.pop(request_id)
        result = self.engine.take_prefilled(request_id)
        runner = self.engine.runner
        # one message per rank (a parallel worker's ranks each hold their KV heads of their layers)
        parts = pack_rank_pages(
            runner.kv_cache,
            result,
            skip,
            self.engine.followers,
            runner.rank_kv_scales,
            num_layers=self.engine.model_config.num_layers,
        )
        messages = [p.encode_tensor_frames(header, layers) for header, layers in parts]
        dealer = self.dealers.get(endpoint)
        if dealer is None:
            dealer = self.dealers[endpoint] = Dealer(endpoint, self.ctx.worker_id, options=KV)
            asyncio.ensure_future(self._ack_loop(dealer))
        self.outgoing[request_id] = _Outgoing(messages, time.monotonic() + self.timeout)
        if self.send_delay_s > 0:
            await asyncio.sleep(self.send_delay_s)  # packed, held, not sent: "mid-transfer" (tests)
        for frames in messages:
            await dealer.send_frames(frames)
        self.bytes_sent += sum(t.numel() * t.element_size() for _, layers in parts for t in layers)

    async def _ack_loop(self, dealer: Dealer) -> None:
        while True:
            msg = await dealer.recv()
            if isinstance(msg, KVPagesAck):
                self.ctx.post(lambda m=msg: self._acknowledged(m))

    def _acknowledged(self, ack: KVPagesAck) -> None:
        if self.outgoing.pop(ack.request_id, None) is None:
            return
        self.engine.release_prefilled(ack.request_id)
        self.on_done(ack.request_id, DoneReason.HANDED_OFF if ack.ok else DoneReason.KV_REJECTED)
        if not ack.ok:
            self.ctx.log.warning("decode worker refused pages", request_id=ack.request_id, error=ack.error)

    def forget(self, request_id: str) -> None:
        """The request ended here some other way (aborted, finished at its first token)."""
        self.targets.pop(request_id, None)
        self.outgoing.pop(request_id, None)

    def expire(self, now: float) -> None:
        for rid in [r for r, o in self.outgoing.items() if o.deadline < now]:
            del self.outgoing[rid]
            self.engine.release_prefilled(rid)
            self.ctx.log.warning("kv transfer timed out", request_id=rid)
            self.on_done(rid, DoneReason.KV_TIMEOUT)

    def close(self) -> None:
        for dealer in self.dealers.values():
            dealer.close()


@dataclass
class _Incoming:
    """Decode side: the two halves of a handoff, which may arrive in either order."""

    task: DecodeTask | None = None
    # the sender's (tp rank, first layer of its stage) -> header, frames
    parts: dict[tuple[int, int], tuple[KVPagesHeader, list]] = field(default_factory=dict)
    sender: bytes | None = None
    deadline: float = 0.0
    pinned: list[int] = field(default_factory=list)  # our cached pages for the task's skip_pages


class HandoffIn:
    """Decode side: receives pages on its KV address, writes them into its own pages and starts
    decoding; owns the pages it pins for a task until the engine takes them."""

    def __init__(
        self,
        ctx: WorkerContext,
        engine: Engine,
        address: str,
        timeout: float,
        on_imported: Callable[[DecodeTask], None],
    ):
        self.ctx, self.engine, self.timeout = ctx, engine, timeout
        self.on_imported = on_imported  # the engine runs the request from here on
        self.router = Router(address, options=KV, allow_wildcard=True)
        self.incoming: dict[str, _Incoming] = {}
        self.bytes_received = 0

    async def receive_loop(self) -> None:
        while True:
            sender, msg, frames = await self.router.recv_with_frames()
            if isinstance(msg, KVPagesHeader):
                self.bytes_received += sum(memoryview(f).nbytes for f in frames)
                self.ctx.post(lambda m=msg, f=frames, s=sender: self.pages(m, f, s))

    def task(self, task: DecodeTask) -> None:
        """Take references on the leading prompt pages the scheduler counted on us holding, so
        that they survive until the pages arrive."""
        entry = self.incoming.setdefault(task.request_id, _Incoming())
        entry.task = task
        entry.deadline = max(entry.deadline, time.monotonic() + self.timeout)
        skip = task.skip_pages
        if skip and not entry.pinned:
            hits = self.engine.blocks.match_prefix(task.prompt_token_ids)
            entry.pinned = hits[:skip]
            self.engine.blocks.free_table(hits[skip:])
            if len(entry.pinned) < skip:
                self.ctx.log.warning(
                    "prefix pages evicted before the handoff",
                    request_id=task.request_id,
                    held=len(entry.pinned),
                    expected=skip,
                )
        self._maybe_import(task.request_id)

    def pages(self, header: KVPagesHeader, frames: list, sender: bytes) -> None:
        """One rank's pages (a single-rank sender sends one part, an N×M-rank sender N×M)."""
        entry = self.incoming.setdefault(header.request_id, _Incoming())
        entry.parts[(header.tp_rank, header.layer_start)] = (header, frames)
        entry.sender = sender
        entry.deadline = max(entry.deadline, time.monotonic() + self.timeout)
        self._maybe_import(header.request_id)

    def _maybe_import(self, request_id: str) -> None:
        entry = self.incoming.get(request_id)
        if entry is None or entry.task is None or not entry.parts:
            return
        header = entry.parts[min(entry.parts)][0]
        headers = {key: h for key, (h, _) in entry.parts.items()}
        num_layers = self.engine.model_config.num_layers
        if not parts_cover(headers, header.tp_size, num_layers):  # the sender's other ranks' pages are on their way
            return
        del self.incoming[request_id]
        task, pinned = entry.task, entry.pinned  # pinned: ours until the engine takes them
        error = None
        try:
            kv_cache, followers = self.engine.runner.kv_cache, self.engine.followers
            tp_size, pp_size = self.engine.config.tensor_parallel_size, self.engine.config.pipeline_parallel_size
            keys = rank_parts(headers, tp_size, pp_size, num_layers)  # ours, rank by rank, or refused
            prompt_len = len(task.prompt_token_ids)
            layers = rank_layers(num_layers, tp_size, pp_size)
            skips = {check_header(headers[k], kv_cache, prompt_len, tp_size, r) for k, r in zip(keys, layers)}
            if len(skips) != 1:
                raise ValueError(f"kv: the ranks' parts disagree (skips {sorted(skips)})")
            (skip,) = skips
            if skip > len(pinned):
                raise ValueError(f"kv: {skip} leading pages not sent, but this worker holds {len(pinned)} of them")
            self.engine.blocks.free_table(pinned[skip:])
            del pinned[skip:]
            rank_pages = [p.decode_tensor_frames(*entry.parts[key]) for key in keys]
            prefix, pinned = pinned, []
            self.engine.import_prefilled(
                request_id,
                list(task.prompt_token_ids),
                task.sampling,
                list(header.first_token_ids),
                lambda table: write_rank_pages(
                    kv_cache,
                    table,
                    rank_pages,
                    followers,
                    [headers[k].kv_scales for k in keys],
                    self.engine.runner.rank_kv_scales,
                ),
                prefix,
            )
        except Exception as e:  # a bad transfer must not take the worker down
            error = f"{type(e).__name__}: {e}"
            self.ctx.log.warning("kv import failed", request_id=request_id, error=error)
            self.engine.blocks.free_table(pinned)
            self.ctx.done(request_id, DoneReason.KV_REJECTED)
        else:
            self.on_imported(task)
        ack = KVPagesAck(request_id=request_id, ok=error is None, error=error)
        asyncio.ensure_future(self._acknowledge(entry.sender, ack))

    async def _acknowledge(self, sender: bytes, ack: KVPagesAck) -> None:
        try:
            await self.router.send(sender, ack)
        except UnknownPeer:  # the prefill worker died after sending: its pages went with it
            self.ctx.log.warning("kv sender gone: acknowledgement dropped", request_id=ack.request_id)

    def held(self) -> list[HeldRequest]:
        return [
            HeldRequest(request_id=rid, reply_to=e.task.reply_to)
            for rid, e in self.incoming.items()
            if e.task is not None
        ]

    def forget(self, request_id: str) -> None:
        """Aborted: give back the pages pinned for it."""
        entry = self.incoming.pop(request_id, None)
        if entry is not None:
            self.engine.blocks.free_table(entry.pinned)

    def expire(self, now: float) -> None:
        for rid in [r for r, i in self.incoming.items() if i.deadline < now]:
            entry = self.incoming.pop(rid)
            self.engine.blocks.free_table(entry.pinned)
            self.ctx.log.warning("handoff expired", request_id=rid)
            self.ctx.done(rid, DoneReason.KV_TIMEOUT)

    def close(self) -> None:
        self.router.close()
