"""Structured outputs in the engine: each constrained sequence's llguidance matcher, and the token
bitmask of a step, filled while the forward pass runs (as vLLM computes it beside the model).

    step:  schedule ─► launch(plan) ─► a thread fills one bitmask row per sampled row of a
                          │            constrained sequence, from its matcher (llguidance
                          │            releases the GIL)
                          ├─► forward pass (this thread)
                          ▼
           StepMasks ◄── result() ─► the sampler sets the logits of refused tokens to -inf
                                   ─► each sequence's matcher consumes the token it took

A matcher is only read by the filling thread and only advanced after `result()`, so the two never
touch one at once. A speculating row's drafts are consumed for the masks of the rows after them,
then rolled back; the rows after a draft the grammar refuses stay all-allowed (that draft is
rejected, so no later row is used). A matcher that is done allows only the end tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.common.structured_outputs import Grammars, ll_tokenizer
from pagemesh.workers.engine.scheduler import StepPlan
from pagemesh.workers.engine.sequence import Sequence

Entry = tuple[llguidance.LLMatcher, int, list[int]]  # (matcher, its first bitmask row, drafts)


@dataclass
class StepMasks:
    """One step's bitmask: `bitmask[r]` packs the allowed tokens of row r (int32 words, bit i of
    word w is token 32w + i); `first_row[seq_id]` is a sequence's row (its draft rows follow);
    `stopped[r]`: the grammar was done at row r (only an end token may come)."""

    bitmask: torch.Tensor
    first_row: dict[int, int]
    stopped: list[bool]

    def row(self, seq: Sequence, ahead: int = 0) -> tuple[torch.Tensor, bool] | None:
        """`seq`'s mask after `ahead` of its drafts, and whether its grammar is done there."""
        first = self.first_row.get(seq.seq_id)
        if first is None:
            return None
        return self.bitmask[first + ahead], self.stopped[first + ahead]


class PendingMasks:
    """A step's masks, being filled (a future) or filled already."""

    def __init__(self, masks: StepMasks | Future) -> None:
        self._masks = masks

    def result(self) -> StepMasks:
        if isinstance(self._masks, Future):
            self._masks = self._masks.result()
        return self._masks


class GrammarMasks:
    """The engine's structured outputs: a new request's matcher (`start`) and each step's masks
    (`launch`). `end_ids`: the tokens that end generation. `tokenizer` None: token ids only, no
    structured outputs. `overlap` False fills the masks in the step's critical path, before the
    forward pass (bench/structured_outputs.py compares the two)."""

    def __init__(self, tokenizer, vocab_size: int, end_ids: frozenset[int], overlap: bool = True) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        self.overlap = overlap
        self._grammars: Grammars | None = None  # built at the first constrained request (~0.3 s)
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(ll_tokenizer(self.tokenizer, self.vocab_size))
        return self._grammars

    def start(self, params: SamplingParams, tokens: Seq[int] = ()) -> llguidance.LLMatcher | None:
        """A new sequence's matcher (None: unconstrained), past `tokens` (sampled elsewhere: a
        resumed request's, a handed-off request's first). ValueError naming the field when the
        grammar does not compile."""
        if not params.constrained:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{params.constraint_field}: structured outputs need the model's tokenizer")
        matcher = self.grammars.matcher(params)
        for token in tokens:
            matcher.consume_token(token)
        return matcher

    def launch(self, plan: StepPlan, overlap: bool | None = None) -> PendingMasks | None:
        """Start filling the masks of `plan`'s sampled rows of constrained sequences, in a thread
        when overlapping (the default: `self.overlap`); None when the plan has none."""
        entries: list[Entry] = []
        first_row: dict[int, int] = {}
        rows = 0
        for chunk in plan.chunks:
            matcher = chunk.seq.grammar
            if matcher is None or not chunk.samples:
                continue
            first_row[chunk.seq.seq_id] = rows
            entries.append((matcher, rows, chunk.drafts))
            rows += 1 + len(chunk.drafts)
        if not entries:
            return None
        bitmask = torch.full((rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        if not (self.overlap if overlap is None else overlap):
            return PendingMasks(_fill(self._executor, entries, bitmask, first_row, self.end_ids))
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return PendingMasks(self._thread.submit(_fill, self._executor, entries, bitmask, first_row, self.end_ids))


def _fill(
    executor: llguidance.LLExecutor,
    entries: list[Entry],
    bitmask: torch.Tensor,
    first_row: dict[int, int],
    end_ids: frozenset[int],
) -> StepMasks:
    stopped = [False] * bitmask.shape[0]
    plain = [(matcher, row) for matcher, row, drafts in entries if not drafts]
    if plain:  # every row at once, over llguidance's threads
        fill_rows(executor, plain, bitmask)
        for matcher, row in plain:
            stopped[row] = matcher.is_stopped()
    for matcher, row, drafts in entries:
        if not drafts:
            continue
        fill_row(matcher, bitmask, row)
        stopped[row] = matcher.is_stopped()
        consumed = 0
        for token in drafts[: matcher.validate_tokens(drafts)]:  # the drafts the grammar takes, in a row
            if token in end_ids:  # the row after an end token is never used: its draft ends the output
                break
            matcher.consume_token(token)
            consumed += 1
            fill_row(matcher, bitmask, row + consumed)
            stopped[row + consumed] = matcher.is_stopped()
        if consumed:
            matcher.rollback(consumed)
    return StepMasks(bitmask, first_row, stopped)


# llguidance writes masks straight into the tensor's memory (contiguous int32 rows on the host); its own
# torch helpers are not imported: their module compiles a kernel with torch.compile at import (~2 s)


def fill_rows(
    executor: llguidance.LLExecutor, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor
) -> None:
    """Row r of `bitmask` := the mask of the matcher paired with r, for every pair at once."""
    executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)
