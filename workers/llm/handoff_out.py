"""The prefill side of the KV handoff: the one owner of a sent request's pages (workers/llm/handoff.py
draws both sides). The engine holds the prompt's pages from its first token on; this module asks
it for copies of the pages the decode worker lacks, sends them, and has the engine release them
when the decode worker acknowledges or the deadline passes. Acknowledged pages are kept (up to a
quarter of the pool, the oldest freed first) until the scheduler aborts the request here at its
end: if the decode worker dies, a migrated request's PrefillTask (`resumed`) sends the same
pages to the next one (`resend`), so that its prompt's K/V is the bits the first one read.

    prefill pool kv[L, P, 2, S, H, D] --Engine.export_prefilled(skip)--> [L, n, 2, S, H, D] per rank
       --pack_export--> KVPagesHeader + one tensor frame per layer, per rank ==> decode worker

Only the pages the decode worker lacks travel: the scheduler says how many leading prompt pages
it holds (`skip_pages`), and the header's `page_indices` are the logical pages sent, always the
tail [skip, total) of the prompt's pages. An fp8 pool's pages travel as fp8 with the sender's
scales in the header. A tensor- or pipeline-parallel worker sends one header per rank (`tp_rank`,
`tp_size`, and its stage's `layer_start`/`layer_end`), each with that rank's KV heads of its
stage's layers (the engine's rank 0 gathers them: workers/engine/kv_relay.py).

At most MAX_BYTES_IN_FLIGHT of copies wait for acknowledgements at a time: a burst of prompts
(32 of 128 tokens are 188 MB of fp32 pages here) would otherwise hold a copy of every one until
its decode worker, busy with its own steps, took it. The others wait in `waiting`, their pages
still in the pool only, and go out between steps as acknowledgements come back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagemesh.common import protocol as p
from pagemesh.common.messages import DoneReason, KVPagesAck, KVPagesHeader
from pagemesh.common.transport import KV, Dealer
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.kv_handoff import DTYPE_NAMES, PageExport, RankPages
from pagemesh.workers.shell.backend import WorkerContext
from pagemesh.workers.shell.faults import kv_send_delay_s

# copies of pages sent and not yet acknowledged, at most (one transfer always goes, whatever its size)
MAX_BYTES_IN_FLIGHT = 64 << 20


@dataclass
class _Outgoing:
    """Pages sent, waiting for the decode worker's acknowledgement."""

    frames: list  # kept alive until acknowledged: zero-copy frames point into them (every rank's)
    deadline: float
    nbytes: int = 0


