"""Anthropic's Messages API and OpenAI's Responses API on a real mesh, through the official
`anthropic` and `openai` clients: each answers a conversation with the text its chat completion
gives (greedy), streams it as its own events, and reports its stop reasons and errors its way."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from pagemesh.bench.local_mesh import HANG_S, running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL_NAME
SYSTEM = "You are a helpful assistant. Answer briefly."
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mesh():
    with running_mesh("--mixed", "1") as url:
        yield url


@pytest.fixture(scope="module")
def claude(mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=mesh, api_key="none", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def chat(client):
    """The greedy chat completion of the system prompt and the turns: what both APIs must say."""
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *TURNS],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )


def test_messages_create_answers_as_the_chat_completion(claude, chat):
    message = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, messages=TURNS, temperature=0)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (message.stop_reason, message.stop_sequence) == (expected, None)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_count_tokens_is_the_prompt_a_messages_request_has(claude, chat):
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=TURNS)
    assert counted.input_tokens == chat.usage.prompt_tokens
    alone = claude.messages.count_tokens(model=MODEL, messages=TURNS[:1])
    assert 0 < alone.input_tokens < counted.input_tokens


def test_messages_stream_gives_the_same_text_as_events(claude, chat):
    with claude.messages.stream(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        system=[{"type": "text", "text": SYSTEM}],
        messages=TURNS,
        temperature=0,
    ) as stream:
        kinds = []
        pieces = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                pieces.append(event.text)
        final = stream.get_final_message()
    text = chat.choices[0].message.content
    assert "".join(pieces) == final.content[0].text == text
    raw = [k for k in kinds if k not in ("text",)]  # the client adds its own "text" events
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.usage.output_tokens == chat.usage.completion_tokens


def test_stop_reasons_max_tokens_stop_sequence_and_end_turn(claude, chat):
    short = claude.messages.create(model=MODEL, max_tokens=2, messages=TURNS, system=SYSTEM, temperature=0)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2

    text = chat.choices[0].message.content
    cut = text.index(" ", 2)  # a stop sequence from the middle of the greedy answer: its second word
    stop = text[cut : cut + 3]
    stopped = claude.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, messages=TURNS, temperature=0, stop_sequences=["@@", stop]
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[: text.index(stop)]

    done = claude.messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Say hi."}], temperature=0
    )
    assert done.stop_reason == "end_turn" and done.usage.output_tokens < 64


def test_messages_errors_are_anthropics(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "assistant", "content": "Hi"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith("messages: the last message must be a user message")
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-none", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"


def test_responses_create_with_a_string_and_with_items_answers_as_the_chat_completion(client, chat):
    text = chat.choices[0].message.content
    items = [{"role": t["role"], "content": t["content"]} for t in TURNS]
    as_items = client.responses.create(
        model=MODEL, instructions=SYSTEM, input=items, max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert as_items.output_text == text and as_items.id.startswith("resp_")
    assert as_items.usage.input_tokens == chat.usage.prompt_tokens
    assert as_items.usage.output_tokens == chat.usage.completion_tokens
    complete = chat.choices[0].finish_reason == "stop"
    assert as_items.status == ("completed" if complete else "incomplete")

    one = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0
    )
    as_string = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0)
    assert as_string.output_text == one.choices[0].message.content
    assert as_string.output[0].type == "message" and as_string.output[0].content[0].type == "output_text"


def test_responses_stream_gives_the_same_text_as_events(client, chat):
    with client.responses.stream(
        model=MODEL,
        instructions=SYSTEM,
        input=[{"role": t["role"], "content": t["content"]} for t in TURNS],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        events = list(stream)
        if chat.choices[0].finish_reason == "stop":
            final = stream.get_final_response()
            assert final.output_text == chat.choices[0].message.content
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == ("response.completed" if chat.choices[0].finish_reason == "stop" else "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat.choices[0].message.content
    assert [e.sequence_number for e in events] == list(range(len(events)))

    raw = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0, stream=True)
    last = list(raw)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_responses_refuses_stored_state(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"


# ---- tools: the chat path's grammar writes a named tool's call; each API returns it its way

# one property, from an enum: the tiny model's call is short (free strings may run to max_tokens)
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_TOKENS = 48


def test_messages_tool_use_round_trip(claude):
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
    ask = dict(model=MODEL, max_tokens=TOOL_TOKENS, messages=ASK_WEATHER, tools=[tool], temperature=0)
    message = claude.messages.create(**ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")

    with claude.messages.stream(**ask, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds  # the client's event for input_json_delta
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather", call.input)]

    answered_ask = dict(
        model=MODEL,
        max_tokens=8,
        tools=[tool],
        tool_choice={"type": "none"},
        temperature=0,
        messages=[
            *ASK_WEATHER,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]},
        ],
    )
    answered = claude.messages.create(**answered_ask)
    assert answered.content[0].type == "text" and answered.stop_reason in ("end_turn", "max_tokens")
    assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens > message.usage.input_tokens
    conversation = {k: v for k, v in answered_ask.items() if k in ("model", "messages", "tools")}
    counted = claude.messages.count_tokens(**conversation)  # tools and tool blocks counted as rendered
    assert counted.input_tokens == answered.usage.input_tokens + answered.usage.cache_read_input_tokens


def test_responses_function_call_round_trip(client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA, "strict": False}  # fmt: skip
    ask = dict(model=MODEL, input=ASK_WEATHER, tools=[tool], max_output_tokens=TOOL_TOKENS, temperature=0)
    response = client.responses.create(**ask, tool_choice={"type": "function", "name": "get_weather"})
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")

    with client.responses.stream(**ask, tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(o.type, o.arguments) for o in final.output] == [("function_call", call.arguments)]

    answered = client.responses.create(
        model=MODEL,
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
        input=[
            *ASK_WEATHER,
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ],
    )
    assert answered.output[0].type == "message" and answered.usage.input_tokens > response.usage.input_tokens
