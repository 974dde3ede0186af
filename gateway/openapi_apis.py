"""The OpenAPI schemas of the APIs served over the chat path: Anthropic's Messages
(gateway/anthropic.py) and OpenAI's Responses (gateway/openai_responses.py), and of vLLM's own
routes, as strict as their parsers, in the document `pagemesh.gateway.openapi` serves."""

from __future__ import annotations

from pagemesh.common.messages import MAX_ID
from pagemesh.common.sampling import MAX_STOP_ITEMS, MAX_STOP_LEN, MAX_TOKENS_LIMIT
from pagemesh.gateway.openai_responses import MAX_METADATA
from pagemesh.gateway.parsing import MAX_CONTENT_PARTS, MAX_MESSAGES


def _object(required: list[str], **properties) -> dict:
    """An object with exactly these properties (any other is a 400)."""
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


_STRING = {"type": "string"}
_NAME = {"type": "string", "minLength": 1}
_SCHEMA = {"type": "object", "description": "a JSON Schema"}
_SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 100},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "stream": {"type": "boolean"},
}

# ---- Anthropic's Messages

_CACHE_CONTROL = _object(["type"], type={"const": "ephemeral"}, ttl={"enum": ["5m", "1h"]})
_A_TEXT = _object(["type", "text"], type={"const": "text"}, text=_STRING, cache_control=_CACHE_CONTROL)
_A_TEXTS = {"type": "array", "maxItems": MAX_CONTENT_PARTS, "items": _A_TEXT}
_A_TOOL_USE = _object(
    ["type", "id", "name", "input"],
    type={"const": "tool_use"},
    id=_NAME,
    name=_NAME,
    input={"type": "object"},
    cache_control=_CACHE_CONTROL,
)
_A_TOOL_RESULT = _object(
    ["type", "tool_use_id"],
    type={"const": "tool_result"},
    tool_use_id=_NAME,
    content={"oneOf": [_STRING, _A_TEXTS]},
    is_error={"type": "boolean"},
    cache_control=_CACHE_CONTROL,
)
_A_BLOCKS = {"type": "array", "minItems": 1, "maxItems": MAX_CONTENT_PARTS}
_A_TOOL_CHOICE_PARALLEL = {"disable_parallel_tool_use": {"type": "boolean"}}
_A_TOOLS_AND_SYSTEM = {
    "system": {"oneOf": [_STRING, _A_TEXTS]},
    "tools": {
        "type": "array",
        "items": _object(
            ["name", "input_schema"],
            type={"const": "custom"},
            name=_NAME,
            description=_STRING,
            input_schema=_SCHEMA,
            cache_control=_CACHE_CONTROL,
        ),
    },
    "tool_choice": {
        "oneOf": [
            _object(["type"], type={"enum": ["auto", "any"]}, **_A_TOOL_CHOICE_PARALLEL),
            _object(["type", "name"], type={"const": "tool"}, name=_NAME, **_A_TOOL_CHOICE_PARALLEL),
            _object(["type"], type={"const": "none"}),
        ]
    },
    "thinking": _object(["type"], type={"const": "disabled"}),
    "cache_control": _CACHE_CONTROL,
}

ANTHROPIC = {
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": _STRING, "message": _STRING},
            },
        },
    },
    "AnthropicMessage": _object(
        ["role", "content"],
        role={"enum": ["user", "assistant"]},
        content={
            "oneOf": [
                _STRING,
                {**_A_BLOCKS, "items": {"oneOf": [_A_TEXT, _A_TOOL_USE, _A_TOOL_RESULT]}},
            ],
            "description": "user turns: text and tool_result blocks; assistant turns: text and tool_use blocks",
        },
    ),
    "MessagesRequest": _object(
        ["model", "max_tokens", "messages"],
        model=_STRING,
        max_tokens={"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
        messages={
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_MESSAGES,
            "items": {"$ref": "#/components/schemas/AnthropicMessage"},
            "description": "the last message is a user message",
        },
        stop_sequences={
            "type": "array",
            "maxItems": MAX_STOP_ITEMS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
        },
        top_k={"type": "integer", "minimum": -1},
        metadata=_object([], user_id={"type": ["string", "null"]}),
        **_SAMPLING,
        **_A_TOOLS_AND_SYSTEM,
    ),
    "CountTokensRequest": _object(
        ["model", "messages"],
        model=_STRING,
        messages={
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_MESSAGES,
            "items": _object(
                ["role", "content"],
                role={"enum": ["user", "assistant"]},
                content={"oneOf": [_STRING, {**_A_BLOCKS, "items": _A_TEXT}]},
            ),
            "description": "text only (tools and tool blocks are not counted here); the last message is a user message",
        },
        system=_A_TOOLS_AND_SYSTEM["system"],
        thinking=_A_TOOLS_AND_SYSTEM["thinking"],
        cache_control=_CACHE_CONTROL,
    ),
}

# ---- OpenAI's Responses