class HandoffOut:
    """Sends each prefilled request's pages to its decode worker; has the engine keep them when
    the decode worker acknowledges, release them when it refuses or the deadline passes."""

    def __init__(self, ctx: WorkerContext, engine: Engine, timeout: float, on_done: Callable[[str, DoneReason], None]):
        self.ctx, self.engine, self.timeout = ctx, engine, timeout
        self.on_done = on_done  # the request left this worker: handed off, refused or timed out
        self.targets: dict[str, tuple[str, int]] = {}  # request -> (decode KV endpoint, pages not to send)
        self.resends: list[str] = []  # migrated requests whose kept pages go out between steps
        self.outgoing: dict[str, _Outgoing] = {}
        self.waiting: dict[str, float] = {}  # request -> deadline: to send once fewer bytes are in flight
        self.max_bytes_in_flight = MAX_BYTES_IN_FLIGHT
        self.dealers: dict[str, Dealer] = {}
        self.bytes_sent = 0
        self.send_delay_s = kv_send_delay_s()  # test-only; 0 unless a test sets it

    def expect(self, request_id: str, endpoint: str, skip_pages: int) -> None:
        self.targets[request_id] = (endpoint, skip_pages)

    def resend(
        self, request_id: str, prompt_token_ids: list[int], endpoint: str, skip_pages: int, kept_id: str = ""
    ) -> bool:
        """A migrated request (PrefillTask.resumed): its pages kept of its first prefill, the bits
        its lost decode worker read, go to the new one (`send_between_steps`); False if
        none are kept (`kept_id`: the id they were kept under, where not `request_id`)."""
        if not self.engine.resend_prefilled(request_id, prompt_token_ids, kept_id):
            return False
        self.expect(request_id, endpoint, skip_pages)
        self.resends.append(request_id)
        return True

    async def send_between_steps(self) -> None:
        """Send the pages `resend` held again (between steps: an export reads the pool, and a
        parallel worker's gathers its ranks), those of requests not aborted meanwhile; then those
        that waited for room in flight, while there is room."""
        resends, self.resends = self.resends, []
        for request_id in resends:
            if request_id in self.targets:
                await self.send(request_id)
        while self.waiting and not self._full():
            request_id = next(iter(self.waiting))
            del self.waiting[request_id]
            if request_id in self.targets:
                await self._send_now(request_id)

    @property
    def bytes_in_flight(self) -> int:
        return sum(o.nbytes for o in self.outgoing.values())

    def _full(self) -> bool:
        return bool(self.outgoing) and self.bytes_in_flight >= self.max_bytes_in_flight

    def has_pages(self, request_id: str) -> bool:
        """The engine holds this finished request's pages for the transfer."""
        return self.engine.take_prefilled(request_id) is not None

    async def send(self, request_id: str) -> None:
        """Send now, or (too many bytes in flight) between the next steps that have room."""
        if self._full() or self.waiting:  # in order: none overtakes one that waits
            self.waiting[request_id] = time.monotonic() + self.timeout
            return
        await self._send_now(request_id)

    async def _send_now(self, request_id: str) -> None:
        endpoint, skip = self.targets.pop(request_id)
        # one message per rank (a parallel worker's ranks each hold their KV heads of their layers)
        parts = pack_export(self.engine.export_prefilled(request_id, skip))
        messages = [p.encode_tensor_frames(header, layers) for header, layers in parts]
        dealer = self.dealers.get(endpoint)
        if dealer is None:
            dealer = self.dealers[endpoint] = Dealer(endpoint, self.ctx.worker_id, options=KV)
            asyncio.ensure_future(self._ack_loop(dealer))
        nbytes = sum(t.numel() * t.element_size() for _, layers in parts for t in layers)
        self.outgoing[request_id] = _Outgoing(messages, time.monotonic() + self.timeout, nbytes)
        if self.send_delay_s > 0:
            await asyncio.sleep(self.send_delay_s)  # packed, held, not sent: "mid-transfer" (tests)
        for frames in messages:
            await dealer.send_frames(frames)
        self.bytes_sent += nbytes

    async def _ack_loop(self, dealer: Dealer) -> None:
        while True:
            msg = await dealer.recv()
            if isinstance(msg, KVPagesAck):
                self.ctx.post(lambda m=msg: self._acknowledged(m))

    def _acknowledged(self, ack: KVPagesAck) -> None:
        if self.outgoing.pop(ack.request_id, None) is None:
            return
        if ack.ok:  # kept for an exact resume until the scheduler says the request ended
            self.engine.keep_prefilled(ack.request_id)
        else:
            self.engine.release_prefilled(ack.request_id)
        self.on_done(ack.request_id, DoneReason.HANDED_OFF if ack.ok else DoneReason.KV_REJECTED)
        if not ack.ok:
            self.ctx.log.warning("decode worker refused pages", request_id=ack.request_id, error=ack.error)

    def forget(self, request_id: str) -> None:
        """The request ended here some other way (aborted, finished at its first token)."""
        self.targets.pop(request_id, None)
        self.outgoing.pop(request_id, None)
        self.waiting.pop(request_id, None)

    def expire(self, now: float) -> None:
        late = [r for r, o in self.outgoing.items() if o.deadline < now]
        late += [r for r, deadline in self.waiting.items() if deadline < now]
        for rid in late:
            self.outgoing.pop(rid, None)
            self.waiting.pop(rid, None)
            self.targets.pop(rid, None)
            self.engine.release_prefilled(rid)
            self.ctx.log.warning("kv transfer timed out", request_id=rid)
            self.on_done(rid, DoneReason.KV_TIMEOUT)

    def close(self) -> None:
        for dealer in self.dealers.values():
            dealer.close()


def pack_export(export: PageExport) -> list[tuple[KVPagesHeader, list[torch.Tensor]]]:
    """The wire parts of an export, rank 0's first: each rank's header and one contiguous CPU
    tensor per layer."""
    return [(_header(export, rank), list(rank.pages.unbind(0))) for rank in export.ranks]


def _header(export: PageExport, rank: RankPages) -> KVPagesHeader:
    pages, skip, total = rank.pages, export.skip_pages, export.num_pages
    return KVPagesHeader(
        request_id=export.request_id,
        seq_index=0,
        num_tokens=len(export.prompt_token_ids),
        layer_start=rank.layers.start,
        layer_end=rank.layers.stop,
        num_pages=total - skip,
        dtype=DTYPE_NAMES[pages.dtype],
        page_shape=list(pages.shape[2:]),
        checksum=0,  # filled in by encode_tensor_frames
        first_token_ids=list(export.first_token_ids),
        last=True,
        page_indices=list(range(skip, total)),
        tp_rank=rank.tp_rank,
        tp_size=export.tp_size,
        kv_scales=[] if rank.kv_scales is None else rank.kv_scales.flatten().tolist(),
    )
