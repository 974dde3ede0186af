"""The tokenizer process's loop over real sockets: a fake gateway, scheduler and worker around it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common.messages import (
    AbortRequest,
    GenerateRequest,
    Ping,
    Pong,
    Ready,
    RequestFailed,
    ScheduleRequest,
    TextDeltaBatch,
    TokenDelta,
    TokenDeltaBatch,
)
from pagemesh.common.model_files import default_model_path
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.tokenizer.config import TokenizerConfig, parse_args
from pagemesh.services.tokenizer.main import run
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TIMEOUT_S = HANG_S  # bounds a hang only; a loaded machine may take long to load the vocabulary
TOKENIZER = default_tokenizer()  # one load per session, shared


def config(tmp_path, **overrides) -> TokenizerConfig:
    a = lambda name: t.ipc_address(str(tmp_path), name)  # noqa: E731
    values = dict(
        model=default_model_path(),
        address=a("tok"),
        output_address=a("tok-out"),
        scheduler_address=a("sched"),
        max_model_len=64,
        name="tok0",
        ready_address=a("ready"),
        log_level="INFO",
    )
    return TokenizerConfig(**{**values, **overrides})


def generate(request_id: str, reply_to: str, **sampling) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model="m",
        prompt_text="Hi",
        prompt_token_ids=None,
        messages=None,
        sampling=SamplingParams(**sampling),
        stream=True,
        reply_to=reply_to,
        arrival_time=1.0,
        include_stop_str_in_output=False,
    )


class FakeScheduler:
    """A scheduler Router that answers the tokenizer's pings with `instance`."""

    def __init__(self, router: t.Router):
        self.router = router
        self.instance = "first"

    async def recv(self):
        while True:
            identity, msg = await self.router.recv()
            if not isinstance(msg, Ping):
                return identity, msg
            await self.router.send(identity, Pong(service="scheduler", instance=self.instance))

    async def send(self, identity: bytes, msg) -> None:
        await self.router.send(identity, msg)


@contextlib.asynccontextmanager
async def mesh(cfg: TokenizerConfig, reply_address: str):
    """Fake scheduler (Router), gateway (Dealer + Pull) and launcher (Pull), then the service."""
    with (
        t.Router(cfg.scheduler_address) as scheduler,
        t.Pull(cfg.ready_address) as ready,
        t.Pull(reply_address) as replies,
        t.Dealer(cfg.address, "gw0") as gateway,
    ):
        service = asyncio.create_task(run(cfg))
        try:
            assert await asyncio.wait_for(ready.recv(), TIMEOUT_S) == Ready(service="tokenizer", name="tok0")
            yield FakeScheduler(scheduler), gateway, replies
        finally:
            service.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await service


