"""The tokenizer process: one asyncio task per socket around `TokenizerCore`.

    gateways  ──GenerateRequest / EmbedRequest / AbortRequest──▶ Router ─┐
    workers   ──TokenDeltaBatch / EmbeddingBatch─────────────▶ Pull   ─┼─ TokenizerCore ─▶ Dealer ──▶ scheduler
    scheduler ──RequestFailed / MigrateRequest───────────────▶ Dealer ─┘        │
                                                                                 └──▶ Push per gateway (reply_to)

A TokenizeRequest or DetokenizeRequest is answered at once, to its gateway's reply address. An
EmbeddingBatch is relayed to the gateways as it is (no text to make).

Gateways ping it (Ping ──▶ Pong with this process's instance id; a gateway whose pings stopped
has its requests aborted: gateway_liveness.py), and it pings the scheduler:
when the scheduler's instance changes, the requests it may have lost are sent to it again. A
MigrateRequest (the request's worker is gone) is answered by sending the request again with the
tokens it has streamed (`TokenizerCore.on_migrate`), or by failing it to its gateway.

Replies to each gateway go through their own bounded queue and sender task, so a gateway that
is gone stalls (and eventually loses) only its own replies, never the other gateways' streams.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from pagemesh.common.liveness import PeerInstance, new_instance, ping_forever
from pagemesh.common.logging import configure_logging
from pagemesh.common.messages import (
    AbortRequest,
    DetokenizeRequest,
    EmbeddingBatch,
    EmbedRequest,
    GenerateRequest,
    MigrateRequest,
    Ping,
    Pong,
    Ready,
    RequestFailed,
    ScheduleRequest,
    TokenDeltaBatch,
    TokenizeRequest,
)
from pagemesh.common.multimodal import ImageSpec
from pagemesh.common.process import Idleness, run_until_signalled, wait_until_idle
from pagemesh.common.tokenizer import Tokenizer
from pagemesh.common.transport import Dealer, Pull, Push, Router, UnknownPeer
from pagemesh.services.tokenizer.config import TokenizerConfig, parse_args
from pagemesh.services.tokenizer.core import TokenizerCore
from pagemesh.services.tokenizer.gateway_liveness import GatewayLiveness
from pagemesh.services.tokenizer.images import ImagePrompts

log = structlog.get_logger()

REPLY_QUEUE_SIZE = 10_000  # messages waiting for one gateway before new ones are dropped


def main(argv: list[str]) -> None:
    config = parse_args(argv)
    configure_logging("tokenizer", config.name, config.log_level)
    idle = Idleness()  # SIGTERM: serve on until no request is in flight here (or the timeout)
    run_until_signalled(run(config, idle), drain=lambda: wait_until_idle(idle, config.drain_timeout))


async def run(config: TokenizerConfig, idle: Idleness | None = None) -> None:
    tokenizer = Tokenizer.from_path(config.model, config.chat_template)
    with (
        Router(config.address) as frontend,
        Pull(config.output_address) as tokens,
        Dealer(config.scheduler_address, config.name) as scheduler,
    ):
        spec = ImageSpec.from_folder(config.model)
        images = ImagePrompts(spec, tokenizer) if spec is not None else None
        core = TokenizerCore(tokenizer, config.max_model_len, reply_to=tokens.address, images=images)
        if idle is not None:
            idle.check = lambda: len(core) == 0
        gateways = GatewayReplies()
        liveness = GatewayLiveness()
        try:
            log.info(
                "serving",
                address=frontend.address,
                output_address=tokens.address,
                scheduler=config.scheduler_address,
                model=str(config.model),
                max_model_len=config.max_model_len,
            )
            if config.ready_address:
                with Push(config.ready_address) as ready:
                    await ready.send(Ready(service="tokenizer", name=config.name))
            await asyncio.gather(
                _serve_gateways(frontend, core, scheduler, gateways, new_instance(), liveness),
                _watch_gateways(core, scheduler, liveness),
                _serve_tokens(tokens, core, scheduler, gateways),
                _serve_scheduler(scheduler, core, gateways),
                ping_forever(scheduler, config.name, tokens.address),
            )
        finally:
            await gateways.close()


async def _serve_gateways(
    frontend: Router,
    core: TokenizerCore,
    scheduler: Dealer,
    gateways: GatewayReplies,
    instance: str,
    liveness: GatewayLiveness,
) -> None:
    while True:
        identity, msg = await frontend.recv()
        if isinstance(msg, Ping):
            if msg.address is not None:
                liveness.seen(msg.address, time.monotonic())
            try:
                await frontend.send(identity, Pong(service="tokenizer", instance=instance))
            except UnknownPeer:  # that gateway is gone already
                log.info("ping from a gateway that left", gateway=identity.decode(errors="replace"))
        elif isinstance(msg, GenerateRequest | EmbedRequest):
            result = core.admit(msg) if isinstance(msg, GenerateRequest) else core.admit_embedding(msg)
            if isinstance(result, ScheduleRequest):
                await scheduler.send(result)
            else:
                log.info("request refused", request_id=msg.request_id, status=result.status, error=result.message)
                gateways.send(msg.reply_to, result)
        elif isinstance(msg, TokenizeRequest):
            gateways.send(msg.reply_to, core.tokenize(msg))
        elif isinstance(msg, DetokenizeRequest):
            gateways.send(msg.reply_to, core.detokenize(msg))
        elif isinstance(msg, AbortRequest):
            # Forwarded after our ScheduleRequest on the same socket, so the scheduler cannot
            # see the abort before the request (the gateway's own abort may overtake it).
            if core.on_abort(msg.request_id):
                await scheduler.send(msg)
        else:
            log.warning("unexpected message from a gateway", type=type(msg).__name__)


async def _watch_gateways(core: TokenizerCore, scheduler: Dealer, liveness: GatewayLiveness) -> None:
    """Abort the requests of gateways whose pings stopped (gateway_liveness.py)."""
    while True:
        await asyncio.sleep(1.0)
        for address in liveness.gone(time.monotonic()):
            ids = core.drop_gateway(address)
            log.warning("gateway gone: its requests aborted", reply_to=address, aborted=len(ids))
            for request_id in ids:
                await scheduler.send(AbortRequest(request_id=request_id, reason="gateway gone"))


async def _serve_tokens(tokens: Pull, core: TokenizerCore, scheduler: Dealer, gateways: GatewayReplies) -> None:
    while True:
        msg = await tokens.recv()
        if isinstance(msg, EmbeddingBatch):
            for address, batch in core.on_embeddings(msg).items():
                gateways.send(address, batch)
            continue
        if not isinstance(msg, TokenDeltaBatch):
            log.warning("unexpected message on the token stream", type=type(msg).__name__)
            continue
        out = core.on_tokens(msg)
        for address, batch in out.batches.items():
            gateways.send(address, batch)
        for abort in out.aborts:
            await scheduler.send(abort)


async def _serve_scheduler(scheduler: Dealer, core: TokenizerCore, gateways: GatewayReplies) -> None:
    peer = PeerInstance()
    while True:
        msg = await scheduler.recv()
        if isinstance(msg, RequestFailed):
            reply_to = core.on_failed(msg)
            if reply_to is not None:
                gateways.send(reply_to, msg)
        elif isinstance(msg, MigrateRequest):
            moved = core.on_migrate(msg)
            if isinstance(moved, ScheduleRequest):
                log.warning("request migrating", request_id=msg.request_id, reason=msg.reason, lost=msg.lost_worker_ids)
                await scheduler.send(moved)
            elif moved is not None:
                gateways.send(*moved)
        elif isinstance(msg, Pong):
            if peer.restarted(msg.instance):
                await _scheduler_restarted(scheduler, core)
        else:
            log.warning("unexpected message from the scheduler", type=type(msg).__name__)


async def _scheduler_restarted(scheduler: Dealer, core: TokenizerCore) -> None:
    """Requests no worker has taken may have been queued in the scheduler process that is gone:
    send them to the new one, which ignores those it already has (sent after it started)."""
    again = core.unstarted()
    log.warning("scheduler restarted", sent_again=len(again))
    for schedule in again:
        await scheduler.send(schedule)


class GatewayReplies:
    """A Push socket, a bounded queue and a sender task per gateway reply address."""

    def __init__(self, queue_size: int = REPLY_QUEUE_SIZE):
        self._queue_size = queue_size
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def send(self, address: str, msg) -> None:
        queue = self._queues.get(address)
        if queue is None:
            try:
                push = Push(address)
            except (OSError, ValueError) as e:
                log.warning("cannot reach gateway", reply_to=address, error=str(e))
                return
            queue = self._queues[address] = asyncio.Queue(self._queue_size)
            self._tasks[address] = asyncio.create_task(_drain(push, queue))
        try:
            queue.put_nowait(msg)
        except asyncio.QueueFull:
            log.warning("gateway not reading; reply dropped", reply_to=address, type=type(msg).__name__)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


async def _drain(push: Push, queue: asyncio.Queue) -> None:
    with push:
        while True:
            await push.send(await queue.get())
