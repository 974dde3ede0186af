"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat path.

A Responses request becomes a chat completion request (`to_chat`), parsed and run like any chat;
`ResponsesAnswer` (gateway/openai_responses_answer.py) writes the chat completion back as a
Response.

    instructions                        -> a "system" message first
    input: a string                     -> one "user" message
    input items: message (input_text / output_text parts) -> a message of its role
                 function_call          -> a tool call of an "assistant" message (consecutive
                                           calls, and the assistant text before them, are one message)
                 function_call_output   -> a "tool" message
    tools (function), tool_choice       -> chat's function tools, tool_choice
    text.format                         -> response_format
    max_output_tokens                   -> max_tokens

Nothing is stored: `store` may only be false (or absent), and `previous_response_id` and
`conversation`, which need stored state, are refused naming themselves.
"""

from __future__ import annotations

from typing import Any

from pagemesh.gateway.chat_bridge import only_keys, renamed
from pagemesh.gateway.errors import ApiError, invalid
from pagemesh.gateway.fields import check_fields
from pagemesh.gateway.parsing import MAX_CONTENT_PARTS, MAX_MESSAGES, ParsedRequest, parse_chat

PATH = "/v1/responses"

# The fields OpenAI defines for POST /v1/responses (its API reference), and those honoured here.
DEFINED = {
    "access_programs", "background", "background_options", "context_management", "conversation", "image",
    "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "moderation", "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier",
    "store", "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs",
    "top_p", "truncation", "user",
}  # fmt: skip
HONOURED = {
    "background", "input", "instructions", "max_output_tokens", "metadata", "model", "parallel_tool_calls",
    "store", "stream", "temperature", "text", "tool_choice", "tools", "top_p", "truncation", "user",
}  # fmt: skip
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 and values of 512 characters

# chat field -> the Responses field it came from (errors the chat parser raises name the latter)
_RENAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
_PASSED = ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls")  # same name, same meaning


def parse_responses(body: dict) -> ParsedRequest:
    """A Responses request, checked, as the chat request it runs as."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise invalid(f"{name}: this server keeps no responses or conversations; send the whole input", name)
    check_fields(body, HONOURED, DEFINED)
    _only_value(body, "store", False, "this server keeps no responses; store must be false")
    _only_value(body, "background", False, "background responses are not supported")
    _only_value(body, "truncation", "disabled", "an input too long for the context is an error, never truncated")
    metadata(body)
    chat, origins = to_chat(body)
    try:
        return parse_chat(chat)
    except ApiError as e:
        raise renamed(e, origins, _RENAMES) from None


def metadata(body: dict) -> dict | None:
    """The request's metadata (echoed in the response), checked."""
    value = body.get("metadata")
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise invalid(f"metadata: must be an object of at most {MAX_METADATA} pairs", "metadata")
    for key, text in value.items():
        if len(key) > 64 or not isinstance(text, str) or len(text) > 512:
            raise invalid("metadata: keys of at most 64 and string values of at most 512 characters", "metadata")
    return value


def to_chat(body: dict) -> tuple[dict, list[str]]:
    """The chat request body of a Responses request, and for each chat message the Responses
    field it came from (`instructions`, `input`, `input[i]`)."""
    messages: list[dict] = []
    origins: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions: must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    _input_messages(body.get("input"), messages, origins)
    chat: dict[str, Any] = {"messages": messages}
    for name in _PASSED:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("text: must be an object", "text")
        only_keys(text, {"format"}, "text")
        if text.get("format") is not None:
            chat["response_format"] = _response_format(text["format"])
    return chat, origins


# --------------------------------------------------------------------------- parts


def _input_messages(value: Any, messages: list[dict], origins: list[str]) -> None:
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        origins.append("input")
        return
    if not isinstance(value, list) or not value:
        raise invalid("input: required, a string or a non-empty list of input items", "input")
    if len(value) > MAX_MESSAGES:
        raise invalid(f"input: at most {MAX_MESSAGES} items", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: must be an input item object", where)
        kind = item.get("type", "message")
        if kind == "message":
            only_keys(item, {"type", "role", "content", "id", "status"}, where)
            messages.append(_message(item, where))
            origins.append(where)
        elif kind == "function_call":
            only_keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
            call = {"id": _string(item, "call_id", where), "type": "function"}
            call["function"] = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and origins[-1].startswith("input["):
                last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text and its calls
            else:
                # no text: "" rather than null, which chat templates without tool support cannot render
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                origins.append(where)
        elif kind == "function_call_output":
            only_keys(item, {"type", "call_id", "output", "id", "status"}, where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{where}.output", ("input_text",))
            if isinstance(text, list):
                text = "\n".join(p["text"] for p in text)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
            origins.append(where)
        else:
            raise invalid(f"{where}.type: {str(kind)[:40]!r} input items are not supported", f"{where}.type")


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(f"{where}.role: must be 'user', 'assistant', 'system' or 'developer'", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
    kinds += ("input_image",) if role == "user" else ()
    return {"role": role, "content": _text_parts(content, f"{where}.content", kinds)}


def _text_parts(value: Any, where: str, kinds: tuple[str, ...]) -> list[dict]:
    """Text content parts (input_text, or output_text in an assistant's turn) as chat text parts;
    a user's input_image as an image_url part."""
    if not isinstance(value, list) or len(value) > MAX_CONTENT_PARTS:
        raise invalid(f"{where}: must be a string or a list of at most {MAX_CONTENT_PARTS} content parts", where)
    parts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            named = f"{kind[:40]!r} parts are" if isinstance(kind, str) else "it is"
            raise invalid(f"{at}: only {' and '.join(kinds)} parts are supported here; {named} not", at)
        if kind == "input_image":  # a user's image, as the chat route's image_url part (gateway/media.py)
            only_keys(part, {"type", "image_url", "detail"}, at)
            if not isinstance(part.get("image_url"), str):
                raise invalid(f"{at}.image_url: required, a data: URL (file_id is not supported)", f"{at}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        only_keys(part, {"type", "text", "annotations", "logprobs"}, at)
        if part.get("annotations") or part.get("logprobs"):
            raise invalid(f"{at}: annotations and logprobs of earlier output are not supported", at)
        if not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text: required, a string", f"{at}.text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise invalid("tools: must be a list of tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"{where}.type: {str(kind)[:40]!r} tools are not supported (only function tools)", where)
        only_keys(tool, {"type", "name", "description", "parameters", "strict"}, where)
        function = {"name": _string(tool, "name", where)}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> str | dict:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        only_keys(value, {"type", "name"}, "tool_choice")
        return {"type": "function", "function": {"name": _string(value, "name", "tool_choice")}}
    raise invalid("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _response_format(value: Any) -> dict:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        only_keys(value, {"type"}, "text.format")
        return {"type": kind}
    if kind == "json_schema":
        only_keys(value, {"type", "name", "schema", "strict", "description"}, "text.format")
        spec = {k: value[k] for k in ("name", "schema", "strict", "description") if value.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("text.format: type must be 'text', 'json_object' or 'json_schema'", "text.format")


def _string(obj: dict, name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{name}: required, a non-empty string", f"{where}.{name}")
    return value


def _only_value(body: dict, name: str, allowed: object, why: str) -> None:
    if body.get(name) is not None and body[name] != allowed:
        raise invalid(f"{name}: {why}", name)