_R_TEXT = _object(["type", "text"], type={"const": "input_text"}, text=_STRING)
_R_OUTPUT_TEXT = _object(
    ["type", "text"],
    type={"const": "output_text"},
    text=_STRING,
    annotations={"type": "array", "maxItems": 0},
    logprobs={"type": "array", "maxItems": 0},
)
_R_PARTS = {"type": "array", "maxItems": MAX_CONTENT_PARTS}
_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_R_ITEM = {
    "oneOf": [
        _object(
            ["role", "content"],
            type={"const": "message"},
            role={"enum": ["user", "system", "developer"]},
            content={"oneOf": [_STRING, {**_R_PARTS, "items": _R_TEXT}]},
            id=_STRING,
            status=_STATUS,
        ),
        _object(
            ["role", "content"],
            type={"const": "message"},
            role={"const": "assistant"},
            content={"oneOf": [_STRING, {**_R_PARTS, "items": {"oneOf": [_R_OUTPUT_TEXT, _R_TEXT]}}]},
            id=_STRING,
            status=_STATUS,
        ),
        _object(
            ["type", "call_id", "name", "arguments"],
            type={"const": "function_call"},
            call_id=_NAME,
            name=_NAME,
            arguments={**_NAME, "description": "the call's arguments, a JSON object as text"},
            id=_STRING,
            status=_STATUS,
        ),
        _object(
            ["type", "call_id", "output"],
            type={"const": "function_call_output"},
            call_id=_NAME,
            output={"oneOf": [_STRING, {**_R_PARTS, "items": _R_TEXT}]},
            id=_STRING,
            status=_STATUS,
        ),
    ]
}
_R_FORMAT = {
    "oneOf": [
        _object(["type"], type={"enum": ["text", "json_object"]}),
        _object(
            ["type", "name", "schema"],
            type={"const": "json_schema"},
            name=_NAME,
            schema=_SCHEMA,
            strict={"type": "boolean"},
            description=_STRING,
        ),
    ]
}

RESPONSES = {
    "ResponsesRequest": _object(
        ["input"],
        model=_STRING,
        input={
            "oneOf": [_STRING, {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _R_ITEM}],
        },
        instructions=_STRING,
        max_output_tokens={"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
        tools={
            "type": "array",
            "items": _object(
                ["type", "name"],
                type={"const": "function"},
                name=_NAME,
                description=_STRING,
                parameters=_SCHEMA,
                strict={"type": "boolean"},
            ),
        },
        tool_choice={
            "oneOf": [
                {"enum": ["none", "auto", "required"]},
                _object(["type", "name"], type={"const": "function"}, name=_NAME),
            ]
        },
        parallel_tool_calls={"type": "boolean"},
        text=_object([], format=_R_FORMAT),
        metadata={
            "type": "object",
            "maxProperties": MAX_METADATA,
            "propertyNames": {"maxLength": 64},
            "additionalProperties": {"type": "string", "maxLength": 512},
        },
        store={"const": False, "description": "nothing is stored: only false"},
        background={"const": False},
        truncation={"const": "disabled"},
        user=_STRING,
        **_SAMPLING,
    ),
}


# vLLM's own routes: /tokenize and /detokenize (gateway/tokens.py), the LoRA routes (gateway/lora.py:
# a 400 unless the mesh runs with --enable-lora)
VLLM = {
    "TokenizeRequest": {
        "type": "object",
        "additionalProperties": False,  # any other field is a 400 (gateway/fields.py)
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string"},
            "messages": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_MESSAGES,
                "items": {"$ref": "#/components/schemas/ChatMessage"},
            },
            "add_special_tokens": {"type": "boolean"},
            "add_generation_prompt": {"type": "boolean", "description": "messages only"},
            "continue_final_message": {"const": False},
            "return_token_strs": {"type": "boolean"},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "additionalProperties": False,  # any other field is a 400 (gateway/fields.py)
        "required": ["tokens"],
        "properties": {
            "model": {"type": "string"},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_ID}},
        },
    },
    "LoadLoRAAdapterRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": {"type": "string", "minLength": 1, "maxLength": 256},
            "lora_path": {"type": "string", "minLength": 1, "description": "a peft folder on the workers' hosts"},
        },
    },
    "UnloadLoRAAdapterRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string", "minLength": 1, "maxLength": 256}},
    },
}

# ---- OpenAI's audio transcriptions (gateway/audio.py): a multipart form

AUDIO = {
    "TranscriptionRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["file"],
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "a WAV file of at most 30 s"},
            "model": {"type": "string", "minLength": 1},
            "response_format": {"enum": ["json", "text"]},
            "temperature": {"type": "number", "minimum": 0, "maximum": 0, "description": "greedy decoding only"},
            "stream": {"type": "boolean", "const": False},
        },
    },
}
TRANSCRIPTION_ANSWER = {  # response_format json (the default), or text
    "application/json": {"schema": {"type": "object"}},
    "text/plain": {"schema": {"type": "string"}},
}
