"""Rendering a model's Jinja chat template the way Hugging Face transformers does.

The template text ships with the model (GGUF `tokenizer.chat_template`, or `chat_template.jinja` /
`tokenizer_config.json` in an HF folder). To produce byte-identical prompts we compile it with
the same environment transformers uses: a sandbox, `trim_blocks` + `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` that does not HTML-escape, `raise_exception` and
`strftime_now` globals, and a no-op `{% generation %}` block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older spellings of the reasoning field; templates may read any of them (as transformers aliases).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Any) -> list[dict]:
    """Check OpenAI-style chat messages; return plain copies with `None` values dropped.

    Each message needs a string `role` and a `content` that is a string or a list of content parts;
    an assistant message may carry `tool_calls` instead of content. Raises ValueError naming the
    offending `messages[i]` field.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: must be a non-empty list of message objects")
    cleaned = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role: required, must be a non-empty string")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"{where}.content: required")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"{where}.content: must be a string or a list of content parts")
        # Templates test for a key's presence, so a None value must look like a missing key.
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        cleaned.append(plain)
    return cleaned


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference.

    `render` returns exactly the string transformers' `apply_chat_template(tokenize=False)` does.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]):
        self.source = source
        self._template = _environment().from_string(source)
        # bos_token, eos_token, unk_token, pad_token: only the ones the model defines.
        self._variables = {name: text for name, text in special_tokens.items() if text is not None}

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """`template_kwargs`: more variables for the template (`enable_thinking`, ...); as in
        transformers, they may shadow the special tokens' variables, not the ones set here. The
        template runs on what a request gave (tools, template variables of any JSON type): any
        error it meets is a jinja2.TemplateError."""
        messages = validate_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._variables, **(template_kwargs or {})},
            )
        except jinja2.TemplateError:
            raise
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
            raise jinja2.TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
