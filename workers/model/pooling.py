"""Pooling a step's final-norm hidden states into one vector per span (embedding requests).

    hidden [T, H]   rows 0..T-1 of the step (every chunk's tokens back to back)
    spans  [(a, b), ...]  ──▶  pooled [S, H] fp32: row s = the sum of hidden[a:b] of span s

A last-token pooling's span is its prompt's last row (b = a + 1); a mean pooling sums every row
of each of its chunks, the engine adds the chunks up across steps and divides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolSpans:
    """The spans of one step, as index tensors on the model's device."""

    rows: torch.Tensor  # [R] int64: every span's rows, span after span
    span_of_row: torch.Tensor  # [R] int64: which span each of `rows` belongs to
    count: int  # spans

    @classmethod
    def build(cls, spans: list[tuple[int, int]], device: torch.device) -> PoolSpans:
        rows = torch.tensor([r for a, b in spans for r in range(a, b)], dtype=torch.int64)
        owner = torch.tensor([s for s, (a, b) in enumerate(spans) for _ in range(a, b)], dtype=torch.int64)
        return cls(rows.to(device, non_blocking=True), owner.to(device, non_blocking=True), len(spans))

    def sum(self, hidden: torch.Tensor) -> torch.Tensor:
        """[count, H] fp32 sums of `hidden`'s rows, span by span."""
        out = torch.zeros(self.count, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, self.span_of_row, hidden[self.rows].float())
