"""The gateway's drain (SIGTERM) over real sockets, with a fake tokenizer and scheduler
(tests/gateway_harness.py): it stops admitting at once, lets what is in flight finish, and ends
what outlasts --drain-timeout with an error event, aborting it in the mesh."""

from __future__ import annotations

import asyncio

from pagemesh.common.messages import AbortRequest, TextDelta, TextDeltaBatch
from pagemesh.tests.gateway_harness import FakeMesh, run, sse_payloads


def first_token(request) -> TextDeltaBatch:
    return TextDeltaBatch(
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
    )


async def refused_while_draining(fake: FakeMesh) -> None:
    for response in (
        await fake.client.get("/ready"),
        await fake.client.post("/v1/completions", json={"prompt": "Hi"}),
    ):
        assert (response.status, response.headers["Retry-After"]) == (503, "5")
        assert (await response.json())["error"]["code"] == "shutting_down"


def test_a_drain_refuses_new_requests_and_waits_for_those_in_flight(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        request = await fake.next_request()
        await fake.reply(request, first_token(request))
        draining = asyncio.create_task(fake.drain.drain())
        await refused_while_draining(fake)
        assert not draining.done()  # one request in flight
        await fake.answer(request, "A", "B")  # ... which finishes
        events = sse_payloads(await (await post).text())
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "AAB" and events[-1] == "[DONE]"
        await draining  # nothing in flight: the process may stop

    run(tmp_path, test, drain_timeout=60.0)


def test_what_outlasts_the_drain_timeout_ends_with_an_error_event_and_is_aborted(tmp_path):
    async def test(fake: FakeMesh):
        post = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
        request = await fake.next_request()
        await fake.reply(request, first_token(request))
        response = await post
        await fake.drain.drain()  # 0.2 s: the request is still going
        events = sse_payloads(await response.text())
        assert events[0]["choices"][0]["text"] == "A"
        assert events[1]["error"]["code"] == "shutting_down" and events[2] == "[DONE]"
        abort = AbortRequest(request_id=request.request_id, reason="gateway drained")
        assert await fake.scheduler.recv() == (b"gw0", abort)
        assert await fake.from_tokenizer() == (b"gw0", abort)

    run(tmp_path, test, drain_timeout=0.2)
