"""Engine statistics: KV utilization, batch shapes, step times."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Running totals over steps. KV utilization of a step = token slots holding a computed
    token / slots in the pages live requests hold (each shared page counted once)."""

    steps: int = 0
    tokens: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    step_seconds: float = 0.0
    kv_utilization_sum: float = 0.0
    kv_utilization_last: float = 0.0
    preemptions: int = 0

    @property
    def mean_kv_utilization(self) -> float:
        return self.kv_utilization_sum / self.steps if self.steps else 0.0

    def record_step(self, plan, scheduler, blocks, seconds: float) -> None:
        self.steps += 1
        self.tokens += plan.num_tokens
        self.decode_tokens += plan.num_decodes
        self.prefill_tokens += plan.num_tokens - plan.num_decodes
        self.step_seconds += seconds
        self.preemptions = scheduler.num_preemptions
        self.kv_utilization_last = kv_utilization(scheduler.running, blocks.page_size)
        self.kv_utilization_sum += self.kv_utilization_last


def kv_utilization(seqs, page_size: int) -> float:
    filled: dict[int, int] = {}
    for seq in seqs:
        for i, page in enumerate(seq.block_table):
            used = min(page_size, max(0, seq.num_computed - i * page_size))
            if used > filled.get(page, -1):
                filled[page] = used
    return sum(filled.values()) / (len(filled) * page_size) if filled else 1.0
