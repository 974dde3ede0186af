"""The decode side of the KV handoff: the one owner of a received request's pages until the engine
takes them (workers/llm/handoff.py draws both sides). A handoff's two halves, the scheduler's
`DecodeTask` and the prefill worker's pages, may come in either order; this module pins the
cached prefix pages the task counts on, checks the pages against the engine's `KVLayout`, has the
engine import them (`Engine.import_pages`: new pages, converted where the pools differ) and
acknowledges, or frees the pins when the transfer is refused or its deadline passes.

    decode pool kv[L, P', 2, S, H, D] <--copy into its own freshly allocated pages-- frames

A tensor- or pipeline-parallel sender sends one header per rank; the parts are keyed by (tp rank,
first layer) and imported once every tp rank's layers cover the model (`parts_cover`), in this
worker's rank order (`rank_parts`; the engine's rank 0 scatters them: workers/engine/kv_relay.py).
An fp8 part carries its sender rank's scales: the engine converts what differs from its pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagemesh.common import protocol as p
from pagemesh.common.messages import DecodeTask, DoneReason, HeldRequest, KVPagesAck, KVPagesHeader
from pagemesh.common.multimodal import hash_token_ids
from pagemesh.common.transport import KV, Router, UnknownPeer
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.kv_handoff import DTYPES_BY_NAME, rank_layers
from pagemesh.workers.shell.backend import WorkerContext

# A task waits this many transfer timeouts for its pages: they come after its prompt's prefill, and
# under a burst the prefill worker's queue of prompts (and of transfers: handoff_out's bound on
# copies in flight) can take longer than a transfer. The scheduler aborts the task here sooner when
# the prefill worker is lost or the client leaves; this deadline only keeps a lost message from
# holding the pinned pages forever.
TASK_WAIT_TIMEOUTS = 4


@dataclass
class _Incoming:
    """The two halves of a handoff, which may arrive in either order."""

    task: DecodeTask | None = None
    # the sender's (tp rank, first layer of its stage) -> header, frames
    parts: dict[tuple[int, int], tuple[KVPagesHeader, list]] = field(default_factory=dict)
    sender: bytes | None = None
    deadline: float = 0.0
    pinned: list[int] = field(default_factory=list)  # our cached pages for the task's skip_pages


class HandoffIn:
    """Receives pages on its KV address, has the engine import them and start decoding; owns the
    pages it pins for a task until the engine takes them."""

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
        """Pin the leading prompt pages the scheduler counted on us holding, so that they survive
        until the pages arrive."""
        entry = self.incoming.setdefault(task.request_id, _Incoming())
        entry.task = task
        waits = self.timeout * (1 if entry.parts else TASK_WAIT_TIMEOUTS)  # the pages' prefill may still run
        entry.deadline = max(entry.deadline, time.monotonic() + waits)
        skip = task.skip_pages
        if skip and not entry.pinned:
            # an image's placeholders are keyed by its content, as the prefill worker's pages are
            entry.pinned = self.engine.pin_prefix_pages(hash_token_ids(task.prompt_token_ids, task.images), skip)
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
        entry.deadline = time.monotonic() + self.timeout  # the transfer has begun: its other parts come soon
        self._maybe_import(header.request_id)

    def _maybe_import(self, request_id: str) -> None:
        entry = self.incoming.get(request_id)
        if entry is None or entry.task is None or not entry.parts:
            return
        header = entry.parts[min(entry.parts)][0]
        headers = {key: h for key, (h, _) in entry.parts.items()}
        layout = self.engine.kv_layout
        if not parts_cover(headers, header.tp_size, layout.num_layers):  # the sender's other ranks' are on their way
            return
        del self.incoming[request_id]
        task, pinned = entry.task, entry.pinned  # pinned: ours until the engine takes them
        error = None
        try:
            tp_size, shape = layout.tp_size, layout.pool_shape
            keys = rank_parts(headers, tp_size, layout.pp_size, layout.num_layers)  # ours, rank by rank, or refused
            prompt_len = len(task.prompt_token_ids)
            skips = {check_header(headers[k], shape, prompt_len, tp_size, r) for k, r in zip(keys, layout.rank_layers)}
            if len(skips) != 1:
                raise ValueError(f"kv: the ranks' parts disagree (skips {sorted(skips)})")
            (skip,) = skips
            if skip > len(pinned):
                raise ValueError(f"kv: {skip} leading pages not sent, but this worker holds {len(pinned)} of them")
            self.engine.free_pages(pinned[skip:])
            del pinned[skip:]
            rank_pages = [p.decode_tensor_frames(*entry.parts[key]) for key in keys]
            prefix, pinned = pinned, []
            # a migrated request: each choice's own tokens, not the sender's first ones (a prefill
            # worker that kept no pages prefilled again and sampled anew), the first taken as the
            # first, the rest decoded again one step each as given: the decode steps that made them
            resumed = [(c.index, c.output_token_ids) for c in task.resumed_choices]
            if task.output_token_ids:
                resumed = [(0, task.output_token_ids)]
            self.engine.import_pages(
                request_id,
                list(task.prompt_token_ids),
                task.sampling,
                list(header.first_token_ids),
                rank_pages,
                [headers[k].kv_scales for k in keys],
                prefix,
                task.images,
                resumed=resumed,
            )
        except Exception as e:  # a bad transfer must not take the worker down
            error = f"{type(e).__name__}: {e}"
            self.ctx.log.warning("kv import failed", request_id=request_id, error=error)
            self.engine.free_pages(pinned)
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
            self.engine.free_pages(entry.pinned)

    def expire(self, now: float) -> None:
        for rid in [r for r, i in self.incoming.items() if i.deadline < now]:
            entry = self.incoming.pop(rid)
            self.engine.free_pages(entry.pinned)
            self.ctx.log.warning("handoff expired", request_id=rid)
            self.ctx.done(rid, DoneReason.KV_TIMEOUT)

    def close(self) -> None:
        self.router.close()


def check_header(
    header: KVPagesHeader, pool_shape: Sequence[int], prompt_len: int, tp_size: int = 1, layers: range | None = None
) -> int:
    """Raise ValueError unless the pages fit this worker's pool exactly (`pool_shape`: a rank's
    pool's, `KVLayout.pool_shape`; `tp_size`: this worker's tensor-parallel ranks, which must be
    the sender's; `layers`: the layers of the receiving rank's stage, which the header's must be;
    None: the whole pool's). Returns how many leading prompt pages the header skips (the receiver
    must hold them already)."""
    if header.tp_size != tp_size:
        raise ValueError(
            f"kv: pages from a worker of tensor-parallel size {header.tp_size}, this worker's is {tp_size} "
            "(KV heads are not resharded: pair workers of one size)"
        )
    num_layers, _, *page_shape = pool_shape
    page_size = page_shape[1]
    layers = range(num_layers) if layers is None else layers
    if (header.layer_start, header.layer_end) != (layers.start, layers.stop):
        raise ValueError(
            f"kv: layers [{header.layer_start}, {header.layer_end}) but this worker's stage holds "
            f"[{layers.start}, {layers.stop}) (pipeline stages are not resharded: pair workers of one shape)"
        )
    if header.page_shape != page_shape:
        raise ValueError(f"kv: page shape {header.page_shape}, this pool's is {page_shape}")
    if header.dtype not in DTYPES_BY_NAME:  # any other is converted on write (kv_handoff.write_pages)
        raise ValueError(f"kv: dtype {header.dtype}, this pool takes {sorted(DTYPES_BY_NAME)}")
    total = -(-prompt_len // page_size)
    if header.num_tokens != prompt_len or not 1 <= header.num_pages <= total:
        raise ValueError(f"kv: {header.num_pages} pages for {header.num_tokens} tokens, the prompt has {prompt_len}")
    skip = total - header.num_pages
    if header.page_indices != list(range(skip, total)):
        raise ValueError(f"kv: pages must be the prompt's last {header.num_pages} of {total}, in order")
    return skip


def parts_cover(parts: dict[tuple[int, int], KVPagesHeader], tp_size: int, num_layers: int) -> bool:
    """Whether the parts received so far (keyed by (tp rank, first layer)) hold every layer of
    the model for each of the sender's `tp_size` ranks: the sender's stages, whatever their
    number, chain [0, num_layers) for every tp rank."""
    for tp_rank in range(tp_size):
        layer = 0
        while layer < num_layers and (h := parts.get((tp_rank, layer))) is not None and h.layer_end > layer:
            layer = h.layer_end
        if layer != num_layers:
            return False
    return True


def rank_parts(
    parts: dict[tuple[int, int], KVPagesHeader], tp_size: int, pp_size: int, num_layers: int
) -> list[tuple[int, int]]:
    """The keys of `parts` in this worker's rank order (rank r: tp rank r % tp_size, its stage's
    first layer). ValueError naming both shapes unless the sender's ranks are exactly ours: KV
    heads and layer ranges are not resharded."""
    layers = rank_layers(num_layers, tp_size, pp_size)
    mine = sorted((rank % tp_size, r.start, r.stop) for rank, r in enumerate(layers))
    sent = sorted((h.tp_rank, h.layer_start, h.layer_end) for h in parts.values())
    if sent != mine:
        their_tp = next(iter(parts.values())).tp_size
        raise ValueError(
            f"kv: pages from a worker of {_shape(their_tp, sent)}, this worker is {_shape(tp_size, mine)} "
            "(KV pages go rank i to rank i and stage j to stage j, not resharded: pair workers of one shape)"
        )
    return [(rank % tp_size, r.start) for rank, r in enumerate(layers)]


def _shape(tp_size: int, ranks: list[tuple[int, int, int]]) -> str:
    stages = sorted({(start, end) for _, start, end in ranks})
    return f"tp {tp_size} x pp {len(stages)} (layers {' '.join(f'[{s}, {e})' for s, e in stages)})"
