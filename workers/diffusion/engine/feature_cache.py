"""Feature caches inside a step batch: each request keeps its own cache, and each row decides
for itself whether it runs the deep blocks this step (the policies are cache_policy.py's).

One forward over a batch whose rows come from requests with different policies, at different
steps (L blocks; `rows` of a request are contiguous in the batch):

    latents ──embed──▶ h0 ──┬─ teacache rows: modulated input vs the last step's ─▶ skip all?
                            ▼
         block 0 on every row that does not skip it (gathered when some do)  ─▶ h1
                            │ fbcache rows: (h1 - h0) vs the residual at their last computed step
                            │ interval rows: the step number
                            ▼
         blocks 1..L-1 on the computing rows only (index_select ─▶ blocks ─▶ index_copy)
         skipping rows: h1 + their cached residual (teacache: h0 + the whole stack's)  ─▶ hL
                            ▼
                        final(hL) ─▶ the model output

A request with policy none (or whose cache did not fit the worker's budget) computes every block
on every row, beside the others. A computing row's hidden states are the blocks' own output, so
threshold 0 / interval 1 gives exactly the uncached numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.diffusion.engine.cache_policy import CacheKind, CachePolicy, RowState, decide
from workers.diffusion.pipelines.base import BlockForward

EPS = 1e-12  # keeps a relative change defined when the reference is all zeros


class RequestCache:
    """One request's feature cache, a row per cond/uncond row of its images:

    residual [rows, T, D]  what the skipped blocks added at the row's last computed step
    signal   [rows, T, D]  fbcache: the first block's residual then; teacache: the last
                           step's modulated input (interval keeps none)
    states   RowState per row (the policy's bookkeeping)"""

    def __init__(self, policy: CachePolicy, rows: int, hidden_shape: tuple[int, int], dtype, device):
        self.policy = policy
        self.residual = torch.zeros((rows, *hidden_shape), dtype=dtype, device=device)
        self.signal = torch.zeros_like(self.residual) if policy.cached_tensors > 1 else None
        self.states = [RowState() for _ in range(rows)]

    @staticmethod
    def bytes_needed(policy: CachePolicy, rows: int, hidden_shape: tuple[int, int], dtype: torch.dtype) -> int:
        tokens, dim = hidden_shape
        return policy.cached_tensors * rows * tokens * dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.residual, self.signal) if t is not None)


@dataclass(frozen=True, kw_only=True)
class CachePart:
    """One request's rows in a batch: rows offset..offset+rows-1, at `step` of `steps`; cache
    None runs every block."""

    cache: RequestCache | None
    offset: int
    rows: int
    step: int
    steps: int


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> list[float]:
    """Per row: mean |current - previous| / mean |previous| (float32)."""
    current, previous = current.float().flatten(1), previous.float().flatten(1)
    return ((current - previous).abs().mean(1) / previous.abs().mean(1).clamp_min(EPS)).tolist()


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _run_blocks(bf: BlockForward, hidden, rows, start: int, stop: int, run: list[int]) -> torch.Tensor:
    """`hidden` with blocks start..stop-1 applied to rows `run` (all of them: no gather)."""
    if len(run) == hidden.shape[0]:
        return bf.blocks(hidden, rows, start, stop)
    out = hidden.clone()
    if run:
        index = _index(run, hidden.device)
        out.index_copy_(0, index, bf.blocks(hidden.index_select(0, index), rows.select(index), start, stop))
    return out


def cached_forward(bf: BlockForward, latents, timesteps, cond, parts: list[CachePart]) -> tuple[torch.Tensor, list]:
    """The model output for every row, and the blocks each part computed (summed over its rows).
    Updates each part's cache and row states."""
    num_blocks = bf.num_blocks
    h0, rows = bf.embed(latents, timesteps, cond)
    device = h0.device
    ranges = [range(p.offset, p.offset + p.rows) for p in parts]

    # TeaCache: decided on the modulated input, before block 0 (a skip skips the whole stack).
    skip_all: set[int] = set()
    tea = [i for i, p in enumerate(parts) if p.cache is not None and p.cache.policy.kind is CacheKind.TEACACHE]
    if tea:
        index = _index([r for i in tea for r in ranges[i]], device)
        modulated = bf.modulated_input(h0.index_select(0, index), rows.select(index))
        start = 0
        for i in tea:
            part, cache = parts[i], parts[i].cache
            mine = modulated[start : start + part.rows]
            start += part.rows
            changes = relative_l1(mine, cache.signal)
            for j, state in enumerate(cache.states):
                change = changes[j] if state.cached else None
                if not decide(cache.policy, state, part.step, part.steps, change):
                    skip_all.add(part.offset + j)
            cache.signal.copy_(mine)

    h1 = _run_blocks(bf, h0, rows, 0, 1, [r for r in range(h0.shape[0]) if r not in skip_all])

    # Interval and First-Block-Cache: decided after block 0.
    skip_rest = set(skip_all)
    for part in parts:
        cache = part.cache
        if cache is None or cache.policy.kind is CacheKind.TEACACHE:
            continue
        changes: list[float | None] = [None] * part.rows
        if cache.policy.kind is CacheKind.FBCACHE:
            first_residual = h1[part.offset : part.offset + part.rows] - h0[part.offset : part.offset + part.rows]
            changes = relative_l1(first_residual, cache.signal)
        refreshed = []
        for j, state in enumerate(cache.states):
            if decide(cache.policy, state, part.step, part.steps, changes[j] if state.cached else None):
                refreshed.append(j)
            else:
                skip_rest.add(part.offset + j)
        if cache.signal is not None and refreshed:  # fbcache compares with its last computed step
            local = _index(refreshed, device)
            cache.signal.index_copy_(0, local, first_residual.index_select(0, local))

    hidden = _run_blocks(bf, h1, rows, 1, num_blocks, [r for r in range(h0.shape[0]) if r not in skip_rest])
    computed = []
    for part, span in zip(parts, ranges):
        skipped = [j for j, row in enumerate(span) if row in skip_rest]
        ran_first = sum(1 for row in span if row in skip_rest and row not in skip_all)
        computed.append((part.rows - len(skipped)) * num_blocks + ran_first)
        if part.cache is not None:
            _reuse_and_store(part, hidden, h0, h1, skipped)
    return bf.final(hidden, rows), computed


def _reuse_and_store(part: CachePart, hidden, h0, h1, skipped: list[int]) -> None:
    """Skipping rows of `part` get their cached residual on top of h1 (a teacache skip: h1 is
    h0, block 0 did not run); computing rows store what the cached blocks added this step."""
    cache, device = part.cache, hidden.device
    skipping = set(skipped)
    computed = [j for j in range(part.rows) if j not in skipping]
    if skipped:
        local = _index(skipped, device)
        rows = local + part.offset
        hidden.index_copy_(0, rows, h1.index_select(0, rows) + cache.residual.index_select(0, local))
    if computed:
        local = _index(computed, device)
        rows = local + part.offset
        base = h0 if cache.policy.kind is CacheKind.TEACACHE else h1
        cache.residual.index_copy_(0, local, hidden.index_select(0, rows) - base.index_select(0, rows))
