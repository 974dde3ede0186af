"""Step-time models per worker role, fitted to the steps a running mesh traced.

A prefill worker, a decode worker and a mixed worker run different steps and pay different host
costs around them, and on a shared CPU a worker's step slows down while another worker is
mid-step. So the in-mesh calibration (`pagemesh.bench.simulator.calibrate.fit_trace`) fits, per role:

    seconds = linear(shape) · (1 + contention · others_busy) · host(t) · jitter

    linear        the role's own LinearStepCost (base, prompt tokens, attention, rows, context)
    contention    the extra fraction a step takes per other worker mid-step when it starts
                  (0 with one worker; what sharing the CPU costs)
    others_busy   how many other workers of the mesh are mid-step (the trace: the summed
                  fraction of the step that each other worker spent stepping)
    jitter        a draw from the role's ratios of measured to modelled time, kept as quantiles
                  (finer towards the top), so that long steps (a descheduled thread, a
                  collection) come at the rate the trace saw them and no more often; drawn
                  from a seeded generator, so a run stays deterministic
    host(t)       the whole machine's slowdown at time t (`HostSlowdown`): on a shared host every
                  worker's steps run slower together for seconds at a time (other processes take
                  the cores), which per-step jitter, drawn independently, averages away within a
                  request; kept as the trace's sequence of per-second factors and replayed in
                  order from a seeded offset, so that slow stretches keep their length

`MeshStepCost` holds the model of each role the trace had, and a pooled one (every step of every
role) for a role it did not, and the host's slowdown over time.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pagemesh.bench.simulator.cost import FEATURES, LinearStepCost, StepShape

# the jitter's grid: every percentile of the ratios, and ever finer towards the top. The rare
# long steps (a stall of 10-20x once in thousands of steps) must keep their own weight: on a
# plain percentile grid the top 1% would interpolate up to the longest step and multiply the
# mean step by up to 1.08, which at a saturated worker's rate grows the queue far past the real one
QUANTILES = np.concatenate(
    [np.linspace(0.0, 0.99, 100), [0.995, 0.998, 0.999, 0.9995, 0.9998, 0.9999, 0.99995, 0.99998, 0.99999, 1.0]]
)
PERCENTILES = np.linspace(0.0, 1.0, 101)  # the grid of models fitted before the finer one
ROUNDS = 200  # at most this many alternations of the linear fit and the contention fit ...
CONVERGED = 1e-7  # ... stopping once the contention moves less than this
MIN_WINDOW_STEPS = 5  # a host window with fewer steps than this says too little: left out


@dataclass(frozen=True)
class TracedStep:
    """One traced step: its shape, its whole cycle's seconds, the other workers' busy share."""

    shape: StepShape
    seconds: float
    others_busy: float = 0.0
    start: float = 0.0  # when it began (seconds, the trace's clock): which host window it ran in

    def deflated(self, factor: float) -> TracedStep:
        """The step as it would have run without the host's slowdown `factor`."""
        return TracedStep(self.shape, self.seconds / factor, self.others_busy, self.start)


@dataclass(frozen=True)
class RoleStepCost:
    """See the module doc. `ratio_quantiles` empty: no jitter."""

    linear: LinearStepCost
    contention: float = 0.0
    ratio_quantiles: tuple[float, ...] = ()

    def step_time(self, shape: StepShape, others_busy: float = 0.0, draw: float | None = None) -> float:
        """Seconds of a step of `shape` starting while `others_busy` other workers step; `draw`
        in [0, 1) picks the jitter (None: the model's own time, no jitter)."""
        seconds = self.linear.step_time(shape) * (1.0 + self.contention * others_busy)
        if draw is not None and self.ratio_quantiles:
            grid = PERCENTILES if len(self.ratio_quantiles) == len(PERCENTILES) else QUANTILES
            seconds *= float(np.interp(draw, grid, self.ratio_quantiles))
        return seconds

    @classmethod
    def fit(cls, steps: list[TracedStep], fallback: LinearStepCost | None = None) -> RoleStepCost:
        """Least squares for the linear part and the contention, alternated; a coefficient whose
        feature no step exercised (a prefill worker has no decode rows) is taken from `fallback`."""
        contention, previous = 0.0, -1.0
        for _ in range(ROUNDS):
            if abs(contention - previous) < CONVERGED:
                break
            previous = contention
            linear = LinearStepCost.fit([(s.shape, s.seconds / (1 + contention * s.others_busy)) for s in steps])
            predicted = np.array([linear.step_time(s.shape) for s in steps])
            busy = np.array([s.others_busy for s in steps])
            measured = np.array([s.seconds for s in steps])
            # measured / predicted - 1 ≈ contention · busy, through the origin, >= 0: in ratios, so
            # that a few long steps do not outweigh the many short ones
            denominator = float(busy @ busy)
            excess = measured / np.maximum(predicted, 1e-9) - 1.0
            contention = max(0.0, float(excess @ busy) / denominator) if denominator else 0.0
        linear = LinearStepCost.fit([(s.shape, s.seconds / (1 + contention * s.others_busy)) for s in steps])
        if fallback is not None:
            unused = [
                name
                for name, column in zip(FEATURES, np.array([s.shape.features() for s in steps]).T)
                if not column.any()
            ]
            linear = LinearStepCost(**{**asdict(linear), **{name: getattr(fallback, name) for name in unused}})
        modelled = np.array([linear.step_time(s.shape) * (1 + contention * s.others_busy) for s in steps])
        ratios = np.array([s.seconds for s in steps]) / np.maximum(modelled, 1e-9)
        return cls(linear, contention, tuple(float(q) for q in np.quantile(ratios, QUANTILES)))

    def to_json(self) -> dict:
        return {"linear": asdict(self.linear), "contention": self.contention, "ratio_quantiles": self.ratio_quantiles}

    @classmethod
    def from_json(cls, data: dict) -> RoleStepCost:
        linear = {k: v for k, v in data["linear"].items() if k in LinearStepCost.__dataclass_fields__}
        return cls(LinearStepCost(**linear), data.get("contention", 0.0), tuple(data.get("ratio_quantiles", ())))


