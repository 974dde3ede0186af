"""The local iteration-level scheduler (ORCA) with stall-free chunked prefill (Sarathi-Serve).

Pure Python (no torch, no zmq: tests/unit/test_purity.py). Every step it builds one plan from scratch:
  1. every running decode gets its one token (oldest first); if a page is missing and none is
     free, the lowest-priority newest running sequence is preempted: by recompute (pages freed,
     tokens kept) or by swap (pages copied to host memory first), and requeued;
  2. prompts already being prefilled continue, a chunk each;
  3. waiting sequences are admitted by (priority, arrival), first looking up the prefix cache,
     with at most `max_long_partial_prefills` long prompts in flight so short ones get through,
all within a per-step token budget, so a long prompt is cut into chunks that ride along with
decodes instead of stalling them. `batching="request"` is the pre-ORCA baseline: a batch is
formed when nothing runs, and no request joins it until all of its members are done.
With pipeline stages (`max_steps_in_flight` > 0) a plan skips the requests that have a step in
flight and takes about 1/M of the live sequences (workers/engine/in_flight.py).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, fields

from pagemesh.workers.engine.block_manager import NULL_PAGE, BlockManager
from pagemesh.workers.engine.in_flight import StepsInFlight
from pagemesh.workers.engine.lora_slots import LoRASlots
from pagemesh.workers.engine.sequence import SeqStatus, Sequence
from pagemesh.workers.engine.speculative import Speculator


@dataclass(frozen=True)
class StepSchedulerConfig:
    """Limits of one engine's step planning (not the mesh's scheduler: `pagemesh.services.scheduler`)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the per-step token budget
    max_prefill_chunk: int = 512  # largest chunk of one prompt in one step
    max_num_partial_prefills: int = 4  # prompts being prefilled at once
    max_long_partial_prefills: int = 1  # of those, prompts longer than the threshold
    long_prefill_threshold: int = 1024  # tokens left to prefill that make a prompt "long"
    batching: str = "iteration"  # iteration (ORCA) | request (baseline)
    preemption_mode: str = "recompute"  # recompute | swap
    swap_pages: int = 0  # host pages available to swap into
    max_steps_in_flight: int = 0  # a pipeline's steps launched, not yet applied (0: one step at a time)

    def __post_init__(self) -> None:
        if self.batching not in ("iteration", "request"):
            raise ValueError("batching: must be iteration or request")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError("preemption_mode: must be recompute or swap")

    @classmethod
    def for_engine(cls, config, max_model_len: int, page_bytes: int) -> StepSchedulerConfig:
        """From an `EngineConfig`: every field of the same name, the long-prompt threshold's
        default (4% of the context length, at least 64 tokens) and the host pages that
        `swap_space_gb` holds at `page_bytes` a page."""
        shared = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        shared["long_prefill_threshold"] = config.long_prefill_threshold or max(64, max_model_len * 4 // 100)
        shared["swap_pages"] = int(config.swap_space_gb * 2**30 // page_bytes)
        pp = getattr(config, "pipeline_parallel_size", 1)
        shared["max_steps_in_flight"] = (getattr(config, "max_steps_in_flight", None) or pp) if pp > 1 else 0
        return cls(**shared)


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq` starting at position `start` run this step. A speculating
    decode's chunk is its last token then its `drafts` (not in `seq.token_ids` until accepted)."""

    seq: Sequence
    start: int
    num_tokens: int
    drafts: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so a new token is sampled after it
        (after each of its positions when it carries drafts)."""
        return self.start + self.num_tokens - len(self.drafts) == self.seq.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before running
    swap_out: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, pages) to host, first
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, new pages) from host
    swap_discard: list[int] = field(default_factory=list)  # seq_ids whose host copy is no longer needed
    preempted: list[Sequence] = field(default_factory=list)
    lora_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter folder) to load, first
    num_decodes: int = 0  # the first num_decodes chunks are single-token decodes (speculating ones follow them)
    max_seqs: int = 0  # a pipeline's micro-batch: sequences this plan may take (Scheduler._takes)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.sampling.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Decides, each step, which tokens of which sequences run."""

    def __init__(
        self,
        config: StepSchedulerConfig,
        blocks: BlockManager,
        speculator: Speculator | None = None,
        loras: LoRASlots | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.speculator = speculator  # None: no speculative decoding
        self.loras = loras  # None: no LoRA adapters; else a running sequence with one pins its slot
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.swapped_pages = 0  # host pages in use
        self.batch: set[int] | None = None  # request-level batching: the current batch's seq ids
        self.discarded_swaps: list[int] = []  # host copies of sequences that ended while swapped
        self.num_preemptions = 0
        self.pending_lora_loads: list[tuple[int, str]] = []  # slots filled outside a plan (add_running)
        # a pipeline: the steps in flight (workers/engine/in_flight.py); None: one step at a time
        self.in_flight = StepsInFlight(config.max_steps_in_flight) if config.max_steps_in_flight else None

    # ---- membership -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages are already filled (a fork, or KV received from a prefill
        worker) joins the decodes directly. ValueError when its LoRA adapter can have no slot
        (every one is pinned by other adapters' running sequences)."""
        if seq.lora is not None:
            if seq.lora_slot >= 0:
                self.loras.pin(seq.lora_slot)
            else:
                got = self.loras.acquire(seq.lora)
                if got is None:
                    raise ValueError(f"lora: every one of the {self.loras.max_loras} adapter slots is in use")
                seq.lora_slot, load = got
                if load is not None:
                    self.pending_lora_loads.append((seq.lora_slot, load))
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if self.batch is not None:
            self.batch.add(seq.seq_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.speculator is not None:  # its estimate goes; a suffix cache keeps its output
            self.speculator.finished(seq.seq_id, seq.output_token_ids, reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.in_flight is None or not self.in_flight.holds(seq):
            self.blocks.free_table(seq.block_table)
        # else a step in flight still writes its pages: `step_returned` frees them
        self._drop_swap(seq)
        self._release_lora(seq)

    def step_returned(self, plan: StepPlan) -> None:
        """A step in flight came back (before its output is applied): free the pages of its
        sequences that ended meanwhile (an abort)."""
        for chunk in plan.chunks:
            if chunk.seq.finished:
                self.blocks.free_table(chunk.seq.block_table)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    @property
    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(swap_discard=self.discarded_swaps, lora_loads=self.pending_lora_loads)
        self.discarded_swaps, self.pending_lora_loads = [], []
        if self.in_flight is not None:
            plan.max_seqs = self.in_flight.batch_cap(
                min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
            )
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_decodes(plan, budget)
        budget = self._schedule_running_prefills(plan, budget)
        if not plan.preempted:  # memory is short: admitting now would just thrash
            self._admit_waiting(plan, budget)
        if self.speculator is not None:
            decode_only = all(c.num_tokens == 1 + len(c.drafts) for c in plan.chunks)  # prefill rows cost less
            self.speculator.planned(plan.num_tokens if decode_only else 0)  # timed at the next plan
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        scheduled: set[int] = set()
        speculating: list[ScheduledChunk] = []  # after the single-token decodes (attention's fast path)
        drafts_of = self._plan_drafts(budget) if self.speculator is not None else {}
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            if self.in_flight is not None and not self._takes(seq, plan, speculating):
                continue
            drafts = drafts_of.get(seq.seq_id, [])[: budget - 1]
            if drafts and self._reserve(seq, 1 + len(drafts), plan):
                speculating.append(ScheduledChunk(seq, seq.num_computed, 1 + len(drafts), drafts))
                scheduled.add(seq.seq_id)
                budget -= 1 + len(drafts)
                continue
            while not self._reserve(seq, 1, plan):
                unscheduled = [s for s in self.running if s.seq_id not in scheduled and not self._busy(s)]
                victim = max(unscheduled, key=_order)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
            plan.num_decodes += 1
            scheduled.add(seq.seq_id)
            budget -= 1
        plan.chunks += [c for c in speculating if c.seq.status is SeqStatus.RUNNING]
        return budget

    def _plan_drafts(self, budget: int) -> dict[int, list[int]]:
        """Each decode's drafts this step (by seq_id): its proposal within its room, cut to the
        length the speculator's policy picks for this batch (workers/engine/draft_length.py)."""
        spec = self.speculator
        spec.step_started(time.perf_counter())
        if not spec.step_allows(sum(1 for s in self.running if not s.is_prefilling)):
            return {}
        decodes = [s for s in self.running if s.status is SeqStatus.RUNNING and not s.is_prefilling]
        decodes = [s for s in decodes if not self._busy(s)]
        spare = budget - len(decodes)
        if spare <= 0:
            return {}
        rows = len(decodes)
        worth = [s for s in decodes if spec.worth_proposing(s.seq_id, rows)]
        proposals = {s.seq_id: d for s in worth if (d := self._drafts(s, spare + 1))}
        ids = list(proposals)
        ks = spec.lengths(ids, [len(proposals[i]) for i in ids], rows, spare)
        return {i: proposals[i][:k] for i, k in zip(ids, ks) if k}

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decode of `seq`, within the step's `budget` and the tokens the
        sequence may still emit (the one sampled token included): none for a request that
        opted out, beam search, or a sequence that has not sampled its first token yet (its
        n > 1 siblings fork from it; a prefill-only request stops after it)."""
        p = seq.sampling
        if seq.num_output_tokens == 0 or seq.pending_forks or seq.replay or not self.speculator.request_allows(p):
            return []
        if seq.spec_cooldown > 0:  # its last drafts were all rejected (free text): back off a while
            seq.spec_cooldown -= 1
            return []
        room = min(budget, p.max_tokens - seq.num_output_tokens, self.speculator.max_model_len - seq.num_tokens) - 1
        return self.speculator.drafts(seq.token_ids, room) if room > 0 else []

    def _schedule_running_prefills(self, plan: StepPlan, budget: int) -> int:
        for seq in self.running:
            if budget == 0:
                break
            if not seq.is_prefilling or (self.in_flight is not None and not self._takes(seq, plan)):
                continue
            n = self._fit(seq, min(seq.num_uncomputed, budget, self.config.max_prefill_chunk))
            if n == 0:
                break
            self._reserve(seq, n, plan)
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return budget

    def _busy(self, seq: Sequence) -> bool:
        return self.in_flight is not None and self.in_flight.is_busy(seq)

    def _takes(self, seq: Sequence, plan: StepPlan, more: list[ScheduledChunk] | tuple = ()) -> bool:
        """With a pipeline: `seq` may join this plan (whose chunks so far are `plan.chunks` and
        `more`) unless its request has a step in flight, or the plan holds its micro-batch's
        share already (a request's other sequences still join it: a group stays together)."""
        if self.in_flight.is_busy(seq):
            return False
        if len(plan.chunks) + len(more) < plan.max_seqs:
            return True
        return any(c.seq.request_id == seq.request_id for c in (*plan.chunks, *more))

    def _is_long(self, seq: Sequence) -> bool:
        return seq.num_uncomputed > self.config.long_prefill_threshold

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        cfg = self.config
        if cfg.batching == "request":
            if self.batch is None or not any(s.seq_id in self.batch for s in self.live_sequences):
                self.batch = {s.seq_id for s in self.waiting[: cfg.max_num_seqs]}
        partial = sum(1 for s in self.running if s.is_prefilling)
        long_partial = sum(1 for s in self.running if s.is_prefilling and self._is_long(s))
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= cfg.max_num_seqs or partial >= cfg.max_num_partial_prefills:
                break
            if self.batch is not None and cfg.batching == "request" and seq.seq_id not in self.batch:
                break
            if self.in_flight is not None and not self._takes(seq, plan):
                continue
            if seq.images_pending:
                continue  # its images' rows are on their way from an encoder worker (messages/encoder.py)
            if (
                seq.swapped_computed is None
                and not seq.block_table
                and seq.num_computed == 0
                and not seq.skips_prefix_cache
            ):
                self._match_prefix(seq)
            long = self._is_long(seq)
            if long and long_partial >= cfg.max_long_partial_prefills:
                self._unmatch_prefix(seq)
                continue  # let shorter prompts behind it through
            if seq.lora is not None and seq.lora_slot < 0 and not self._acquire_lora(seq, plan):
                self._unmatch_prefix(seq)
                continue  # every slot is pinned by other adapters: sequences behind it may go
            if seq.swapped_computed is not None:
                if not self._swap_in(seq, plan):
                    self._release_lora(seq)
                    break
            n = self._fit(seq, min(seq.num_uncomputed, budget, cfg.max_prefill_chunk))
            if n == 0:
                self._unmatch_prefix(seq)  # a waiting sequence holds no pages
                self._release_lora(seq)  # nor a slot
                break
            self.waiting.remove(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._reserve(seq, n, plan)
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            still_prefilling = seq.num_uncomputed > n
            partial += still_prefilling
            long_partial += still_prefilling and long

    def _acquire_lora(self, seq: Sequence, plan: StepPlan) -> bool:
        got = self.loras.acquire(seq.lora)
        if got is None:
            return False
        seq.lora_slot, load = got
        if load is not None:
            plan.lora_loads.append((seq.lora_slot, load))
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.loras.release(seq.lora_slot)
            seq.lora_slot = -1

    def _match_prefix(self, seq: Sequence) -> None:
        hits = self.blocks.match_prefix(seq.hash_token_ids, seq.prefix_root)
        seq.block_table.extend(hits)
        seq.num_cached_pages = len(hits)
        seq.num_computed = seq.num_prefix_hit_tokens = len(hits) * self.blocks.page_size

    def _unmatch_prefix(self, seq: Sequence) -> None:
        if seq.swapped_computed is None and seq.block_table:
            self.blocks.free_table(seq.block_table)
            seq.num_computed = seq.num_cached_pages = seq.num_prefix_hit_tokens = 0

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

    # ---- preemption -----------------------------------------------------------------------
    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free the pages and requeue. Swap mode first copies the computed pages to host memory
        (when there is room, and no page was freed behind a sliding window: a swapped-in table
        is whole, its pages published to the prefix cache) so resuming skips the recompute."""
        self.running.remove(seq)
        pages = -(-seq.num_computed // self.blocks.page_size)
        whole = not seq.block_table or seq.block_table[0] != NULL_PAGE  # no page freed behind a window
        swap = self.config.preemption_mode == "swap" and pages and whole
        if swap and self.swapped_pages + pages <= self.config.swap_pages:
            plan.swap_out.append((seq.seq_id, seq.block_table[:pages]))
            seq.swapped_computed = seq.num_computed
            self.swapped_pages += pages
        self.blocks.free_table(seq.block_table)
        seq.num_computed = 0
        seq.num_cached_pages = 0
        seq.status = SeqStatus.WAITING
        self._release_lora(seq)  # taken again when it is admitted again
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_order)
        plan.preempted.append(seq)

    def _swap_in(self, seq: Sequence, plan: StepPlan) -> bool:
        pages = -(-seq.swapped_computed // self.blocks.page_size)
        if pages > self.blocks.num_free_pages:
            return False
        self.blocks.grow(seq.block_table, seq.swapped_computed)
        plan.swap_in.append((seq.seq_id, list(seq.block_table)))
        seq.num_computed = seq.swapped_computed
        self._drop_swap(seq, discard=False)  # the runner consumes the host copy
        return True

    def _drop_swap(self, seq: Sequence, discard: bool = True) -> None:
        """Forget a sequence's host copy (`discard`: the runner must free it too)."""
        if seq.swapped_computed is not None:
            if discard:
                self.discarded_swaps.append(seq.seq_id)
            self.swapped_pages -= -(-seq.swapped_computed // self.blocks.page_size)
            seq.swapped_computed = None
