"""Tool calls and reasoning end to end on a scripted model: the gateway and the real tokenizer
service (with a chat template from docs/chat_templates/) over real sockets, a fake scheduler that
"generates" the answer each test scripts, token by token, ending with the end token, and the
official openai client and its helpers (`pydantic_function_tool`, `parse`, `stream`).

What this shows: the request reaches the template (tools, tool calls, tool results,
chat_template_kwargs), the forced calls' schema reaches the mesh, and a model that writes a call
or thinks gets the answer OpenAI's clients read, streamed or not. What the model writes is
scripted here; the live mesh tests (tests/integration/test_mesh_tool_calls.py) run the model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import openai
import pydantic
import pytest
from aiohttp.test_utils import TestServer

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common.messages import (
    ClusterStatus,
    Ready,
    ScheduleRequest,
    StatusRequest,
    TokenDelta,
    TokenDeltaBatch,
)
from pagemesh.common.model_files import default_model_path
from pagemesh.gateway.app import Gateway
from pagemesh.gateway.chat_output import AUTO_NEEDS_FLAGS
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.metrics import GatewayMetrics
from pagemesh.services.tokenizer.config import TokenizerConfig
from pagemesh.services.tokenizer.main import run as run_tokenizer
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "docs" / "chat_templates"
TOKENIZER = default_tokenizer()
END = min(TOKENIZER.eos_token_ids)


class Weather(pydantic.BaseModel):
    city: str
    unit: str


WEATHER = openai.pydantic_function_tool(Weather, name="get_weather", description="The weather in a city")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class ScriptedModel:
    """The fake scheduler: answers each ScheduleRequest with the next scripted text, a token a
    step, then the end token (finish "stop"); keeps the requests it got (pings and aborts
    are let be)."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.requests: list[ScheduleRequest] = []

    def prompt(self) -> str:
        return TOKENIZER.decode(self.requests[-1].prompt_token_ids, skip_special_tokens=False)

    async def serve(self, router: t.Router) -> None:
        pushes: dict[str, t.Push] = {}
        while True:
            identity, msg = await router.recv()
            if isinstance(msg, StatusRequest):
                await router.send(identity, ClusterStatus(ready=True, workers=[], queued=0))
            elif isinstance(msg, ScheduleRequest):
                self.requests.append(msg)
                push = pushes.setdefault(msg.reply_to, t.Push(msg.reply_to))
                ids = TOKENIZER.encode(self.script.pop(0), add_special_tokens=False) + [END]
                for step, token in enumerate(ids):
                    delta = TokenDelta(
                        request_id=msg.request_id,
                        index=0,
                        token_ids=[token],
                        logprobs=None,
                        finish_reason="stop" if step == len(ids) - 1 else None,
                        num_prompt_tokens=len(msg.prompt_token_ids),
                    )
                    await push.send(TokenDeltaBatch(worker_id="w0", deltas=[delta]))


@contextlib.asynccontextmanager
async def mesh(tmp_path: Path, template: str, **gateway_flags):
    a = lambda name: t.ipc_address(str(tmp_path), name)  # noqa: E731
    tok_cfg = TokenizerConfig(
        model=default_model_path(),
        address=a("tok"),
        output_address=a("tok-out"),
        scheduler_address=a("sched"),
        max_model_len=2048,
        name="tok0",
        ready_address=a("ready"),
        log_level="INFO",
        chat_template=(TEMPLATES / template).read_text(),
    )
    gw_cfg = GatewayConfig(
        host="127.0.0.1",
        port=0,
        tokenizer_address=a("tok"),
        scheduler_address=a("sched"),
        reply_address=a("gw"),
        model=default_model_path(),
        model_names=("smol",),
        max_body_bytes=1 << 20,
        request_timeout=30.0,
        name="gw0",
        ready_address=None,
        log_level="INFO",
        **gateway_flags,
    )
    model = ScriptedModel()
    with t.Router(a("sched")) as scheduler, t.Pull(a("ready")) as ready:
        tasks = [asyncio.create_task(model.serve(scheduler)), asyncio.create_task(run_tokenizer(tok_cfg))]
        client_mesh = MeshClient(gw_cfg.tokenizer_address, gw_cfg.scheduler_address, gw_cfg.reply_address, "gw0")
        client_mesh.start()
        server = TestServer(Gateway(gw_cfg, client_mesh, TOKENIZER, GatewayMetrics()).app())
        await server.start_server()
        try:
            assert await ready.recv() == Ready(service="tokenizer", name="tok0")
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none", max_retries=0)
            yield client, model
            await client.close()
        finally:
            await server.close()
            await client_mesh.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def run(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, HANG_S))


CALL_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
)


