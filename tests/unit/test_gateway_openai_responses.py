"""OpenAI's Responses API at the gateway: the request as the chat request it runs as, the chat
answer written back as a Response and as its events, what a stateless server refuses, and the
official openai client against the gateway with a fake tokenizer and scheduler behind it."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from pagemesh.common.messages import TextDelta
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.openai_responses import parse_responses, to_chat
from pagemesh.gateway.openai_responses_answer import ResponsesAnswer, echo_fields
from pagemesh.gateway.responses import ResponseBuilder
from pagemesh.tests.gateway_harness import MODEL, FakeMesh, run


def test_input_items_become_the_chat_request_they_mean():
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20 C"}]},
            {"role": "developer", "content": "Answer in French."},
        ],
        "max_output_tokens": 9,
        "temperature": 0,
        "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "store": False,
        "stream": True,
    }  # fmt: skip
    chat, origins = to_chat(body)
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lyon"}'}},
    ]
    assert chat == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "20 C"},
            {"role": "developer", "content": "Answer in French."},
        ],
        "model": MODEL,
        "temperature": 0,
        "stream": True,
        "max_tokens": 9,
        "tools": [{"type": "function",
                   "function": {"name": "weather", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    }  # fmt: skip
    assert origins == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]", "input[6]"]
    assert to_chat({"input": "Hi"})[0] == {"messages": [{"role": "user", "content": "Hi"}]}


def test_a_plain_request_parses_as_the_same_chat():
    parsed = parse_responses({"model": MODEL, "input": "Hi", "instructions": "S", "max_output_tokens": 3})
    assert parsed.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert parsed.sampling.max_tokens == 3 and not parsed.stream


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "keeps no"),
        ({"input": "x", "store": True}, "store", "store must be false"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"input": "x", "max_output_token": 3}, "max_output_token", "Unrecognized"),
        ({"input": "x", "truncation": "auto"}, "truncation", "never truncated"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "'item_reference'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "u"}]}]},
         "input[0].content[0]", "input_file"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]", "input_image"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: must be"),
        ({"input": [{"role": "user", "content": 5}, {"role": "user", "content": "x"}]}, "input[0].content", "content"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format", "type must be"),
    ],
)  # fmt: skip
def test_what_is_not_honoured_is_a_400_naming_it(body, param, words):
    with pytest.raises(ApiError) as info:
        parse_responses(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert param in info.value.message and words in info.value.message


def builder() -> ResponseBuilder:
    return ResponseBuilder(
        kind="chat",
        request_id="cmpl-abc",
        model=MODEL,
        created=7,
        n=1,
        logprobs=None,
        include_usage=False,
        token_text=str,
    )


def delta(text: str, completion_tokens: int, finish: str | None = None) -> TextDelta:
    return TextDelta(
        request_id="cmpl-abc",
        index=0,
        text=text,
        token_ids=[1],
        logprobs=None,
        finish_reason=finish,
        prompt_tokens=10,
        completion_tokens=completion_tokens,
        cached_tokens=2,
    )


def events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == "event: " + payload["type"]
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


ECHO = echo_fields({"instructions": "S"}, 1.0, 1.0)


def test_a_stream_of_text_then_a_function_call_is_the_responses_event_sequence():
    b = builder()
    answer = ResponsesAnswer(ECHO)
    stream = answer.stream(b)
    first = b.add(delta("Let me", 1))  # the gateway applies the first reply, then opens the stream
    raw = stream.start() + stream.chunk(first)
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]})
    more = {"index": 0, "function": {"arguments": ": 1}"}}
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]})
    raw += stream.end()
    got = events(raw)
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["usage"] is None
    message = {"id": "msg_abc", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Let me", "annotations": [], "logprobs": []}]}  # fmt: skip
    function_call = {"id": "fc_abc_0", "type": "function_call", "call_id": "call_1", "name": "f",
                     "arguments": '{"x": 1}', "status": "completed"}  # fmt: skip
    assert got[7]["item"] == message and got[12]["item"] == function_call
    assert got[11] == {"type": "response.function_call_arguments.done", "item_id": "fc_abc_0", "output_index": 1,
                       "name": "f", "arguments": '{"x": 1}', "sequence_number": 11}  # fmt: skip
    final = got[-1]["response"]
    assert final["output"] == [message, function_call] and final["status"] == "completed"
    assert final["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 11,
    }
    assert final["instructions"] == "S" and final["store"] is False and final["id"] == "resp_abc"


def test_max_output_tokens_makes_an_incomplete_response():
    b = builder()
    b.add(delta("Hi", 1, finish="length"))
    body = ResponsesAnswer(ECHO).response(b)
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert body["output"][0]["status"] == "incomplete"


# ---- over HTTP, with the official client


def client_for(fake: FakeMesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(fake.client.make_url("/v1")), api_key="none", max_retries=0)


def test_official_openai_client_create_and_stream(tmp_path):
    async def test(fake: FakeMesh):
        client = client_for(fake)
        try:
            pending = asyncio.create_task(
                client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=5)
            )
            request = await fake.next_request()
            assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            await fake.answer(request, "Hello", " there", finish="stop")
            response = await pending
            assert response.output_text == "Hello there" and response.status == "completed"
            assert (response.usage.input_tokens, response.usage.output_tokens) == (4, 2)
            assert response.instructions == "Be brief." and response.max_output_tokens == 5

            async def streamed():
                async with client.responses.stream(model=MODEL, input=[{"role": "user", "content": "Hi"}]) as stream:
                    deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                    return deltas, await stream.get_final_response()

            pending = asyncio.create_task(streamed())
            request = await fake.next_request()
            assert request.stream
            await fake.answer(request, "Hel", "lo", finish="stop")
            deltas, final = await pending
            assert deltas == ["Hel", "lo"] and final.output_text == "Hello"

            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
            assert info.value.body["param"] == "previous_response_id"
        finally:
            await client.close()

    run(tmp_path, test)


def test_reasoning_split_off_by_the_gateway_is_a_reasoning_item_first():
    b = builder()
    stream = ResponsesAnswer(ECHO).stream(b)
    b.add(delta("x", 1, finish="stop"))
    raw = stream.start()
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": None}]})
    raw += stream.chunk({"choices": [{"index": 0, "delta": {"content": "Yes."}, "finish_reason": "stop"}]})
    raw += stream.end()
    got = events(raw)
    assert [e["type"] for e in got][2:9] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    reasoning = {"id": "rs_abc", "type": "reasoning", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": "hmm"}]}  # fmt: skip
    assert got[-1]["response"]["output"][0] == reasoning
    assert got[-1]["response"]["output"][1]["content"][0]["text"] == "Yes."
    chat = b.response()
    chat["choices"][0]["message"] |= {"reasoning_content": "hmm", "content": "Yes."}
    b.response = lambda: chat
    assert ResponsesAnswer(ECHO).response(b)["output"][0] == reasoning


def test_an_answer_the_mesh_aborted_is_incomplete_without_a_reason():
    b = builder()
    b.add(delta("Hi", 1, finish="abort"))
    body = ResponsesAnswer(ECHO).response(b)
    assert (body["status"], body["incomplete_details"], body["output"][0]["status"]) == (
        "incomplete",
        None,
        "incomplete",
    )
