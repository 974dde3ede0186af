"""Feature caches inside a step batch: each request keeps its own cache, and each row decides
for itself whether it runs the deep blocks this step (the policies are cache_policy.py's).

One forward over a batch whose rows come from requests with different policies, at different
steps (L blocks; `rows` of a request are contiguous in the batch):

    latents ──embed──▶ h0 ──┬─ teacache rows: modulated input vs the last step's
                            │  (rescaled by the model's polynomial, if fitted)    ─▶ skip all?
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

from pagemesh.workers.diffusion.engine.cache_policy import CacheKind, CachePolicy, RowState, decide
from pagemesh.workers.diffusion.pipelines.base import BlockForward

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


def _run_blocks(bf: BlockForward, hidden, rows, start: int, stop: int, skip: set[int]) -> torch.Tensor:
    """`hidden` with blocks start..stop-1 applied to every row not in `skip` (gathered and
    scattered back when some are; none skipped: no copy)."""
    if not skip:
        return bf.blocks(hidden, rows, start, stop)
    out = hidden.clone()
    run = [r for r in range(hidden.shape[0]) if r not in skip]
    if run:
        index = _index(run, hidden.device)
        out.index_copy_(0, index, bf.blocks(hidden.index_select(0, index), rows.select(index), start, stop))
    return out


def _kind_of(part: CachePart) -> CacheKind:
    return part.cache.policy.kind if part.cache is not None else CacheKind.NONE


def _decide_rows(part: CachePart, changes: list[float], first: int, coefficients=None) -> list[bool]:
    """Each row's decision (True: compute); `changes[first + j]` is row j's signal;
    `coefficients`: the model's teacache rescaling (cache_policy.rescaled), None for the raw change."""
    cache = part.cache
    return [
        decide(
            cache.policy,
            state,
            part.step,
            part.steps,
            changes[first + j] if changes and state.cached else None,
            coefficients,
        )
        for j, state in enumerate(cache.states)
    ]


def _signals(bf: BlockForward, parts: list[CachePart], h0, h1, rows) -> tuple[torch.Tensor, list[float]]:
    """The current signal of the rows of `parts` (one kind, all dynamic), stacked, and each
    row's relative change from its stored one: one gather and one host sync for all of them."""
    index = _index([r for p in parts for r in range(p.offset, p.offset + p.rows)], h0.device)
    if _kind_of(parts[0]) is CacheKind.TEACACHE:
        current = bf.modulated_input(h0.index_select(0, index), rows.select(index))
    else:  # fbcache: what block 0 added
        current = h1.index_select(0, index) - h0.index_select(0, index)
    return current, relative_l1(current, torch.cat([p.cache.signal for p in parts]))


def _store_signal(cache: RequestCache, current: torch.Tensor, keep: list[bool]) -> None:
    if all(keep):
        cache.signal.copy_(current)
    elif any(keep):
        local = _index([j for j, k in enumerate(keep) if k], current.device)
        cache.signal.index_copy_(0, local, current.index_select(0, local))