def test_auto_with_the_hermes_parser_streamed_and_not(tmp_path):
    async def main():
        async with mesh(
            tmp_path, "chatml_tools_hermes.jinja", enable_auto_tool_choice=True, tool_call_parser="hermes"
        ) as (client, model):
            model.script.append(CALL_TEXT)
            answer = await client.chat.completions.parse(model="smol", messages=ASK, tools=[WEATHER])
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me check."
            (call,) = choice.message.tool_calls
            assert call.id.startswith("call_") and call.type == "function"
            assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris", "unit": "c"}')
            assert call.function.parsed_arguments == Weather(city="Paris", unit="c")
            # the template saw the tools (the answer was detokenized with special tokens kept, less the end)
            assert f"<tools>\n{json.dumps(WEATHER['function'])}\n</tools>" in model.prompt()
            assert model.requests[-1].sampling.json_schema is None  # auto: the model writes freely

            model.script.append(CALL_TEXT)
            fragments = []
            async with client.chat.completions.stream(model="smol", messages=ASK, tools=[WEATHER]) as stream:
                async for event in stream:
                    if event.type == "tool_calls.function.arguments.delta":
                        fragments.append(event.arguments_delta)
                    assert event.type != "content.delta" or "<" not in event.delta  # the tag never leaks
                streamed = await stream.get_final_completion()
            assert len(fragments) > 5 and "".join(fragments) == call.function.arguments  # token by token
            choice = streamed.choices[0]
            assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me check.")
            assert choice.message.tool_calls[0].function.parsed_arguments == Weather(city="Paris", unit="c")

            model.script.append("It is sunny.")  # no call: the content as it is
            plain = await client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER])
            assert plain.choices[0].finish_reason == "stop"
            assert (plain.choices[0].message.content, plain.choices[0].message.tool_calls) == ("It is sunny.", None)

            model.script.append(CALL_TEXT)  # tool_choice none: the same text is content
            none = await client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="none")
            assert none.choices[0].message.content == CALL_TEXT and none.choices[0].finish_reason == "stop"

    run(main())


def test_required_and_a_named_function_read_what_the_grammar_wrote(tmp_path):
    async def main():
        async with mesh(tmp_path, "chatml_tools_hermes.jinja") as (client, model):
            with pytest.raises(openai.BadRequestError) as info:  # auto needs the flags, as in vLLM
                await client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER])
            assert info.value.param == "tool_choice" and info.value.body["message"] == AUTO_NEEDS_FLAGS

            model.script.append('[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}]')
            answer = await client.chat.completions.parse(
                model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
            )
            schema = json.loads(model.requests[-1].sampling.json_schema)
            assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
            choice = answer.choices[0]
            assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
            assert choice.message.tool_calls[0].function.parsed_arguments == Weather(city="Oslo", unit="f")

            named = {"type": "function", "function": {"name": "get_weather"}}
            model.script.append('{"city": "Rome", "unit": "c"}')
            async with client.chat.completions.stream(
                model="smol", messages=ASK, tools=[WEATHER], tool_choice=named
            ) as stream:
                streamed = await stream.get_final_completion()
            assert json.loads(model.requests[-1].sampling.json_schema) == WEATHER["function"]["parameters"]
            choice = streamed.choices[0]  # (the stream opened with content "", as every chat stream)
            assert (choice.finish_reason, choice.message.content) == ("tool_calls", "")
            assert choice.message.tool_calls[0].function.name == "get_weather"
            assert choice.message.tool_calls[0].function.parsed_arguments == Weather(city="Rome", unit="c")

            broken = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/Missing"}}}
            with pytest.raises(openai.BadRequestError) as info:  # a schema the grammar engine cannot compile
                await client.chat.completions.create(model="smol", messages=ASK, tools=[broken], tool_choice="required")
            assert info.value.param == "tools" and "Missing" in info.value.body["message"]

    run(main())


def test_a_tool_result_goes_back_through_the_template(tmp_path):
    async def main():
        async with mesh(
            tmp_path, "chatml_tools_hermes.jinja", enable_auto_tool_choice=True, tool_call_parser="hermes"
        ) as (client, model):
            model.script.append(CALL_TEXT)
            first = await client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER])
            call = first.choices[0].message.tool_calls[0]
            model.script.append("It is 21 degrees and sunny in Paris.")
            messages = [
                *ASK,
                first.choices[0].message.model_dump(exclude_none=True),  # the answer, as clients send it back
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
            ]
            second = await client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER])
            assert second.choices[0].message.content == "It is 21 degrees and sunny in Paris."
            assert model.prompt().endswith(
                "<|im_start|>assistant\nLet me check.\n<tool_call>\n"
                '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>\n'
                '<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response><|im_end|>\n'
                "<|im_start|>assistant\n"
            )

    run(main())


THINKING = "The sky looks blue because\nshort waves scatter more.</think>\n\nRayleigh scattering."


def test_reasoning_content_when_the_template_opened_the_thinking(tmp_path):
    async def main():
        async with mesh(tmp_path, "chatml_think.jinja", reasoning_parser="deepseek_r1") as (client, model):
            model.script.append(THINKING)
            answer = await client.chat.completions.create(model="smol", messages=ASK)
            message = answer.choices[0].message
            assert model.prompt().endswith("<|im_start|>assistant\n<think>\n")  # the output starts inside
            assert message.reasoning_content == "The sky looks blue because\nshort waves scatter more."
            assert message.content == "\n\nRayleigh scattering." and answer.choices[0].finish_reason == "stop"

            model.script.append(THINKING)
            stream = await client.chat.completions.create(model="smol", messages=ASK, stream=True)
            deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
            reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
            content = [d.content for d in deltas if d.content]
            assert len(reasoning) > 3 and "".join(reasoning) == message.reasoning_content
            assert "".join(content) == message.content
            assert not any("</" in part for part in reasoning + content)

    run(main())


def test_chat_template_kwargs_reach_the_template(tmp_path):
    async def main():
        async with mesh(tmp_path, "chatml_think.jinja", reasoning_parser="qwen3") as (client, model):
            model.script.append("Rayleigh scattering.")
            answer = await client.chat.completions.create(
                model="smol", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
            )
            assert model.prompt().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            message = answer.choices[0].message
            assert (message.content, message.reasoning_content) == ("Rayleigh scattering.", None)

            model.script.append(THINKING)  # thinking on (the default): the split as deepseek_r1's
            answer = await client.chat.completions.create(model="smol", messages=ASK)
            assert answer.choices[0].message.reasoning_content.startswith("The sky looks blue")

    run(main())
