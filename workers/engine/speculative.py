"""Speculative decoding: who proposes drafts, and when. Two methods:

    ngram            prompt lookup: no draft model, the sequence itself proposes (below)
    draft_quantized  self-speculation: the same model's quantized weights propose, the full model
                     verifies (workers/engine/draft_model.py runs the draft)

Pure Python (no torch, no zmq: tests/unit/test_purity.py).

    tokens   ... the cat sat on the mat . the cat sat [?]
                     └── last n-gram "the cat sat" found earlier ──┘
    drafts   on the mat .          (the K tokens that followed the earlier occurrence)

The scheduler asks `Speculator.drafts` for each decode it plans (a draft model's proposals are
placeholders until the engine's `DraftProposer` fills them in after planning, when every
speculating sequence's pages are reserved); a speculating decode runs its
last token and its K drafts as one K+1-token chunk of the normal mixed batch, and the update
(`workers/engine/update.py`) keeps the drafts the target model agrees with, then one more token
(the bonus, or the correction at the first disagreement).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields

from pagemesh.common.sampling import SamplingParams

# Decode rows in a step above which nobody speculates: verifying K extra positions per row costs
# about as much as it saves once the step is big enough to be compute bound
# (docs/perf/speculative.md has the measurement behind the default).
DEFAULT_MAX_DECODE_ROWS = 8
METHODS = ("ngram", "draft_quantized")
DRAFT_QUANTIZATIONS = ("gguf", "int8")  # as `--quantization` (workers/model/quantization.py)
PENDING_DRAFT = -1  # a draft model's proposal not made yet (never a token id)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, as vLLM spells it: `{"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_max": N, "prompt_lookup_min": M}` (plus our `max_decode_rows`: steps with more
    decode rows than this do not speculate), or `{"method": "draft_quantized",
    "num_speculative_tokens": K, "quantization": "gguf"}`: the draft is the served model with its
    linear weights quantized as `--quantization` would (`gguf`: the GGUF file's own 4-bit blocks;
    `int8`: rounded at load). `quantization` is the draft's only; the n-gram method ignores it,
    the draft method ignores the prompt_lookup keys."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_decode_rows: int = DEFAULT_MAX_DECODE_ROWS
    quantization: str = "gguf"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: must be one of {list(METHODS)}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization: must be one of {list(DRAFT_QUANTIZATIONS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "max_decode_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("speculative_config.prompt_lookup_max: must be an integer >= prompt_lookup_min")

    @classmethod
    def from_json(cls, text: str | None) -> SpeculativeConfig | None:
        """Parse the flag's JSON object (None or empty: speculation off). Raises ValueError
        naming the bad key."""
        if not text:
            return None
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(values, dict):
            raise ValueError("speculative_config: must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


def propose_ngram(tokens: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram of `tokens` (n from `max_n` down to `min_n`); [] when no suffix of those lengths
    occurs earlier. The match must end before the last token, so at least one token follows it.

    The search is `bytes.rfind` over the ids packed 4 bytes each (C speed on long contexts; a
    hit at an offset that is not a multiple of 4 straddles two ids and is skipped)."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    data = array("i", tokens).tobytes()
    limit = (length - 1) * 4  # matches lie within tokens[:-1]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * 4 :]
        end = limit
        while True:
            pos = data.rfind(pattern, 0, end)
            if pos < 0:
                break
            if pos % 4 == 0:
                start = pos // 4 + n
                return list(tokens[start : start + k])
            end = pos + len(pattern) - 1
    return []


@dataclass
class SpeculationStats:
    """Totals over verified drafts: acceptance rate = accepted / proposed; mean accepted length
    = tokens emitted per verifying pass (accepted drafts + the one sampled token)."""

    passes: int = 0  # speculating decode rows verified
    proposed: int = 0  # draft tokens run through the model
    accepted: int = 0  # of those, kept

    def record(self, proposed: int, accepted: int) -> None:
        self.passes += 1
        self.proposed += proposed
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0


class Speculator:
    """Decides which decodes speculate this step and proposes their drafts; keeps the engine's
    totals (`stats`). `max_model_len`: drafts never run past the context length."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()

    def step_allows(self, num_decode_rows: int) -> bool:
        """Speculate in a step with this many decode rows (big batches do not gain)."""
        return num_decode_rows <= self.config.max_decode_rows

    @property
    def uses_draft_model(self) -> bool:
        return self.config.method == "draft_quantized"

    @staticmethod
    def request_allows(params: SamplingParams) -> bool:
        """Beam search is never speculated (its beams fork and rescore every step), nor a
        request that turned it off (`speculative: false`)."""
        return params.speculative and not params.use_beam_search

    def drafts(self, token_ids: Seq[int], max_drafts: int) -> list[int]:
        """At most min(K, `max_drafts`) draft tokens for a sequence whose tokens are `token_ids`
        (with a draft model: exactly that many PENDING_DRAFT placeholders, filled after planning)."""
        cfg = self.config
        k = min(cfg.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        if self.uses_draft_model:
            return [PENDING_DRAFT] * k
        return propose_ngram(token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)


def use_speculation(engine, config: SpeculativeConfig | None) -> SpeculationStats | None:
    """Turn speculation on (with `config`, fresh stats) or off (None) in a running `Engine`,
    between steps: the scheduler reads its speculator each step. For benchmarks and tests that
    compare both on one loaded model."""
    speculator = Speculator(config, engine.max_model_len) if config is not None else None
    engine.scheduler.speculator = speculator
    if speculator is not None and speculator.uses_draft_model:
        from pagemesh.workers.engine.draft_model import attach_drafter  # torch: the engine has it loaded already

        attach_drafter(engine, config)  # kept when speculation goes off: the next run reuses it
    if speculator is not None:
        engine.updater.speculation = engine.stats.speculation = speculator.stats
        return speculator.stats
    return None
