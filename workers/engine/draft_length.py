"""How many drafts each speculating sequence verifies this step: chosen from the measured acceptance
and a measured cost of the step, with no fixed batch-size cut-off.

Pure Python (no torch, no zmq: tests/unit/test_purity.py).

    acceptance   per sequence, a = P(a draft is kept | the drafts before it were): a draft pass
                 with k drafts that kept m is m successes and, if m < k, one failure (the drafts
                 after the first miss are never tested). Exponentially weighted, seeded from the
                 engine-wide rate, so a new sequence starts from what the others measured; the
                 policy reads it plus one standard error of the sequence's own passes, so a new
                 sequence tries a draft or two before the others' rate holds it back.
    gain         k drafts at acceptance a yield (1 - a^(k+1)) / (1 - a) tokens a pass: the j-th
                 draft adds a^j tokens in expectation.
    cost         the step's wall time against the rows (tokens) it ran, measured over the
                 decode-only steps the engine actually ran (from one plan to the next: forward,
                 sampling, update): a running least-squares line t(R) = fixed + per_row * R, and
                 the mean step of each bin of 8 rows where one has been seen. While a step is
                 bound by reading the weights (one stream on a CPU) per_row is small against
                 fixed and extra rows are nearly free; once it is compute bound the per-row term
                 dominates and a draft must be kept often to pay for its row; where a kernel
                 changes path (this CPU's quantized linears from 65 rows) the bins see the step
                 that the line averages away. Before any step, per_row / fixed = 1/16
                 (docs/perf/speculative.md: 1 row ~12 ms, 32 rows ~35 ms a step on the 2-core CPU).
    choice       the j-th draft of sequence i gains a_i^j expected tokens and costs one row.
                 Drafts are taken best gain first, and the step keeps the count with the most
                 expected tokens per second (with equal costs a row, the best m gains are the
                 best set of m). Large batches already emit many tokens a second, so only
                 drafts that are nearly sure to be kept survive there; low acceptance gets 0.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

PRIOR_ROW_RATIO = 1 / 16  # per-row / fixed step time before anything is measured
PRIOR_WEIGHT = 4.0  # the prior's weight, in steps at a one-row spread, against the measured slope
PRIOR_ACCEPTANCE = 0.8  # the engine-wide rate before any draft was verified (optimistic: a first pass is cheap)
NEW_BONUS = 0.3  # at least this much optimism before a sequence's first verified draft
PROBE_EVERY = 32  # a sequence held at 0 drafts proposes 1 about this often (x rows / 8 from 8 decode rows on:
# probes stay ~1/32 of a step's rows at most), so its estimate can recover


class StepCost:
    """A step's seconds against its rows: a running weighted least-squares line over every step,
    and beside it the mean of the steps in each bin of 8 rows (1-8 exact), which catches what a
    line cannot: a kernel that changes path at some row count (this CPU's quantized linears widen
    their weights from 65 rows: docs/perf/speculative.md). A bin seen at least `MIN_BIN` times
    answers for its rows; elsewhere the line does."""

    MIN_BIN = 2

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.bins: dict[int, list[float]] = {}  # bin -> [weight, sum of rows, sum of seconds]

    @staticmethod
    def bin(rows: int) -> int:
        return rows if rows <= 8 else 8 + (rows - 1) // 8

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        if self.w >= 8:  # one stall (the machine, a pause between runs) is not the model's cost
            seconds = min(seconds, 4 * self.time(rows))
        d = self.decay
        self.w = d * self.w + 1
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds
        b = self.bins.setdefault(self.bin(rows), [0.0, 0.0, 0.0])
        b[0], b[1], b[2] = d * b[0] + 1, d * b[1] + rows, d * b[2] + seconds

    def fit(self) -> tuple[float, float]:
        """The line's (fixed, per_row); in arbitrary units (1, 1/16) before any step was observed."""
        if self.w == 0:
            return 1.0, PRIOR_ROW_RATIO
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx - self.w * mx * mx
        cov = self.sxy - self.w * mx * my
        prior_slope = PRIOR_ROW_RATIO * my / (1 + PRIOR_ROW_RATIO * mx)  # the prior's line through the mean
        slope = max(0.0, (cov + PRIOR_WEIGHT * prior_slope) / (max(var, 0.0) + PRIOR_WEIGHT))
        fixed = max(my - slope * mx, 0.05 * my)  # a step never costs nothing
        return fixed, slope

    def time(self, rows: int) -> float:
        fixed, per_row = self.fit()
        index = self.bin(rows)
        b = self.bins.get(index)
        if b is None or b[0] < self.MIN_BIN:
            return fixed + per_row * rows
        # the bin's mean, moved along the slope from the bin below (the line's, if less: a line
        # fitted across a cliff is too steep on both sides of it)
        mean_rows, mean_time = b[1] / b[0], b[2] / b[0]
        slope = per_row
        below = self.bins.get(index - 1)
        if below is not None and below[0] >= self.MIN_BIN and mean_rows > below[1] / below[0]:
            local = (mean_time - below[2] / below[0]) / (mean_rows - below[1] / below[0])
            slope = min(per_row, max(local, 0.0))
        return mean_time + slope * (rows - mean_rows)