def test_request_tokens_text_stop_abort_and_503_over_sockets(tmp_path):
    cfg = config(tmp_path)
    reply_address = t.ipc_address(str(tmp_path), "gw-replies")

    async def main():
        async with mesh(cfg, reply_address) as (scheduler, gateway, replies):
            # request -> ScheduleRequest with the service's output address as reply_to
            await gateway.send(generate("r1", reply_address, stop=("world",)))
            identity, scheduled = await scheduler.recv()
            assert identity == b"tok0"
            assert scheduled == ScheduleRequest(
                request_id="r1",
                prompt_token_ids=TOKENIZER.encode("Hi"),
                sampling=SamplingParams(stop=("world",)),
                reply_to=cfg.output_address,
                arrival_time=1.0,
            )
            # a worker streams tokens; the stop string ends the request and aborts it
            with t.Push(scheduled.reply_to) as worker:
                ids = TOKENIZER.encode(" Hello world", add_special_tokens=False)
                await worker.send(
                    TokenDeltaBatch(
                        worker_id="w0",
                        deltas=[
                            TokenDelta(
                                request_id="r1",
                                index=0,
                                token_ids=ids,
                                logprobs=None,
                                finish_reason=None,
                                num_prompt_tokens=2,
                            )
                        ],
                    )
                )
                batch = await replies.recv()
                assert isinstance(batch, TextDeltaBatch)
                assert [(d.text, d.finish_reason, d.completion_tokens) for d in batch.deltas] == [
                    (" Hello ", "stop", 2)
                ]
                assert await scheduler.recv() == (b"tok0", AbortRequest(request_id="r1", reason="stop string"))

            # the scheduler refuses a request: the gateway gets the failure
            await gateway.send(generate("r2", reply_address))
            identity, _ = await scheduler.recv()
            failed = RequestFailed(
                request_id="r2",
                status=503,
                error_type="service_unavailable",
                message="no capacity",
                param=None,
                code="no_capacity",
            )
            await scheduler.send(identity, failed)
            assert await replies.recv() == failed

            # too long for the context: refused without reaching the scheduler
            await gateway.send(generate("r3", reply_address, max_tokens=64))
            refused = await replies.recv()
            assert (refused.request_id, refused.code) == ("r3", "context_length_exceeded")

            # a gateway abort of a known request is forwarded (after its ScheduleRequest)
            await gateway.send(generate("r4", reply_address))
            await gateway.send(AbortRequest(request_id="r4", reason="client disconnected"))
            assert (await scheduler.recv())[1].request_id == "r4"
            assert await scheduler.recv() == (b"tok0", AbortRequest(request_id="r4", reason="client disconnected"))

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_pings_and_a_restarted_scheduler_over_sockets(tmp_path):
    cfg = config(tmp_path)
    reply_address = t.ipc_address(str(tmp_path), "gw-replies")

    async def main():
        async with mesh(cfg, reply_address) as (scheduler, gateway, replies):
            await gateway.send(Ping(sender="gw0"))  # a gateway's ping: the tokenizer's instance comes back
            pong = await gateway.recv()
            assert pong.service == "tokenizer" and len(pong.instance) == 32
            await gateway.send(Ping(sender="gw0"))
            assert await gateway.recv() == pong  # the same process

            for rid in ("streaming", "queued"):
                await gateway.send(generate(rid, reply_address))
                assert (await scheduler.recv())[1].request_id == rid
            with t.Push(cfg.output_address) as worker:
                await worker.send(
                    TokenDeltaBatch(
                        worker_id="w0",
                        deltas=[
                            TokenDelta(
                                request_id="streaming",
                                index=0,
                                token_ids=[28],
                                logprobs=None,
                                finish_reason=None,
                                num_prompt_tokens=2,
                            )
                        ],
                    )
                )
                assert isinstance(await replies.recv(), TextDeltaBatch)
            scheduler.instance = "second"  # pings now reach a new scheduler process
            identity, again = await scheduler.recv()  # what no worker took is sent to it again
            assert (identity, type(again), again.request_id) == (b"tok0", ScheduleRequest, "queued")
            with pytest.raises(asyncio.TimeoutError):  # and nothing is failed
                await asyncio.wait_for(replies.recv(), 0.3)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_ping_from_a_gateway_that_left_does_not_stop_the_tokenizer():
    from pagemesh.services.tokenizer.gateway_liveness import GatewayLiveness
    from pagemesh.services.tokenizer.main import _serve_gateways

    class Frontend:  # a Router whose first peer is gone by the time its Pong goes out
        def __init__(self):
            self.incoming = asyncio.Queue()
            for peer in (b"gone", b"gw0"):
                self.incoming.put_nowait((peer, Ping(sender=peer.decode())))
            self.sent = asyncio.Queue()

        async def recv(self):
            return await self.incoming.get()

        async def send(self, identity, msg):
            if identity == b"gone":
                raise t.UnknownPeer("no connected peer with identity b'gone'")
            self.sent.put_nowait((identity, msg))

    async def main():
        frontend = Frontend()
        serving = asyncio.create_task(_serve_gateways(frontend, None, None, None, "inst", GatewayLiveness()))
        assert await asyncio.wait_for(frontend.sent.get(), TIMEOUT_S) == (
            b"gw0",
            Pong(service="tokenizer", instance="inst"),
        )
        assert not serving.done()
        serving.cancel()

    asyncio.run(main())


def test_flags_and_env_build_the_config(monkeypatch):
    monkeypatch.setenv("PAGEMESH_SCHEDULER_ADDRESS", "tcp://127.0.0.1:5001")
    cfg = parse_args(
        ["--address", "tcp://127.0.0.1:5002", "--output-address", "tcp://127.0.0.1:5003", "--name", "tok7"]
    )
    assert (cfg.scheduler_address, cfg.address, cfg.output_address, cfg.name) == (
        "tcp://127.0.0.1:5001",
        "tcp://127.0.0.1:5002",
        "tcp://127.0.0.1:5003",
        "tok7",
    )
    assert cfg.model == default_model_path()
    assert cfg.max_model_len == 8192  # SmolLM2's context length is 8192, also the cap
    assert parse_args(["--address", "a", "--output-address", "b", "--max-model-len", "100"]).max_model_len == 100
