"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes, answered by the tokenizer process.

    {"prompt": str} | {"messages": [...]}  ──TokenizeRequest──▶ tokenizer
        ◀── {"count", "max_model_len", "tokens", "token_strs"}
    {"tokens": [ids]}  ──DetokenizeRequest──▶ tokenizer  ◀── {"prompt": text}

The gateway checks each field's shape (a 400 names it; a field vLLM defines that is not honoured
here is a 400 too, gateway/fields.py); the tokenizer renders the chat template and answers what
only it knows (an id outside the vocabulary, a template's refusal), as a 400 naming the field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pagemesh.common.messages import MAX_ID, DetokenizeRequest, TokenizeRequest
from pagemesh.common.protocol import MAX_TOKEN_IDS
from pagemesh.gateway.auth import API_KEY
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.errors import invalid
from pagemesh.gateway.fields import check_detokenize_fields, check_tokenize_fields
from pagemesh.gateway.limits import KeyLimits
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.parsing import _messages as chat_messages  # the chat route's own checks
from pagemesh.gateway.parsing import check_model, parse_json


@dataclass(frozen=True)
class TokenizeCall:
    """A checked /tokenize body: a prompt or chat messages (exactly one)."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool

    def request(self, request_id: str, reply_to: str) -> TokenizeRequest:
        return TokenizeRequest(
            request_id=request_id,
            reply_to=reply_to,
            prompt_text=self.prompt,
            messages=self.messages,
            add_special_tokens=self.add_special_tokens,
            add_generation_prompt=self.add_generation_prompt,
            return_token_strs=self.return_token_strs,
        )


@dataclass(frozen=True)
class DetokenizeCall:
    model: str | None
    tokens: list[int]


def parse_tokenize(body: dict) -> TokenizeCall:
    """vLLM's defaults: a prompt gets the tokenizer's special tokens (BOS) unless
    `add_special_tokens` is false; messages do not (the chat template writes its own) unless it
    is true, and end with the assistant's header unless `add_generation_prompt` is false."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if prompt is None and messages is None:
        raise invalid("prompt: required, a string (or `messages`, a chat)", "prompt")
    if prompt is not None and messages is not None:
        raise invalid("messages: give `prompt` or `messages`, not both", "messages")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid("prompt: must be a string", "prompt")
    if prompt is not None and body.get("add_generation_prompt") is not None:
        raise invalid("add_generation_prompt: only with `messages`", "add_generation_prompt")
    if _bool(body, "continue_final_message", False):
        raise invalid("continue_final_message: not supported by this server", "continue_final_message")
    check_tokenize_fields(body)
    return TokenizeCall(
        model=_model(body),
        prompt=prompt,
        messages=_text_messages(messages) if messages is not None else None,
        add_special_tokens=_bool(body, "add_special_tokens", prompt is not None),
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        return_token_strs=_bool(body, "return_token_strs", False),
    )


def _text_messages(messages) -> list[dict[str, str]]:
    urls: list[str] = []
    out = chat_messages(messages, urls)
    if urls:
        raise invalid("messages: /tokenize takes text only; image_url parts are counted by a chat request", "messages")
    return out


def parse_detokenize(body: dict) -> DetokenizeCall:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKEN_IDS:
        raise invalid(f"tokens: required, a list of at most {MAX_TOKEN_IDS} token ids", "tokens")
    if not all(type(t) is int and 0 <= t <= MAX_ID for t in tokens):
        raise invalid(f"tokens: token ids must be integers in [0, {MAX_ID}]", "tokens")
    check_detokenize_fields(body)
    return DetokenizeCall(model=_model(body), tokens=tokens)


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model: must be a string", "model")
    return model


def _bool(body: dict, name: str, default: bool) -> bool:
    value: Any = body.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise invalid(f"{name}: must be a boolean", name)
    return value


class TokenRoutes:
    """The two handlers: each request is one call to the tokenizer (MeshClient.call), counted
    against its key's concurrency (not its tokens: nothing runs on a worker)."""

    def __init__(self, config: GatewayConfig, mesh: MeshClient, limits: KeyLimits):
        self.config, self.mesh, self.limits = config, mesh, limits

    async def tokenize(self, request: web.Request) -> web.Response:
        call = parse_tokenize(parse_json(await request.read()))
        check_model(call, self.config.model_names)
        result = await self._call(request, call.request(f"tok-{uuid.uuid4().hex}", self.mesh.reply_to))
        return web.json_response(
            {
                "count": len(result.token_ids),
                "max_model_len": result.max_model_len,
                "tokens": result.token_ids,
                "token_strs": result.token_strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        call = parse_detokenize(parse_json(await request.read()))
        check_model(call, self.config.model_names)
        request_id = f"detok-{uuid.uuid4().hex}"
        reply_to = self.mesh.reply_to
        result = await self._call(
            request, DetokenizeRequest(request_id=request_id, reply_to=reply_to, token_ids=call.tokens)
        )
        return web.json_response({"prompt": result.text})

    async def _call(self, request: web.Request, call: TokenizeRequest | DetokenizeRequest):
        admission = self.limits.admit(request[API_KEY], None)
        try:
            return await self.mesh.call(call, self.config.request_timeout)
        finally:
            admission.finish(0)
