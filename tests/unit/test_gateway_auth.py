"""The gateway's doors over real sockets (tests/gateway_harness.py): API keys and per-key limits as
the official openai client sees them, body and header limits at the HTTP level, request fields
with limits, chat roles, and the self-describing routes."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from pagemesh.gateway.openapi import VERSION
from pagemesh.tests.gateway_harness import MODEL, FakeMesh, run

KEYS = ("key-alpha", "key-beta")


def client_for(fake: FakeMesh, key: str) -> openai.AsyncOpenAI:
    # max_retries=0: the client retries 401s never but 429s by default; a test wants the first answer
    return openai.AsyncOpenAI(base_url=str(fake.client.make_url("/v1")), api_key=key, max_retries=0)


async def answer_all(fake: FakeMesh, n_texts: int = 2) -> None:
    while True:
        request = await fake.next_request()
        await fake.answer(request, *["tok"] * n_texts, finish="stop")


def error_of(body: dict) -> tuple:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error["type"], error["param"], error["code"]


# ---- API keys


def test_keys_guard_v1_and_leave_probes_open(tmp_path):
    async def test(fake: FakeMesh):
        responder = asyncio.create_task(answer_all(fake))
        good, wrong = client_for(fake, "key-beta"), client_for(fake, "key-gamma")
        try:
            completion = await good.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert completion.choices[0].text == "toktok"
            with pytest.raises(openai.AuthenticationError) as info:
                await wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            assert info.value.type == "invalid_request_error"
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
            assert [m.id for m in (await good.models.list()).data] == [MODEL]
        finally:
            responder.cancel()
            await good.close()
            await wrong.close()
        # no Authorization header at all, on every keyed route (an unknown /v1 path too: 401 first)
        for method, path in [
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/images/generations"),
            ("GET", "/v1/models"),
            ("GET", f"/v1/models/{MODEL}"),
            ("GET", "/v1/nothing"),
        ]:
            response = await fake.client.request(method, path, json={"prompt": "x"})
            assert response.status == 401, path
            assert error_of(await response.json()) == ("invalid_request_error", None, "invalid_api_key")
            assert response.headers["WWW-Authenticate"] == "Bearer"
        for path in ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/"):  # "/": the status page
            assert (await fake.client.get(path)).status == 200, path
        assert (await fake.client.get("/ready")).status != 401  # 503 here: the fake scheduler is silent

    run(tmp_path, test, api_keys=KEYS)


def test_metrics_can_require_a_key(tmp_path):
    async def test(fake: FakeMesh):
        for path in ("/metrics", "/", "/status"):  # the operational paths close together
            assert (await fake.client.get(path)).status == 401, path
        response = await fake.client.get("/metrics", headers={"Authorization": "Bearer key-alpha"})
        assert response.status == 200
        assert (await fake.client.get("/health")).status == 200

    run(tmp_path, test, api_keys=KEYS, metrics_require_key=True)


# ---- per-key limits


def test_concurrent_requests_over_the_key_limit_are_429_with_retry_after(tmp_path):
    async def test(fake: FakeMesh):
        alpha, beta = client_for(fake, "key-alpha"), client_for(fake, "key-beta")
        try:
            held = asyncio.create_task(alpha.completions.create(model=MODEL, prompt="Hi", max_tokens=2))
            request = await fake.next_request()  # the first is in the mesh, unanswered
            with pytest.raises(openai.RateLimitError) as info:
                await alpha.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert info.value.status_code == 429 and info.value.response.headers["Retry-After"] == "1"
            assert (info.value.type, info.value.code) == ("rate_limit_error", "rate_limit_exceeded")
            assert "1 requests in flight" in info.value.message
            other = asyncio.create_task(beta.completions.create(model=MODEL, prompt="Hi", max_tokens=2))
            await fake.answer(await fake.next_request(), "b", finish="stop")  # another key is not held back
            assert (await other).choices[0].text == "b"
            await fake.answer(request, "a", finish="stop")
            assert (await held).choices[0].text == "a"
            responder = asyncio.create_task(answer_all(fake))
            try:  # the slot is free again
                assert (await alpha.completions.create(model=MODEL, prompt="Hi", max_tokens=2)).choices
            finally:
                responder.cancel()
        finally:
            await alpha.close()
            await beta.close()

    run(tmp_path, test, api_keys=KEYS, max_concurrent_requests_per_key=1)


def test_tokens_per_minute_over_the_key_limit_are_429_with_retry_after(tmp_path):
    async def test(fake: FakeMesh):
        responder = asyncio.create_task(answer_all(fake))
        alpha, beta = client_for(fake, "key-alpha"), client_for(fake, "key-beta")
        try:
            # 6 tokens a minute; the fake reports 4 prompt tokens + 2 per choice: 5 choices use 14
            completion = await alpha.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=5)
            assert completion.usage.total_tokens == 14
            with pytest.raises(openai.RateLimitError) as info:  # 8 in debt at 0.1 token/s
                await alpha.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            retry_after = int(info.value.response.headers["Retry-After"])
            assert 1 <= retry_after <= 90 and "6 tokens per minute" in info.value.message
            assert info.value.body["type"] == "rate_limit_error"
            assert (await beta.completions.create(model=MODEL, prompt="Hi", max_tokens=2)).choices
        finally:
            responder.cancel()
            await alpha.close()
            await beta.close()

    run(tmp_path, test, api_keys=KEYS, max_tokens_per_minute_per_key=6)


def test_limits_without_keys_hold_all_requests_as_one(tmp_path):
    async def test(fake: FakeMesh):
        held = asyncio.create_task(fake.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        request = await fake.next_request()
        response = await fake.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        assert error_of(await response.json()) == ("rate_limit_error", None, "rate_limit_exceeded")
        await fake.answer(request, "a", finish="stop")
        assert (await held).status == 200

    run(tmp_path, test, max_concurrent_requests_per_key=1)


# ---- body and header limits at the HTTP level


def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(tmp_path):
    async def test(fake: FakeMesh):
        # a raw client that declares 1 GB and sends 10 bytes: the answer comes without the rest
        reader, writer = await asyncio.open_connection(fake.client.host, fake.client.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000000000\r\n\r\n{"prompt":'
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        assert error_of(body) == ("invalid_request_error", None, "request_too_large")
        assert "4096 bytes" in body["error"]["message"]
        writer.close()

    run(tmp_path, test)


def test_header_limits_are_431_in_the_openai_shape(tmp_path):
    async def test(fake: FakeMesh):
        cases = [
            ("GET", "/v1/models", {"X-Big": "a" * 3000}),  # one header line over 2048 bytes
            ("GET", "/v1/models?q=" + "a" * 3000, {}),  # the request line
            ("GET", "/v1/models", {f"X-H{i}": "1" for i in range(200)}),  # too many headers
        ]
        for method, path, headers in cases:
            response = await fake.client.request(method, path, headers=headers)
            assert response.status == 431, path[:20]
            assert response.content_type == "application/json"
            assert error_of(await response.json()) == ("invalid_request_error", None, "request_header_fields_too_large")
        response = await fake.client.get("/health", headers={"X-Fine": "a" * 1500})
        assert response.status == 200

    run(tmp_path, test, max_header_bytes=2048)


# ---- fields with limits, and chat roles


@pytest.mark.parametrize(
    "body, param, limit",
    [
        ({"prompt": "x", "n": 17}, "n", "16"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop", "16"),
        ({"prompt": "x", "stop": "s" * 257}, "stop", "256"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
        ({"prompt": "x", "stop_token_ids": list(range(17))}, "stop_token_ids", "16"),
        # subnormal: a worker's torch reads it as 0 and would drop the request the gateway let through
        ({"prompt": "x", "top_p": 5e-324}, "top_p", "(0, 1]"),
        ({"prompt": "x", "repetition_penalty": 5e-324}, "repetition_penalty", "(0, 10]"),
        ({"prompt": "x", "temperature": 1e-310}, "temperature", "[0, 100]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'wizard'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}]},
            "messages[1].tool_call_id",
            "required",
        ),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "'function'"),
    ],
)
def test_fields_over_their_limits_and_unknown_roles_are_400s_naming_the_field(tmp_path, body, param, limit):
    async def test(fake: FakeMesh):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = await fake.client.post(path, json=body)
        assert response.status == 400
        payload = await response.json()
        assert error_of(payload)[:2] == ("invalid_request_error", param)
        assert payload["error"]["message"].startswith(param) and limit in payload["error"]["message"]

    run(tmp_path, test, max_body_bytes=1 << 20)


def test_developer_messages_reach_the_template_as_system(tmp_path):
    async def test(fake: FakeMesh):
        messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "Hi"}]
        pending = asyncio.create_task(fake.client.post("/v1/chat/completions", json={"messages": messages}))
        request = await fake.next_request()
        assert [m["role"] for m in request.messages] == ["system", "user"]
        await fake.answer(request, "ok", finish="stop")
        assert (await pending).status == 200

    run(tmp_path, test)


# ---- the gateway describing itself


def test_version_openapi_and_docs(tmp_path):
    async def test(fake: FakeMesh):
        assert await (await fake.client.get("/version")).json() == {"version": VERSION}
        document = await (await fake.client.get("/openapi.json")).json()
        assert document["openapi"].startswith("3.")
        served = {r.resource.canonical for r in fake.client.app.router.routes() if r.method != "HEAD"}
        assert set(document["paths"]) == served
        page = await (await fake.client.get("/docs")).text()
        assert "/v1/chat/completions" in page and "ChatCompletionRequest" in page
        assert "<script" not in page and "src=" not in page and "://" not in page  # nothing fetched

    run(tmp_path, test)
