"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat path.

A Messages request becomes a chat completion request (`to_chat`), parsed and run like any chat;
`MessagesAnswer` (gateway/anthropic_answer.py) writes the chat completion back as a Message.

    system                          -> a "system" message first
    user text blocks                -> a "user" message (text parts)
    user tool_result blocks         -> "tool" messages (tool_call_id = tool_use_id)
    assistant text + tool_use       -> an "assistant" message with tool_calls
    tools (name, description, input_schema) -> function tools
    tool_choice auto | any | tool | none    -> "auto" | "required" | {"function": name} | "none"
    stop_sequences                  -> stop (the matched one is kept in the text, to be named; the
                                       answer cuts it off and reports it as `stop_sequence`)

Errors leave in Anthropic's shape (`error_body`), with the statuses the gateway gives them.
"""

from __future__ import annotations

import json
from typing import Any

from pagemesh.gateway.chat_bridge import only_keys, renamed
from pagemesh.gateway.errors import ApiError, invalid
from pagemesh.gateway.fields import check_fields
from pagemesh.gateway.parsing import MAX_CONTENT_PARTS, MAX_MESSAGES, ParsedRequest, parse_chat

PATH = "/v1/messages"

# The top-level fields Anthropic defines for /v1/messages (its API reference), and the ones this
# server honours. `cache_control` (here and on blocks) asks for a prompt-cache breakpoint: the
# prefix cache keeps every prompt's pages while it has room, so it is honoured as it stands.
DEFINED = {
    "cache_control", "container", "context_management", "inference_geo", "max_tokens", "mcp_servers",
    "messages", "metadata", "model", "output_config", "service_tier", "stop_sequences", "stream", "system",
    "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p",
}  # fmt: skip
HONOURED = {
    "cache_control", "max_tokens", "messages", "metadata", "model", "stop_sequences", "stream", "system",
    "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p",
}  # fmt: skip
COUNT_TOKENS_DEFINED = {
    "cache_control", "context_management", "mcp_servers", "messages", "model", "output_config", "system",
    "thinking", "tool_choice", "tools",
}  # fmt: skip
COUNT_TOKENS_HONOURED = {"cache_control", "messages", "model", "system", "thinking", "tool_choice", "tools"}

# chat field -> the Messages field it came from (errors the chat parser raises name the latter)
_RENAMES = {"stop": "stop_sequences", "user": "metadata.user_id", "parallel_tool_calls": "tool_choice"}

# Anthropic's error type for each status the gateway answers with
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def owns(path: str) -> bool:
    """The path is one of this API's (its errors are written in Anthropic's shape)."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(error: ApiError) -> dict:
    """Anthropic's `{"type": "error", "error": {"type", "message"}}` for an ApiError."""
    kind = _ERROR_TYPES.get(error.status)
    if kind is None:
        if error.status < 500:
            kind = "invalid_request_error"
        else:
            kind = "overloaded_error" if error.code == "overloaded" else "api_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def parse_messages(body: dict) -> ParsedRequest:
    """A Messages request, checked, as the chat request it runs as."""
    check_fields(body, HONOURED, DEFINED)
    if body.get("max_tokens") is None:
        raise invalid("max_tokens: required", "max_tokens")
    if body.get("model") is None:
        raise invalid("model: required", "model")
    chat, origins = to_chat(body)
    try:
        return parse_chat(chat)
    except ApiError as e:
        raise renamed(e, origins, _RENAMES) from None


def parse_count_tokens(body: dict) -> ParsedRequest:
    """A count_tokens request, checked, as the chat request whose prompt it counts: its tools and
    tool blocks are rendered by the chat template as a Messages request's are."""
    check_fields(body, COUNT_TOKENS_HONOURED, COUNT_TOKENS_DEFINED)
    if body.get("model") is None:
        raise invalid("model: required", "model")
    chat, origins = to_chat(body)
    try:
        return parse_chat(chat)
    except ApiError as e:
        raise renamed(e, origins, _RENAMES) from None


