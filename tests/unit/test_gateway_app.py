"""The gateway's HTTP app over real sockets, with a fake tokenizer and scheduler (real transport)
on the other side; the official openai client talks to it where shapes matter."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from bench.local_mesh import HANG_S
from common import transport as t
from common.messages import (
    AbortRequest,
    ClusterStatus,
    GenerateRequest,
    KVPoolLoad,
    Ping,
    Pong,
    RequestFailed,
    StatusRequest,
    TextDelta,
    TextDeltaBatch,
    TokenLogprob,
    WorkerStatus,
)
from common.model_files import default_model_path
from common.sampling import SamplingParams
from gateway import app as gateway_app
from gateway.config import GatewayConfig
from gateway.mesh import MeshClient
from gateway.metrics import GatewayMetrics
from tests.default_model import tokenizer as default_tokenizer

TIMEOUT_S = HANG_S  # bounds a hang only; a loaded machine may take long to load the vocabulary
TOKENIZER = default_tokenizer()  # one load per session, shared
MODEL = "smol"


class FakeMesh:
    """A tokenizer Router and a scheduler Router that tests drive by hand, plus the gateway's
    app on a test server."""

    def __init__(self, tokenizer: t.Router, scheduler: t.Router, client: TestClient):
        self.tokenizer, self.scheduler, self.client = tokenizer, scheduler, client
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
    with t.Router(config.tokenizer_address) as tokenizer, t.Router(config.scheduler_address) as scheduler:
        mesh = MeshClient(config.tokenizer_address, config.scheduler_address, config.reply_address, config.name)
        mesh.start()
        server = TestServer(gateway_app.Gateway(config, mesh, TOKENIZER, GatewayMetrics()).app())
        fake = None
        try:
            async with TestClient(server) as client:
                fake = FakeMesh(tokenizer, scheduler, client)
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


def test_completion_round_trip(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(
            fake.client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stop": "x", "seed": 3}
            )
        )
        request = await fake.next_request()
        assert request.request_id.startswith("cmpl-") and len(request.request_id) == 37
        assert (request.model, request.prompt_text, request.stream) == (MODEL, "Hi", False)
        assert request.sampling == SamplingParams(max_tokens=5, stop=("x",), seed=3)
        await fake.answer(request, "Hello", " world")
        response = await post
        assert response.status == 200
        body = await response.json()
        assert body["id"] == request.request_id and isinstance(body["created"], int)
        del body["id"], body["created"]
        assert body == {
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        }

    run(tmp_path, test)


def test_a_batch_of_prompts_runs_as_one_request_per_prompt_with_choices_numbered_across_it(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(
            fake.client.post("/v1/completions", json={"prompt": ["Hi", [5, 6]], "n": 2, "max_tokens": 3})
        )
        first, second = await fake.next_request(), await fake.next_request()
        base = first.request_id[:-2]
        assert (first.request_id, second.request_id) == (base + "-0", base + "-1")
        assert (first.prompt_text, second.prompt_token_ids) == ("Hi", [5, 6])
        await fake.answer(second, "B", "b")  # the second prompt's answers come first
        await fake.answer(first, "A")
        body = await (await post).json()
        assert body["id"] == base
        assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "A"), (1, "A"), (2, "Bb"), (3, "Bb")]
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14}  # 4 per prompt

        stream = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": ["x", "y"], "stream": True}))
        first, second = await fake.next_request(), await fake.next_request()
        await fake.answer(second, "Y")
        await fake.answer(first, "X")
        events = sse_payloads(await (await stream).text())
        assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-1]] == [(1, "Y"), (0, "X")]

    run(tmp_path, test)


def test_echo_puts_the_prompt_in_front_of_each_choice_with_its_logprobs(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(
            fake.client.post(
                "/v1/completions", json={"prompt": [[9906, 1917]], "echo": True, "logprobs": 0, "max_tokens": 1, "n": 2}
            )
        )
        request = await fake.next_request()
        assert request.sampling.prompt_logprobs == 0
        prompt_lp = [TokenLogprob(token_id=1917, logprob=-2.5, top_ids=[], top_logprobs=[])]
        sampled = [TokenLogprob(token_id=30, logprob=-0.5, top_ids=[], top_logprobs=[])]
        await fake.reply(
            request,
            TextDeltaBatch(
                deltas=[
                    TextDelta(
                        request_id=request.request_id,
                        index=0,
                        text="?",
                        token_ids=[30],
                        logprobs=sampled,
                        finish_reason="length",
                        prompt_tokens=2,
                        completion_tokens=1,
                        queue_time_s=None,
                        prompt_token_ids=[9906, 1917],
                        prompt_logprobs=prompt_lp,
                    ),
                    TextDelta(
                        request_id=request.request_id,
                        index=1,
                        text="?",
                        token_ids=[30],
                        logprobs=sampled,
                        finish_reason="length",
                        prompt_tokens=2,
                        completion_tokens=1,
                    ),
                ]
            ),
        )
        body = await (await post).json()
        prompt_text = TOKENIZER.decode([9906, 1917])
        for choice in body["choices"]:
            assert choice["text"] == prompt_text + "?"
            tokens = [TOKENIZER.token_text(i) for i in (9906, 1917, 30)]
            assert choice["logprobs"]["tokens"] == tokens
            assert choice["logprobs"]["token_logprobs"] == [None, -2.5, -0.5]
            assert choice["logprobs"]["top_logprobs"][0] is None
            assert choice["logprobs"]["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
        assert body["usage"]["prompt_tokens"] == 2

        bad = await fake.client.post("/v1/completions", json={"prompt": [1, 2, 10**7], "echo": True})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "prompt"

        post = asyncio.create_task(
            fake.client.post("/v1/completions", json={"prompt": "Say", "echo": True, "stream": True})
        )
        request = await fake.next_request()
        assert request.sampling.prompt_logprobs is None
        await fake.answer(request, " hi", " there")
        events = sse_payloads(await (await post).text())
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["Say hi", " there"]

    run(tmp_path, test)


def test_json_schemas_the_engine_cannot_enforce_are_400s_before_the_mesh(tmp_path):
    def schema(**props):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": props}}}

    async def test(fake: FakeMesh):
        for response_format, why in [
            (schema(pet={"enum": ["cat", "🦜"]}), "cannot be written token by token"),  # only byte tokens
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, "root"),
            (schema(a={"type": "string", "minLength": 2}), "minLength"),
        ]:
            r = await fake.client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "response_format": response_format},
            )
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "response_format" and why in body["error"]["message"]
        post = asyncio.create_task(
            fake.client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "response_format": schema(pet={"enum": ["cat", "é"]}),
                },
            )
        )
        request = await fake.next_request()  # a schema it can write reaches the mesh
        assert request.sampling.json_schema == '{"type":"object","properties":{"pet":{"enum":["cat","é"]}}}'
        await fake.answer(request, '{"pet": "cat"}', finish="stop")
        assert (await post).status == 200

    run(tmp_path, test)


def test_one_failed_prompt_of_a_batch_fails_the_request_and_aborts_the_others(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": ["a", "b", "c"]}))
        requests = [await fake.next_request() for _ in range(3)]
        await fake.answer(requests[0], "A")  # finished: nothing left to abort there
        await fake.reply(
            requests[1],
            RequestFailed(
                request_id=requests[1].request_id,
                status=400,
                error_type="invalid_request_error",
                message="prompt too long",
                param="prompt",
                code="context_length_exceeded",
            ),
        )
        response = await post
        assert response.status == 400 and (await response.json())["error"]["message"] == "prompt too long"
        assert await fake.scheduler.recv() == (
            b"gw0",
            AbortRequest(request_id=requests[2].request_id, reason="another prompt of the batch failed"),
        )
        with contextlib.suppress(asyncio.TimeoutError):  # the others had ended
            extra = await asyncio.wait_for(fake.scheduler.recv(), 0.3)
            raise AssertionError(f"also aborted: {extra}")

    run(tmp_path, test)


def test_streaming_chat_with_usage(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(
            fake.client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        )
        request = await fake.next_request()
        assert request.messages == [{"role": "user", "content": "Hi"}]
        await fake.answer(request, "Hel", "lo", finish="stop")
        response = await post
        assert (response.status, response.headers["Content-Type"]) == (200, "text/event-stream")
        events = sse_payloads(await response.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert {c["id"] for c in chunks} == {"chat" + request.request_id}
        assert [(c["choices"], c["usage"]) for c in chunks] == [
            (
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                None,
            ),
            ([{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}], None),
            ([{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "stop"}], None),
            ([], {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}),
        ]

    run(tmp_path, test)


@pytest.mark.parametrize("stream", [False, True])
def test_mesh_errors_before_output_keep_their_status(tmp_path, stream):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": stream}))
        request = await fake.next_request()
        await fake.reply(
            request,
            RequestFailed(
                request_id=request.request_id,
                status=503,
                error_type="service_unavailable",
                message="no capacity: queue full",
                param=None,
                code="no_capacity",
            ),
        )
        response = await post
        assert (response.status, response.headers["Retry-After"]) == (503, "1")
        assert await response.json() == {
            "error": {
                "message": "no capacity: queue full",
                "type": "service_unavailable",
                "param": None,
                "code": "no_capacity",
            }
        }

    run(tmp_path, test)


def test_failure_mid_stream_is_an_error_event_then_done(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        request = await fake.next_request()
        await fake.reply(
            request,
            TextDeltaBatch(
                deltas=[
                    TextDelta(
                        request_id=request.request_id,
                        index=0,
                        text="A",
                        token_ids=[5],
                        logprobs=None,
                        finish_reason=None,
                        prompt_tokens=4,
                        completion_tokens=1,
                    )
                ]
            ),
        )
        await fake.reply(
            request,
            RequestFailed(
                request_id=request.request_id,
                status=500,
                error_type="server_error",
                message="worker died",
                param=None,
                code=None,
            ),
        )
        response = await post
        events = sse_payloads(await response.text())
        assert events[0]["choices"][0]["text"] == "A"
        assert events[1:] == [
            {"error": {"message": "worker died", "type": "server_error", "param": None, "code": None}},
            "[DONE]",
        ]

    run(tmp_path, test)


def test_client_disconnect_aborts_at_scheduler_and_tokenizer(tmp_path):
    async def test(fake: FakeMesh):
        async with aiohttp.ClientSession() as session:
            pending = asyncio.create_task(
                session.post(
                    fake.client.make_url("/v1/completions"), json={"prompt": "Hi", "stream": True, "max_tokens": 100}
                )
            )
            request = await fake.next_request()  # headers come with the first delta
            await fake.reply(
                request,
                TextDeltaBatch(
                    deltas=[
                        TextDelta(
                            request_id=request.request_id,
                            index=0,
                            text="A",
                            token_ids=[5],
                            logprobs=None,
                            finish_reason=None,
                            prompt_tokens=4,
                            completion_tokens=1,
                        )
                    ]
                ),
            )
            response = await pending
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
            response.close()  # the client goes away mid-stream
        abort = AbortRequest(request_id=request.request_id, reason="client disconnected")
        assert await fake.scheduler.recv() == (b"gw0", abort)
        assert await fake.from_tokenizer() == (b"gw0", abort)

    run(tmp_path, test)


def test_a_restarted_tokenizer_ends_the_requests_in_flight_with_503_and_aborts_them(tmp_path):
    async def test(fake: FakeMesh):
        streaming = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        waiting = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Ho"}))
        first, second = await fake.next_request(), await fake.next_request()
        if first.prompt_text != "Hi":
            first, second = second, first
        await fake.reply(
            first,
            TextDeltaBatch(
                deltas=[
                    TextDelta(
                        request_id=first.request_id,
                        index=0,
                        text="A",
                        token_ids=[5],
                        logprobs=None,
                        finish_reason=None,
                        prompt_tokens=4,
                        completion_tokens=1,
                    )
                ]
            ),
        )
        fake.tokenizer_instance = "second"  # the next pong comes from a new process
        pending = asyncio.create_task(fake.from_tokenizer())  # answers pings until the aborts come
        waited = await waiting
        assert waited.status == 503
        assert (await waited.json())["error"]["code"] == "service_restarted"
        events = sse_payloads(await (await streaming).text())
        assert events[0]["choices"][0]["text"] == "A"
        assert events[1]["error"]["code"] == "service_restarted" and events[2] == "[DONE]"
        aborts = {await pending, await fake.from_tokenizer()}
        assert aborts == {
            (b"gw0", AbortRequest(request_id=r.request_id, reason="tokenizer restarted")) for r in (first, second)
        }
        at_scheduler = {await fake.scheduler.recv(), await fake.scheduler.recv()}
        assert at_scheduler == aborts

    run(tmp_path, test, request_timeout=8.0)


def test_no_request_goes_out_before_the_tokenizer_answered_a_ping(tmp_path, monkeypatch):
    from gateway import mesh as gateway_mesh

    monkeypatch.setattr(gateway_mesh, "TOKENIZER_WAIT_S", 0.3)

    async def test(fake: FakeMesh):  # the fake tokenizer reads nothing: no Pong comes
        r = await fake.client.post("/v1/completions", json={"prompt": "Hi"})
        assert r.status == 503 and (await r.json())["error"]["code"] == "service_unavailable"
        with pytest.raises(asyncio.TimeoutError):  # only pings reached it, no GenerateRequest
            await asyncio.wait_for(fake.from_tokenizer(), 0.5)
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi"}))
        request = await fake.next_request()  # answering the pings lets it through
        await fake.answer(request, "A")
        assert (await post).status == 200

    run(tmp_path, test)


def test_client_leaving_before_any_output_aborts(tmp_path):
    async def test(fake: FakeMesh):
        async with aiohttp.ClientSession() as session:
            pending = asyncio.create_task(session.post(fake.client.make_url("/v1/completions"), json={"prompt": "Hi"}))
            request = await fake.next_request()
            pending.cancel()  # the client closes the connection while the request is queued
        assert await fake.scheduler.recv() == (
            b"gw0",
            AbortRequest(request_id=request.request_id, reason="client disconnected"),
        )

    run(tmp_path, test)


def test_timeout_is_504_and_aborts(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi"}))
        request = await fake.next_request()
        response = await post
        assert response.status == 504
        assert (await response.json())["error"]["code"] == "timeout"
        assert await fake.scheduler.recv() == (b"gw0", AbortRequest(request_id=request.request_id, reason="timeout"))

    run(tmp_path, test, request_timeout=0.3)


def test_logprobs_token_texts_come_from_the_tokenizer(tmp_path):
    hello = TOKENIZER.encode("Hello", add_special_tokens=False)[0]

    async def test(fake: FakeMesh):
        post = asyncio.create_task(
            fake.client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1},
            )
        )
        request = await fake.next_request()
        assert request.sampling.logprobs == 1
        await fake.reply(
            request,
            TextDeltaBatch(
                deltas=[
                    TextDelta(
                        request_id=request.request_id,
                        index=0,
                        text="Hello",
                        token_ids=[hello],
                        logprobs=[TokenLogprob(token_id=hello, logprob=-0.5, top_ids=[hello], top_logprobs=[-0.5])],
                        finish_reason="length",
                        prompt_tokens=4,
                        completion_tokens=1,
                    )
                ]
            ),
        )
        body = await (await post).json()
        entry = {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}
        assert body["choices"][0]["logprobs"] == {"content": [{**entry, "top_logprobs": [entry]}]}

    run(tmp_path, test)


# ---- errors the gateway answers itself


@pytest.mark.parametrize(
    "method, path, body, status, error_type, param, code",
    [
        ("POST", "/v1/completions", b"{nope", 400, "invalid_request_error", None, None),
        (
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "x", "n": 0}).encode(),
            400,
            "invalid_request_error",
            "n",
            None,
        ),
        (
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "x", "model": "gpt-4"}).encode(),
            404,
            "invalid_request_error",
            "model",
            "model_not_found",
        ),
        (
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "x" * 5000}).encode(),
            413,
            "invalid_request_error",
            None,
            "request_too_large",
        ),
        ("POST", "/v1/nothing", b"{}", 404, "not_found_error", None, "not_found"),
        ("GET", "/v1/completions", b"", 405, "invalid_request_error", None, "method_not_allowed"),
    ],
)
def test_gateway_errors_are_openai_shaped(tmp_path, method, path, body, status, error_type, param, code):
    async def test(fake: FakeMesh):
        response = await fake.client.request(method, path, data=body)
        assert response.status == status
        error = (await response.json())["error"]
        assert (error["type"], error["param"], error["code"]) == (error_type, param, code)
        assert isinstance(error["message"], str) and "Traceback" not in error["message"]

    run(tmp_path, test)


def test_chunked_body_over_the_limit_is_413(tmp_path):
    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    async def test(fake: FakeMesh):
        response = await fake.client.post("/v1/completions", data=chunks())
        assert response.status == 413

    run(tmp_path, test)


# ---- other endpoints


def test_models_and_health(tmp_path):
    async def test(fake: FakeMesh):
        response = await fake.client.get("/v1/models")
        body = await response.json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
        assert (await fake.client.get(f"/v1/models/{MODEL}")).status == 200
        assert (await fake.client.get("/v1/models/other")).status == 404
        assert (await fake.client.get("/health")).status == 200

    run(tmp_path, test)


STATUS = ClusterStatus(
    ready=True,
    workers=[
        WorkerStatus(
            worker_id="w0",
            kind="llm",
            role="mixed",
            alive=True,
            running=2,
            waiting=1,
            requests_finished=0,
            kv=KVPoolLoad(free_pages=0, used_pages=30, total_pages=120, bytes_sent=0, bytes_received=0),
        )
    ],
    queued=0,
)


async def answer_status(fake: FakeMesh, status: ClusterStatus) -> None:
    identity, msg = await fake.scheduler.recv()
    assert (identity, msg) == (b"gw0", StatusRequest(requester="gw0"))
    await fake.scheduler.send(identity, status)


def test_ready_and_metrics_ask_the_scheduler(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_app, "STATUS_TIMEOUT_S", 0.2)

    async def test(fake: FakeMesh):
        assert (await fake.client.get("/ready")).status == 503  # nobody answers
        answering = asyncio.create_task(answer_status(fake, STATUS))
        response = await fake.client.get("/ready")  # the scheduler is ready; the tokenizer has not answered
        assert response.status == 503 and "tokenizer" in (await response.json())["error"]["message"]
        await answering
        pinging = asyncio.create_task(fake.from_tokenizer())  # answers the pings from now on
        answering = asyncio.create_task(answer_status(fake, STATUS))
        for _ in range(int(HANG_S / 0.1)):  # until the first pong has come (a ceiling, not a limit)
            response = await fake.client.get("/ready")
            if response.status == 200:
                break
            await asyncio.sleep(0.1)
            answering = asyncio.create_task(answer_status(fake, STATUS))
        assert response.status == 200
        await answering
        pinging.cancel()
        answering = asyncio.create_task(answer_status(fake, ClusterStatus(ready=False, workers=[], queued=0)))
        response = await fake.client.get("/ready")
        assert response.status == 503 and (await response.json())["error"]["code"] == "not_ready"
        await answering

        answering = asyncio.create_task(answer_status(fake, STATUS))
        response = await fake.client.get("/metrics")
        await answering
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await response.text()
        assert 'pagemesh_num_requests_running{worker="w0"} 2\n' in text
        assert 'pagemesh_kv_cache_usage_ratio{worker="w0"} 0.25\n' in text

    run(tmp_path, test)


# ---- the official client


async def auto_answer(fake: FakeMesh) -> None:
    while True:
        request = await fake.next_request()
        await fake.answer(request, "Hello", " there", finish="stop")


def test_official_openai_client(tmp_path):
    async def test(fake: FakeMesh):
        responder = asyncio.create_task(auto_answer(fake))
        client = openai.AsyncOpenAI(base_url=str(fake.client.make_url("/v1")), api_key="none", max_retries=0)
        try:
            completion = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
            assert completion.choices[0].text == "Hello there" and completion.usage.total_tokens == 6
            chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
            assert [c.message.content for c in chat.choices] == ["Hello there"] * 2
            assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 4
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces, usage = [], None
            async for chunk in stream:
                pieces += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            assert "".join(pieces) == "Hello there" and usage.prompt_tokens == 4
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="gpt-4", prompt="Hi")
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
            assert info.value.body["param"] == "temperature"
        finally:
            responder.cancel()
            await client.close()

    run(tmp_path, test)
