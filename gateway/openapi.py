"""`/openapi.json`, `/docs` and `/version`: the gateway describing itself.

The document states the request bodies as `pagemesh.gateway.parsing`, `.images` and `.audio` check them, with
the same limits (it is what schemathesis fuzzes the gateway with, so a schema looser than the
parser only means more 400s; one stricter would hide inputs from the fuzzer). `/docs` renders the
document in the page itself from the JSON, with no script or stylesheet from anywhere else.
"""

from __future__ import annotations

import html
import importlib.metadata
import json

from aiohttp import web

from pagemesh.common.messages import MAX_ID, MAX_IMAGES
from pagemesh.common.sampling import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_ITEMS,
    MAX_STOP_LEN,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
)
from pagemesh.gateway.chat_options import MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS, MAX_TOOLS, RESERVED_TEMPLATE_VARIABLES
from pagemesh.gateway.embeddings import ENCODING_FORMATS, MAX_INPUTS, POOLINGS
from pagemesh.gateway.openapi_apis import ANTHROPIC, AUDIO, RESPONSES, TRANSCRIPTION_ANSWER, VLLM
from pagemesh.gateway.parsing import CHAT_ROLES, MAX_MESSAGES, MAX_PROMPTS
from pagemesh.gateway.structured_outputs import BACKENDS, MAX_CHOICES

try:
    VERSION = importlib.metadata.version("pagemesh")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"

_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_ID}, "minItems": 1}
_STOP = {
    "oneOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
        {
            "type": "array",
            "maxItems": MAX_STOP_ITEMS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
        },
    ],
    "description": f"at most {MAX_STOP_ITEMS} strings of at most {MAX_STOP_LEN} characters",
}
_SAMPLING = {
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "temperature": {"type": "number", "minimum": 0, "maximum": 100},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
    "stop": _STOP,
    "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_ITEMS, "items": {"type": "integer", "minimum": 0}},
    "logit_bias": {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": f'{{"token id": bias}}, at most {MAX_LOGIT_BIAS} entries',
    },
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean"},
    "speculative": {"type": "boolean", "description": "false: no speculative decoding for this request"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "include_stop_str_in_output": {"type": "boolean"},
    "user": {"type": "string"},
}
_JSON_OR_TEXT = {"oneOf": [{"type": "object"}, {"type": "string"}]}  # a JSON object, or its JSON text
_CHOICES = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}}
_STRUCTURED = {  # structured outputs, on both routes (gateway/structured_outputs.py; docs/api.md)
    "response_format": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
            "json_schema": {
                "type": "object",
                "required": ["schema"],
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}},
            },
            "structures": {"type": "array", "description": "structural_tag: [{begin, schema, end}, ...]"},
            "triggers": {"type": "array", "items": {"type": "string", "minLength": 1}},
        },
    },
    "structured_outputs": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "json": _JSON_OR_TEXT,
            "regex": {"type": "string", "minLength": 1},
            "choice": _CHOICES,
            "grammar": {"type": "string", "minLength": 1, "description": "EBNF (GBNF) or Lark"},
            "json_object": {"type": "boolean"},
            "structural_tag": _JSON_OR_TEXT,
            "whitespace_pattern": {"type": "string", "minLength": 1},
            "disable_any_whitespace": {"type": "boolean"},
            "disable_fallback": {"type": "boolean"},
            "disable_additional_properties": {"type": "boolean", "description": "true is refused"},
        },
        "description": "exactly one of json, regex, choice, grammar, json_object, structural_tag",
    },
    "guided_json": _JSON_OR_TEXT,
    "guided_regex": {"type": "string", "minLength": 1},
    "guided_choice": _CHOICES,
    "guided_grammar": {"type": "string", "minLength": 1, "description": "EBNF (GBNF) or Lark"},
    "guided_whitespace_pattern": {"type": "string", "minLength": 1},
    "guided_decoding_backend": {"enum": list(BACKENDS), "description": "the grammar engine is llguidance"},
}
_TOOL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "a JSON Schema"},
                "strict": {"type": "boolean"},
            },
        },
    },
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "a JSON object, as text"},
            },
        },
    },
}
_CONTENT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_SCHEMAS = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "CompletionRequest": {
        "type": "object",
        "additionalProperties": False,  # any other field is a 400 (gateway/fields.py)
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    _TOKEN_IDS,
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_PROMPTS,
                        "items": {"oneOf": [{"type": "string"}, _TOKEN_IDS]},
                    },
                ]
            },
            **_SAMPLING,
            **_STRUCTURED,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
            "echo": {"type": "boolean"},
            "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "description": "content is required except on an assistant message with tool_calls; a tool message "
        "needs tool_call_id",
        "properties": {
            "role": {"enum": sorted(CHAT_ROLES)},
            "content": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "maxItems": 256, "items": _CONTENT_PART},
                    {"type": "null"},
                ]
            },
            "name": {"type": "string"},
            "tool_calls": {"type": "array", "maxItems": MAX_TOOL_CALLS, "items": _TOOL_CALL},
            "tool_call_id": {"type": "string", "minLength": 1},
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "additionalProperties": False,  # any other field is a 400 (gateway/fields.py)
        "required": ["messages"],
        "properties": {
            "messages": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_MESSAGES,
                "items": {"$ref": "#/components/schemas/ChatMessage"},
            },
            **_SAMPLING,
            **_STRUCTURED,
            "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL},
            "tool_choice": {
                "oneOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "function"],
                        "properties": {
                            "type": {"const": "function"},
                            "function": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}},
                            },
                        },
                    },
                ],
                "description": 'a named function must be among `tools`; "auto" (the default with tools) needs the '
                "gateway's --enable-auto-tool-choice",
            },
            "parallel_tool_calls": {"type": "boolean"},
            "chat_template_kwargs": {
                "type": "object",
                "maxProperties": MAX_TEMPLATE_KWARGS,
                "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_VARIABLES)}},
                "description": 'more variables for the chat template, e.g. {"enable_thinking": false}',
            },
        },
    },
    "ImageRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {"type": "string", "minLength": 1, "maxLength": 4000},
            "model": {"type": "string", "minLength": 1},
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_IMAGES},
            "size": {"type": "string", "pattern": "^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"},
            "response_format": {"const": "b64_json"},
            "seed": {"type": "integer", "minimum": 0},
            "num_inference_steps": {"type": "integer", "minimum": 1},
            "guidance_scale": {"type": "number", "minimum": 0, "maximum": 100},
            "negative_prompt": {"type": "string"},
            "sampler": {"enum": ["ddpm", "ddim", "dpmsolver++", "unipc", "euler"]},
        },
    },
    "EmbeddingRequest": {
        "type": "object",
        "additionalProperties": False,  # any other field is a 400 (gateway/fields.py)
        "required": ["input"],
        "properties": {
            "input": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_INPUTS,
                        "items": {"type": "string", "minLength": 1},
                    },
                    _TOKEN_IDS,
                    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _TOKEN_IDS},
                ]
            },
            "model": {"type": "string"},
            "encoding_format": {"enum": list(ENCODING_FORMATS)},
            "dimensions": {
                "type": "integer",
                "minimum": 1,
                "description": "only the model's hidden size: its embeddings cannot be shortened",
            },
            "user": {"type": "string"},
            "add_special_tokens": {"type": "boolean"},
            "priority": {"type": "integer", "minimum": -(2**31) + 1, "maximum": 2**31 - 1},
            "pooling": {
                "enum": list(POOLINGS),
                "description": "pagemesh's extra: the last token (default) or the mean",
            },
        },
    },
}


