"""The gateway's request lifecycle over real sockets, with a fake tokenizer and scheduler on the
other side (tests/gateway_harness.py): failures, aborts on disconnect and timeout, readiness and
metrics from the scheduler (a lost tokenizer: tests/unit/test_gateway_tokenizer_replicas.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common.messages import (
    AbortRequest,
    ClusterStatus,
    KVPoolLoad,
    RequestFailed,
    StatusRequest,
    TextDelta,
    TextDeltaBatch,
    WorkerStatus,
)
from pagemesh.gateway import app as gateway_app
from pagemesh.tests.gateway_harness import FakeMesh, run, sse_payloads


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


def test_no_request_goes_out_before_the_tokenizer_answered_a_ping(tmp_path, monkeypatch):
    from pagemesh.gateway import mesh as gateway_mesh

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
        assert 'pagemesh_num_requests_running{worker="w0"} 2.0\n' in text
        assert 'pagemesh_kv_cache_usage_ratio{worker="w0"} 0.25\n' in text

    run(tmp_path, test)
