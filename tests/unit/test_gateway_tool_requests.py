"""Chat requests with tools, tool_choice and chat_template_kwargs -> what the mesh is asked
(gateway/chat_options.py, gateway/parsing.py, gateway/chat_output.py): the schema the grammar
holds a forced call to (vLLM's), the JSON text the tokenizer gets, and every refusal's param."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from pagemesh.common.messages import GenerateRequest
from pagemesh.gateway.chat_output import AUTO_NEEDS_FLAGS, chat_output_spec
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.parsing import parse_chat
from pagemesh.tests.gateway_harness import MODEL


class Weather(pydantic.BaseModel):
    city: str
    unit: str


class Unit(pydantic.BaseModel):
    name: str


class Convert(pydantic.BaseModel):
    """Pydantic writes the nested model under $defs: the required schema lifts it to its root."""

    amount: float
    unit: Unit


WEATHER = openai.pydantic_function_tool(Weather, name="get_weather", description="The weather in a city")
CONVERT = openai.pydantic_function_tool(Convert, name="convert")
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields) -> dict:
    return {"model": "m", "messages": CHAT, **fields}


def refusal(body, parse=parse_chat) -> tuple[str | None, str]:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value.param, info.value.message


def generate_request(parsed, **kwargs) -> GenerateRequest:
    (request,) = parsed.to_generate_requests("r", "m", "gw", 0.0, **kwargs)
    return request


def config(**flags) -> GatewayConfig:
    values = dict(
        host="h",
        port=0,
        tokenizer_address="t",
        scheduler_address="s",
        reply_address="r",
        model=None,
        model_names=(MODEL,),
        max_body_bytes=1 << 20,
        request_timeout=1.0,
        name="g",
        ready_address=None,
        log_level="INFO",
    )
    return GatewayConfig(**{**values, **flags})


def test_a_named_function_holds_the_answer_to_its_parameters():
    parsed = parse_chat(
        chat(tools=[WEATHER, CONVERT], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert json.loads(parsed.sampling.json_schema) == WEATHER["function"]["parameters"]
    assert parsed.chat_options.tool_choice == "function" and parsed.chat_options.function == "get_weather"
    request = generate_request(parsed)
    assert json.loads(request.tools) == [WEATHER, CONVERT]  # the template sees them as given
    assert request.skip_special_tokens and request.chat_template_kwargs is None


def test_required_is_an_array_of_calls_to_the_tools_as_vllm_builds_it():
    parsed = parse_chat(chat(tools=[WEATHER], tool_choice="required"))
    weather = WEATHER["function"]["parameters"]
    item = {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": weather},
        "required": ["name", "parameters"],
    }
    assert json.loads(parsed.sampling.json_schema) == {"type": "array", "items": item, "minItems": 1}
    one = parse_chat(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert json.loads(one.sampling.json_schema)["maxItems"] == 1


def test_required_over_several_tools_is_an_any_of_with_their_definitions_at_the_root():
    options = parse_chat(chat(tools=[WEATHER, CONVERT], tool_choice="auto")).chat_options
    schema = options.__class__(**{**options.__dict__, "tool_choice": "required"}).json_schema()
    assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [["get_weather"], ["convert"]]
    assert schema["$defs"] == CONVERT["function"]["parameters"]["$defs"]
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]


def test_tools_default_to_auto_which_needs_the_flags():
    parsed = parse_chat(chat(tools=[WEATHER]))
    assert parsed.chat_options.tool_choice == "auto" and parsed.sampling.json_schema is None
    with pytest.raises(ApiError) as info:
        chat_output_spec(parsed, config())
    assert (info.value.status, info.value.param, info.value.message) == (400, "tool_choice", AUTO_NEEDS_FLAGS)
    spec = chat_output_spec(parsed, config(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    assert (spec.tool_choice, spec.tool_parser, spec.keep_special_tokens) == ("auto", "hermes", True)
    assert not chat_output_spec(
        parsed, config(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    ).keep_special_tokens
    # no tools, or tool_choice none: the answer is read as it is (unless a reasoning parser splits it)
    assert chat_output_spec(parse_chat(chat(tools=[WEATHER], tool_choice="none")), config()) is None
    assert chat_output_spec(parse_chat(chat()), config(reasoning_parser="qwen3")).reasoning_parser == "qwen3"
    # an answer a grammar holds to JSON has no thinking in it
    forced = parse_chat(chat(tools=[WEATHER], tool_choice="required"))
    assert chat_output_spec(forced, config(reasoning_parser="qwen3")).reasoning_parser is None


def test_tool_calls_and_results_reach_the_tokenizer_as_templates_read_them():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},  # vLLM's answers carry an empty list
    ]
    parsed = parse_chat(
        chat(messages=messages, tools=[WEATHER], tool_choice="none", chat_template_kwargs={"enable_thinking": False})
    )
    request = generate_request(parsed)
    assert request.messages[1:] == [
        {
            "role": "assistant",
            "tool_calls": json.dumps(
                [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        "id": "call_1",
                    }
                ]
            ),
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert json.loads(request.chat_template_kwargs) == {"enable_thinking": False}


BAD = [
    (chat(tools={"type": "function"}), "tools"),
    (chat(tools=[{"type": "retrieval"}]), "tools[0]"),
    (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (chat(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "returns": {}}}]), "tools[0].function.returns"),
    (chat(tools=[WEATHER], tool_choice="any"), "tool_choice"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "convert"}}), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
    (chat(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls"),
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (chat(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs"),
    (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
    (chat(messages=[*CHAT, {"role": "tool", "content": "x"}]), "messages[1].tool_call_id"),
    (chat(messages=[*CHAT, {"role": "assistant", "content": None}]), "messages[1].content"),
    (
        chat(
            messages=[
                *CHAT,
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                },
            ]
        ),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        chat(messages=[*CHAT, {"role": "assistant", "tool_calls": [{"type": "function"}]}]),
        "messages[1].tool_calls[0].function",
    ),
    (chat(messages=[{"role": "function", "content": "x", "name": "f"}]), "messages[0].role"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(function_call="auto"), "function_call"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(body, param):
    assert refusal(body)[0] == param


def test_the_flags_reach_the_gateway_and_the_tokenizer(tmp_path, monkeypatch):
    from pagemesh.gateway.config import parse_args as parse_gateway
    from pagemesh.services import launcher
    from pagemesh.services.tokenizer.config import parse_args as parse_tokenizer

    monkeypatch.delenv("PAGEMESH_SERVED_MODEL_NAME", raising=False)
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    argv = dict(
        launcher.plan(launcher.parse(["--mixed", "1", *flags, "--chat-template", str(template)]), str(tmp_path))
    )
    gateway = parse_gateway(argv["gateway"][1:])
    assert (gateway.enable_auto_tool_choice, gateway.tool_call_parser, gateway.reasoning_parser) == (
        True,
        "hermes",
        "qwen3",
    )
    assert parse_tokenizer(argv["tokenizer"][1:]).chat_template == "{{ messages[0].content }}"
    assert "--chat-template" not in argv["gateway"] and "--tool-call-parser" not in argv["tokenizer"]
    plain = dict(launcher.plan(launcher.parse(["--mixed", "1"]), str(tmp_path)))
    gateway = parse_gateway(plain["gateway"][1:])
    assert (gateway.enable_auto_tool_choice, gateway.tool_call_parser, gateway.reasoning_parser) == (False, None, None)
    assert parse_tokenizer(plain["tokenizer"][1:]).chat_template is None

    for bad in (["--enable-auto-tool-choice"], ["--tool-call-parser", "pythonic"], ["--reasoning-parser", "r2"]):
        with pytest.raises(SystemExit):
            launcher.parse(["--mixed", "1", *bad])
    with pytest.raises(SystemExit):  # neither a file nor a template
        parse_tokenizer([*plain["tokenizer"][1:], "--chat-template", str(tmp_path / "missing.jinja")])
