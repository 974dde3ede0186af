"""Engine statistics: KV utilization, batch shapes, step times."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemesh.workers.engine.speculative import SpeculationStats


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
    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # drafts proposed / accepted

    @property
    def mean_kv_utilization(self) -> float:
        return self.kv_utilization_sum / self.steps if self.steps else 0.0

    def record_step(self, plan, scheduler, blocks, seconds: float) -> None:
        self.steps += 1
        self.tokens += plan.num_tokens
        decodes = plan.num_decodes + sum(c.num_tokens for c in plan.chunks if c.drafts)  # verifying rows decode
        self.decode_tokens += decodes
        self.prefill_tokens += plan.num_tokens - decodes
        self.step_seconds += seconds
        self.preemptions = scheduler.num_preemptions
        self.kv_utilization_last = kv_utilization(scheduler.running, blocks.page_size)
        self.kv_utilization_sum += self.kv_utilization_last


def kv_utilization(seqs, page_size: int) -> float:
    """Filled slots / slots of the distinct pages `seqs` hold. A page is full for a sequence up to
    its computed length, and only the page holding its last computed token is partly filled; a
    shared page counts once, as filled as its fullest holder has it. Set operations on the block
    tables keep this at ~1 Python step per sequence, not per page (it runs every engine step)."""
    held: set[int] = set()
    full: set[int] = set()
    partial: dict[int, int] = {}
    for seq in seqs:
        table = seq.block_table
        held.update(table)
        n_full = min(seq.num_computed // page_size, len(table))
        full.update(table[:n_full])
        rest = seq.num_computed - n_full * page_size
        if rest > 0 and n_full < len(table) and rest > partial.get(table[n_full], 0):
            partial[table[n_full]] = rest
    if not held:
        return 1.0
    filled = len(full) * page_size + sum(used for page, used in partial.items() if page not in full)
    return filled / (len(held) * page_size)
