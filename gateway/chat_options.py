"""A chat request's tools and template options, checked: `tools`, `tool_choice`,
`parallel_tool_calls`, `chat_template_kwargs`, and the tool-calling parts of messages (an
assistant's `tool_calls`, a tool message's `tool_call_id`).

tool_choice, as vLLM reads it:

    none      the model answers in text (the template still sees the tools)
    auto      the default when tools are given: the model may call them, a --tool-call-parser finds
              the calls in its text (needs --enable-auto-tool-choice, else a 400)
    required  the grammar makes it write a JSON array of calls: [{"name": ..., "parameters": ...}]
    {"type": "function", "function": {"name": N}}
              the grammar makes it write N's arguments, valid against N's `parameters` schema
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagemesh.gateway.chat_bridge import only_keys
from pagemesh.gateway.errors import invalid

MAX_TOOLS = 128  # OpenAI's limit
MAX_TEMPLATE_KWARGS = 64
MAX_TOOL_CALLS = 128  # per assistant message
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# variables the server itself gives the template: a request may not set them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request says about tools and its chat template. `tool_choice` is "none",
    "auto", "required" or "function" (then `function` names it); `tools` are as given, in
    OpenAI's shape, which is what chat templates read."""

    tools: tuple[dict, ...] = ()
    tool_choice: str = "none"
    function: str | None = None
    parallel_tool_calls: bool = True
    template_kwargs: dict | None = None

    @property
    def forced(self) -> bool:
        """The grammar makes the answer a call (tool_choice required, or a named function)."""
        return self.tool_choice in ("required", "function")

    def tools_json(self) -> str | None:
        return json.dumps(list(self.tools), ensure_ascii=False) if self.tools else None

    def template_kwargs_json(self) -> str | None:
        return json.dumps(self.template_kwargs, ensure_ascii=False) if self.template_kwargs else None

    def json_schema(self) -> dict | None:
        """The schema the answer is held to, as vLLM builds it: a named function's parameters; for
        "required", an array (of one call when parallel_tool_calls is false) of
        {"name": a tool's name, "parameters": its parameters}, the tools' `$defs` at its root."""
        if self.tool_choice == "function":
            return _parameters(self._tool(self.function))
        if self.tool_choice != "required":
            return None
        alternatives, definitions = [], {}
        for tool in self.tools:
            parameters = dict(_parameters(tool))
            name = tool["function"]["name"]
            for key in ("$defs", "definitions"):
                table = parameters.pop(key, None) or {}
                if not isinstance(table, dict):
                    raise invalid(f"tools: {name}'s {key} must be an object", "tools")
                for def_name, schema in table.items():
                    if definitions.setdefault(def_name, schema) != schema:
                        raise invalid(f"tools: two tools define ${key} {def_name!r} differently", "tools")
            alternatives.append(
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                    "required": ["name", "parameters"],
                }
            )
        items = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        if definitions:
            schema["$defs"] = definitions
        return schema

    def _tool(self, name: str | None) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def parse_chat_options(body: dict) -> ChatOptions:
    tools = _tools(body.get("tools"))
    choice, function = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise invalid("parallel_tool_calls: must be a boolean", "parallel_tool_calls")
    return ChatOptions(
        tools=tools,
        tool_choice=choice,
        function=function,
        parallel_tool_calls=parallel is not False,
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
    )


def _tools(value: Any) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(f"tools: must be a list of at most {MAX_TOOLS} tools", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(
                f"{where}: only function tools are supported ({{'type': 'function', 'function': ...}})", where
            )
        only_keys(tool, {"type", "function"}, where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function: required, an object", f"{where}.function")
        only_keys(function, {"name", "description", "parameters", "strict"}, f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise invalid(
                f"{where}.function.name: required, 1 to 64 letters, digits, '_' or '-'", f"{where}.function.name"
            )
        if name in names:
            raise invalid(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise invalid(f"{where}.function.{key}: must be {what}", f"{where}.function.{key}")
        if function.get("strict") is not None and type(function["strict"]) is not bool:
            raise invalid(f"{where}.function.strict: must be a boolean", f"{where}.function.strict")
        kept = {key: v for key, v in function.items() if v is not None}
        tools.append({"type": "function", "function": kept})
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise invalid(f"tool_choice: must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
        if value != "none" and not tools:
            raise invalid(f"tool_choice: {value!r} needs `tools`", "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid(
            'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not any(t["function"]["name"] == name for t in tools):
        raise invalid(f"tool_choice: the function {name[:64]!r} is not among `tools`", "tool_choice")
    return "function", name


def _template_kwargs(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise invalid(
            f"chat_template_kwargs: must be an object of at most {MAX_TEMPLATE_KWARGS} entries", "chat_template_kwargs"
        )
    for key in value:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise invalid(
                f"chat_template_kwargs.{key}: set by the server, not by a request", f"chat_template_kwargs.{key}"
            )
    return dict(value) or None


# --------------------------------------------------------------------------- messages


def tool_calls_field(value: Any, where: str) -> str:
    """An assistant message's `tool_calls` as the wire carries it: JSON text of the calls, each
    function's `arguments` (a JSON string in OpenAI's shape) parsed into the object templates read."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOL_CALLS:
        raise invalid(f"{where}: must be a non-empty list of at most {MAX_TOOL_CALLS} tool calls", where)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise invalid(f"{at}: must be a function call ({{'id', 'type': 'function', 'function'}})", at)
        only_keys(call, {"id", "type", "function"}, at)
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{at}.function: required, with a name and arguments", f"{at}.function")
        only_keys(function, {"name", "arguments"}, f"{at}.function")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments: must be a JSON object (as a string)", f"{at}.function.arguments")
        parsed = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise invalid(f"{at}.id: must be a string", f"{at}.id")
            parsed["id"] = call["id"]
        calls.append(parsed)
    return json.dumps(calls, ensure_ascii=False)
