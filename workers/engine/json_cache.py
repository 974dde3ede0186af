"""The token masks of JSON mode's requests, built once and kept for the next requests."""

from __future__ import annotations

import functools
import json

from pagemesh.common.json_schema import compile_schema
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.json_mode import JsonMasks

SCHEMA_MASKS = 16  # JSON schemas whose token masks are kept (a schema's masks are rebuilt when needed again)


class JsonMaskCache:
    """The masks of any JSON object (built at their first use), and those of the last
    SCHEMA_MASKS JSON schemas, least recently used first. Without a tokenizer (None) there is no
    JSON mode."""

    def __init__(self, tokenizer, vocab_size: int, end_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        self.schema_masks: dict[str, JsonMasks] = {}  # JSON Schema text -> its masks, least recent first

    @functools.cached_property
    def json_masks(self) -> JsonMasks | None:
        """JSON mode's token masks for any object (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return JsonMasks.for_tokenizer(self.tokenizer, self.vocab_size, set(self.end_ids))

    def for_params(self, params: SamplingParams) -> JsonMasks | None:
        """The masks of a new request's JSON mode (its sequences keep them); None when it has
        none. ValueError when its schema cannot be enforced."""
        if not params.constrained:
            return None
        if self.json_masks is None:
            raise ValueError("response_format: JSON mode needs the model's tokenizer")
        if params.json_schema is None:
            return self.json_masks
        masks = self.schema_masks.pop(params.json_schema, None)
        if masks is None:
            try:
                masks = self.json_masks.for_grammar(compile_schema(json.loads(params.json_schema)))
            except (ValueError, RecursionError) as e:
                raise ValueError(f"response_format: {e}") from None
        self.schema_masks[params.json_schema] = masks  # most recently used last
        while len(self.schema_masks) > SCHEMA_MASKS:
            self.schema_masks.pop(next(iter(self.schema_masks)))
        return masks