def _errors(*statuses: int, schema: dict = _ERROR) -> dict:
    reasons = {
        400: "invalid request (the message names the field and the limit)",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "request body too large",
        429: "per-key rate limit (Retry-After says when to retry)",
        503: "no capacity, or the mesh is not ready (Retry-After)",
        504: "request timed out",
    }
    return {str(s): {"description": reasons[s], "content": {"application/json": {"schema": schema}}} for s in statuses}


def _generation(summary: str, schema: str, error: dict = _ERROR, security: tuple[str, ...] = ("bearer",)) -> dict:
    return {
        "post": {
            "summary": summary,
            "security": [{name: []} for name in security],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {
                    "description": "the result (JSON), or a stream of server-sent events when `stream` is true",
                    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
                },
                **_errors(400, 401, 404, 413, 429, 503, 504, schema=error),
            },
        }
    }


_TEXT = {"text/plain": {"schema": {"type": "string"}}}  # vLLM's LoRA routes answer in words


def _post(summary: str, schema: str, answer: dict | None = None, body: str = "application/json") -> dict:
    """A request (a `body` document) answered with one JSON body (no stream), or with `answer`'s content."""
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {body: {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {
                    "description": "the result",
                    "content": answer or {"application/json": {"schema": {"type": "object"}}},
                },
                **_errors(400, 401, 404, 413, 429, 503, 504),
            },
        }
    }


