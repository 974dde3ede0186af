"""`POST /v1/embeddings`: OpenAI's embeddings API, served by the LLM workers that prefill.

    body ──parse_embeddings (a 400 names the field)──▶ one EmbedRequest per input ──▶ tokenizer
      ──▶ (tokenized, its length checked) scheduler ──▶ a prefill or mixed worker: the prompt's
          final-norm hidden state, pooled and L2-normalised ──▶ tokenizer, relayed ──▶ here
    ◀── {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
         "model", "usage": {"prompt_tokens", "total_tokens"}}, inputs in order

`encoding_format` "base64" is OpenAI's: the little-endian float32 bytes of each vector, base64.
`dimensions` only where it changes nothing: a causal LM's embedding is its hidden state, which
cannot be shortened (it is no Matryoshka model), so any other size is a 400 naming the field.
`pooling` ("last", the default, or "mean") is pagemesh's own extra.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from pagemesh.common.messages import MAX_ID, Embedding, EmbedRequest, Pooling, RequestFailed
from pagemesh.common.model_config import read_model_config
from pagemesh.common.protocol import MAX_TOKEN_IDS
from pagemesh.gateway.auth import API_KEY
from pagemesh.gateway.config import GatewayConfig
from pagemesh.gateway.errors import ApiError, from_request_failed, invalid
from pagemesh.gateway.fields import check_embedding_fields
from pagemesh.gateway.limits import KeyLimits, estimate_prompt_tokens
from pagemesh.gateway.mesh import MeshClient
from pagemesh.gateway.parsing import Prompt, check_model, parse_json
from pagemesh.gateway.responses import to_json

log = structlog.get_logger()

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit); each runs as its own request in the mesh
ENCODING_FORMATS = ("float", "base64")
POOLINGS = tuple(p.value for p in Pooling)


@dataclass(frozen=True)
class EmbeddingsCall:
    """A checked embeddings body: each input is (text, None) or (None, token ids)."""

    model: str | None
    inputs: tuple[Prompt, ...]
    encoding_format: str
    dimensions: int | None
    add_special_tokens: bool
    priority: int
    pooling: Pooling

    def requests(self, request_id: str, reply_to: str, arrival_time: float) -> list[EmbedRequest]:
        """One EmbedRequest per input: `<request_id>-<i>`, or `request_id` for a single input."""
        ids = [request_id] if len(self.inputs) == 1 else [f"{request_id}-{i}" for i in range(len(self.inputs))]
        return [
            EmbedRequest(
                request_id=rid,
                prompt_text=text,
                prompt_token_ids=token_ids,
                add_special_tokens=self.add_special_tokens,
                pooling=self.pooling,
                priority=self.priority,
                reply_to=reply_to,
                arrival_time=arrival_time,
            )
            for rid, (text, token_ids) in zip(ids, self.inputs)
        ]


def parse_embeddings(body: dict) -> EmbeddingsCall:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model: must be a string", "model")
    encoding = _field(body, "encoding_format", str, "float")
    if encoding not in ENCODING_FORMATS:
        raise invalid(f"encoding_format: must be 'float' or 'base64', got {encoding[:40]!r}", "encoding_format")
    dimensions = _field(body, "dimensions", int, None)
    if dimensions is not None and dimensions < 1:
        raise invalid("dimensions: must be a positive integer", "dimensions")
    priority = _field(body, "priority", int, 0)
    if not -(2**31) < priority < 2**31:
        raise invalid("priority: must be a 32-bit integer", "priority")
    pooling = _field(body, "pooling", str, Pooling.LAST.value)
    if pooling not in POOLINGS:
        raise invalid(f"pooling: must be one of {list(POOLINGS)}", "pooling")
    _field(body, "user", str, None)  # the client's own bookkeeping: it changes no vector
    check_embedding_fields(body)
    return EmbeddingsCall(
        model=model,
        inputs=_inputs(body.get("input")),
        encoding_format=encoding,
        dimensions=dimensions,
        add_special_tokens=_field(body, "add_special_tokens", bool, True),
        priority=priority,
        pooling=Pooling(pooling),
    )


def _field(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not kind:
        raise invalid(f"{name}: must be {_KINDS[kind]}", name)
    return value


_KINDS = {str: "a string", int: "an integer", bool: "a boolean"}


def _inputs(value: Any) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's
    four shapes); none of them empty."""
    if isinstance(value, str):
        value = [value]
    elif value is None:
        raise invalid("input: required", "input")
    elif not isinstance(value, list) or not value:
        raise invalid("input: must be a non-empty string or list (of strings, token ids or token-id lists)", "input")
    elif all(type(x) is int for x in value):
        value = [value]  # one input of token ids
    if len(value) > MAX_INPUTS:
        raise invalid(f"input: at most {MAX_INPUTS} inputs in one request", "input")
    inputs = []
    for i, item in enumerate(value):
        where = "input" if len(value) == 1 else f"input[{i}]"
        if isinstance(item, str) and item:
            inputs.append((item, None))
        elif isinstance(item, list) and item and len(item) <= MAX_TOKEN_IDS:
            if not all(type(t) is int and 0 <= t <= MAX_ID for t in item):
                raise invalid(f"{where}: token ids must be integers in [0, {MAX_ID}]", where)
            inputs.append((None, item))
        else:
            raise invalid(f"{where}: must be a non-empty string or a non-empty list of token ids", where)
    return tuple(inputs)


