"""Gateway + the real tokenizer service over real sockets; a fake scheduler doubles as the worker
(it answers each ScheduleRequest with token batches). The official openai client is the client."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from aiohttp.test_utils import TestServer

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common.messages import (
    AbortRequest,
    ClusterStatus,
    Ready,
    RequestFailed,
    ScheduleRequest,
    StatusRequest,
    TokenDelta,
    TokenDeltaBatch,
)
from pagemesh.common.model_files import default_model_path
from pagemesh.gateway.app import Gateway
from pagemesh.gateway.config import GatewayConfig, parse_args
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.metrics import GatewayMetrics
from pagemesh.services.tokenizer.config import TokenizerConfig
from pagemesh.services.tokenizer.main import run as run_tokenizer
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TIMEOUT_S = HANG_S  # bounds a hang only; a loaded machine may take long to load the vocabulary
TOKENIZER = default_tokenizer()  # one load per session, shared
REPLY = TOKENIZER.encode(" Hello world, how are you?", add_special_tokens=False)


async def fake_scheduler(router: t.Router, aborts: asyncio.Queue) -> None:
    """Answers StatusRequest; 'places' each request by streaming REPLY (one token a step, capped at
    max_tokens, n choices) to its reply_to; refuses prompts containing 'busy' with a 503; queues
    the aborts it receives."""
    pushes: dict[str, t.Push] = {}
    while True:
        identity, msg = await router.recv()
        if isinstance(msg, AbortRequest):
            aborts.put_nowait(msg)
        elif isinstance(msg, StatusRequest):
            await router.send(identity, ClusterStatus(ready=True, workers=[], queued=0))
        elif isinstance(msg, ScheduleRequest):
            if TOKENIZER.encode("busy", add_special_tokens=False)[0] in msg.prompt_token_ids:
                await router.send(
                    identity,
                    RequestFailed(
                        request_id=msg.request_id,
                        status=503,
                        error_type="service_unavailable",
                        message="no capacity",
                        param=None,
                        code="no_capacity",
                    ),
                )
                continue
            push = pushes.setdefault(msg.reply_to, t.Push(msg.reply_to))
            steps = min(len(REPLY), msg.sampling.max_tokens)
            for step in range(steps):
                finish = "length" if step == steps - 1 else None
                await push.send(
                    TokenDeltaBatch(
                        worker_id="w0",
                        deltas=[
                            TokenDelta(
                                request_id=msg.request_id,
                                index=i,
                                token_ids=[REPLY[step]],
                                logprobs=None,
                                finish_reason=finish,
                                num_prompt_tokens=len(msg.prompt_token_ids),
                            )
                            for i in range(msg.sampling.n)
                        ],
                    )
                )


@contextlib.asynccontextmanager
async def mesh(tmp_path):
    a = lambda name: t.ipc_address(str(tmp_path), name)  # noqa: E731
    tok_cfg = TokenizerConfig(
        model=default_model_path(),
        address=a("tok"),
        output_address=a("tok-out"),
        scheduler_address=a("sched"),
        max_model_len=64,
        name="tok0",
        ready_address=a("ready"),
        log_level="INFO",
    )
    gw_cfg = GatewayConfig(
        host="127.0.0.1",
        port=0,
        tokenizer_address=a("tok"),
        scheduler_address=a("sched"),
        reply_address=a("gw"),
        model=default_model_path(),
        model_names=("smol",),
        max_body_bytes=1 << 20,
        request_timeout=10.0,
        name="gw0",
        ready_address=None,
        log_level="INFO",
    )
    aborts: asyncio.Queue = asyncio.Queue()
    with t.Router(a("sched")) as scheduler, t.Pull(a("ready")) as ready:
        tasks = [asyncio.create_task(fake_scheduler(scheduler, aborts)), asyncio.create_task(run_tokenizer(tok_cfg))]
        client_mesh = MeshClient(gw_cfg.tokenizer_address, gw_cfg.scheduler_address, gw_cfg.reply_address, "gw0")
        client_mesh.start()
        server = TestServer(Gateway(gw_cfg, client_mesh, TOKENIZER, GatewayMetrics()).app())
        await server.start_server()
        try:
            assert await ready.recv() == Ready(service="tokenizer", name="tok0")
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none", max_retries=0)
            yield client, aborts
            await client.close()
        finally:
            await server.close()
            await client_mesh.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_chat_and_completions_through_the_tokenizer_service(tmp_path):
    async def main():
        async with mesh(tmp_path) as (client, aborts):
            chat = await client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3
            )
            assert [c.message.content for c in chat.choices] == [" Hello world,"] * 2
            assert chat.usage.completion_tokens == 6
            assert chat.usage.prompt_tokens == len(TOKENIZER.encode_chat([{"role": "user", "content": "Hi"}]))

            # a stop string ends the stream early and the tokenizer aborts the request
            stream = await client.completions.create(
                model="smol", prompt="Hi", stop=[" how"], max_tokens=20, stream=True
            )
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].text for c in chunks) == " Hello world,"
            assert chunks[-1].choices[0].finish_reason == "stop"
            request_id = chunks[-1].id
            assert await aborts.get() == AbortRequest(request_id=request_id, reason="stop string")

            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="smol", prompt="Hi", max_tokens=64)
            assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
            assert "maximum context length is 64 tokens" in info.value.message

            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(model="smol", prompt="busy")
            assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_gateway_flags(monkeypatch):
    monkeypatch.setenv("PAGEMESH_REPLY_ADDRESS", "tcp://127.0.0.1:6003")
    cfg = parse_args(
        [
            "--tokenizer-address",
            "tcp://127.0.0.1:6001",
            "--scheduler-address",
            "tcp://127.0.0.1:6002",
            "--port",
            "9000",
            "--request-timeout",
            "30",
        ]
    )
    assert (cfg.host, cfg.port, cfg.reply_address, cfg.request_timeout, cfg.max_body_bytes) == (
        "127.0.0.1",
        9000,
        "tcp://127.0.0.1:6003",
        30.0,
        4 << 20,
    )
    assert cfg.model_names == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct",
        str(default_model_path()),
    )
    assert cfg.served_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg.max_model_len == 8192  # SmolLM2's context length, also the cap
