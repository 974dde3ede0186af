"""Tool calling and reasoning on a real mesh running the default model (SmolLM2-135M-Instruct),
through the official openai client and its helpers.

What each test shows, honestly:
- `required` and a named function: the grammar makes a model never trained for tools write a
  call whose arguments parse and validate against the pydantic model, streamed and not.
- `none`: text, no calls. `auto` with the Hermes template and parser: the template puts the tools
  in the prompt, and whatever the model writes comes back well formed (SmolLM2-135M rarely calls
  a tool on its own: the parser's detection of calls it writes is tested on scripted answers in
  tests/unit/test_chat_tools_scripted.py, its formats in tests/unit/test_tool_call_parsers.py).
- a tool result goes back through the template and the model answers.
- reasoning: with a template that opens <think>, the model's answer is read as thinking (SmolLM2
  never closes it: the split at </think> is tested on scripted answers), streamed as the
  non-streamed; chat_template_kwargs turns the thinking off and the answer is content.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest

from pagemesh.bench.local_mesh import HANG_S, running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow
TEMPLATES = Path(__file__).resolve().parents[2] / "docs" / "chat_templates"
MODEL = DEFAULT_MODEL_NAME


class Weather(pydantic.BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class Convert(pydantic.BaseModel):
    amount: float
    currency: str


WEATHER = openai.pydantic_function_tool(Weather, name="get_weather", description="The current weather in a city")
CONVERT = openai.pydantic_function_tool(Convert, name="convert_currency", description="Convert money to euros")
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
LIMITS = {"max_tokens": 128, "temperature": 0}


@pytest.fixture(scope="module")
def client():
    flags = ["--mixed", "1", "--chat-template", str(TEMPLATES / "chatml_tools_hermes.jinja")]
    with running_mesh(*flags, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def test_required_makes_the_model_write_a_valid_call(client):
    one_call = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, **LIMITS}
    answer = client.chat.completions.parse(model=MODEL, messages=ASK, **one_call)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)

    with client.chat.completions.stream(model=MODEL, messages=ASK, **one_call) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.tool_calls[0].function.arguments == call.function.arguments  # greedy

    # parallel calls allowed (the default): the model may write several; each one it finished is valid
    many = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", **LIMITS)
    calls = many.choices[0].message.tool_calls
    finished = calls if many.choices[0].finish_reason == "tool_calls" else calls[:-1]
    assert calls and all(Weather.model_validate_json(c.function.arguments) for c in finished)


def test_a_named_function_gets_arguments_valid_for_it(client):
    named = {"type": "function", "function": {"name": "convert_currency"}}
    messages = [{"role": "user", "content": "How much is 20 dollars in euros?"}]
    answer = client.chat.completions.parse(
        model=MODEL, messages=messages, tools=[WEATHER, CONVERT], tool_choice=named, **LIMITS
    )
    (call,) = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "convert_currency" and isinstance(call.function.parsed_arguments, Convert)
    with client.chat.completions.stream(
        model=MODEL, messages=messages, tools=[WEATHER, CONVERT], tool_choice=named, **LIMITS
    ) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_none_and_auto_answer_well_formed(client):
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", **LIMITS)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=ASK, **LIMITS)
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens  # the template wrote the tools in

    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CONVERT], **LIMITS)
    choice = auto.choices[0]
    if choice.message.tool_calls:  # whatever it wrote: calls to the tools offered, or text
        assert choice.finish_reason in ("tool_calls", "length")
        assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "convert_currency"}
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content


def test_a_tool_result_goes_back_to_the_model(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", **LIMITS)
    message = first.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
        for call in message.tool_calls
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=[*ASK, message.model_dump(exclude_none=True), *results],
        tools=[WEATHER],
        tool_choice="none",
        **LIMITS,
    )
    assert second.choices[0].message.content and second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.fixture(scope="module")
def thinking_client():
    template = str(TEMPLATES / "chatml_think.jinja")
    with running_mesh("--mixed", "1", "--chat-template", template, "--reasoning-parser", "qwen3") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def test_reasoning_content_streamed_and_not(thinking_client):
    limits = {"max_tokens": 24, "temperature": 0}
    answer = thinking_client.chat.completions.create(model=MODEL, messages=ASK, **limits)
    message = answer.choices[0].message
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    if message.content is None:  # it never closed its thinking (SmolLM2 was not trained to think)
        assert answer.choices[0].finish_reason == "length"

    stream = thinking_client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **limits)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == (message.content or "")

    off = thinking_client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **limits
    )
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content
    assert off.usage.prompt_tokens > answer.usage.prompt_tokens  # the template wrote <think></think> for it