def cached_forward(bf: BlockForward, latents, timesteps, cond, parts: list[CachePart]) -> tuple[torch.Tensor, list]:
    """The model output for every row, and the blocks each part computed (summed over its rows).
    Updates each part's cache and row states."""
    num_blocks = bf.num_blocks
    h0, rows = bf.embed(latents, timesteps, cond)
    computes: dict[int, list[bool]] = {}  # part number -> each row: runs the cached blocks

    # TeaCache: decided on the modulated input, before block 0 (a skip skips the whole stack);
    # its signal is the previous step's, whatever that step did.
    tea = [i for i, p in enumerate(parts) if _kind_of(p) is CacheKind.TEACACHE]
    if tea:
        current, changes = _signals(bf, [parts[i] for i in tea], h0, None, rows)
        coefficients = getattr(bf, "teacache_coefficients", None)  # the model's rescaling, if fitted
        first = 0
        for i in tea:
            computes[i] = _decide_rows(parts[i], changes, first, coefficients)
            first += parts[i].rows
        signals = [parts[i].cache.signal for i in tea]
        torch._foreach_copy_(signals, list(current.split([s.shape[0] for s in signals])))
    skip_all = {parts[i].offset + j for i in tea for j, c in enumerate(computes[i]) if not c}
    if all(_kind_of(p) in (CacheKind.TEACACHE, CacheKind.NONE) for p in parts):
        # no row decides after block 0: the whole stack in one call (one gather and scatter); a
        # teacache skip's h1 is its h0
        hidden = _run_blocks(bf, h0, rows, 0, num_blocks, skip_all)
        return _finish(bf, parts, computes, hidden, h0, h0, rows, skip_all)
    h1 = _run_blocks(bf, h0, rows, 0, 1, skip_all)

    # First-Block-Cache (on block 0's residual, against the last computed step's) and interval.
    fb = [i for i, p in enumerate(parts) if _kind_of(p) is CacheKind.FBCACHE]
    if fb:
        current, changes = _signals(bf, [parts[i] for i in fb], h0, h1, rows)
        first = 0
        for i in fb:
            computes[i] = _decide_rows(parts[i], changes, first)
            _store_signal(parts[i].cache, current[first : first + parts[i].rows], computes[i])
            first += parts[i].rows
    for i, part in enumerate(parts):
        if _kind_of(part) is CacheKind.INTERVAL:
            computes[i] = _decide_rows(part, [], 0)
    skip_rest = {parts[i].offset + j for i, c in computes.items() for j, runs in enumerate(c) if not runs}
    hidden = _run_blocks(bf, h1, rows, 1, num_blocks, skip_rest)
    return _finish(bf, parts, computes, hidden, h0, h1, rows, skip_all)


def _finish(bf: BlockForward, parts, computes, hidden, h0, h1, rows, skip_all: set[int]) -> tuple[torch.Tensor, list]:
    """The caches updated, the skipping rows' hidden states filled in, the final layer run, and
    the blocks each part computed."""
    _store_residuals(parts, computes, hidden, h0, h1)
    _reuse_residuals(parts, computes, hidden, h1)
    computed = []
    for i, part in enumerate(parts):
        runs = computes.get(i, [True] * part.rows)
        ran_first_only = sum(1 for j, c in enumerate(runs) if not c and part.offset + j not in skip_all)
        computed.append(sum(runs) * bf.num_blocks + ran_first_only)
    return bf.final(hidden, rows), computed


def _store_residuals(parts: list[CachePart], computes: dict[int, list[bool]], hidden, h0, h1) -> None:
    """Computing rows keep what the cached blocks added this step (teacache: the whole stack).
    Requests whose rows all computed take their rows of one batch-wide difference, in one copy."""
    added: dict[bool, torch.Tensor] = {}  # whole stack (teacache)? -> hidden minus its base, every row
    targets, sources = [], []
    for i, runs in computes.items():
        part, cache = parts[i], parts[i].cache
        whole_stack = cache.policy.kind is CacheKind.TEACACHE
        base = h0 if whole_stack else h1
        span = slice(part.offset, part.offset + part.rows)
        if all(runs):
            if whole_stack not in added:
                added[whole_stack] = hidden - base
            targets.append(cache.residual)
            sources.append(added[whole_stack][span])
        elif any(runs):
            local = _index([j for j, c in enumerate(runs) if c], hidden.device)
            mine = local + part.offset
            cache.residual.index_copy_(0, local, hidden.index_select(0, mine) - base.index_select(0, mine))
    if targets:
        torch._foreach_copy_(targets, sources)


def _reuse_residuals(parts: list[CachePart], computes: dict[int, list[bool]], hidden, h1) -> None:
    """Skipping rows: h1 + their cached residual (a teacache skip: h1 is h0, block 0 did not run),
    in one scatter for the batch."""
    skipping, residuals = [], []
    for i, runs in computes.items():
        part, cache = parts[i], parts[i].cache
        local = [j for j, c in enumerate(runs) if not c]
        if not local:
            continue
        skipping += [part.offset + j for j in local]
        whole = len(local) == part.rows
        residuals.append(cache.residual if whole else cache.residual.index_select(0, _index(local, hidden.device)))
    if skipping:
        index = _index(skipping, hidden.device)
        hidden.index_copy_(0, index, h1.index_select(0, index) + torch.cat(residuals))