@dataclass(frozen=True)
class HostSlowdown:
    """The machine's slowdown over time: `factors[k]` is the median ratio of measured to modelled
    step time over every worker's steps in the k-th `window_s` of the trace that held at least
    MIN_WINDOW_STEPS steps (idle stretches left out), divided by the median over those windows
    (a typical second is 1). No factors: no slowdown."""

    factors: tuple[float, ...] = ()
    window_s: float = 1.0
    # where each factor's window lay on the trace's clock (perf_counter seconds): window k of the
    # factors began at origin + windows[k] · window_s (empty: not recorded, only `at` works)
    origin: float = 0.0
    windows: tuple[int, ...] = ()

    @property
    def span_s(self) -> float:
        return len(self.factors) * self.window_s

    def at(self, t: float) -> float:
        """The factor at time t (seconds from any origin: the sequence repeats)."""
        if not self.factors:
            return 1.0
        return self.factors[int(t // self.window_s) % len(self.factors)]

    def at_clock(self, clock: float) -> float:
        """The factor of the window that held `clock` on the trace's own clock: the machine's
        measured slowdown at that very moment (1 where that second held too few steps)."""
        if not self.windows:
            raise ValueError("this host slowdown has no clock (fitted before windows were recorded)")
        key = int((clock - self.origin) // self.window_s)
        index = bisect.bisect_left(self.windows, key)
        return self.factors[index] if index < len(self.windows) and self.windows[index] == key else 1.0

    @classmethod
    def fit(cls, starts: list[float], ratios: list[float], window_s: float = 1.0) -> tuple[HostSlowdown, list[float]]:
        """From each step's start and its measured-to-modelled ratio (the model without jitter):
        the slowdown, and each step's own window factor (1 where its window was left out)."""
        if not starts:
            return cls((), window_s), []
        origin = min(starts)
        keys = [int((start - origin) // window_s) for start in starts]
        windows: dict[int, list[float]] = {}
        for key, ratio in zip(keys, ratios):
            windows.setdefault(key, []).append(ratio)
        medians = {k: float(np.median(r)) for k, r in sorted(windows.items()) if len(r) >= MIN_WINDOW_STEPS}
        # relative to the typical second: the roles' models keep the scale, the factors the changes
        typical = float(np.median(list(medians.values()))) if medians else 1.0
        factors = {k: m / typical for k, m in medians.items()}
        host = cls(tuple(factors.values()), window_s, origin, tuple(factors))
        return host, [factors.get(key, 1.0) for key in keys]

    def to_json(self) -> dict:
        return {"window_s": self.window_s, "factors": self.factors, "origin": self.origin, "windows": self.windows}

    @classmethod
    def from_json(cls, data: dict | None) -> HostSlowdown:
        if not data:
            return cls()
        return cls(tuple(data["factors"]), data["window_s"], data.get("origin", 0.0), tuple(data.get("windows", ())))


@dataclass(frozen=True)
class MeshStepCost:
    """One RoleStepCost per worker role (`WorkerRole.value`) and a pooled one for the others,
    and the host's slowdown over time (shared by every worker)."""

    pooled: RoleStepCost
    roles: dict[str, RoleStepCost] = field(default_factory=dict)
    source: str = ""
    host: HostSlowdown = HostSlowdown()

    def for_role(self, role: str) -> RoleStepCost:
        return self.roles.get(role, self.pooled)

    def save(self, path: Path) -> None:
        data = {
            "source": self.source,
            "pooled": self.pooled.to_json(),
            "roles": {role: cost.to_json() for role, cost in sorted(self.roles.items())},
            "host": self.host.to_json(),
        }
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> MeshStepCost:
        data = json.loads(Path(path).read_text())
        roles = {role: RoleStepCost.from_json(cost) for role, cost in data["roles"].items()}
        return cls(
            RoleStepCost.from_json(data["pooled"]),
            roles,
            data.get("source", ""),
            HostSlowdown.from_json(data.get("host")),
        )

    @staticmethod
    def is_one(path: Path) -> bool:
        """Whether the JSON at `path` is a MeshStepCost (else a plain LinearStepCost)."""
        return "roles" in json.loads(Path(path).read_text())
