"""What the APIs that run as chat completions (Anthropic's Messages, OpenAI's Responses) share on
the way in: each turns its body into a chat request body and remembers, for each chat message,
the field of its own body it came from, so that an error of the chat parser names that field.
"""

from __future__ import annotations

import dataclasses

from pagemesh.gateway.errors import ApiError, invalid


def only_keys(obj: dict, allowed: set[str], where: str) -> None:
    """Refuse a non-null key of `obj` outside `allowed` (400 naming it): no field of a nested
    object is ignored either."""
    for key, value in obj.items():
        if value is not None and key not in allowed:
            allowed_names = ", ".join(sorted(allowed))
            raise invalid(f"{where}.{key}: not supported here (allowed: {allowed_names})", f"{where}.{key}")


def renamed(error: ApiError, origins: list[str], renames: dict[str, str]) -> ApiError:
    """An error of the chat parser, naming the field of the original body: `messages[k]...` ->
    `origins[k]...`, a top-level chat field by `renames` (chat name -> original name)."""
    param = error.param
    if param is None:
        return error
    head, dot, rest = param.partition(".")
    if head.startswith("messages[") and head.endswith("]") and head[9:-1].isdecimal():
        k = int(head[9:-1])
        new = origins[k] + dot + rest if k < len(origins) else param
    else:
        new = renames.get(head, head) + dot + rest
    if new == param:
        return error
    message = new + error.message[len(param) :] if error.message.startswith(param) else error.message
    return dataclasses.replace(error, param=new, message=message)