def embeddings_response(call: EmbeddingsCall, model: str, results: list[Embedding]) -> dict:
    """OpenAI's list of embeddings (in input order) with its usage."""
    if call.encoding_format == "base64":
        vectors = [base64.b64encode(struct.pack(f"<{len(r.values)}f", *r.values)).decode("ascii") for r in results]
    else:
        vectors = [r.values for r in results]
    tokens = sum(r.prompt_tokens for r in results)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


class EmbeddingsRoute:
    """The handler: the inputs run as requests in the mesh, all answering to one queue; the
    first failure fails the whole call (the others are aborted), as a completion batch does."""

    def __init__(
        self,
        config: GatewayConfig,
        mesh: MeshClient,
        limits: KeyLimits,
        until_serving: Callable[[], Awaitable[None]],
    ):
        self.config, self.mesh, self.limits, self.until_serving = config, mesh, limits, until_serving

    @functools.cached_property
    def hidden_size(self) -> int:
        """The model's hidden size: the length of its embeddings (read once, when first asked)."""
        return read_model_config(self.config.model).hidden_size

    async def handle(self, request: web.Request) -> web.Response:
        arrival = time.monotonic()
        call = parse_embeddings(parse_json(await request.read()))
        check_model(call, self.config.model_names)
        if call.dimensions is not None and call.dimensions != self.hidden_size:
            raise invalid(
                f"dimensions: this model's embeddings have {self.hidden_size} dimensions and cannot be shortened "
                "(it is not a Matryoshka model); leave `dimensions` out",
                "dimensions",
            )
        await self.until_serving()
        request_id = f"embd-{uuid.uuid4().hex}"
        requests = call.requests(request_id, self.mesh.reply_to, time.time())
        queue = self.mesh.open([r.request_id for r in requests])
        admission = self.limits.admit(request[API_KEY], estimate_prompt_tokens(call.inputs, None))
        results: dict[str, Embedding] = {}
        submitted: list[str] = []
        ended: set[str] = set()  # answered, or failed: nothing to abort
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                for r in requests:
                    await self.mesh.submit(r)
                    submitted.append(r.request_id)
                while len(results) < len(requests):
                    reply = await self._next(queue, arrival)
                    ended.add(reply.request_id)
                    if isinstance(reply, RequestFailed):
                        log.info("embedding request failed", status=reply.status, error=reply.message)
                        raise from_request_failed(reply)
                    results[reply.request_id] = reply
            finally:
                for rid in submitted:
                    if rid not in ended:  # the client left, a timeout, or another input failed
                        self.mesh.abort(rid, "client disconnected or the request ended")
                for r in requests:
                    self.mesh.discard(r.request_id)
                admission.finish(sum(e.prompt_tokens for e in results.values()))
        log.info("embedding request done", inputs=len(requests), seconds=round(time.monotonic() - arrival, 4))
        body = embeddings_response(call, self.config.served_model, [results[r.request_id] for r in requests])
        return web.Response(body=to_json(body), content_type="application/json")

    async def _next(self, queue: asyncio.Queue, arrival: float) -> Embedding | RequestFailed:
        remaining = arrival + self.config.request_timeout - time.monotonic()
        try:
            _, reply = await asyncio.wait_for(queue.get(), max(remaining, 0.0))
        except TimeoutError:
            timeout = self.config.request_timeout
            raise ApiError(504, f"request timed out after {timeout:g} s", "server_error", None, "timeout") from None
        return reply
