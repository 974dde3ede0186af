"""The gateway's side of the mesh: its three sockets and the routing of replies to requests.

    submit()        GenerateRequest / EmbedRequest ──Dealer──▶ tokenizer
    call()          TokenizeRequest / DetokenizeRequest ──Dealer──▶ tokenizer; awaits its one answer
    submit_direct() ImageRequest / TranscriptionRequest ──Dealer──▶ scheduler (refusals come back on the same Dealer)
    abort()         AbortRequest    ──Dealer──▶ scheduler, and ──Dealer──▶ tokenizer (drops its state)
    status()        StatusRequest   ──Dealer──▶ scheduler ──ClusterStatus──▶ back on the same Dealer
    lora_op()       LoRAAdapterRequest ──Dealer──▶ scheduler ──LoRAAdapterReply──▶ back on the same Dealer
    replies         TextDeltaBatch / EmbeddingBatch / ImageResult / TranscriptionResult / TokenizeResult /
                    DetokenizeResult / RequestFailed ──▶ Pull (reply_to) ──▶ the request's queue
    Ping every second ──Dealer──▶ tokenizer ──Pong(instance)──▶ back on the same Dealer

A background task per receiving socket does the routing; a request's queue holds
`(arrival time, list[TextDelta] | Embedding | ImageResult | ... | RequestFailed)` items, one per
incoming message (an EmbeddingBatch is split by request). When the
tokenizer's instance changes, it was restarted and lost every request in flight: they end with a
503 at once (and are aborted at the scheduler) instead of at the request timeout. No request goes
out before the first Pong, so the first instance seen is the one the requests went to.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import structlog

from pagemesh.common.liveness import PeerInstance, ping_forever
from pagemesh.common.messages import (
    AbortRequest,
    ClusterStatus,
    DetokenizeRequest,
    DetokenizeResult,
    Embedding,
    EmbeddingBatch,
    EmbedRequest,
    GenerateRequest,
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
    """Sockets and per-request reply queues of one gateway. Call `start()` inside the event loop."""

    def __init__(self, tokenizer_address: str, scheduler_address: str, reply_address: str, identity: str):
        self.identity = identity
        self._tokenizer = Dealer(tokenizer_address, identity)
        self._scheduler = Dealer(scheduler_address, identity)
        self._replies = Pull(reply_address)
        self.reply_to = self._replies.address
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
        self._status_waiter: asyncio.Future[ClusterStatus] | None = None
        self._lora_waiters: dict[str, asyncio.Future[LoRAAdapterReply]] = {}  # op id -> its answer
        self._tasks: set[asyncio.Task] = set()
        # set by the tokenizer's first Pong: requests go out only once its instance is known, so
        # a restart is always seen as a change of instance
        self._tokenizer_known = asyncio.Event()
        self._unknown_aborted: OrderedDict[str, float] = OrderedDict()  # request id -> when

    def start(self) -> None:
        for loop in (
            self._route_replies(),
            self._route_status(),
            self._watch_tokenizer(),
            ping_forever(self._tokenizer, self.identity, self.reply_to),  # the tokenizer watches it
        ):
            self._spawn(loop)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in (self._tokenizer, self._scheduler, self._replies):
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

    @property
    def tokenizer_known(self) -> bool:
        """The tokenizer has answered a ping."""
        return self._tokenizer_known.is_set()

    async def submit(self, request: GenerateRequest | EmbedRequest | TokenizeRequest | DetokenizeRequest) -> None:
        if not self._tokenizer_known.is_set():
            try:
                await asyncio.wait_for(self._tokenizer_known.wait(), TOKENIZER_WAIT_S)
            except TimeoutError:
                raise ApiError(
                    503,
                    "Service unavailable: the tokenizer does not answer; retry later.",
                    "server_error",
                    None,
                    "service_unavailable",
                    headers={"Retry-After": "5"},
                ) from None
        await self._tokenizer.send(request)

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
        self.discard(request_id)
        self._spawn(self._send_abort(AbortRequest(request_id=request_id, reason=reason)))

    async def _send_abort(self, abort: AbortRequest) -> None:
        await self._scheduler.send(abort)
        await self._tokenizer.send(abort)

    async def _route_replies(self) -> None:
        while True:
            msg = await self._replies.recv()
            now = time.monotonic()
            if isinstance(msg, TextDeltaBatch):
                by_request: dict[str, list[TextDelta]] = {}
                for delta in msg.deltas:
                    by_request.setdefault(delta.request_id, []).append(delta)
                for request_id, deltas in by_request.items():
                    if not self._deliver(request_id, (now, deltas)) and not any(d.finish_reason for d in deltas):
                        self._abort_unknown(request_id, now)
            elif isinstance(msg, EmbeddingBatch):
                for embedding in msg.embeddings:
                    self._deliver(embedding.request_id, (now, embedding))
            elif isinstance(msg, RequestFailed | ImageResult | TranscriptionResult | TokenizeResult | DetokenizeResult):
                self._deliver(msg.request_id, (now, msg))
            else:
                log.warning("unexpected message on the reply stream", type=type(msg).__name__)

    def _deliver(self, request_id: str, reply: Reply) -> bool:
        """Queue a reply for its request; False when this process does not know it (its client
        left, it timed out, or an earlier process of this gateway sent it): dropped."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(reply)
        return queue is not None

    def _abort_unknown(self, request_id: str, now: float) -> None:
        """Tokens keep coming for a request nobody here reads (an earlier process of this gateway
        sent it, and it was killed): stop it everywhere, at most once a second per request."""
        last = self._unknown_aborted.get(request_id)
        if last is not None and now - last < UNKNOWN_ABORT_INTERVAL_S:
            return
        self._unknown_aborted[request_id] = now
        self._unknown_aborted.move_to_end(request_id)
        if len(self._unknown_aborted) > MAX_UNKNOWN_REMEMBERED:
            self._unknown_aborted.popitem(last=False)
        self._spawn(self._send_abort(AbortRequest(request_id=request_id, reason="no client at this gateway")))

    async def _watch_tokenizer(self) -> None:
        peer = PeerInstance()
        while True:
            msg = await self._tokenizer.recv()
            if not isinstance(msg, Pong):
                log.warning("unexpected message from the tokenizer", type=type(msg).__name__)
                continue
            if peer.restarted(msg.instance):
                self._tokenizer_restarted()
            self._tokenizer_known.set()

    def _tokenizer_restarted(self) -> None:
        """Every request in flight went through the tokenizer process that is gone."""
        log.warning("tokenizer restarted", failed_requests=len(self._queues))
        self.fail_in_flight(
            "Request failed: the tokenizer restarted; retry later.", "service_restarted", "tokenizer restarted"
        )

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
            self._spawn(self._send_abort(AbortRequest(request_id=request_id, reason=abort_reason)))

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
