"""Speculative decoding: who proposes drafts, and when. Three methods:

    ngram            prompt lookup: no draft model, the sequence itself proposes (below)
    suffix           SuffixDecoding: the sequence itself and a cache of this server's recent
                     outputs propose (workers/engine/suffix_decoding.py)
    draft_quantized  self-speculation: the same model's quantized weights propose, the full model
                     verifies (workers/engine/draft_model.py runs the draft)

How many drafts each sequence verifies is chosen every step from its measured acceptance and the
measured cost of a step's rows (workers/engine/draft_length.py): no fixed batch-size cut-off.

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
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.draft_length import Acceptance, DraftLengths
from pagemesh.workers.engine.suffix_decoding import SuffixCache, draft_from_sequence, earlier_occurrences

METHODS = ("ngram", "suffix", "draft_quantized")
DRAFT_QUANTIZATIONS = ("gguf", "int8")  # as `--quantization` (workers/model/quantization.py)
PENDING_DRAFT = -1  # a draft model's proposal not made yet (never a token id)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, as vLLM spells it: `{"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_max": N, "prompt_lookup_min": M}`, or `{"method": "suffix", "num_speculative_tokens":
    K, "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}` (vLLM's keys and
    defaults; K defaults to the tree depth there, as in vLLM), or `{"method": "draft_quantized",
    "num_speculative_tokens": K, "quantization": "gguf"}`: the draft is the served model with its
    linear weights quantized as `--quantization` would (`gguf`: the GGUF file's own 4-bit blocks;
    `int8`: rounded at load). `quantization` is the draft's only; the n-gram method ignores it,
    the draft method ignores the prompt_lookup keys.

    Our `max_decode_rows` (kept for old configs): None (the default) leaves how many drafts each
    sequence verifies to the draft-length policy, at every batch size; set, it is the old fixed
    rule: steps with more decode rows than this do not speculate, the others verify every draft
    proposed (up to K)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_decode_rows: int | None = None
    quantization: str = "gguf"
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: must be one of {list(METHODS)}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization: must be one of {list(DRAFT_QUANTIZATIONS)}")
        integers = ("suffix_decoding_max_tree_depth", "num_speculative_tokens", "prompt_lookup_min", "max_decode_rows")
        for name in integers:
            value = getattr(self, name)
            if name == "max_decode_rows" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1")
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests: must be an integer >= 0")
        factor = self.suffix_decoding_max_spec_factor
        if not isinstance(factor, int | float) or factor <= 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor: must be a number > 0")
        prob = self.suffix_decoding_min_token_prob
        if not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob: must be a number in [0, 1]")
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
        if values.get("method") == "suffix" and "num_speculative_tokens" not in values:  # vLLM's default
            values["num_speculative_tokens"] = values.get("suffix_decoding_max_tree_depth", 24)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


def propose_ngram(tokens: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram of `tokens` (n from `max_n` down to `min_n`); [] when no suffix of those lengths
    occurs earlier. The match must end before the last token, so at least one token follows it.

    The search is `bytes.rfind` over the ids packed 4 bytes each (`earlier_occurrences`)."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for start in earlier_occurrences(data, length, n, 1):
            return list(tokens[start : start + k])
    return []


@dataclass
class SpeculationStats:
    """Totals over verified drafts: acceptance rate = accepted / proposed; mean accepted length
    = tokens emitted per verifying pass (accepted drafts + the one sampled token)."""

    passes: int = 0  # speculating decode rows verified (vLLM's num_drafts)
    proposed: int = 0  # draft tokens run through the model
    accepted: int = 0  # of those, kept
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: passes that kept draft j (0-based)
    acceptance: Acceptance | None = field(default=None, repr=False, compare=False)  # per-sequence estimates

    def record(self, proposed: int, accepted: int, key: Hashable = None) -> None:
        self.passes += 1
        self.proposed += proposed
        self.accepted += accepted
        if len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos += [0] * (accepted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1
        if self.acceptance is not None and key is not None:
            self.acceptance.record(key, proposed, accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0


class Speculator:
    """Decides which decodes speculate this step, how many drafts each, and proposes them; keeps
    the engine's totals (`stats`). `max_model_len`: drafts never run past the context length."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.policy = DraftLengths()
        self.stats = SpeculationStats(acceptance=self.policy.acceptance)
        self.suffix_cache = (
            SuffixCache(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)
            if config.method == "suffix"
            else None
        )

    def step_allows(self, num_decode_rows: int) -> bool:
        """Speculate at all in a step with this many decode rows (only a set `max_decode_rows`
        says no; otherwise `lengths` decides per sequence)."""
        return self.config.max_decode_rows is None or num_decode_rows <= self.config.max_decode_rows

    def lengths(self, seq_ids: Seq[int], available: Seq[int], num_decode_rows: int, budget: int) -> list[int]:
        """How many of its `available` proposed drafts each sequence verifies this step, adding at
        most `budget` rows to a step of `num_decode_rows` decode rows (workers/engine/draft_length.py).
        With `max_decode_rows` set, the old fixed rule instead: every proposed draft, in order."""
        if self.config.max_decode_rows is not None:
            out = []
            for n in available:
                out.append(min(n, budget))
                budget -= out[-1]
            return out
        return self.policy.lengths(seq_ids, available, num_decode_rows, budget)

    def worth_proposing(self, seq_id: int, num_decode_rows: int) -> bool:
        """Look its proposal up at all (a set `max_decode_rows`: always)."""
        return self.config.max_decode_rows is not None or self.policy.worth_proposing(seq_id, num_decode_rows)

    def step_started(self, now: float) -> None:
        self.policy.step_started(now)

    def planned(self, rows: int) -> None:
        self.policy.planned(rows)

    def finished(self, seq_id: int, output_ids: Seq[int], reason: str | None) -> None:
        """A sequence ended: its estimate goes; a suffix cache keeps its output (not an abort's)."""
        self.policy.acceptance.forget(seq_id)
        if self.suffix_cache is not None and reason in ("stop", "length"):
            self.suffix_cache.add(output_ids)

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
        if self.suffix_cache is not None:
            depth, factor, prob = (
                cfg.suffix_decoding_max_tree_depth,
                cfg.suffix_decoding_max_spec_factor,
                cfg.suffix_decoding_min_token_prob,
            )
            own = draft_from_sequence(token_ids, k, depth, factor, prob)
            cached = self.suffix_cache.draft(token_ids, k, factor, prob)
            return (cached if cached[1:] > own[1:] else own)[0]  # the higher score, then the longer match
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
