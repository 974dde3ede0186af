"""The gateway's OpenAI API over real sockets, with a fake tokenizer and scheduler on the other
side (tests/gateway_harness.py): requests, responses and their shapes, errors at the boundary;
the official openai client talks to it where shapes matter."""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest

from pagemesh.common.messages import (
    AbortRequest,
    RequestFailed,
    TextDelta,
    TextDeltaBatch,
    TokenLogprob,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.gateway_harness import MODEL, TOKENIZER, FakeMesh, run, sse_payloads


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
            "usage": {
                "prompt_tokens": 4,
                "completion_tokens": 2,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
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
        assert body["usage"] == {
            "prompt_tokens": 8,
            "completion_tokens": 6,
            "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 0},
        }  # 4 per prompt

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


def test_grammars_that_do_not_compile_are_400s_before_the_mesh(tmp_path):
    def schema(**props):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": props}}}

    async def test(fake: FakeMesh):
        for route, field, value, why in [
            ("chat/completions", "response_format", schema(a={"type": "array", "uniqueItems": True}), "uniqueItems"),
            ("chat/completions", "response_format", schema(a={"type": "string", "pattern": "[a-"}), "character class"),
            ("completions", "guided_regex", "(?=a)b", "look-around"),
            ("completions", "structured_outputs", {"grammar": "root ::= x"}, "Rule 'x' not found"),
        ]:
            body = {"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
            r = await fake.client.post(f"/v1/{route}", json={**body, field: value})
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == field and why in error["message"], error
        post = asyncio.create_task(
            fake.client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    # an emoji is byte tokens only: the hand-written automaton (text per token) refused it
                    "response_format": schema(pet={"enum": ["cat", "🦜"]}, age={"type": "integer", "minimum": 0}),
                },
            )
        )
        request = await fake.next_request()  # a grammar that compiles reaches the mesh
        assert request.sampling.json_schema == (
            '{"type":"object","properties":{"pet":{"enum":["cat","🦜"]},"age":{"type":"integer","minimum":0}}}'
        )
        await fake.answer(request, '{"pet": "cat", "age": 3}', finish="stop")
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
            (
                [],
                {
                    "prompt_tokens": 4,
                    "completion_tokens": 2,
                    "total_tokens": 6,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            ),
        ]

    run(tmp_path, test)


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