def _get(summary: str, content_type: str = "application/json", keyed: bool = False, statuses=()) -> dict:
    op = {"summary": summary, "responses": {"200": {"description": "ok", "content": {content_type: {}}}}}
    if keyed:
        op["security"] = [{"bearer": []}]
        statuses = (401, *statuses)
    op["responses"].update(_errors(*statuses))
    return {"get": op}


def build_document() -> dict:
    """The OpenAPI 3.1 document of every route the gateway serves."""
    model_path = _get("one model's card", keyed=True, statuses=(404,))
    model_path["get"]["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pagemesh gateway",
            "version": VERSION,
            "description": "OpenAI-compatible API of a pagemesh mesh. Errors are OpenAI's "
            '`{"error": {"message", "type", "param", "code"}}`.',
        },
        "paths": {
            "/v1/completions": _generation("text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("chat completion", "ChatCompletionRequest"),
            "/v1/messages": _generation(
                "Anthropic's Messages API (errors in Anthropic's shape; the key as Bearer or x-api-key)",
                "MessagesRequest",
                _ANTHROPIC_ERROR,
                ("bearer", "x-api-key"),
            ),
            "/v1/messages/count_tokens": _generation(
                'the prompt tokens of a Messages request: {"input_tokens": n}',
                "CountTokensRequest",
                _ANTHROPIC_ERROR,
                ("bearer", "x-api-key"),
            ),
            "/v1/responses": _generation("OpenAI's Responses API, stateless", "ResponsesRequest"),
            "/v1/images/generations": _generation("image generation", "ImageRequest"),
            "/v1/audio/transcriptions": _post(
                "speech to text: a WAV's transcript",
                "TranscriptionRequest",
                TRANSCRIPTION_ANSWER,
                "multipart/form-data",
            ),
            "/v1/embeddings": _post("embeddings of one input or a batch", "EmbeddingRequest"),
            "/tokenize": _post("a prompt's or chat's token ids (vLLM's)", "TokenizeRequest"),
            "/detokenize": _post("the text of token ids (vLLM's)", "DetokenizeRequest"),
            "/v1/load_lora_adapter": _post("load a LoRA adapter on every LLM worker", "LoadLoRAAdapterRequest", _TEXT),
            "/v1/unload_lora_adapter": _post("unload a LoRA adapter everywhere", "UnloadLoRAAdapterRequest", _TEXT),
            "/v1/models": _get("the served models", keyed=True),
            "/v1/models/{model}": model_path,
            "/health": _get("the gateway is up", "text/plain"),
            "/ready": _get("the mesh can serve", statuses=(503,)),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/version": _get("the server's version"),
            "/openapi.json": _get("this document"),
            "/docs": _get("this document as a page", "text/html"),
            "/": _get("the live status page", "text/html"),
            "/status": _get("the status page's figures: workers, queue, recent requests"),
        },
        "components": {
            "schemas": {**_SCHEMAS, **ANTHROPIC, **RESPONSES, **VLLM, **AUDIO},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


DOCUMENT = build_document()
_DOCUMENT_BYTES = json.dumps(DOCUMENT, indent=1).encode()


async def document(request: web.Request) -> web.Response:
    return web.Response(body=_DOCUMENT_BYTES, content_type="application/json")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def docs_page(request: web.Request) -> web.Response:
    return web.Response(text=_DOCS_HTML, content_type="text/html")


def _docs_html(doc: dict) -> str:
    """Each route with its summary, and each request schema as JSON: a page with nothing to fetch."""
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            rows.append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                f"<td>{html.escape(op['summary'])}</td><td>{'key' if 'security' in op else 'open'}</td></tr>"
            )
    schemas = "".join(
        f"<h3 id='{name}'>{name}</h3><pre>{html.escape(json.dumps(schema, indent=2))}</pre>"
        for name, schema in doc["components"]["schemas"].items()
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>pagemesh API</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td{padding:.2em .8em}"
        "pre{background:#f4f4f4;padding:.5em;overflow:auto}</style></head><body>"
        f"<h1>pagemesh gateway {html.escape(VERSION)}</h1>"
        f"<p>{html.escape(doc['info']['description'])} The machine-readable document: "
        "<a href='/openapi.json'>/openapi.json</a>. Keyed routes need <code>Authorization: Bearer KEY</code> "
        "when the gateway has API keys.</p>"
        f"<table><tr><th>method</th><th>path</th><th>what</th><th>auth</th></tr>{''.join(rows)}</table>"
        f"<h2>Request bodies</h2>{schemas}</body></html>"
    )


_DOCS_HTML = _docs_html(DOCUMENT)
