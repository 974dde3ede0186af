"""The diffusion engine's running totals (no torch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DiffusionStats:
    """Totals since the engine started. `rows_per_forward`: rows -> forwards that ran that many."""

    steps: int = 0  # forwards run
    rows: int = 0
    rows_per_forward: Counter[int] = field(default_factory=Counter)
    requests_per_forward: Counter[int] = field(default_factory=Counter)
    images_finished: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    forward_s: float = 0.0  # wall time in forwards and sampler steps

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    def record_forward(self, rows: int, requests: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.rows_per_forward[rows] += 1
        self.requests_per_forward[requests] += 1
        self.forward_s += seconds
