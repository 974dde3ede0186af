"""Feature-cache policies: which rows of a step batch recompute the deep blocks and which reuse
their cached output. Pure Python (no torch: tests/unit/test_purity.py); the tensors and the
signals a policy reads are the engine's (engine/feature_cache.py).

A request asks for a policy as "<policy>[:<value>]" (ImageParams.cache; the worker's
--diffusion-cache when it asks for none):

    none          every block, every step
    interval:N    DeepCache / FORA: the first block always runs; the blocks after it run every
                  N-th step and the steps between reuse their cached residual
    fbcache:T     First-Block-Cache: the first block always runs; the rest are skipped when the
                  first block's residual moved by less than T (relative L1) since the last step
                  that ran them
    teacache:T    TeaCache: the relative L1 change of the first block's timestep-modulated input
                  from the previous step, rescaled by the model's polynomial into an estimate of
                  the model output's relative change (`rescaled`), is accumulated; while the sum
                  is below T every block is skipped (the whole stack's cached residual is reused);
                  past it, all run and the sum restarts

TeaCache's rescaling (Liu et al. 2024): the modulated input's change is not the output's; a
polynomial p fitted per model on uncached runs (training/fit_teacache.py: the output's relative
L1 change against the input's, step to step) maps one to the other, so that T reads as "the
output may drift this much", comparable across models and with the published thresholds. A model
without fitted coefficients accumulates the raw change. p is clamped at 0: the sum never falls,
so T = 0 still computes every step.

Every policy computes the first WARMUP_STEPS and the last COOLDOWN_STEPS steps in full: the
early steps lay out the image, and the last ones its detail. A threshold of 0 or interval 1
never skips, so it reproduces the uncached image exactly.

The decision is made per row (an image's cond row, and its uncond row with guidance), each with
its own `RowState`, so rows of one step batch may decide differently:

    step s of a row ─ warm-up / cool-down? ─yes─▶ compute
                          │ no
                          ▼
        interval: (s - WARMUP_STEPS + 1) % N == 0      ─▶ compute, else reuse
        fbcache:  no cache yet or change >= T          ─▶ compute, else reuse
        teacache: accumulated += p(change); >= T       ─▶ compute (sum back to 0), else reuse
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

WARMUP_STEPS = 2
COOLDOWN_STEPS = 1
MAX_INTERVAL = 1000
MAX_THRESHOLD = 100.0


class CacheKind(enum.StrEnum):
    NONE = "none"
    INTERVAL = "interval"
    FBCACHE = "fbcache"
    TEACACHE = "teacache"


DEFAULT_VALUES = {CacheKind.INTERVAL: 3.0, CacheKind.FBCACHE: 0.08, CacheKind.TEACACHE: 0.3}
POLICIES_HELP = (
    "none; interval:N (reuse the deep blocks for N steps, N an integer >= 1, default 3); "
    "fbcache:T (First-Block-Cache, threshold T >= 0, default 0.08); "
    "teacache:T (TeaCache, threshold T >= 0, default 0.3)"
)


class CachePolicyError(ValueError):
    """A cache spec that names no policy or gives it a bad value (the engine's 400, param 'cache')."""


@dataclass(frozen=True, kw_only=True)
class CachePolicy:
    """A parsed policy. `value`: N for interval, the threshold T for fbcache and teacache."""

    kind: CacheKind = CacheKind.NONE
    value: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.kind is not CacheKind.NONE

    @property
    def spec(self) -> str:
        """The canonical "<policy>[:<value>]" (what results report)."""
        if self.kind is CacheKind.NONE:
            return "none"
        if self.kind is CacheKind.INTERVAL:
            return f"interval:{int(self.value)}"
        return f"{self.kind}:{self.value:g}"

    @property
    def first_cached_block(self) -> int:
        """The first block a skipped step reuses instead of running: TeaCache skips the whole
        stack, the others always run block 0 (their signal, or DeepCache's shallow path)."""
        return 0 if self.kind is CacheKind.TEACACHE else 1

    @property
    def cached_tensors(self) -> int:
        """[tokens, dim] tensors kept per row: the skipped blocks' residual, and for the dynamic
        policies the signal of the last step (first-block residual / modulated input)."""
        return {CacheKind.NONE: 0, CacheKind.INTERVAL: 1}.get(self.kind, 2)


NO_CACHE = CachePolicy()


def parse_cache_policy(spec: str | None) -> CachePolicy:
    """ "<policy>[:<value>]" -> CachePolicy; None or "" is none. Raises CachePolicyError."""
    if spec is None or not spec.strip():
        return NO_CACHE
    name, sep, raw = spec.strip().lower().partition(":")
    try:
        kind = CacheKind(name)
    except ValueError:
        raise CachePolicyError(f"cache: unknown policy {name!r}; policies: {POLICIES_HELP}") from None
    if kind is CacheKind.NONE:
        if sep:
            raise CachePolicyError(f"cache: 'none' takes no value; policies: {POLICIES_HELP}")
        return NO_CACHE
    if not sep:
        return CachePolicy(kind=kind, value=DEFAULT_VALUES[kind])
    try:
        value = float(raw)
    except ValueError:
        raise CachePolicyError(f"cache: {spec!r} has no number after ':'; policies: {POLICIES_HELP}") from None
    if kind is CacheKind.INTERVAL:
        if not (value.is_integer() and 1 <= value <= MAX_INTERVAL):
            raise CachePolicyError(f"cache: interval must be an integer in [1, {MAX_INTERVAL}], got {raw!r}")
    elif not (math.isfinite(value) and 0 <= value <= MAX_THRESHOLD):
        raise CachePolicyError(f"cache: {kind} threshold must be a number in [0, {MAX_THRESHOLD:g}], got {raw!r}")
    return CachePolicy(kind=kind, value=value)


@dataclass
class RowState:
    """One row's cache bookkeeping (its tensors are the engine's). `cached`: its residual has
    been stored once, so a skip has something to reuse."""

    cached: bool = False
    accumulated: float = 0.0  # teacache: the change summed since the last computed step
    computed: int = 0  # steps that ran the cached blocks
    skipped: int = 0  # steps that reused them


def in_full_window(step: int, steps: int) -> bool:
    """Warm-up or cool-down: the step runs every block whatever the policy."""
    return step < WARMUP_STEPS or step >= steps - COOLDOWN_STEPS


def rescaled(change: float, coefficients: tuple[float, ...] | None) -> float:
    """TeaCache's estimate of the output's relative change from the modulated input's: the
    polynomial `coefficients` (highest degree first, as numpy.polyfit gives them) at `change`,
    clamped at 0 (a NaN stays NaN, so it computes); `change` itself without coefficients."""
    if coefficients is None:
        return change
    value = 0.0
    for c in coefficients:  # Horner, as numpy.polyval
        value = value * change + c
    return 0.0 if value < 0 else value


def decide(
    policy: CachePolicy,
    row: RowState,
    step: int,
    steps: int,
    change: float | None = None,
    coefficients: tuple[float, ...] | None = None,
) -> bool:
    """True: this row runs the cached blocks at `step` (0-based, of `steps`); False: it reuses
    them. `change`: the policy's signal for this row at this step (fbcache: the first-block
    residual's relative L1 change since the last computed step; teacache: the modulated input's
    since the previous step); None when there is no previous value. `coefficients`: teacache's
    rescaling polynomial for the model (`rescaled`), None for the raw change. Updates `row`."""
    if change is not None and policy.kind is CacheKind.TEACACHE:
        change = rescaled(change, coefficients)
    compute = _decide(policy, row, step, steps, change)
    if compute:
        row.computed += 1
        row.cached = True
    else:
        row.skipped += 1
    return compute


def _decide(policy: CachePolicy, row: RowState, step: int, steps: int, change: float | None) -> bool:
    if not policy.enabled:
        return True
    if not row.cached or in_full_window(step, steps):
        row.accumulated = 0.0
        return True
    if policy.kind is CacheKind.INTERVAL:  # the last warm-up step was a computed one: N-1 reuses follow it
        return (step - WARMUP_STEPS + 1) % int(policy.value) == 0
    if change is None:
        return True
    if policy.kind is CacheKind.FBCACHE:
        return not change < policy.value  # a NaN change computes
    row.accumulated += change
    if row.accumulated < policy.value:
        return False
    row.accumulated = 0.0
    return True
