"""Tools, tool calls, tool results and chat_template_kwargs reach a chat template as transformers'
`apply_chat_template` passes them: our render of docs/chat_templates/ equals transformers' (the
oracle) on the default model's vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagemesh.common.model_files import default_model_path
from pagemesh.common.tokenizer import Tokenizer
from pagemesh.tests.default_model import hf_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "docs" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
        {"role": "assistant", "content": "Sunny and 21 C."},
        {"role": "user", "content": "Thanks!"},
    ],
]


@pytest.mark.parametrize("template", ["chatml_tools_hermes.jinja", "chatml_think.jinja"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["ask", "round trip"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["default", "no thinking"])
def test_renders_as_transformers_does(template, messages, kwargs):
    source = (TEMPLATES / template).read_text()
    ours = Tokenizer.from_path(default_model_path(), chat_template=source)
    if template == "chatml_think.jinja" and any(m.get("tool_calls") for m in messages):
        messages = [m if not m.get("tool_calls") else {"role": "assistant", "content": "Ok."} for m in messages]
    expected = hf_tokenizer().apply_chat_template(
        messages, tools=TOOLS, chat_template=source, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours.apply_chat_template(messages, tools=TOOLS, template_kwargs=kwargs) == expected
