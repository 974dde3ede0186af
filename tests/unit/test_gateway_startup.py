"""A request that comes while the mesh starts waits (bounded) for it, then gets 503 with
Retry-After; once the mesh was ready it goes through (fake tokenizer and scheduler, real sockets)."""

from __future__ import annotations

import asyncio
import dataclasses

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common.messages import ClusterStatus, StatusRequest
from pagemesh.gateway import app as gateway_app
from pagemesh.tests.gateway_harness import FakeMesh, run

NOT_READY = ClusterStatus(ready=False, workers=[], queued=0)


async def answer_status(fake: FakeMesh, status: ClusterStatus) -> None:
    identity, msg = await fake.scheduler.recv()
    assert msg == StatusRequest(requester="gw0")
    await fake.scheduler.send(identity, status)


def test_before_the_mesh_is_ready_a_request_gets_503_with_retry_after(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_app, "STATUS_TIMEOUT_S", 0.2)

    async def test(fake: FakeMesh):
        # the tokenizer never answers a ping: nothing is known, the wait runs out
        response = await fake.client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.status == 503
        assert response.headers["Retry-After"] == str(gateway_app.RETRY_AFTER_S)
        error = (await response.json())["error"]
        assert error["code"] == "service_unavailable" and "starting" in error["message"]

    run(tmp_path, test, startup_wait=0.5)


def test_a_request_waits_for_the_mesh_to_become_ready_then_runs(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        reaching = asyncio.create_task(fake.next_request())  # answers the tokenizer's pings meanwhile
        await answer_status(fake, NOT_READY)  # asked once the tokenizer answered: not ready yet
        await answer_status(fake, NOT_READY)  # still waiting: it asks again
        assert not reaching.done()  # nothing went to the tokenizer while the mesh was not ready
        await answer_status(fake, dataclasses.replace(NOT_READY, ready=True))
        request = await reaching
        await fake.answer(request, "Hel", "lo")
        response = await post
        assert response.status == 200
        assert (await response.json())["choices"][0]["text"] == "Hello"
        # from now on the gateway does not ask before each request
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}))
        await fake.answer(await fake.next_request(), "!")
        assert (await post).status == 200

    run(tmp_path, test, startup_wait=HANG_S)
