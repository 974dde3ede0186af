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

from pagemesh.common.messages import MAX_ID, GenerateRequest
from pagemesh.common.multimodal import IMAGE_MARK
from pagemesh.common.protocol import MAX_TOKEN_IDS
from pagemesh.common.sampling import (
    MAX_LOGIT_BIAS,
    MAX_STOP_ITEMS,
    SamplingParams,
)
from pagemesh.gateway.chat_options import ChatOptions, parse_chat_options, tool_calls_field
from pagemesh.gateway.errors import ApiError, from_value_error, invalid
from pagemesh.gateway.fields import check_chat_fields, check_completion_fields
from pagemesh.gateway.structured_outputs import Constraint, json_schema_constraint, parse_constraint

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_PROMPTS = 256  # prompts in one completion request (each runs as its own request in the mesh)
# OpenAI's roles this server honours. `developer` is OpenAI's newer name for `system`: it reaches
# the chat template as `system`, the role the Llama-family templates know. A `tool` message answers
# a tool call (its `tool_call_id`); the deprecated `function` role is refused, as `functions` is.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


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
    chat_options: ChatOptions | None = None  # chat: tools, tool_choice, chat_template_kwargs
    constraint_field: str | None = None  # the field whose grammar holds the output (its 400s name it)
    image_urls: tuple[str, ...] = ()  # chat: each image part's URL, in order (IMAGE_MARK in the text; gateway/media.py)

    def to_generate_requests(
        self,
        request_id: str,
        model: str,
        reply_to: str,
        arrival_time: float,
        skip_special_tokens: bool = True,
        images: list[bytes] | None = None,
    ) -> list[GenerateRequest]:
        """One GenerateRequest per prompt. A batch of k prompts becomes k requests in the mesh,
        `<request_id>-<i>`; their choices are the response's choices i*n .. i*n+n-1 (vLLM's order).
        `skip_special_tokens=False`: the text keeps special tokens (a tool-call marker may be one).
        `images`: the files behind `image_urls` (MediaPolicy.load)."""
        if self.messages is not None:
            request = self._request(request_id, None, None, model, reply_to, arrival_time, skip_special_tokens)
            return [dataclasses.replace(request, images=images or [])]
        if len(self.prompts) == 1:
            return [self._request(request_id, *self.prompts[0], model, reply_to, arrival_time)]
        return [
            self._request(f"{request_id}-{i}", text, ids, model, reply_to, arrival_time)
            for i, (text, ids) in enumerate(self.prompts)
        ]

    def _request(
        self, request_id, text, ids, model, reply_to, arrival_time, skip_special_tokens=True
    ) -> GenerateRequest:
        options = self.chat_options or ChatOptions()
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
            tools=options.tools_json(),
            chat_template_kwargs=options.template_kwargs_json(),
            skip_special_tokens=skip_special_tokens,
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
    constraint = parse_constraint(body)
    max_tokens = f.int("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    sampling = _sampling(f, max_tokens, logprobs, _renamed(constraint), constraint.sampling)
    echo = f.bool("echo", False)
    if echo and logprobs is not None:  # the prompt's tokens come with logprobs too
        sampling = dataclasses.replace(sampling, prompt_logprobs=logprobs)
    check_completion_fields(body)
    parsed = _parsed(f, "completion", prompts, None, sampling, logprobs)
    return dataclasses.replace(parsed, echo=echo, constraint_field=constraint.field)


def parse_chat(body: dict) -> ParsedRequest:
    f = _Fields(body)
    options = parse_chat_options(body)
    constraint = parse_constraint(body)  # response_format, structured_outputs, guided_* (gateway/structured_outputs.py)
    if options.forced:  # the grammar holds the answer to a call (gateway/chat_options.py)
        if constraint.sampling:
            raise invalid(f"{constraint.field}: not with tool_choice 'required' or a named function", constraint.field)
        constraint = json_schema_constraint(options.json_schema(), "tools")
    urls: list[str] = []
    messages = _messages(body.get("messages"), urls)
    logprobs = None
    top_logprobs = f.int("top_logprobs", None)
    if f.bool("logprobs", False):
        logprobs = 0 if top_logprobs is None else top_logprobs
    elif top_logprobs is not None:
        raise invalid("top_logprobs: requires logprobs to be true", "top_logprobs")
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    rename = {"max_tokens": limit_field, "logprobs": "top_logprobs", **_renamed(constraint)}
    # max_tokens None: what the context leaves (the tokenizer resolves it)
    sampling = _sampling(f, f.int(limit_field, None), logprobs, rename, constraint.sampling)
    check_chat_fields(body)
    parsed = _parsed(f, "chat", (), messages, sampling, logprobs)
    return dataclasses.replace(parsed, chat_options=options, constraint_field=constraint.field, image_urls=tuple(urls))


def check_model(parsed: ParsedRequest, accepted: tuple[str, ...]) -> None:
    """404 unless the request names one of the served model's names (or none)."""
    if parsed.model is not None and parsed.model not in accepted:
        raise ApiError(
            404, f"The model `{parsed.model}` does not exist.", "invalid_request_error", "model", "model_not_found"
        )


# --------------------------------------------------------------------------- parts


def _renamed(constraint: Constraint) -> dict[str, str]:
    """SamplingParams' constraint fields -> the request field that set them (for their 400s)."""
    return dict.fromkeys(("json_object", "json_schema", "structured"), constraint.field) if constraint.field else {}


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
    f: _Fields, max_tokens: int | None, logprobs: int | None, rename: dict[str, str], constraint: dict | None = None
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
            **(constraint or {}),
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


def _messages(value: Any, image_urls: list[str]) -> list[dict[str, str]]:
    """Role and content strings (parts joined by newlines, IMAGE_MARK for a user's image part,
    whose URL goes to `image_urls`); `name` kept when given; an assistant's `tool_calls` (its
    content may then be null) as JSON text, a tool message's `tool_call_id`."""
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
        plain = {"role": CHAT_ROLES[role]}
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if tool_calls:
            plain["tool_calls"] = tool_calls_field(tool_calls, f"{where}.tool_calls")
        if not tool_calls or message.get("content") is not None:
            urls = image_urls if role == "user" else None
            plain["content"] = _content(message.get("content"), f"{where}.content", urls)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{where}.tool_call_id: required, a non-empty string", f"{where}.tool_call_id")
            plain["tool_call_id"] = call_id
        name = message.get("name")
        if isinstance(name, str):
            plain["name"] = name
        out.append(plain)
    return out


_ROLES_ALLOWED = "allowed: 'system', 'developer', 'user', 'assistant', 'tool' (the deprecated 'function' is not)"


def _content(value: Any, where: str, image_urls: list[str] | None = None) -> str:
    """A message's text; with `image_urls` (a user message), image_url parts are taken too."""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list) and len(value) <= MAX_CONTENT_PARTS:
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and image_urls is not None:
                image_urls.append(_image_url(part, f"{where}[{i}]"))
                texts.append(IMAGE_MARK)
                continue
            if not (kind == "text" and isinstance(part.get("text"), str)):
                what = "text and image_url" if image_urls is not None else "text"
                raise invalid(f"{where}: only {what} content parts are supported here", where)
            texts.append(_text(part["text"], where))
        return "\n".join(texts)
    if value is None:
        raise invalid(f"{where}: required", where)
    raise invalid(f"{where}: must be a string or a list of at most {MAX_CONTENT_PARTS} text parts", where)


def _text(text: str, where: str) -> str:
    if IMAGE_MARK in text:
        raise invalid(f"{where}: the character U+E000 is reserved (it marks where an image stands)", where)
    return text


def _image_url(part: dict, where: str) -> str:
    """An image_url part's URL (OpenAI's `{"url": ..., "detail": ...}` or vLLM's bare string)."""
    image = part.get("image_url")
    if isinstance(image, dict):
        extra = set(image) - {"url", "detail"}
        if extra:
            raise invalid(f"{where}.image_url: unknown fields {sorted(extra)}", f"{where}.image_url")
        if image.get("detail", "auto") not in ("auto", "low", "high"):
            raise invalid(f"{where}.image_url.detail: one of 'auto', 'low', 'high'", f"{where}.image_url.detail")
        image = image.get("url")
    if not isinstance(image, str) or not image:
        raise invalid(f"{where}.image_url.url: required, a data: URL", f"{where}.image_url")
    if set(part) - {"type", "image_url"}:
        raise invalid(f"{where}: unknown fields {sorted(set(part) - {'type', 'image_url'})}", where)
    return image


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
