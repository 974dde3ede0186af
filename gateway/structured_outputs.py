"""The request fields of structured outputs -> the constraint's SamplingParams fields.

One constraint per request, in any of three spellings (docs/api.md, "Structured outputs"):

- OpenAI's `response_format`: `text`, `json_object`, `json_schema` (`json_schema.schema`), and
  vLLM's `structural_tag` (`structures` and `triggers`);
- vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
  `json_object`, `structural_tag`, with `whitespace_pattern`, `disable_any_whitespace`,
  `disable_fallback`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
  `guided_whitespace_pattern` and `guided_decoding_backend`.

Shapes and types are checked here (400 naming the field); whether the grammar compiles is the
app's check, with llguidance (common/structured_outputs.py), which names the field this module
reports. JSON whitespace options reach llguidance inside the schema, as its `x-guidance` options.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Any

from pagemesh.common.sampling import SamplingParams
from pagemesh.common.structured_outputs import Grammars, ll_tokenizer
from pagemesh.gateway.errors import invalid

if TYPE_CHECKING:
    from pagemesh.gateway.parsing import ParsedRequest

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FIELDS = {"response_format", "structured_outputs", *GUIDED, "guided_whitespace_pattern", "guided_decoding_backend"}
BACKENDS = ("auto", "guidance", "llguidance")  # guided_decoding_backend: what this server runs is llguidance
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OPTIONS = (
    "whitespace_pattern",
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
)
MAX_CHOICES = 4096
OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A request's constraint: `sampling`, the SamplingParams fields it sets ({}: none), and
    `field`, the request field that set it (what a 400 about its grammar names)."""

    sampling: dict = dataclasses.field(default_factory=dict)
    field: str | None = None