class Acceptance:
    """Per-sequence acceptance estimates (keyed by anything hashable: the scheduler uses seq_id)."""

    def __init__(self, decay: float = 0.7, prior_weight: float = 1.0) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self.hits = self.trials = 0.0  # engine-wide, unweighted
        self.per: dict[Hashable, list[float]] = {}  # key -> [hits, trials, steps held at 0, own trials]

    @property
    def global_rate(self) -> float:
        return self.hits / self.trials if self.trials else PRIOR_ACCEPTANCE

    def _state(self, key: Hashable) -> list[float]:
        state = self.per.get(key)
        if state is None:
            state = self.per[key] = [self.prior_weight * self.global_rate, self.prior_weight, 0.0, 0.0]
        return state

    def rate(self, key: Hashable) -> float:
        hits, trials, _, _ = self._state(key)
        return hits / trials if trials else self.global_rate

    def optimistic(self, key: Hashable) -> float:
        """The estimate plus one standard error of a rate seen over this sequence's own drafts:
        a new sequence gets a first draft even where the engine-wide rate says no (the rate was
        made by other text: a cold suffix cache, free chat beside quoting), and one or two
        misses take that back."""
        a, own = self.rate(key), self._state(key)[3]
        error = (a * (1 - a) / (1 + own)) ** 0.5
        return min(1.0, a + (error if own else max(error, NEW_BONUS)))

    def record(self, key: Hashable, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        self.hits += accepted
        self.trials += trials
        state = self._state(key)
        state[0] = self.decay * state[0] + accepted
        state[1] = self.decay * state[1] + trials
        state[3] = self.decay * state[3] + trials

    def forget(self, key: Hashable) -> None:
        self.per.pop(key, None)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verifying pass emits in expectation: k drafts at acceptance a, plus the sampled one."""
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def choose(rates: Sequence[float], available: Sequence[int], num_rows: int, cost: StepCost, budget: int) -> list[int]:
    """Draft counts for sequences with acceptance `rates` and at most `available` drafts each, in a
    step of `num_rows` decode rows (each emits one token without drafts), adding at most `budget`
    rows: the counts that maximise expected tokens per second of step time under `cost`.

    Drafts are taken best gain first (the j-th draft of a sequence at acceptance a gains a^j), and
    the step stops at the count with the most tokens per second over all counts tried: with
    a straight-line cost that is where the next gain falls below the step's rate, and past a bin
    whose steps cost more (a kernel's cliff) it is still the best count seen, not the first dip."""
    heap = [(-a, i) for i, (a, n) in enumerate(zip(rates, available)) if n > 0 and a > 0]
    heapq.heapify(heap)
    order: list[int] = []
    taken = [0] * len(rates)
    tokens, rows = float(num_rows), num_rows
    best, best_speed = 0, tokens / cost.time(rows)
    streak = 0  # drafts in a row that did not beat the best
    while heap and len(order) < budget:
        neg_gain, i = heapq.heappop(heap)
        order.append(i)
        tokens += -neg_gain
        rows += 1
        speed = tokens / cost.time(rows)
        if speed > best_speed:
            best, best_speed, streak = len(order), speed, 0
        else:
            streak += 1
            if streak > 16:  # 16 rows past the best without a better count: the gains only fall
                break
        taken[i] += 1
        if taken[i] < available[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i))
    ks = [0] * len(rates)
    for i in order[:best]:
        ks[i] += 1
    return ks


def probe_every(num_rows: int) -> int:
    return PROBE_EVERY * max(1, num_rows // 8)


class DraftLengths:
    """The policy a `Speculator` keeps: the step-time fit, the acceptance estimates, and the
    per-step choice (with a one-draft probe every `PROBE_EVERY` steps for a sequence held at 0)."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self.acceptance = Acceptance()
        self._step: tuple[float, int] | None = None  # (start, rows) of the step planned last
        self._times: tuple[int, float, float] | None = None  # (rows, t(rows), t(rows + 1) - t(rows)) this step

    def step_started(self, now: float) -> None:
        """A plan is being made at `now`: the previous one ran in the meantime."""
        self._times = None
        if self._step is not None:
            start, rows = self._step
            self.cost.observe(rows, now - start)
        self._step = (now, 0)

    def planned(self, rows: int) -> None:
        if self._step is not None:
            self._step = (self._step[0], rows) if rows else None  # an empty plan times nothing

    def worth_proposing(self, key: Hashable, num_rows: int) -> bool:
        """Whether a first draft of `key` could pay in a step of `num_rows` decode rows (else its
        proposal is not even looked up: that costs CPU time at large batches), or its probe is due."""
        if self._times is None or self._times[0] != num_rows:  # once a step, not once a sequence
            now = self.cost.time(num_rows)
            self._times = (num_rows, now, max(self.cost.time(num_rows + 1) - now, 0.0))
        _, now, marginal = self._times
        if self.acceptance.optimistic(key) * now > num_rows * marginal:
            return True
        state = self.acceptance._state(key)
        state[2] += 1
        return state[2] >= probe_every(num_rows)

    def lengths(self, keys: Sequence[Hashable], available: Sequence[int], num_rows: int, budget: int) -> list[int]:
        rates = [self.acceptance.optimistic(k) for k in keys]
        ks = choose(rates, available, num_rows, self.cost, budget)
        spare = budget - sum(ks)
        for i, key in enumerate(keys):
            if ks[i] or not available[i]:
                continue
            state = self.acceptance._state(key)
            state[2] += 1
            if state[2] >= probe_every(num_rows) and spare > 0:
                state[2], ks[i], spare = 0, 1, spare - 1
        return ks
