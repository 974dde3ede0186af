"""OpenAI request bodies -> a checked `ParsedRequest` (and from it a GenerateRequest).

Every problem raises `ApiError` (400 `invalid_request_error`, `param` = the field). Types are
checked strictly (a bool is not an integer, a float is not an integer, NaN never parses), every
list is bounded before it is copied, and range checks are left to `SamplingParams.validate()`,
the one place that knows them. No field is silently ignored (gateway/fields.py): one this gateway
does not honour, or that nobody defines, is refused with a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pagemesh.common.json_schema import SchemaError, compile_schema
from pagemesh.common.messages import MAX_ID, GenerateRequest
from pagemesh.common.protocol import MAX_TOKEN_IDS
from pagemesh.common.sampling import (
    MAX_LOGIT_BIAS,
    MAX_SCHEMA_LEN,
    MAX_STOP_ITEMS,
    SamplingParams,
)
from pagemesh.gateway.errors import ApiError, from_value_error, invalid
from pagemesh.gateway.fields import check_chat_fields, check_completion_fields

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_PROMPTS = 256  # prompts in one completion request (each runs as its own request in the mesh)
# OpenAI's roles this server honours. `developer` is OpenAI's newer name for `system`: it reaches
# the chat template as `system`, the role the Llama-family templates know. `tool` and `function`
# messages answer tool calls, which this server refuses (`tools`), so they are refused too.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


Prompt = tuple["str | None", "list[int] | None"]  # (text, token ids): exactly one is set


@dataclass(frozen=True)
class ParsedRequest:
    """A checked completion or chat request. `logprobs` is the number of alternatives per token
    (0 = the sampled token's logprob only), None when logprobs are off."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompts: tuple[Prompt, ...]  # completions: one or more; chat: none
    messages: list[dict[str, str]] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None
    include_stop_str_in_output: bool
    echo: bool = False  # completions: each choice's text starts with its prompt (and logprobs with the prompt's)

    def to_generate_requests(
        self, request_id: str, model: str, reply_to: str, arrival_time: float
    ) -> list[GenerateRequest]:
        """One GenerateRequest per prompt. A batch of k prompts becomes k requests in the mesh,
        `<request_id>-<i>`; their choices are the response's choices i*n .. i*n+n-1 (vLLM's order)."""
        if self.messages is not None:
            return [self._request(request_id, None, None, model, reply_to, arrival_time)]
        if len(self.prompts) == 1:
            return [self._request(request_id, *self.prompts[0], model, reply_to, arrival_time)]
        return [
            self._request(f"{request_id}-{i}", text, ids, model, reply_to, arrival_time)
            for i, (text, ids) in enumerate(self.prompts)
        ]

    def _request(self, request_id, text, ids, model, reply_to, arrival_time) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id,
            model=model,
            prompt_text=text,
            prompt_token_ids=ids,
            messages=self.messages,
            sampling=self.sampling,
            stream=self.stream,
            reply_to=reply_to,
            arrival_time=arrival_time,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; malformed JSON (or NaN/Infinity) -> 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_completion(body: dict) -> ParsedRequest:
    f = _Fields(body)
    if f.optional("suffix", str):
        raise invalid("suffix: not supported", "suffix")
    prompts = _prompts(body.get("prompt"))
    logprobs = f.int("logprobs", None)
    sampling = _sampling(f, f.int("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS), logprobs, {})
    echo = f.bool("echo", False)
    if echo and logprobs is not None:  # the prompt's tokens come with logprobs too
        sampling = dataclasses.replace(sampling, prompt_logprobs=logprobs)
    check_completion_fields(body)
    return dataclasses.replace(_parsed(f, "completion", prompts, None, sampling, logprobs), echo=echo)


def parse_chat(body: dict) -> ParsedRequest:
    f = _Fields(body)
    if body.get("tools") or body.get("functions"):
        raise invalid("tools: tool and function calling are not supported", "tools")
    json_mode = _json_mode(body.get("response_format"))
    messages = _messages(body.get("messages"))
    logprobs = None
    top_logprobs = f.int("top_logprobs", None)
    if f.bool("logprobs", False):
        logprobs = 0 if top_logprobs is None else top_logprobs
    elif top_logprobs is not None:
        raise invalid("top_logprobs: requires logprobs to be true", "top_logprobs")
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    rename = {"max_tokens": limit_field, "logprobs": "top_logprobs"}
    rename.update({"json_object": "response_format", "json_schema": "response_format"})
    # max_tokens None: what the context leaves (the tokenizer resolves it)
    sampling = _sampling(f, f.int(limit_field, None), logprobs, rename, json_mode)
    check_chat_fields(body)
    return _parsed(f, "chat", (), messages, sampling, logprobs)


def check_model(parsed: ParsedRequest, accepted: tuple[str, ...]) -> None:
    """404 unless the request names one of the served model's names (or none)."""
    if parsed.model is not None and parsed.model not in accepted:
        raise ApiError(
            404, f"The model `{parsed.model}` does not exist.", "invalid_request_error", "model", "model_not_found"
        )


# --------------------------------------------------------------------------- parts


def _json_mode(value: Any) -> dict:
    """response_format -> the SamplingParams fields of JSON mode: {} for text (the default),
    json_object, or json_schema (checked here: a schema the engine cannot enforce is a 400)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema: required, a JSON Schema object", "response_format")
        try:
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
            if len(text) > MAX_SCHEMA_LEN:
                raise SchemaError(f"longer than {MAX_SCHEMA_LEN} characters")
            compile_schema(schema)
        except (SchemaError, RecursionError) as e:
            raise invalid(f"response_format: this JSON Schema cannot be enforced: {e}", "response_format") from None
        return {"json_schema": text}
    raise invalid('response_format: type must be "text", "json_object" or "json_schema"', "response_format")


def _logit_bias(f: _Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: keys are token ids written as decimal strings."""
    value = f.optional("logit_bias", dict)
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdecimal() and len(key) <= 10) or int(key) > MAX_ID:
            raise invalid(f"logit_bias: keys must be token ids, got {key[:32]!r}", "logit_bias")
        if type(bias) not in (int, float) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias: the bias of token {key} must be a number in [-100, 100]", "logit_bias")
        pairs.append((int(key), float(bias)))
    if len({i for i, _ in pairs}) != len(pairs):  # "7" and "07"
        raise invalid("logit_bias: token ids must be distinct", "logit_bias")
    return tuple(pairs)


def _parsed(f: _Fields, kind: str, prompts, messages, sampling, logprobs) -> ParsedRequest:
    stream = f.bool("stream", False)
    options = f.optional("stream_options", dict)
    if options is not None and not stream:
        raise invalid("stream_options: only allowed when stream is true", "stream_options")
    include_usage = _Fields(options or {}, "stream_options.").bool("include_usage", False)
    return ParsedRequest(
        kind,
        f.optional("model", str),
        prompts,
        messages,
        sampling,
        stream,
        include_usage,
        logprobs,
        f.bool("include_stop_str_in_output", False),
    )


def _sampling(
    f: _Fields, max_tokens: int | None, logprobs: int | None, rename: dict[str, str], json_mode: dict | None = None
) -> SamplingParams:
    defaults = SamplingParams()
    try:
        sampling = SamplingParams(
            n=f.int("n", defaults.n),
            temperature=f.number("temperature", defaults.temperature),
            top_p=f.number("top_p", defaults.top_p),
            top_k=f.int("top_k", defaults.top_k),
            min_p=f.number("min_p", defaults.min_p),
            seed=f.int("seed", None),
            repetition_penalty=f.number("repetition_penalty", defaults.repetition_penalty),
            presence_penalty=f.number("presence_penalty", defaults.presence_penalty),
            frequency_penalty=f.number("frequency_penalty", defaults.frequency_penalty),
            max_tokens=max_tokens,
            min_tokens=f.int("min_tokens", defaults.min_tokens),
            stop_token_ids=tuple(f.int_list("stop_token_ids", MAX_STOP_ITEMS)),
            stop=tuple(_stop(f.body.get("stop"))),
            ignore_eos=f.bool("ignore_eos", False),
            logprobs=logprobs,
            best_of=f.int("best_of", None),
            use_beam_search=f.bool("use_beam_search", False),
            length_penalty=f.number("length_penalty", defaults.length_penalty),
            priority=f.int("priority", defaults.priority),
            logit_bias=_logit_bias(f),
            speculative=f.bool("speculative", True),
            **(json_mode or {}),
        ).validate()
    except ValueError as e:
        raise from_value_error(e, rename) from None
    if not sampling.streams:  # the n choices are picked at the end
        if f.bool("stream", False):
            raise invalid("stream: not available with best_of > n or use_beam_search", "stream")
        if logprobs is not None:
            raise invalid("logprobs: not available with best_of > n or use_beam_search", "logprobs")
    return sampling


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and len(value) <= MAX_STOP_ITEMS and all(isinstance(s, str) for s in value):
        return value
    raise invalid(f"stop: must be a string or a list of at most {MAX_STOP_ITEMS} strings", "stop")


def _prompts(value: Any) -> tuple[Prompt, ...]:
    """A string, a list of token ids, or a batch: a list of strings and token-id lists."""
    if isinstance(value, str):
        return ((value, None),)
    if value is None:
        raise invalid("prompt: required", "prompt")
    if not isinstance(value, list):
        raise invalid("prompt: must be a string, a list of token ids, or a list of those", "prompt")
    if not value:
        raise invalid("prompt: must not be empty", "prompt")
    if not any(isinstance(x, (str, list)) for x in value):
        return ((None, _token_ids(value, "prompt", MAX_TOKEN_IDS)),)
    if len(value) > MAX_PROMPTS:
        raise invalid(f"prompt: at most {MAX_PROMPTS} prompts in one request", "prompt")
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append((item, None))
        elif isinstance(item, list) and item:
            prompts.append((None, _token_ids(item, f"prompt[{i}]", MAX_TOKEN_IDS)))
        else:
            raise invalid(f"prompt[{i}]: must be a string or a non-empty list of token ids", f"prompt[{i}]")
    return tuple(prompts)


def _token_ids(value: list, name: str, limit: int) -> list[int]:
    if len(value) > limit:
        raise invalid(f"{name}: at most {limit} token ids", name)
    if not all(type(x) is int and 0 <= x <= MAX_ID for x in value):
        raise invalid(f"{name}: token ids must be integers in [0, {MAX_ID}]", name)
    return list(value)


def _messages(value: Any) -> list[dict[str, str]]:
    """Role and content strings (text parts joined by newlines); `name` kept when given."""
    if not isinstance(value, list) or not value:
        raise invalid("messages: required, a non-empty list of messages", "messages")
    if len(value) > MAX_MESSAGES:
        raise invalid(f"messages: at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where}: must be an object with role and content", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"{where}.role: required, a non-empty string", f"{where}.role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role: unknown role {role[:40]!r}; {_ROLES_ALLOWED}", f"{where}.role")
        plain = {"role": CHAT_ROLES[role], "content": _content(message.get("content"), f"{where}.content")}
        name = message.get("name")
        if isinstance(name, str):
            plain["name"] = name
        out.append(plain)
    return out


_ROLES_ALLOWED = (
    "allowed: 'system', 'developer', 'user', 'assistant' "
    "('tool' and 'function' messages are refused: tool calling is not supported)"
)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) <= MAX_CONTENT_PARTS:
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"{where}: only text content parts are supported", where)
            texts.append(part["text"])
        return "\n".join(texts)
    if value is None:
        raise invalid(f"{where}: required", where)
    raise invalid(f"{where}: must be a string or a list of at most {MAX_CONTENT_PARTS} text parts", where)


class _Fields:
    """Typed reads of optional fields of one JSON object; null means "use the default"."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def _bad(self, name: str, what: str) -> ApiError:
        return invalid(f"{self.prefix}{name}: must be {what}", f"{self.prefix}{name}")

    def optional(self, name: str, kind: type):
        value = self.body.get(name)
        if value is not None and not isinstance(value, kind):
            raise self._bad(name, _KIND_NAMES[kind])
        return value

    def int(self, name: str, default: int | None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if type(value) is not int:
            raise self._bad(name, "an integer")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if type(value) not in (int, float):
            raise self._bad(name, "a number")
        try:
            return float(value)
        except OverflowError:
            raise self._bad(name, "a finite number") from None

    def bool(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if type(value) is not bool:
            raise self._bad(name, "a boolean")
        return value

    def int_list(self, name: str, limit: int) -> list[int]:
        value = self.body.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or len(value) > limit:
            raise self._bad(name, f"a list of at most {limit} token ids")
        return _token_ids(value, name, limit)


_KIND_NAMES = {str: "a string", dict: "an object"}
