"""The diffusion engine's running totals (no torch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DiffusionStats:
    """Totals since the engine started. `rows_per_forward`: rows -> forwards that ran that many.

    Blocks (pipelines with a block forward): one row through one transformer block is one block
    evaluation; `blocks_skipped` are those feature caches answered from a cached residual.
    `cache_bytes`: what the running requests' feature caches hold now, against the budget."""

    steps: int = 0  # forwards run
    rows: int = 0
    rows_per_forward: Counter[int] = field(default_factory=Counter)
    requests_per_forward: Counter[int] = field(default_factory=Counter)
    images_finished: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    forward_s: float = 0.0  # wall time in forwards and sampler steps
    blocks_computed: int = 0
    blocks_skipped: int = 0
    cache_bytes: int = 0
    cache_peak_bytes: int = 0
    cache_budget_bytes: int = 0
    requests_cached: int = 0  # requests that ran with a feature cache
    requests_over_cache_budget: int = 0  # asked for one, ran uncached: it did not fit

    @property
    def block_fraction(self) -> float:
        """Blocks computed over the blocks an uncached run would have computed."""
        total = self.blocks_computed + self.blocks_skipped
        return self.blocks_computed / total if total else 1.0

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    def record_forward(self, rows: int, requests: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.rows_per_forward[rows] += 1
        self.requests_per_forward[requests] += 1
        self.forward_s += seconds

    def reserve_cache(self, nbytes: int) -> None:
        self.cache_bytes += nbytes
        self.cache_peak_bytes = max(self.cache_peak_bytes, self.cache_bytes)

    def release_cache(self, nbytes: int) -> None:
        self.cache_bytes -= nbytes
