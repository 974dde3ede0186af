"""Structured outputs: a request's constraint as an llguidance grammar, each compiled once.

No torch: the gateway imports it. The gateway compiles a request's grammar to refuse one that
does not compile (a 400 naming the field), the worker compiles it again for the matcher each
sequence steps through (workers/engine/grammar_masks.py); both keep the last MAX_GRAMMARS
compiled, and a sequence starts from a copy of its grammar's compiled matcher.

    SamplingParams                          llguidance grammar
    json_object                        ->   the JSON Schema {"type": "object"}
    json_schema  (JSON text)           ->   that schema (every keyword llguidance implements; any
                                            other is an error, never ignored); whitespace between
                                            tokens bounded (JSON_OPTIONS) unless the schema's
                                            `x-guidance` options say otherwise
    structured   ("regex", pattern)    ->   the pattern, matched whole
                 ("choice", [...])     ->   exactly one of the strings
                 ("grammar", text)     ->   EBNF (GBNF, as llama.cpp and vLLM write it) or Lark
                 ("structural_tag", {"structures": [{"begin", "schema", "end"}], "triggers": [...]})
                                       ->   free text in which each trigger starts a tagged part
                                            whose body follows its JSON Schema
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from pagemesh.common.sampling import SamplingParams

MAX_GRAMMARS = 64  # compiled grammars kept, least recently used dropped first
MAX_ERROR_LEN = 400  # characters of llguidance's message quoted back
OBJECT_SCHEMA = '{"type": "object"}'
# between two JSON tokens at most one line break and 32 spaces or tabs (compact or indented JSON), so a
# model cannot pad for ever: llguidance's default takes any run of whitespace, and a small model, once
# it writes blank lines, may write them to max_tokens. A schema's own `x-guidance` options
# (guided_whitespace_pattern, ...) override it.
JSON_OPTIONS = {"whitespace_pattern": r"(\r?\n)?[\x20\x09]{0,32}"}

Key = tuple[bool, "str | None", "tuple[str, str] | None"]


def ll_tokenizer(tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a `common.tokenizer.Tokenizer`: its tokenizer.json, its end tokens (the
    grammar allows them once it is satisfied) and `vocab_size` rows of mask (the model's, when it
    pads the tokenizer's vocabulary). Takes ~0.3 s: build it once."""
    return llguidance.LLTokenizer(
        tokenizer.backend_json(),
        n_vocab=vocab_size or tokenizer.vocab_size,
        eos_token=sorted(tokenizer.eos_token_ids),
    )


def constraint_key(params: SamplingParams) -> Key | None:
    """What identifies `params`' grammar (None: unconstrained)."""
    if not params.constrained:
        return None
    return (params.json_object, params.json_schema, params.structured)


def grammar_text(params: SamplingParams) -> str:
    """llguidance's grammar for a constrained `params`. ValueError naming the SamplingParams field
    when its spec is malformed (the grammar itself is checked when it compiles)."""
    field = params.constraint_field
    try:
        if params.json_object or params.json_schema is not None:
            schema = OBJECT_SCHEMA if params.json_object else params.json_schema
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        kind, spec = params.structured
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ValueError("choice: must be a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
        return _structural_tag(json.loads(spec))
    except (ValueError, TypeError, AssertionError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{field}: {_short(str(e))}") from None


def _structural_tag(tag: object) -> str:
    """vLLM's structural tag (`structures` with `begin`, `schema` and `end`; `triggers`): the text
    is free until a trigger, then the tag's begin, a JSON value of its schema and its end."""
    if not isinstance(tag, dict) or set(tag) - {"type", "structures", "triggers"}:
        raise ValueError("structural_tag: an object with `structures` and `triggers` (vLLM's form)")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("structural_tag.triggers: must be a non-empty list of non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise ValueError("structural_tag.structures: must be a non-empty list")
    tags = []
    for i, item in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(item, dict) or set(item) != {"begin", "schema", "end"}:
            raise ValueError(f"{where}: must be an object of exactly `begin`, `schema` and `end`")
        begin, schema, end = item["begin"], item["schema"], item["end"]
        if not (isinstance(begin, str) and isinstance(end, str) and isinstance(schema, dict)):
            raise ValueError(f"{where}: `begin` and `end` are strings, `schema` a JSON Schema object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{where}.begin: starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    return llguidance.StructTag.to_grammar(tags)


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_LEN else message[: MAX_ERROR_LEN - 3] + "..."


class Grammars:
    """The compiled grammars of one tokenizer: the last `capacity` requests' grammars, each as an
    llguidance matcher at its start. Safe to call from several threads (the gateway compiles off
    its event loop; llguidance releases the GIL while it compiles)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, capacity: int = MAX_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.compiles = 0  # grammars compiled (a cache hit compiles none)
        self._compiled: OrderedDict[Key, llguidance.LLMatcher] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A matcher at the start of `params`' grammar, the caller's own to advance (None:
        unconstrained). ValueError naming the SamplingParams field when it does not compile."""
        key = constraint_key(params)
        if key is None:
            return None
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._compile(params)
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the field unless `params`' grammar compiles (compiled once, cached)."""
        self.matcher(params)

    def _compile(self, params: SamplingParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        self.compiles += 1
        if matcher.is_error():
            raise ValueError(f"{params.constraint_field}: {_short(matcher.get_error())}")
        return matcher
