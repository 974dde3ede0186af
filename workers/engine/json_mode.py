"""JSON mode (`response_format` json_object or json_schema): which tokens may come next.

A JSON-mode sequence carries a `JsonCursor`: its automaton state (`json_grammar` for any object,
a `json_schema.SchemaGrammar` for a schema; both expose INITIAL, step, run, is_complete,
MAX_DEPTH and TEXT_MODES) and how many
whitespace-only tokens it has just emitted between JSON tokens (at most MAX_WHITESPACE_TOKENS in a
row, so a model cannot pad forever). `JsonMasks.allowed(cursor)` is a bool mask over the
vocabulary: a token is allowed iff its whole text keeps the document valid JSON; the tokens that
end generation are allowed once the object is closed. Masks are cached by state, so the walk over
the vocabulary happens once per state kind (inside a string, after a key, ...), and tokens
without quotes, backslashes or control characters pass through a string without a walk.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagemesh.common import json_grammar as g

MAX_WHITESPACE_TOKENS = 2  # whitespace-only tokens in a row between JSON tokens
MAX_CACHED_MASKS = 512  # for all grammars and devices of one vocabulary; least recently used go first
_grammar_keys = itertools.count()


@dataclass(frozen=True)
class JsonCursor:
    state: g.State = g.INITIAL
    whitespace_run: int = 0

    @property
    def complete(self) -> bool:
        return g.is_complete(self.state)


class JsonMasks:
    """Token masks for one vocabulary. `texts[i]` is the text token i adds, None for special
    tokens; `end_ids` are the tokens that end generation (allowed once the object is closed)."""

    def __init__(self, texts: list[str | None], end_ids: set[int], vocab_size: int, grammar=g):
        self.grammar, self._grammar_key = grammar, next(_grammar_keys)  # (an id() could be reused)
        self.texts = texts
        self.vocab_size = vocab_size
        self.end_ids = sorted(i for i in end_ids if i < vocab_size)
        self._end_set = set(self.end_ids)
        self.whitespace_only = {i for i, t in enumerate(texts) if t and all(c in g.WHITESPACE for c in t)}
        self.plain = [t is not None and t != "" and all(c not in '"\\' and ord(c) >= 0x20 for c in t) for t in texts]
        self.by_first: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            if t:
                self.by_first.setdefault(t[0], []).append(i)
        # A token closes at most `closers` containers and opens at most `openers`, so its validity
        # depends on the innermost closers + 1 open containers, and on the depth only near the
        # bottom or near MAX_DEPTH: masks are cached under just that much of the stack.
        self._closers = max((t.count("]") + t.count("}") for t in texts if t), default=0)
        self._openers = max((t.count("[") + t.count("{") for t in texts if t), default=0)
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def for_grammar(self, grammar) -> JsonMasks:
        """Masks of another grammar over the same vocabulary (its tables shared, its own cache)."""
        other = object.__new__(JsonMasks)
        other.__dict__.update(self.__dict__)  # the cache too: MAX_CACHED_MASKS bounds them all
        other.grammar, other._grammar_key = grammar, next(_grammar_keys)
        return other

    def start(self) -> JsonCursor:
        return JsonCursor(self.grammar.INITIAL)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, end_ids: set[int]) -> JsonMasks:
        special = tokenizer.special_token_ids
        texts = [
            None if i in special or i >= tokenizer.vocab_size else tokenizer.token_text(i) for i in range(vocab_size)
        ]
        return cls(texts, end_ids, vocab_size)

    def allowed(self, cursor: JsonCursor, device: torch.device | str = "cpu") -> torch.Tensor:
        capped = cursor.whitespace_run >= MAX_WHITESPACE_TOKENS and cursor.state[0] not in self.grammar.TEXT_MODES
        mode, stack, detail = cursor.state
        keep = self._closers + 1
        exact = len(stack) <= keep or len(stack) >= self.grammar.MAX_DEPTH - self._openers
        key = (self._grammar_key, mode, stack[-keep:], len(stack) if exact else -1, detail, capped, str(device))
        mask = self._cache.get(key)
        if mask is None:
            ids = self._allowed_ids(cursor.state, capped)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[torch.tensor(ids or self.end_ids, dtype=torch.int64)] = True  # (never empty here)
            mask = self._cache[key] = mask.to(device)
            if len(self._cache) > MAX_CACHED_MASKS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return mask

    def _allowed_ids(self, state: g.State, capped: bool) -> list[int]:
        ids: list[int] = []
        grammar = self.grammar
        if state[0] == g.STRING and state[2][1] == "":  # most of the vocabulary stays in the string
            ids = [i for i, plain in enumerate(self.plain) if plain]
            walk = [i for i, t in enumerate(self.texts) if t and not self.plain[i]]
            ids += [i for i in walk if grammar.run(state, self.texts[i]) is not None]
        else:
            for first, group in self.by_first.items():
                after = grammar.step(state, first)
                if after is None:
                    continue
                ids += [
                    i for i in group if len(self.texts[i]) == 1 or grammar.run(after, self.texts[i][1:]) is not None
                ]
        if capped:
            ids = [i for i in ids if i not in self.whitespace_only]
        if grammar.is_complete(state):
            ids += [i for i in self.end_ids if i not in ids]
        else:  # an end token with text (some vocabularies) must not cut the object short
            ids = [i for i in ids if i not in self._end_set]
        return ids

    def advance(self, cursor: JsonCursor, token_id: int) -> JsonCursor:
        """The cursor after `token_id` (an end token leaves it as it is)."""
        text = self.texts[token_id] if token_id < len(self.texts) else None
        if not text:
            return cursor
        state = self.grammar.run(cursor.state, text)
        if state is None:  # not allowed by the mask: cannot happen; keep the last valid state
            return cursor
        structural = cursor.state[0] not in self.grammar.TEXT_MODES
        run = cursor.whitespace_run + 1 if structural and token_id in self.whitespace_only else 0
        return JsonCursor(state, run)
