"""The local iteration-level scheduler (ORCA) with stall-free chunked prefill (Sarathi-Serve).

Pure Python. Every step it builds one plan from scratch:
  1. every running decode gets its one token (oldest first); if a page is missing and none is
     free, the newest running sequence is preempted by recompute (pages freed, requeued first);
  2. prompts already being prefilled continue, a chunk each;
  3. waiting sequences are admitted FCFS, first looking up the prefix cache,
all within a per-step token budget, so a long prompt is cut into chunks that ride along with
decodes instead of stalling them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the per-step token budget
    max_prefill_chunk: int = 512  # largest chunk of one prompt in one step
    max_num_partial_prefills: int = 4  # prompts being prefilled at once


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq` starting at position `start` run this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so a new token is sampled after it."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before running
    preempted: list[Sequence] = field(default_factory=list)
    num_decodes: int = 0  # the first num_decodes chunks are single-token decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Decides, each step, which tokens of which sequences run."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- membership -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages are already filled (a fork, or KV received from a prefill
        worker) joins the decodes directly."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.free_table(seq.block_table)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_decodes(plan, budget)
        budget = self._schedule_running_prefills(plan, budget)
        if not plan.preempted:  # memory is short: admitting now would just thrash
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            while not self._reserve(seq, 1, plan):
                victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
            plan.num_decodes += 1
            scheduled.add(seq.seq_id)
            budget -= 1
        return budget

    def _schedule_running_prefills(self, plan: StepPlan, budget: int) -> int:
        for seq in self.running:
            if budget == 0:
                break
            if not seq.is_prefilling:
                continue
            n = self._fit(seq, min(seq.num_uncomputed, budget, self.config.max_prefill_chunk))
            if n == 0:
                break
            self._reserve(seq, n, plan)
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        partial = sum(1 for s in self.running if s.is_prefilling)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if partial >= self.config.max_num_partial_prefills:
                break
            seq = self.waiting[0]
            if not seq.block_table and seq.num_computed == 0:
                hits = self.blocks.match_prefix(seq.token_ids)
                seq.block_table.extend(hits)
                seq.num_computed = seq.num_cached_pages = len(hits)
                seq.num_computed *= self.blocks.page_size
                seq.num_prefix_hit_tokens = seq.num_computed
            n = self._fit(seq, min(seq.num_uncomputed, budget, self.config.max_prefill_chunk))
            if n == 0:
                break
            self.waiting.popleft()
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._reserve(seq, n, plan)
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            partial += seq.num_uncomputed > n

    # ---- pages ----------------------------------------------------------------------------
    def _pages_for(self, seq: Sequence, n: int) -> int:
        """Pages to take so `seq` can write tokens [num_computed, num_computed + n)."""
        needed = self.blocks.pages_needed(seq.block_table, seq.num_computed + n)
        first_page = seq.num_computed // self.blocks.page_size
        if first_page < len(seq.block_table):
            needed += self.blocks.pages[seq.block_table[first_page]].ref_count > 1
        return needed

    def _fit(self, seq: Sequence, n: int) -> int:
        """The largest m <= n tokens of `seq` whose pages can be had now."""
        free = self.blocks.num_free_pages
        first_page = seq.num_computed // self.blocks.page_size
        if first_page < len(seq.block_table) and self.blocks.pages[seq.block_table[first_page]].ref_count > 1:
            free -= 1  # the shared page must be copied first
        room = (len(seq.block_table) + free) * self.blocks.page_size - seq.num_computed
        return max(0, min(n, room))

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        if self._pages_for(seq, n) > self.blocks.num_free_pages:
            return False
        first_page = seq.num_computed // self.blocks.page_size
        if first_page < len(seq.block_table):
            copy = self.blocks.ensure_writable(seq.block_table, seq.num_computed)
            if copy is not None:
                plan.page_copies.append(copy)
        self.blocks.grow(seq.block_table, seq.num_computed + n)
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute-preemption: drop the pages, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.blocks.free_table(seq.block_table)
        seq.num_computed = 0
        seq.num_cached_pages = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