class GrammarCheck:
    """The gateway's check that a request's grammar compiles, with llguidance as the worker will
    compile it: a 400 naming the field that set it otherwise. The tokenizer's llguidance view is
    built at the first constrained request; compiling runs off the event loop (a large grammar
    takes a while), each grammar once (`Grammars` keeps the last ones)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.grammars: Grammars | None = None
        self._lock = threading.Lock()

    async def check(self, parsed: ParsedRequest) -> None:
        sampling = parsed.sampling
        if not sampling.constrained:
            return
        try:
            await asyncio.to_thread(self._check, sampling)
        except ValueError as e:
            where = parsed.constraint_field or ("structured_outputs" if sampling.structured else "response_format")
            raise invalid(f"{where}: {str(e).partition(': ')[2]}", where) from None

    def _check(self, sampling: SamplingParams) -> None:
        with self._lock:
            if self.grammars is None:
                self.grammars = Grammars(ll_tokenizer(self.tokenizer))
        self.grammars.check(sampling)


def parse_constraint(body: dict) -> Constraint:
    """The constraint of a completion or chat body; 400 naming the field for a malformed one, or
    for two at once."""
    found = [
        c
        for c in (
            _response_format(body.get("response_format")),
            _structured(body.get("structured_outputs")),
            _guided(body),
        )
        if c.sampling
    ]
    if len(found) > 1:
        raise invalid(
            f"{found[1].field}: one constraint per request (response_format, structured_outputs or guided_*), "
            f"and {found[0].field} sets one",
            found[1].field,
        )
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise invalid(
            f"guided_decoding_backend: this server's grammar engine is llguidance; one of {', '.join(BACKENDS)}",
            "guided_decoding_backend",
        )
    constraint = found[0] if found else Constraint()
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        constraint = _whitespace(constraint, "guided_whitespace_pattern", pattern, False)
    return constraint


def json_schema_constraint(schema: dict, where: str) -> Constraint:
    """A JSON Schema set by `where` (as tool_choice's calls are held to their tools' schemas)."""
    return Constraint({"json_schema": _text(schema)}, where)


def _response_format(value: Any) -> Constraint:
    where = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return Constraint()
    if kind == "json_object":
        return Constraint({"json_object": True}, where)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid(f"{where}.json_schema.schema: required, a JSON Schema object", where)
        return Constraint({"json_schema": _text(schema)}, where)
    if kind == "structural_tag":
        tag = {k: v for k, v in value.items() if k != "type"}
        return Constraint({"structured": ("structural_tag", _text(tag))}, where)
    raise invalid(f'{where}: type must be "text", "json_object", "json_schema" or "structural_tag"', where)


def _structured(value: Any) -> Constraint:
    where = "structured_outputs"
    if value is None:
        return Constraint()
    if not isinstance(value, dict):
        raise invalid(f"{where}: must be an object", where)
    for key, item in value.items():
        if key not in STRUCTURED_KEYS + STRUCTURED_OPTIONS:
            raise invalid(f"Unrecognized request argument supplied: {where}.{key}", f"{where}.{key}")
        if key in STRUCTURED_OPTIONS[1:] and item is not None and type(item) is not bool:
            raise invalid(f"{where}.{key}: must be a boolean", f"{where}.{key}")
    if value.get("disable_additional_properties"):
        raise invalid(f"{where}.disable_additional_properties: not supported by this server", where)
    keys = [k for k in STRUCTURED_KEYS if value.get(k) is not None]
    if len(keys) != 1:
        raise invalid(f"{where}: exactly one of {', '.join(STRUCTURED_KEYS)}", where)
    [key] = keys
    constraint = _one(key, value[key], f"{where}.{key}", where)
    if value.get("whitespace_pattern") is not None or value.get("disable_any_whitespace"):
        pattern = value.get("whitespace_pattern")
        constraint = _whitespace(
            constraint, f"{where}.whitespace_pattern", pattern, bool(value.get("disable_any_whitespace"))
        )
    return constraint


def _guided(body: dict) -> Constraint:
    keys = [k for k in GUIDED if body.get(k) is not None]
    if len(keys) > 1:
        raise invalid(f"{keys[1]}: only one of {', '.join(GUIDED)}", keys[1])
    if not keys:
        return Constraint()
    [key] = keys
    return _one(key.removeprefix("guided_"), body[key], key, key)


def _one(kind: str, value: Any, name: str, where: str) -> Constraint:
    """One constraint of `kind` (json, regex, choice, grammar, json_object, structural_tag) from
    `value`, the field `name`; the constraint names `where`."""
    if kind == "json":
        if isinstance(value, str):
            value = _loads(value, name)
        if not isinstance(value, dict):
            raise invalid(f"{name}: must be a JSON Schema object (or its JSON text)", name)
        return Constraint({"json_schema": _text(value)}, where)
    if kind == "json_object":
        if value is not True:
            raise invalid(f"{name}: must be true", name)
        return Constraint({"json_object": True}, where)
    if kind == "choice":
        if not (
            isinstance(value, list) and 0 < len(value) <= MAX_CHOICES and all(isinstance(c, str) and c for c in value)
        ):
            raise invalid(f"{name}: must be a list of 1 to {MAX_CHOICES} non-empty strings", name)
        return Constraint({"structured": ("choice", _text(value))}, where)
    if kind == "structural_tag":
        if isinstance(value, str):
            value = _loads(value, name)
        if not isinstance(value, dict):
            raise invalid(f"{name}: must be an object (or its JSON text)", name)
        return Constraint({"structured": ("structural_tag", _text(value))}, where)
    if not isinstance(value, str) or not value:  # regex, grammar
        raise invalid(f"{name}: must be a non-empty string", name)
    return Constraint({"structured": (kind, value)}, where)


def _whitespace(constraint: Constraint, name: str, pattern: Any, none: bool) -> Constraint:
    """The JSON constraint with llguidance's whitespace options: `pattern` (a regex) between
    tokens, or `none` of it."""
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise invalid(f"{name}: must be a non-empty string (a regex)", name)
    if pattern is not None and none:
        raise invalid(f"{name}: not with disable_any_whitespace", name)
    sampling = constraint.sampling
    if not (sampling.get("json_object") or "json_schema" in sampling):
        raise invalid(f"{name}: only with a JSON constraint (a schema or a JSON object)", name)
    schema = json.loads(sampling["json_schema"]) if "json_schema" in sampling else dict(OBJECT)
    options = schema.get("x-guidance")
    options = dict(options) if isinstance(options, dict) else {}
    if pattern is not None:
        options["whitespace_pattern"] = pattern
    if none:  # no whitespace at all: the bounded default pattern (common/structured_outputs.py) overridden too
        options.update(whitespace_flexible=False, whitespace_pattern=None)
    schema["x-guidance"] = options
    return Constraint({"json_schema": _text(schema)}, constraint.field)


def _loads(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise invalid(f"{name}: not valid JSON", name) from None


def _text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
