"""Anthropic's Messages API at the gateway: the request as the chat request it runs as, the chat
answer written back as a Message and as Anthropic's events, errors in Anthropic's shape, and the
official anthropic client against the gateway with a fake tokenizer and scheduler behind it."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from pagemesh.common.messages import TextDelta, TokenizeRequest, TokenizeResult
from pagemesh.common.multimodal import IMAGE_MARK
from pagemesh.gateway.anthropic import parse_messages, to_chat
from pagemesh.gateway.anthropic_answer import MessagesAnswer
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.responses import ResponseBuilder
from pagemesh.tests.gateway_harness import MODEL, FakeMesh, run

BASE = {"model": MODEL, "max_tokens": 8}


def test_a_conversation_with_tools_becomes_the_chat_request_it_means():
    body = {
        **BASE,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no"}],
                     "is_error": True},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "tools": [{"name": "weather", "description": "Weather now", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"],
        "metadata": {"user_id": "u-7"},
        "temperature": 0,
        "top_k": 5,
        "stream": True,
    }  # fmt: skip
    chat, origins = to_chat(body)
    assert chat == {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Checking."}],
                "tool_calls": [
                    {"id": "toolu_1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no"},
            {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
        ],
        "model": MODEL,
        "max_tokens": 8,
        "temperature": 0,
        "top_k": 5,
        "stream": True,
        "stop": ["\n\n"],
        "include_stop_str_in_output": True,
        "user": "u-7",
        "tools": [
            {
                "type": "function",
                "function": {"name": "weather", "parameters": {"type": "object"}, "description": "Weather now"},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
    }  # fmt: skip
    assert origins == ["system", "messages[0]", "messages[1]", "messages[2]", "messages[2]", "messages[2]"]
    assert to_chat({**BASE, "messages": body["messages"][:1], "tool_choice": {"type": "any"}})[0]["tool_choice"] == (
        "required"
    )


def test_a_plain_conversation_parses_as_the_same_chat():
    parsed = parse_messages(
        {**BASE, "system": "S", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    )
    assert parsed.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert (parsed.sampling.max_tokens, parsed.sampling.stop, parsed.include_stop_str_in_output) == (8, (), False)


def asking(*content, **fields) -> dict:
    """A Messages request of one user turn (`content`: its blocks, or "x")."""
    return {**BASE, "messages": [{"role": "user", "content": list(content) if content else "x"}], **fields}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": [{"role": "user", "content": "x"}], "model": MODEL}, "max_tokens", "required"),
        (asking(max_token=3), "max_token", "Unrecognized"),
        (asking(container="c"), "container", "not supported"),
        (asking(thinking={"type": "enabled"}), "thinking", "thinking"),
        ({**asking(), "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
         "messages", "last"),
        (asking({"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}),
         "messages[0].content[0].source", "only base64"),
        (asking({"type": "document", "source": {}}), "messages[0].content[0]", "'document'"),
        (asking({"type": "text", "text": "x", "extra": 1}), "messages[0].content[0].extra", "not supported"),
        (asking(stop_sequences=["s"] * 17), "stop_sequences", "at most 16"),
        (asking(temperature="hot"), "temperature", "a number"),
        (asking(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0]", "only client tools"),
        (asking(tool_choice={"type": "sometimes"}), "tool_choice", "'auto'"),
        (asking(tool_choice={"type": {"nested": 1}}), "tool_choice", "'auto'"),  # a 500 the fuzzer found
    ],
)  # fmt: skip
def test_what_is_not_honoured_is_a_400_naming_it(body, param, words):
    with pytest.raises(ApiError) as info:
        parse_messages(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert param in info.value.message and words in info.value.message


def test_an_image_block_becomes_an_image_url_part_of_the_chat():
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    parsed = parse_messages(asking(block, {"type": "text", "text": "What is this?"}))
    assert parsed.image_urls == ("data:image/png;base64,iVBORw0KGgo=",)
    assert parsed.messages[-1]["content"] == IMAGE_MARK + "\nWhat is this?"


def builder() -> ResponseBuilder:
    return ResponseBuilder(
        kind="chat",
        request_id="cmpl-abc123",
        model=MODEL,
        created=1,
        n=1,
        logprobs=None,
        include_usage=False,
        token_text=str,
    )


def delta(text: str, completion_tokens: int, finish: str | None = None, cached: int = 0) -> TextDelta:
    return TextDelta(
        request_id="cmpl-abc123",
        index=0,
        text=text,
        token_ids=[1],
        logprobs=None,
        finish_reason=finish,
        prompt_tokens=10,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
    )


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        out.append((name[7:], payload))
    return out


def test_a_stream_of_text_then_a_tool_call_is_anthropics_event_sequence():
    b = builder()
    stream = MessagesAnswer(stop=()).stream(b)
    first = b.add(delta("Let me ", 1, cached=4))  # the gateway opens once the first reply is in (its prompt length)
    raw = stream.start() + stream.chunk(first)
    raw += stream.chunk(b.add(delta("check.", 2)))
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]})
    more = {"index": 0, "function": {"arguments": '{"x": 1}'}}
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]})
    raw += stream.end()
    usage = {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}
    message = {"id": "msg_abc123", "type": "message", "role": "assistant", "model": MODEL, "content": []}
    message |= {"stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}

    def event(kind: str, **fields) -> tuple[str, dict]:
        return kind, {"type": kind, **fields}

    tool_use = {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert events(raw) == [
        event("message_start", message=message),
        event("ping"),
        event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Let me "}),
        event("content_block_delta", index=0, delta={"type": "text_delta", "text": "check."}),
        event("content_block_stop", index=0),
        event("content_block_start", index=1, content_block=tool_use),
        event("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": '{"x": 1}'}),
        event("content_block_stop", index=1),
        event(
            "message_delta",
            delta={"stop_reason": "tool_use", "stop_sequence": None},
            usage={**usage, "output_tokens": 2},
        ),
        event("message_stop"),
    ]


def test_the_matched_stop_sequence_is_cut_from_the_text_and_named():
    b = builder()
    answer = MessagesAnswer(stop=("END", "D"))
    stream = answer.stream(b)
    raw = stream.chunk(b.add(delta("abc", 1)))
    raw += stream.chunk(b.add(delta("dEN", 2)))  # a stop's start may come in any chunk
    raw += stream.chunk(b.add(delta("D", 3, finish="stop")))
    raw += stream.end()
    texts = [p["delta"]["text"] for name, p in events(raw) if name == "content_block_delta"]
    assert "".join(texts) == "abcd"
    final = [p for name, p in events(raw) if name == "message_delta"][0]["delta"]
    assert final == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    body = answer.response(b)
    assert (body["content"], body["stop_reason"], body["stop_sequence"]) == (
        [{"type": "text", "text": "abcd"}],
        "stop_sequence",
        "END",
    )


@pytest.mark.parametrize(
    "finish, text, reason, sequence",
    [("stop", "done", "end_turn", None), ("length", "doneEND", "max_tokens", None), ("abort", "x", None, None)],
)
def test_stop_reasons(finish, text, reason, sequence):
    b = builder()
    b.add(delta(text, 1, finish=finish))
    body = MessagesAnswer(stop=("END",)).response(b)
    assert (body["stop_reason"], body["stop_sequence"], body["content"]) == (
        reason,
        sequence,
        [{"type": "text", "text": text}],
    )


def test_a_chat_answer_with_tool_calls_is_a_message_with_tool_use_blocks():
    b = builder()
    b.add(delta("", 3, finish="stop"))
    chat = b.response()
    chat["choices"][0]["message"]["content"] = None
    chat["choices"][0]["message"]["tool_calls"] = [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}
    ]
    chat["choices"][0]["finish_reason"] = "tool_calls"
    b.response = lambda: chat
    body = MessagesAnswer(stop=()).response(b)
    assert body == {
        "id": "msg_abc123",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "tool_use", "id": "call_9", "name": "f", "input": {"a": [1]}}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


# ---- over HTTP, with the official client


def client_for(fake: FakeMesh, key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(fake.client.make_url("")), api_key=key, max_retries=0)


def test_official_anthropic_client_create_and_stream(tmp_path):
    async def test(fake: FakeMesh):
        client = client_for(fake)
        try:
            pending = asyncio.create_task(
                client.messages.create(
                    model=MODEL,
                    max_tokens=5,
                    system="Be brief.",
                    messages=[{"role": "user", "content": "Hi"}],
                    stop_sequences=["!"],
                )
            )
            request = await fake.next_request()
            assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            assert (request.sampling.max_tokens, request.sampling.stop, request.include_stop_str_in_output) == (
                5,
                ("!",),
                True,
            )
            await fake.answer(request, "Hello", " there!", finish="stop")
            message = await pending
            assert message.id.startswith("msg_") and message.model == MODEL
            assert [(b.type, b.text) for b in message.content] == [("text", "Hello there")]
            assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "!")
            assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 2)

            async def streamed():
                async with client.messages.stream(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
                ) as stream:
                    texts = [text async for text in stream.text_stream]
                    return texts, await stream.get_final_message()

            pending = asyncio.create_task(streamed())
            request = await fake.next_request()
            assert request.stream
            await fake.answer(request, "Hel", "lo", finish="length")
            texts, final = await pending
            assert texts == ["Hel", "lo"]
            assert [(b.type, b.text) for b in final.content] == [("text", "Hello")]
            assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == ("max_tokens", 2, 4)
        finally:
            await client.close()

    run(tmp_path, test)


def test_errors_have_anthropics_shape_and_status(tmp_path):
    async def test(fake: FakeMesh):
        client = client_for(fake)
        try:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(model=MODEL, max_tokens=5, messages=[], temperature=0.5)
            assert info.value.body == {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "messages: required, a non-empty list of messages",
                },
            }
            with pytest.raises(anthropic.NotFoundError) as info:
                await client.messages.create(
                    model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}]
                )
            assert info.value.body["error"]["type"] == "not_found_error"
            response = await fake.client.get("/v1/messages")  # a wrong method: still Anthropic's shape
            assert response.status == 405
            assert (await response.json())["error"]["type"] == "invalid_request_error"
        finally:
            await client.close()

    run(tmp_path, test)


def test_x_api_key_is_accepted_as_a_key(tmp_path):
    async def test(fake: FakeMesh):
        good, bad = client_for(fake, "key-alpha"), client_for(fake, "wrong")
        try:
            pending = asyncio.create_task(
                good.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
            )
            await fake.answer(await fake.next_request(), "ok", finish="stop")
            assert (await pending).content[0].text == "ok"
            with pytest.raises(anthropic.AuthenticationError) as info:
                await bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
            assert info.value.body["error"]["type"] == "authentication_error"
            response = await fake.client.get("/v1/models", headers={"x-api-key": "key-alpha"})
            assert response.status == 200  # the same keys, on every keyed route
        finally:
            await good.close()
            await bad.close()

    run(tmp_path, test, api_keys=("key-alpha",))


def test_count_tokens_is_the_tokenizers_count_of_the_rendered_conversation(tmp_path):
    async def test(fake: FakeMesh):
        client = client_for(fake)
        try:
            pending = asyncio.create_task(
                client.messages.count_tokens(model=MODEL, system="S", messages=[{"role": "user", "content": "Hi"}])
            )
            _, call = await fake.from_tokenizer()
            assert isinstance(call, TokenizeRequest)
            assert (call.messages, call.prompt_text) == (
                [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                None,
            )
            assert (call.add_special_tokens, call.add_generation_prompt) == (False, True)  # as a chat's prompt
            await fake.reply(call, TokenizeResult(request_id=call.request_id, token_ids=[5, 6, 7], max_model_len=64))
            assert (await pending).input_tokens == 3

            assert (call.tools, call.chat_template_kwargs) == (None, None)

            tool = {"name": "f", "input_schema": {"type": "object"}}
            pending = asyncio.create_task(
                client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[tool])
            )
            _, call = await fake.from_tokenizer()
            function = {"name": "f", "parameters": {"type": "object"}}
            assert [t["function"] | {"description": None} for t in json.loads(call.tools)] == [
                function | {"description": None}
            ]  # the template sees the tools as a chat request's
            await fake.reply(call, TokenizeResult(request_id=call.request_id, token_ids=[5] * 9, max_model_len=64))
            assert (await pending).input_tokens == 9
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.count_tokens(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"max_tokens": 3}
                )
            assert "max_tokens" in info.value.body["error"]["message"]
        finally:
            await client.close()

    run(tmp_path, test)


def test_reasoning_split_off_by_the_gateway_is_a_thinking_block_first():
    b = builder()
    stream = MessagesAnswer(stop=()).stream(b)
    b.add(delta("x", 1))
    raw = stream.start()
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": None}]})
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"content": "Yes."}, "finish_reason": "stop"}]})
    raw += stream.end()
    blocks = [(p["index"], p["content_block"]) for name, p in events(raw) if name == "content_block_start"]
    assert blocks == [(0, {"type": "thinking", "thinking": "", "signature": ""}), (1, {"type": "text", "text": ""})]
    deltas = [(p["index"], p["delta"]) for name, p in events(raw) if name == "content_block_delta"]
    assert deltas == [(0, {"type": "thinking_delta", "thinking": "hmm"}), (1, {"type": "text_delta", "text": "Yes."})]
    chat = b.response()
    chat["choices"][0]["message"] |= {"reasoning_content": "hmm", "content": "Yes."}
    b.response = lambda: chat
    assert MessagesAnswer(stop=()).response(b)["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "text", "text": "Yes."},
    ]