def to_chat(body: dict) -> tuple[dict, list[str]]:
    """The chat request body of a Messages request, and for each chat message the Messages
    field it came from (`system`, `messages[i]`)."""
    _thinking(body.get("thinking"))
    _cache_control(body.get("cache_control"), "cache_control")
    messages, origins = [], []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_parts(body["system"], "system")})
        origins.append("system")
    for message, origin in _messages(body.get("messages")):
        messages.append(message)
        origins.append(origin)
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop_sequences: must be a list of strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
            chat["include_stop_str_in_output"] = True  # to name the one that matched; the answer cuts it
    user = _metadata_user(body.get("metadata"))
    if user is not None:
        chat["user"] = user
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    return chat, origins


# --------------------------------------------------------------------------- parts


def _messages(value: Any):
    """(chat message, origin) for each chat message the Messages conversation becomes."""
    if not isinstance(value, list) or not value:
        raise invalid("messages: required, a non-empty list of messages", "messages")
    if len(value) > MAX_MESSAGES:
        raise invalid(f"messages: at most {MAX_MESSAGES} messages", "messages")
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where}: must be an object with role and content", where)
        only_keys(message, {"role", "content"}, where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role: must be 'user' or 'assistant'", f"{where}.role")
        if isinstance(content, str):
            yield {"role": role, "content": content}, where
            continue
        blocks = _blocks(content, f"{where}.content")
        if role == "user":
            yield from ((m, where) for m in _user_messages(blocks, f"{where}.content"))
        else:
            yield _assistant_message(blocks, f"{where}.content"), where
    if value[-1].get("role") != "user":
        raise invalid(
            "messages: the last message must be a user message (continuing an assistant message is not supported)",
            "messages",
        )


def _blocks(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value or len(value) > MAX_CONTENT_PARTS:
        raise invalid(f"{where}: must be a string or a list of 1 to {MAX_CONTENT_PARTS} content blocks", where)
    for j, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}[{j}]: must be a content block object with a type", f"{where}[{j}]")
    return value


def _user_messages(blocks: list[dict], where: str) -> list[dict]:
    """Text blocks as user messages, each tool_result as a tool message, in their order."""
    out: list[dict] = []
    text: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block["type"] == "text":
            text.append(_text_block(block, at))
        elif block["type"] == "image":
            text.append(_image_block(block, at))
        elif block["type"] == "tool_result":
            if text:
                out.append({"role": "user", "content": text})
                text = []
            out.append(_tool_result(block, at))
        else:
            raise invalid(f"{at}.type: {block['type'][:40]!r} blocks are not supported in user messages", at)
    if text:
        out.append({"role": "user", "content": text})
    return out


def _image_block(block: dict, where: str) -> dict:
    """An image block with a base64 source, as the chat route's image_url part (a data: URL)."""
    only_keys(block, {"type", "source", "cache_control"}, where)
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise invalid(f"{where}.source: only base64 image sources are served (no URLs are fetched)", f"{where}.source")
    only_keys(source, {"type", "media_type", "data"}, f"{where}.source")
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not media_type.startswith("image/") or not isinstance(data, str):
        raise invalid(f"{where}.source: media_type (image/...) and data (base64) are required", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def _assistant_message(blocks: list[dict], where: str) -> dict:
    text, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block["type"] == "text":
            text.append(_text_block(block, at))
        elif block["type"] == "tool_use":
            only_keys(block, {"type", "id", "name", "input", "cache_control"}, at)
            _cache_control(block.get("cache_control"), f"{at}.cache_control")
            for name in ("id", "name"):
                if not isinstance(block.get(name), str) or not block[name]:
                    raise invalid(f"{at}.{name}: required, a non-empty string", f"{at}.{name}")
            if not isinstance(block.get("input"), dict):
                raise invalid(f"{at}.input: required, an object", f"{at}.input")
            arguments = json.dumps(block["input"], ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        else:
            raise invalid(f"{at}.type: {block['type'][:40]!r} blocks are not supported in assistant messages", at)
    # no text: "" rather than null, which chat templates without tool support cannot render
    message: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_result(block: dict, where: str) -> dict:
    only_keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
    _cache_control(block.get("cache_control"), f"{where}.cache_control")
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id: required, a non-empty string", f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _joined(_text_parts(content, f"{where}.content"))
    is_error = block.get("is_error")
    if is_error is not None and type(is_error) is not bool:
        raise invalid(f"{where}.is_error: must be a boolean", f"{where}.is_error")
    if is_error:  # chat's tool messages have no error flag: the model reads it in the text
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _text_parts(value: Any, where: str) -> str | list[dict]:
    """A string, or a list of text blocks as chat text parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or len(value) > MAX_CONTENT_PARTS:
        raise invalid(f"{where}: must be a string or a list of at most {MAX_CONTENT_PARTS} text blocks", where)
    parts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            named = f"{kind[:40]!r} blocks are" if isinstance(kind, str) else "it is"
            raise invalid(f"{at}: only text blocks are supported here; {named} not", at)
        parts.append(_text_block(block, at))
    return parts


def _text_block(block: dict, where: str) -> dict:
    only_keys(block, {"type", "text", "cache_control", "citations"}, where)
    _cache_control(block.get("cache_control"), f"{where}.cache_control")
    if block.get("citations"):
        raise invalid(f"{where}.citations: not supported by this server", f"{where}.citations")
    if not isinstance(block.get("text"), str):
        raise invalid(f"{where}.text: required, a string", f"{where}.text")
    return {"type": "text", "text": block["text"]}


def _joined(parts: str | list[dict]) -> str:
    return parts if isinstance(parts, str) else "\n".join(p["text"] for p in parts)


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise invalid("tools: must be a list of tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where}: must be a tool object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise invalid(f"{where}.type: {str(kind)[:40]!r} tools are not supported (only client tools)", where)
        only_keys(tool, {"type", "name", "description", "input_schema", "cache_control"}, where)
        _cache_control(tool.get("cache_control"), f"{where}.cache_control")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid(f"{where}.name: required, a non-empty string", f"{where}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise invalid(f"{where}.input_schema: required, a JSON Schema object", f"{where}.input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise invalid(f"{where}.description: must be a string", f"{where}.description")
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> dict:
    """The chat fields of a tool_choice: tool_choice, and parallel_tool_calls when it is turned off."""
    kind = value.get("type") if isinstance(value, dict) else None
    allowed = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"}}
    allowed |= {"tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if not isinstance(kind, str) or kind not in allowed:
        raise invalid("tool_choice: must be an object with type 'auto', 'any', 'tool' or 'none'", "tool_choice")
    only_keys(value, allowed[kind], "tool_choice")
    if kind == "tool":
        if not isinstance(value.get("name"), str) or not value["name"]:
            raise invalid("tool_choice.name: required, a non-empty string", "tool_choice.name")
        chat: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": value["name"]}}}
    else:
        chat = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[kind]}
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and type(disable) is not bool:
        raise invalid("tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice")
    if disable:
        chat["parallel_tool_calls"] = False
    return chat


def _metadata_user(value: Any) -> str | None:
    """metadata.user_id: an end user's id for the client's own bookkeeping, as chat's `user`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("metadata: must be an object", "metadata")
    only_keys(value, {"user_id"}, "metadata")
    user = value.get("user_id")
    if user is not None and not isinstance(user, str):
        raise invalid("metadata.user_id: must be a string", "metadata.user_id")
    return user


def _thinking(value: Any) -> None:
    if value is None:
        return
    if not (isinstance(value, dict) and value.get("type") == "disabled"):
        raise invalid("thinking: extended thinking is not supported by this server (only type 'disabled')", "thinking")
    only_keys(value, {"type"}, "thinking")


def _cache_control(value: Any, where: str) -> None:
    if value is None:
        return
    if not (isinstance(value, dict) and value.get("type") == "ephemeral"):
        raise invalid(f"{where}: must be {{'type': 'ephemeral'}}", where)
    only_keys(value, {"type", "ttl"}, where)
    if value.get("ttl") not in (None, "5m", "1h"):
        raise invalid(f"{where}.ttl: must be '5m' or '1h'", f"{where}.ttl")
