"""The tokenizer service's side of tool calling and reasoning (TokenizerCore): the tools, tool
calls and template variables a GenerateRequest carries reach the chat template, and an answer
read with special tokens kept has them in its text, less the end token."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pagemesh.common.model_files import default_model_path
from pagemesh.common.tokenizer import Tokenizer
from pagemesh.services.tokenizer.core import TokenizerCore
from pagemesh.tests.default_model import tokenizer as default_tokenizer
from pagemesh.tests.unit.test_tokenizer_service import feed, ids_of, request, tokens

TEMPLATES = Path(__file__).resolve().parents[2] / "docs" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": json.dumps(CALLS)},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]


def test_tools_tool_calls_and_template_variables_reach_the_template():
    hermes = Tokenizer.from_path(default_model_path(), (TEMPLATES / "chatml_tools_hermes.jinja").read_text())
    c = TokenizerCore(hermes, 4096, reply_to="ipc:///tmp/out")
    admitted = c.admit(
        dataclasses.replace(
            request(messages=MESSAGES, max_tokens=4), tools=json.dumps(TOOLS), chat_template_kwargs="{}"
        )
    )
    expected = hermes.encode_chat(
        [MESSAGES[0], {**MESSAGES[1], "tool_calls": CALLS}, MESSAGES[2]], tools=TOOLS, template_kwargs={}
    )
    assert admitted.prompt_token_ids == expected
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in hermes.decode(expected)

    think = Tokenizer.from_path(default_model_path(), (TEMPLATES / "chatml_think.jinja").read_text())
    c = TokenizerCore(think, 4096, reply_to="ipc:///tmp/out")
    off = c.admit(
        dataclasses.replace(
            request("r2", messages=MESSAGES[:1], max_tokens=4), chat_template_kwargs='{"enable_thinking": false}'
        )
    )
    assert think.decode(off.prompt_token_ids, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")


def test_a_template_error_on_request_values_is_a_400():
    think = Tokenizer.from_path(default_model_path(), "{{ messages[0].content + enable_thinking }}")
    failed = TokenizerCore(think, 64, reply_to="ipc:///tmp/out").admit(
        dataclasses.replace(request(messages=MESSAGES[:1]), chat_template_kwargs='{"enable_thinking": 1}')
    )
    assert (failed.status, failed.param) == (400, "messages") and "TypeError" in failed.message


def test_special_tokens_kept_in_the_text_except_the_end_token():
    tok = default_tokenizer()
    start, end = tok.encode("<|im_start|>", add_special_tokens=False)[0], min(tok.eos_token_ids)
    c = TokenizerCore(tok, 64, reply_to="ipc:///tmp/out")
    c.admit(dataclasses.replace(request("kept", max_tokens=8), skip_special_tokens=False))
    c.admit(request("skipped", max_tokens=8))
    answer = [*ids_of("Hi"), start, *ids_of(" there"), end]
    out = feed(c, *(tokens(rid, 0, answer, finish="stop") for rid in ("kept", "skipped")))
    texts = {d.request_id: d.text for batch in out.batches.values() for d in batch.deltas}
    assert texts == {"kept": "Hi<|im_start|> there", "skipped": "Hi there"}
