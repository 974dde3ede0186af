"""The scheduler's failure and migration handling: the books of the requests placed on workers,
and how each ends other than by running to its end on its workers.

    RequestDone(failed reason) ──────────────────────────▶ fail
    RequestDone(FINISHED) from the prefill worker ───────▶ abort at the decode worker (no handoff)
    AbortRequest ────────────────────────────────────────▶ abort at every holder
    worker lost (heartbeats stopped, WorkerStopped, restarted under its id) ─▶ for each request:
        an image or a transcription (`Placed.retry`) ──▶ starts over: its queue entry is handed
            back (`take_restarted`), up to --max-migrations times, else fail
        cannot move (migration.py), or no decode/mixed worker left ──▶ fail
        else ──▶ MigrateRequest to its tokenizer, abort at every holder (the prefill worker
            that keeps its prompt's pages keeps them: migration.py)
    a request ends (done, failed, aborted, refused) ──▶ its kept prompt pages freed (AbortRequest
        to the keeper); so are those of a moved request its tokenizer did not send again (sweep_kept)
    fail = RequestFailed (503 worker_failure) to its tokenizer, abort at every holder
    refuse = RequestFailed (400, the field the worker named) for a request its worker refused

A tokenizer that has not pinged this scheduler process yet (it restarted) is told when it does:
what is for it waits in `unreported`. Pure logic: no sockets, no clock; what to send is appended
to the caller's Outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    Message,
    MigrateRequest,
    RequestDone,
    RequestFailed,
    WorkerKind,
    WorkerRole,
)
from pagemesh.services.scheduler.migration import cannot_migrate
from pagemesh.services.scheduler.queues import Queued
from pagemesh.services.scheduler.registry import Registry, WorkerInfo

Destination = bytes | str  # a peer's Router identity, or a worker id
Outputs = list[tuple[Destination, Message]]

MAX_UNREPORTED = 10_000  # failures kept per tokenizer that has not pinged yet
KEPT_ORPHAN_S = 30.0  # a moved request's kept pages wait this long for its tokenizer to send it again
# RequestDone reasons that end a request with an error for the client (REJECTED says its own why)
FAILURES = {
    DoneReason.KV_REJECTED: "the decode worker refused the KV pages",
    DoneReason.KV_TIMEOUT: "the KV handoff timed out",
}


@dataclass
class Placed:
    """A request on workers: who asked (its tokenizer's token address) and which workers hold it.
    `prefill` is the prefill worker of a handoff not yet done (None: no handoff). `migrations`:
    times it moved after losing its worker (None: it cannot move, see migration.py)."""

    request_id: str
    reply_to: str
    holders: set[str]
    prefill: str | None
    migrations: int | None = 0
    # a request its one worker runs whole (an image, a transcription): its queue entry (with its
    # `restarts`), to place again from the start when that worker is lost
    retry: Queued | None = None


class PlacedRequests:
    """The requests on workers (`placed`, by request id), the tokenizers to tell about them
    (`tokenizers`: token address -> identity) and what waits for a tokenizer not heard from yet
    (`unreported`). Placement adds to `placed` and to the holders' `requests` in the registry;
    everything here takes requests off both."""

    def __init__(self, registry: Registry, max_migrations: int, wait_for_return: bool = False):
        """`wait_for_return`: a lost worker's requests move even when no worker is left to take
        them: they wait in the queue for one to come back (--worker-return-wait)."""
        self.registry = registry
        self.max_migrations = max_migrations
        self.wait_for_return = wait_for_return
        self._restarted: list[Queued] = []  # queue entries of lost workers' images and transcriptions
        self.placed: dict[str, Placed] = {}
        # request -> the prefill worker that keeps its prompt's pages since their handoff (an
        # exact resume, migration.py); told to free them (AbortRequest) when the request ends
        self.kept: dict[str, str] = {}
        self.orphaned: dict[str, float] = {}  # kept, neither placed nor queued since (sweep_kept)
        self.kept_ids: dict[str, str] = {}  # request -> the id its keeper knows, where another (moved_to)
        self.tokenizers: dict[str, bytes] = {}
        self.unreported: dict[str, list[RequestFailed | MigrateRequest]] = {}

    def done(self, msg: RequestDone, out: Outputs) -> None:
        """A worker finished its part of a request: a failure fails it everywhere; a prefill
        worker that finished it at the first token frees the decode worker's pages."""
        placed = self.placed.get(msg.request_id)
        self.release(msg.worker_id, msg.request_id)
        if placed is None:
            return
        placed.holders.discard(msg.worker_id)
        if msg.reason is DoneReason.HANDED_OFF and msg.worker_id == placed.prefill:
            if self.kept.get(msg.request_id, msg.worker_id) != msg.worker_id:  # another keeper before
                self.free_kept(msg.request_id, "kept by another worker now", out)
            self.kept[msg.request_id] = msg.worker_id
            self.kept_ids.pop(msg.request_id, None)  # its keeper knows it by this id now
        if msg.reason is DoneReason.REJECTED:
            self.refuse(placed, msg.detail or "refused by its worker", out)
        elif msg.reason.failed:
            self.fail(placed, FAILURES[msg.reason], out)
        elif msg.reason is DoneReason.FINISHED and msg.worker_id == placed.prefill:
            self.abort_holders(placed, "finished at the first token", out)  # no handoff needed
        if not placed.holders and self.placed.pop(msg.request_id, None) is not None:
            self.free_kept(msg.request_id, "the request ended", out)

    def abort(self, msg: AbortRequest, out: Outputs) -> None:
        """Abort a request at every worker holding it (a queued one is the caller's to drop)."""
        placed = self.placed.get(msg.request_id)
        if placed is not None:
            self.abort_holders(placed, msg.reason, out, moves=bool(msg.moved_to))
        else:  # queued (a migrated one waiting for a worker keeps pages), or unknown here
            if not msg.moved_to:
                self.free_kept(msg.request_id, msg.reason, out)
            if msg.worker_id in self.registry.workers:  # placed by an earlier scheduler process
                out.append((msg.worker_id, AbortRequest(request_id=msg.request_id, reason=msg.reason)))
        if msg.moved_to and msg.request_id in self.kept:  # it goes on under the new id: so do its kept pages
            self.kept[msg.moved_to] = self.kept.pop(msg.request_id)
            self.kept_ids[msg.moved_to] = self.kept_ids.pop(msg.request_id, msg.request_id)
            self.orphaned.pop(msg.request_id, None)

    def abort_holders(self, placed: Placed, reason: str, out: Outputs, moves: bool = False) -> None:
        """Abort the request at each of its holders and forget it; unless it `moves` (migrates),
        its kept prompt pages are freed too."""
        rid = placed.request_id
        for wid in list(placed.holders):
            out.append((wid, AbortRequest(request_id=rid, reason=reason)))
            self.release(wid, rid)
        self.placed.pop(rid, None)
        if not moves:
            self.free_kept(rid, reason, out)

    def free_kept(self, request_id: str, reason: str, out: Outputs) -> None:
        """The prefill worker that keeps the request's prompt pages frees them (an AbortRequest)."""
        keeper = self.kept.pop(request_id, None)
        self.orphaned.pop(request_id, None)
        kept_id = self.kept_ids.pop(request_id, request_id)
        if keeper is not None and keeper in self.registry.workers:
            out.append((keeper, AbortRequest(request_id=kept_id, reason=reason)))

    def sweep_kept(self, now: float, known: Callable[[str], bool], out: Outputs) -> None:
        """Free the kept pages of requests neither placed nor queued (`known`) for KEPT_ORPHAN_S:
        moved, and not sent again by their tokenizer (it ended meanwhile, or the tokenizer died)."""
        for rid in list(self.kept):
            if known(rid):
                self.orphaned.pop(rid, None)
            elif now - self.orphaned.setdefault(rid, now) > KEPT_ORPHAN_S:
                self.free_kept(rid, "the request did not come back", out)

    def fail(self, placed: Placed, why: str, out: Outputs) -> None:
        """Tell the request's tokenizer it failed (or keep that until it pings), abort it everywhere."""
        failed = RequestFailed(
            request_id=placed.request_id,
            status=503,
            error_type="server_error",
            message=f"Request failed: {why}; retry later.",
            param=None,
            code="worker_failure",
        )
        self.tell_tokenizer(placed.reply_to, failed, out)
        self.abort_holders(placed, why, out)

    def refuse(self, placed: Placed, why: str, out: Outputs) -> None:
        """The worker refused the request as it is (its engine's ValueError, "field: why", e.g. a
        prompt that cannot fit the KV pool): a 400 naming the field, as the gateway's own checks
        give; retrying the same request would not help."""
        field, sep, _ = why.partition(":")
        failed = RequestFailed(
            request_id=placed.request_id,
            status=400,
            error_type="invalid_request_error",
            message=why,
            param=field if sep and field.isidentifier() else None,
            code=None,
        )
        self.tell_tokenizer(placed.reply_to, failed, out)
        self.abort_holders(placed, why, out)

    def tell_tokenizer(self, reply_to: str, msg: RequestFailed | MigrateRequest, out: Outputs) -> None:
        origin = self.tokenizers.get(reply_to)
        if origin is not None:
            out.append((origin, msg))
        else:  # its tokenizer has not pinged this scheduler process yet: tell it when it does
            waiting = self.unreported.setdefault(reply_to, [])
            if len(waiting) < MAX_UNREPORTED:
                waiting.append(msg)

    def tokenizer_pinged(self, address: str, identity: bytes, out: Outputs) -> None:
        """A tokenizer said where its token address is: what waited for it goes now."""
        self.tokenizers[address] = identity
        out.extend((identity, failed) for failed in self.unreported.pop(address, ()))

    def lost(self, gone: WorkerInfo, why: str, now: float, out: Outputs) -> None:
        """Every request placed on a worker process that is gone moves to another worker (its
        tokenizer sends it again, MigrateRequest), or fails if it cannot move, has moved
        `max_migrations` times, or no worker of its kind is left to take it (said at once, with
        the loss's own why, rather than after a round trip through the tokenizer). Either way it
        is aborted at every holder, the gone worker's id too: a worker only silent for a while
        stops computing it, and a process restarted under the id does not know it."""
        takers = [
            w for role in (WorkerRole.DECODE, WorkerRole.MIXED) for w in self.registry.alive(WorkerKind.LLM, role, now)
        ]
        nowhere = "" if takers or self.wait_for_return else ", and no workers are available to move it to"
        for rid in list(gone.requests):
            placed = self.placed.get(rid)
            if placed is None:
                continue
            if placed.retry is not None and placed.retry.restarts < self.max_migrations:
                self._restarted.append(placed.retry)  # nothing of it is kept: it starts over elsewhere
                self.abort_holders(placed, why, out)
                continue
            refusal = cannot_migrate(placed.migrations, self.max_migrations)
            if refusal is None and nowhere and placed.migrations is not None:
                refusal = nowhere
            if refusal is not None:
                self.fail(placed, f"{why}{refusal}", out)
                continue
            lost = sorted(placed.holders | {gone.worker_id})
            self.tell_tokenizer(placed.reply_to, MigrateRequest(request_id=rid, reason=why, lost_worker_ids=lost), out)
            self.abort_holders(placed, why, out, moves=True)
        if gone.role == WorkerRole.PREFILL:  # what it kept is gone with it
            self.kept = {rid: keeper for rid, keeper in self.kept.items() if keeper != gone.worker_id}
            self.kept_ids = {rid: kept_id for rid, kept_id in self.kept_ids.items() if rid in self.kept}

    def take_restarted(self) -> list[Queued]:
        """The queue entries of the images and transcriptions whose worker was lost since the
        last call, to place again (the caller's queues)."""
        restarted, self._restarted = self._restarted, []
        return restarted

    def release(self, worker_id: str, request_id: str) -> None:
        info = self.registry.workers.get(worker_id)
        if info is not None:
            info.requests.discard(request_id)
