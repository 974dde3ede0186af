"""The gateway's side of the mesh: its three sockets and the routing of replies to requests.

    submit()        GenerateRequest / EmbedRequest ──Dealer──▶ a tokenizer replica (the live one
                    with the fewest requests: gateway/tokenizer_routes.py)
    call()          TokenizeRequest / DetokenizeRequest ──Dealer──▶ a tokenizer; awaits its one answer
    submit_direct() ImageRequest / TranscriptionRequest ──Dealer──▶ scheduler (refusals come back on the same Dealer)
    abort()         AbortRequest    ──Dealer──▶ scheduler, and ──Dealer──▶ tokenizer (drops its state)
    status()        StatusRequest   ──Dealer──▶ scheduler ──ClusterStatus──▶ back on the same Dealer
    lora_op()       LoRAAdapterRequest ──Dealer──▶ scheduler ──LoRAAdapterReply──▶ back on the same Dealer
    replies         TextDeltaBatch / EmbeddingBatch / ImageResult / TranscriptionResult / TokenizeResult /
                    DetokenizeResult / RequestFailed ──▶ Pull (reply_to) ──▶ the request's queue
    Ping every second ──Dealer──▶ each tokenizer ──Pong(instance)──▶ back on the same Dealer

A background task per receiving socket does the routing; a request's queue holds
`(arrival time, list[TextDelta] | Embedding | ImageResult | ... | RequestFailed)` items, one per
incoming message (an EmbeddingBatch is split by request). When a
tokenizer's instance changes, it was restarted and lost every request in flight through it; when it
stops answering while another answers, it is lost too. Either way its requests move to a live
replica (the restarted one too) under new ids, each stream with what its client has had, and go on
where they were (gateway/tokenizer_routes.py, services/tokenizer/resume.py). No request goes out
before a replica's first Pong, so the first instance seen is the one its requests went to.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence

import structlog

from pagemesh.common.liveness import ping_forever
from pagemesh.common.messages import (
    AbortRequest,
    ClusterStatus,
    DetokenizeRequest,
    DetokenizeResult,
    Embedding,
    EmbeddingBatch,
    ImageRequest,
    ImageResult,
    LoRAAdapterReply,
    LoRAAdapterRequest,
    Pong,
    RequestFailed,
    StatusRequest,
    TextDelta,
    TextDeltaBatch,
    TokenizeRequest,
    TokenizeResult,
    TranscriptionRequest,
    TranscriptionResult,
)
from pagemesh.common.transport import Dealer, Pull
from pagemesh.gateway.errors import ApiError, from_request_failed
from pagemesh.gateway.tokenizer_routes import (
    MAX_TOKENIZER_MOVES,
    Route,
    TokenizerLink,
    TokenizerRequest,
    pick,
)

DirectRequest = ImageRequest | TranscriptionRequest  # no tokenizer on their path: straight to the scheduler

log = structlog.get_logger()

Reply = tuple[
    float,
    list[TextDelta] | Embedding | ImageResult | TranscriptionResult | TokenizeResult | DetokenizeResult | RequestFailed,
]
TOKENIZER_WAIT_S = 10.0  # a request waits this long for a tokenizer that has not answered yet
UNKNOWN_ABORT_INTERVAL_S = 1.0  # between aborts of one unknown request whose tokens keep coming
MAX_UNKNOWN_REMEMBERED = 4096


class MeshClient:
    """Sockets and per-request reply queues of one gateway. Call `start()` inside the event loop.
    `tokenizer_addresses`: one address per tokenizer replica."""

    def __init__(
        self, tokenizer_addresses: Sequence[str] | str, scheduler_address: str, reply_address: str, identity: str
    ):
        self.identity = identity
        addresses = [tokenizer_addresses] if isinstance(tokenizer_addresses, str) else list(tokenizer_addresses)
        self._links = [TokenizerLink(address, Dealer(address, identity)) for address in addresses]
        self._scheduler = Dealer(scheduler_address, identity)
        self._replies = Pull(reply_address)
        self.reply_to = self._replies.address
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
        self._routes: dict[str, Route] = {}  # by own id: requests that went to a tokenizer
        self._current: dict[str, str] = {}  # the id each route goes by now -> its own id
        self._status_waiter: asyncio.Future[ClusterStatus] | None = None
        self._lora_waiters: dict[str, asyncio.Future[LoRAAdapterReply]] = {}  # op id -> its answer
        self._tasks: set[asyncio.Task] = set()
        # set by the first Pong: requests go out only to a replica whose instance is known, so its
        # restart is always seen as a change of instance. From then on one replica at least stays
        # live: a silent one is dropped only while another answers (_watch_silence)
        self._tokenizer_up = asyncio.Event()
        self._unknown_aborted: OrderedDict[str, float] = OrderedDict()  # request id -> when
        self.tokenizer_moves = 0  # requests moved to another replica (or a restarted one)

    def start(self) -> None:
        for link in self._links:
            self._spawn(self._watch_tokenizer(link))
            self._spawn(ping_forever(link.socket, self.identity, self.reply_to))  # the tokenizer watches it
        for loop in (self._route_replies(), self._route_status(), self._watch_silence()):
            self._spawn(loop)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in (*(link.socket for link in self._links), self._scheduler, self._replies):
            sock.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests

    def open(self, request_ids: list[str]) -> asyncio.Queue[Reply]:
        """Register requests (one call's: one per prompt) before submitting them, so no reply can
        arrive unrouted; their replies share the queue returned."""
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        for request_id in request_ids:
            self._queues[request_id] = queue
        return queue

    def discard(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        route = self._routes.pop(request_id, None)
        if route is not None:
            self._current.pop(route.current_id, None)
            if route.link is not None:
                route.link.requests.discard(request_id)

    @property
    def tokenizer_known(self) -> bool:
        """A tokenizer replica answers pings."""
        return self._tokenizer_up.is_set()

    async def submit(self, request: TokenizerRequest) -> None:
        if not self._tokenizer_up.is_set():
            try:
                await asyncio.wait_for(self._tokenizer_up.wait(), TOKENIZER_WAIT_S)
            except TimeoutError:
                raise ApiError(
                    503,
                    "Service unavailable: the tokenizer does not answer; retry later.",
                    "server_error",
                    None,
                    "service_unavailable",
                    headers={"Retry-After": "5"},
                ) from None
        link = pick(self._links)  # one is live: see _tokenizer_up
        self._routes[request.request_id] = Route(request, link)
        self._current[request.request_id] = request.request_id
        link.requests.add(request.request_id)
        await link.socket.send(request)

    async def call(
        self, request: TokenizeRequest | DetokenizeRequest, timeout: float
    ) -> TokenizeResult | DetokenizeResult:
        """Ask the tokenizer and await its answer; its refusal (a RequestFailed) raises as the
        ApiError it names, no answer within `timeout` seconds a 504."""
        queue = self.open([request.request_id])
        try:
            await self.submit(request)
            try:
                _, answer = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                raise ApiError(504, f"request timed out after {timeout:g} s", "server_error", None, "timeout") from None
        finally:
            self.discard(request.request_id)
        if isinstance(answer, RequestFailed):
            raise from_request_failed(answer)
        return answer

    async def submit_direct(self, request: DirectRequest) -> None:
        """Image and transcription requests need no tokenizer: straight to the scheduler."""
        await self._scheduler.send(request)

    async def call_direct(
        self, request: ImageRequest | TranscriptionRequest, arrival: float, timeout_s: float
    ) -> Reply:
        """Send a request straight to the scheduler and wait for its one reply until `timeout_s`
        after `arrival` (monotonic): a 504 ApiError then; a client that leaves (cancellation) or a
        timeout aborts the request, freeing its place in the worker's batch."""
        queue = self.open([request.request_id])
        ended = False
        try:
            await self.submit_direct(request)
            try:
                _, reply = await asyncio.wait_for(queue.get(), max(arrival + timeout_s - time.monotonic(), 0.0))
            except TimeoutError:
                raise ApiError(
                    504, f"request timed out after {timeout_s:g} s", "server_error", None, "timeout"
                ) from None
            ended = True
            return reply
        finally:
            if not ended:
                self.abort_direct(request.request_id, "client disconnected or timed out")
            self.discard(request.request_id)

    def abort_direct(self, request_id: str, reason: str) -> None:
        """Abort a request sent with `submit_direct` (the tokenizer never had it)."""
        self.discard(request_id)
        self._spawn(self._scheduler.send(AbortRequest(request_id=request_id, reason=reason)))

    def abort(self, request_id: str, reason: str) -> None:
        """Stop the request everywhere and forget it. Does not wait, so a handler being cancelled
        (client gone) can call it from `finally`."""
        current, link = self._now_at(request_id)
        self.discard(request_id)
        self._spawn(self._send_abort(AbortRequest(request_id=current, reason=reason), link))

    def _now_at(self, request_id: str) -> tuple[str, TokenizerLink | None]:
        """The id a request goes by now, and its tokenizer (None: not known, or none)."""
        route = self._routes.get(request_id)
        return (request_id, None) if route is None else (route.current_id, route.link)

    async def _send_abort(self, abort: AbortRequest, link: TokenizerLink | None) -> None:
        """To the scheduler, and to the request's tokenizer (every one when that is not known)."""
        await self._scheduler.send(abort)
        for tokenizer in [link] if link is not None else self._links:
            await tokenizer.socket.send(abort)

    async def _route_replies(self) -> None:
        while True:
            msg = await self._replies.recv()
            now = time.monotonic()
            if isinstance(msg, TextDeltaBatch):
                by_request: dict[str, list[TextDelta]] = {}
                for delta in msg.deltas:
                    by_request.setdefault(delta.request_id, []).append(delta)
                for request_id, deltas in by_request.items():
                    own = self._own_id(request_id)
                    route = self._routes.get(own) if own is not None else None
                    if own is not None and own != request_id:
                        deltas = [dataclasses.replace(d, request_id=own) for d in deltas]
                    if own is not None and self._deliver(own, (now, deltas)):
                        if route is not None:
                            route.record(deltas)
                    elif not any(d.finish_reason for d in deltas):
                        self._abort_unknown(request_id, now)
            elif isinstance(msg, EmbeddingBatch):
                for embedding in msg.embeddings:
                    self._deliver_as_own(embedding, now)
            elif isinstance(msg, RequestFailed | ImageResult | TranscriptionResult | TokenizeResult | DetokenizeResult):
                self._deliver_as_own(msg, now)
            else:
                log.warning("unexpected message on the reply stream", type=type(msg).__name__)

    def _own_id(self, request_id: str) -> str | None:
        """The request a reply under `request_id` is for: a route's own id when that is the id it
        goes by now; None when it went under that id before it moved (a stale reply); else the
        id itself (a request with no tokenizer on its path, or none known here)."""
        if request_id in self._current:
            return self._current[request_id]
        return None if request_id in self._routes else request_id

    def _deliver_as_own(self, msg, now: float) -> None:
        own = self._own_id(msg.request_id)
        if own is not None:
            self._deliver(own, (now, msg if own == msg.request_id else dataclasses.replace(msg, request_id=own)))

    def _deliver(self, request_id: str, reply: Reply) -> bool:
        """Queue a reply for its request; False when this process does not know it (its client
        left, it timed out, or an earlier process of this gateway sent it): dropped."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(reply)
        return queue is not None

    def _abort_unknown(self, request_id: str, now: float) -> None:
        """Tokens keep coming for a request nobody here reads (an earlier process of this gateway
        sent it and was killed, or it moved to another tokenizer under a new id): stop it
        everywhere, at most once a second per request."""
        last = self._unknown_aborted.get(request_id)
        if last is not None and now - last < UNKNOWN_ABORT_INTERVAL_S:
            return
        self._unknown_aborted[request_id] = now
        self._unknown_aborted.move_to_end(request_id)
        if len(self._unknown_aborted) > MAX_UNKNOWN_REMEMBERED:
            self._unknown_aborted.popitem(last=False)
        self._spawn(self._send_abort(AbortRequest(request_id=request_id, reason="no client at this gateway"), None))

    # ---- tokenizer replicas: liveness, and moving the requests of a lost one

    async def _watch_tokenizer(self, link: TokenizerLink) -> None:
        while True:
            msg = await link.socket.recv()
            if not isinstance(msg, Pong):
                log.warning("unexpected message from the tokenizer", type=type(msg).__name__, address=link.address)
                continue
            was_live = link.live
            if link.answered(msg.instance, time.monotonic()):
                self._lost(link, "restarted")
            elif not was_live:
                log.info("tokenizer answers", address=link.address)
            self._tokenizer_up.set()

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for link in self._links:
                if link.silent(now) and any(other.live and not other.silent(now) for other in self._links):
                    link.live = False
                    self._lost(link, "silent")

    def _lost(self, link: TokenizerLink, why: str) -> None:
        """Every request through `link` is gone there: each moves to a live replica."""
        log.warning("tokenizer lost: moving its requests", address=link.address, why=why, requests=len(link.requests))
        for own in list(link.requests):
            self._move(self._routes[own], link)

    def _move(self, route: Route, lost: TokenizerLink) -> None:
        """Send a request again through a live replica (not `lost` if another is live; `lost`
        itself when it is the restarted one alone), under a new id; the old id is aborted."""
        route.link.requests.discard(route.own_id)
        old_id, route.link = route.current_id, None
        if route.moves >= MAX_TOKENIZER_MOVES:
            self._spawn(self._send_abort(AbortRequest(request_id=old_id, reason="its tokenizer was lost"), lost))
            self._fail(route.own_id, "Request failed: its tokenizer was lost too often; retry later.")
            return
        target = pick(self._links, avoid=lost)  # never None: one replica at least is live (see _tokenizer_up)
        self._current.pop(old_id, None)
        request = route.moved()
        # the old id is aborted, naming the new one: what a prefill worker kept of it stays for that
        abort = AbortRequest(request_id=old_id, reason="its tokenizer was lost", moved_to=route.current_id)
        self._spawn(self._send_abort(abort, lost))
        self._current[route.current_id] = route.own_id
        route.link = target
        target.requests.add(route.own_id)
        self.tokenizer_moves += 1
        log.info("request moved to a tokenizer", request_id=route.own_id, to=target.address, moves=route.moves)
        self._spawn(target.socket.send(request))

    def _fail(self, own: str, message: str) -> None:
        failed = RequestFailed(
            request_id=own, status=503, error_type="server_error", message=message, param=None, code="service_restarted"
        )
        self._deliver(own, (time.monotonic(), failed))
        self.abort(own, "tokenizer lost")

    @property
    def in_flight(self) -> int:
        """Requests in the mesh that wait for replies here."""
        return len(self._queues)

    def fail_in_flight(self, message: str, code: str, abort_reason: str) -> None:
        """End every request in flight with a 503 `code` (an error event in a stream), and abort
        it in the mesh."""
        now = time.monotonic()
        for request_id in list(self._queues):
            failed = RequestFailed(
                request_id=request_id, status=503, error_type="server_error", message=message, param=None, code=code
            )
            self._deliver(request_id, (now, failed))
            current, link = self._now_at(request_id)
            self._spawn(self._send_abort(AbortRequest(request_id=current, reason=abort_reason), link))

    # ---- status

    async def status(self, timeout: float = 1.0) -> ClusterStatus | None:
        """The scheduler's ClusterStatus, or None if it did not answer within `timeout` seconds.
        Concurrent callers share one query."""
        waiter = self._status_waiter
        if waiter is None or waiter.done():
            waiter = self._status_waiter = asyncio.get_running_loop().create_future()
            await self._scheduler.send(StatusRequest(requester=self.identity))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            if self._status_waiter is waiter:  # lost query: let the next caller ask again
                self._status_waiter = None
            return None

    async def lora_op(self, request: LoRAAdapterRequest, timeout: float) -> LoRAAdapterReply | None:
        """Load or unload a LoRA adapter on every LLM worker, through the scheduler; its answer,
        or None if none came within `timeout` seconds."""
        waiter = self._lora_waiters[request.op_id] = asyncio.get_running_loop().create_future()
        try:
            await self._scheduler.send(request)
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            return None
        finally:
            self._lora_waiters.pop(request.op_id, None)

    async def _route_status(self) -> None:
        while True:
            msg = await self._scheduler.recv()
            if isinstance(msg, ClusterStatus):
                waiter = self._status_waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            elif isinstance(msg, LoRAAdapterReply):
                lora_waiter = self._lora_waiters.get(msg.op_id)
                if lora_waiter is not None and not lora_waiter.done():
                    lora_waiter.set_result(msg)
            elif isinstance(msg, RequestFailed):  # an image or transcription request the scheduler refused
                self._deliver(msg.request_id, (time.monotonic(), msg))
            else:
                log.warning("unexpected message from the scheduler", type=type(msg).__name__)
