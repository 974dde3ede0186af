"""The gateway's HTTP app over real sockets, with a fake tokenizer and scheduler (real transport) on
the other side: what the gateway tests share."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common.messages import (
    GenerateRequest,
    Ping,
    Pong,
    TextDelta,
    TextDeltaBatch,
)
from pagemesh.common.model_files import default_model_path
from pagemesh.gateway import app as gateway_app
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.drain import GatewayDrain
from pagemesh.gateway.http_server import GatewayRunner
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.metrics import GatewayMetrics
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TIMEOUT_S = HANG_S  # bounds a hang only; a loaded machine may take long to load the vocabulary
TOKENIZER = default_tokenizer()  # one load per session, shared
MODEL = "smol"


class GatewayTestServer(TestServer):
    """aiohttp's TestServer on the gateway's own runner (its header limits and error pages)."""

    def __init__(self, app, max_header_bytes: int, **kwargs):
        super().__init__(app, **kwargs)
        self.max_header_bytes = max_header_bytes

    async def _make_runner(self, **kwargs):
        return GatewayRunner(self.app, max_header_bytes=self.max_header_bytes, **kwargs)


class FakeMesh:
    """A tokenizer Router (one per replica in `tokenizers`: `tokenizer` is the first) and a
    scheduler Router that tests drive by hand, plus the gateway's app on a test server."""

    def __init__(self, tokenizers: list[t.Router], scheduler: t.Router, client: TestClient, drain: GatewayDrain):
        self.tokenizers, self.scheduler, self.client = tokenizers, scheduler, client
        self.tokenizer = tokenizers[0]
        self.drain = drain  # what the gateway process's SIGTERM would run: `await fake.drain.drain()`
        self.tokenizer_instance = "first"  # what the fake tokenizer answers pings with
        self._pushes: dict[str, t.Push] = {}

    async def from_tokenizer(self) -> tuple[bytes, object]:
        """The next message the gateway sends the tokenizer, pings answered on the way."""
        while True:
            identity, msg = await self.tokenizer.recv()
            if not isinstance(msg, Ping):
                return identity, msg
            await self.tokenizer.send(identity, Pong(service="tokenizer", instance=self.tokenizer_instance))

    async def next_request(self) -> GenerateRequest:
        _, msg = await self.from_tokenizer()
        assert isinstance(msg, GenerateRequest)
        return msg

    async def reply(self, request: GenerateRequest, msg) -> None:
        if request.reply_to not in self._pushes:
            self._pushes[request.reply_to] = t.Push(request.reply_to)
        await self._pushes[request.reply_to].send(msg)

    async def answer(self, request: GenerateRequest, *texts: str, finish: str = "length") -> None:
        """Reply with one TextDelta per text (one token each) and finish on the last."""
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            for index in range(request.sampling.n):
                await self.reply(
                    request,
                    TextDeltaBatch(
                        deltas=[
                            TextDelta(
                                request_id=request.request_id,
                                index=index,
                                text=text,
                                token_ids=[i + 10],
                                logprobs=None,
                                finish_reason=finish if last else None,
                                prompt_tokens=4,
                                completion_tokens=i + 1,
                            )
                        ]
                    ),
                )

    def close(self) -> None:
        for push in self._pushes.values():
            push.close()


@contextlib.asynccontextmanager
async def running_gateway(tmp_path: Path, **overrides):
    a = lambda name: t.ipc_address(str(tmp_path), name)  # noqa: E731
    values = dict(
        host="127.0.0.1",
        port=0,
        tokenizer_address=a("tok"),
        scheduler_address=a("sched"),
        reply_address=a("gw-replies"),
        model=default_model_path(),
        model_names=(MODEL, str(default_model_path())),
        max_body_bytes=4096,
        request_timeout=5.0,
        name="gw0",
        ready_address=None,
        log_level="INFO",
    )
    config = GatewayConfig(**{**values, **overrides})
    with contextlib.ExitStack() as sockets:
        tokenizers = [sockets.enter_context(t.Router(address)) for address in config.tokenizer_addresses]
        scheduler = sockets.enter_context(t.Router(config.scheduler_address))
        mesh = MeshClient(config.tokenizer_addresses, config.scheduler_address, config.reply_address, config.name)
        mesh.start()
        drain = GatewayDrain(config.drain_timeout)
        drain.mesh = mesh
        app = gateway_app.Gateway(config, mesh, TOKENIZER, GatewayMetrics(), drain).app()
        server = GatewayTestServer(app, config.max_header_bytes)
        fake = None
        try:
            async with TestClient(server) as client:
                fake = FakeMesh(tokenizers, scheduler, client, drain)
                yield fake
        finally:
            if fake is not None:
                fake.close()
            await mesh.close()


def run(tmp_path, test, **overrides):
    async def main():
        async with running_gateway(tmp_path, **overrides) as fake:
            await test(fake)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def sse_payloads(body: str) -> list:
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


# ---- generation
