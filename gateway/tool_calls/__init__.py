"""Tool calls in a chat answer: one parser per model family (`--tool-call-parser`), and the two
that read what the grammar of tool_choice "required" or a named function made the model write.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen 2.5/3)
    llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>   (Llama 3.x)
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}]   (Mistral)
"""

from __future__ import annotations

from collections.abc import Callable

from pagemesh.gateway.tool_calls.base import CallDelta, ToolCall, ToolCallParser, ToolDelta
from pagemesh.gateway.tool_calls.forced import NamedCallParser
from pagemesh.gateway.tool_calls.llama3_json import Llama3JsonParser
from pagemesh.gateway.tool_calls.tagged import hermes, mistral, required_calls

# name -> a new parser for one choice (parallel: keep more than one call)
TOOL_CALL_PARSERS: dict[str, Callable[[bool], ToolCallParser]] = {
    "hermes": hermes,
    "llama3_json": Llama3JsonParser,
    "mistral": mistral,
}
# the parsers whose marker may be a special token: the answer is detokenized with special tokens
# kept for them, as vLLM does (`[TOOL_CALLS]` is one in Mistral's vocabulary, `<tool_call>` in some)
KEEP_SPECIAL_TOKENS = frozenset({"hermes", "mistral"})

__all__ = [
    "KEEP_SPECIAL_TOKENS",
    "TOOL_CALL_PARSERS",
    "CallDelta",
    "NamedCallParser",
    "ToolCall",
    "ToolCallParser",
    "ToolDelta",
    "required_calls",
]
