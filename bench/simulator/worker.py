"""One simulated LLM worker: the real engine scheduler and block manager, a step-time model in
place of the forward pass, and the worker's side of the wire (the messages a real worker sends).

    task (GenerateTask | PrefillTask | DecodeTask) ──▶ Sequence ──▶ Scheduler.schedule()
        ──▶ StepShape ──▶ cost.step_time ──▶ (virtual time later) update: tokens, pages, ends

What the update does is the engine's StepUpdate reduced to what timing needs: computed tokens
advance, full pages go to the prefix cache, a chunk that reaches the end samples one token (a
placeholder id), a request ends at its output length. Prefill-only requests are held and their
pages sent as `PrefillTask` says; a decode worker imports them as the real HandoffIn does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagemesh.bench.simulator.clock import EventLoop
from pagemesh.bench.simulator.cost import StepShape
from pagemesh.common.messages import (
    AbortRequest,
    DecodeTask,
    DoneReason,
    GenerateTask,
    Heartbeat,
    KVEventsResync,
    KVPoolInfo,
    KVPoolLoad,
    Message,
    PrefillTask,
    RegisterWorker,
    RequestDone,
    WorkerKind,
    WorkerRole,
)
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.kv_event_feed import KVEventFeed
from pagemesh.workers.engine.scheduler import Scheduler, StepPlan, StepSchedulerConfig
from pagemesh.workers.engine.sequence import Sequence
from pagemesh.workers.engine.step_trace import step_shape

PLACEHOLDER_TOKEN = 0  # sampled ids are not modelled; what matters is how many and when


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: WorkerRole
    page_size: int
    num_pages: int
    page_bytes: int  # one page of every layer (what a transfer moves per page)
    step: StepSchedulerConfig
    prefix_caching: bool = True
    heartbeat_interval: float = 0.25


@dataclass
class Held:
    """A prefill worker's request after its first token: pages kept until the decode side acks."""

    table: list[int]
    task: PrefillTask


@dataclass
class Expected:
    """A decode worker's request waiting for its pages (the DecodeTask came first, or the pages)."""

    task: DecodeTask | None = None
    pinned: list[int] = field(default_factory=list)
    arrived: tuple[list[int], int] | None = None  # (first token ids, pages sent)


class SimWorker:
    """See the module doc. `send(message)` goes to the scheduler core; `emit(request_id, n, t)`
    reports n output tokens of a request reaching its client at virtual time t; `handoff(...)`
    carries a prefill's pages to the decode worker (the cluster applies the transfer model)."""

    def __init__(
        self,
        spec: WorkerSpec,
        loop: EventLoop,
        step_time: Callable[[StepShape], float],
        send: Callable[[Message], None],
        emit: Callable[[str, int, float], None],
        handoff: Callable[[SimWorker, PrefillTask, list[int], int], None],
    ):
        self.spec, self.loop, self.step_time = spec, loop, step_time
        self.send, self.emit, self.handoff = send, emit, handoff
        self.blocks = BlockManager(spec.num_pages, spec.page_size, spec.prefix_caching)
        self.kv_events = KVEventFeed(spec.worker_id, self.blocks)  # as the real worker's, sent with each heartbeat
        self.scheduler = Scheduler(spec.step, self.blocks)
        self.seqs: dict[str, Sequence] = {}
        self.targets: dict[str, int] = {}  # request id -> output tokens it ends at
        self.prefill_tasks: dict[str, PrefillTask] = {}
        self.held: dict[str, Held] = {}
        self.expected: dict[str, Expected] = {}
        self.busy = False
        self.stepping = False  # a step is running (busy also covers waiting for pages)
        self.finished = 0
        self.steps = 0
        self.busy_s = 0.0
        self.bytes_sent = self.bytes_received = 0
        self.max_used_pages = 0

    # ---- the wire -------------------------------------------------------------------------
    def registration(self) -> RegisterWorker:
        endpoint = f"sim://{self.spec.worker_id}" if self.spec.role == WorkerRole.DECODE else ""
        return RegisterWorker(
            worker_id=self.spec.worker_id,
            kind=WorkerKind.LLM,
            role=self.spec.role,
            model="simulated",
            max_running=self.spec.step.max_num_seqs,
            kv=KVPoolInfo(page_size=self.spec.page_size, num_pages=self.spec.num_pages, kv_endpoint=endpoint),
            instance="sim",
        )

    def heartbeat(self) -> None:
        for msg in self.kv_events.take()[1]:
            self.send(msg)
        self.send(
            Heartbeat(
                worker_id=self.spec.worker_id,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting) + len(self.expected),
                time=self.loop.now,
                requests_finished=self.finished,
                kv=KVPoolLoad(
                    free_pages=self.blocks.num_free_pages,
                    used_pages=self.blocks.num_used_pages,
                    total_pages=self.spec.num_pages,
                    bytes_sent=self.bytes_sent,
                    bytes_received=self.bytes_received,
                ),
            )
        )
        self.loop.after(self.spec.heartbeat_interval, self.heartbeat)

    def receive(self, msg: Message) -> None:
        if isinstance(msg, GenerateTask):
            self._start(msg.request_id, msg.prompt_token_ids, msg.sampling.max_tokens)
        elif isinstance(msg, PrefillTask):
            self.prefill_tasks[msg.request_id] = msg
            self._start(msg.request_id, msg.prompt_token_ids, msg.sampling.max_tokens)
        elif isinstance(msg, DecodeTask):
            entry = self.expected.setdefault(msg.request_id, Expected())
            entry.task = msg
            self.targets[msg.request_id] = msg.sampling.max_tokens
            if msg.skip_pages:  # pin the prefix the scheduler counted on, as HandoffIn.task does
                hits = self.blocks.match_prefix(msg.prompt_token_ids)
                entry.pinned = hits[: msg.skip_pages]
                self.blocks.free_table(hits[msg.skip_pages :])
            self._maybe_import(msg.request_id)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, KVEventsResync):
            self.kv_events.resync()

    # ---- requests -------------------------------------------------------------------------
    def _start(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(request_id, 0, list(prompt), len(prompt), params, arrival_time=self.loop.now)
        self.seqs[request_id] = seq
        self.targets[request_id] = max_tokens
        self.scheduler.add(seq)
        self.kick()

    def pages_arrived(self, request_id: str, first_tokens: int, pages_sent: int) -> None:
        """The prefill worker's pages reached this (decode) worker."""
        entry = self.expected.setdefault(request_id, Expected())
        entry.arrived = ([PLACEHOLDER_TOKEN] * first_tokens, pages_sent)
        self.bytes_received += pages_sent * self.spec.page_bytes
        self._maybe_import(request_id)

    def _maybe_import(self, request_id: str) -> None:
        entry = self.expected.get(request_id)
        if entry is None or entry.task is None or entry.arrived is None:
            return
        del self.expected[request_id]
        prompt = list(entry.task.prompt_token_ids)
        table = list(entry.pinned)
        if self.blocks.pages_needed(table, len(prompt)) > self.blocks.num_free_pages:
            self.blocks.free_table(table)  # the real import raises OutOfPages: KV_REJECTED
            self._done(request_id, DoneReason.KV_REJECTED)
            return
        self.blocks.grow(table, len(prompt))
        cached = self.blocks.cache_full_pages(table, prompt, 0, len(prompt))
        seq = Sequence(
            request_id, 0, prompt + entry.arrived[0], len(prompt), entry.task.sampling, arrival_time=self.loop.now
        )
        seq.block_table, seq.num_computed, seq.num_cached_pages = table, len(prompt), cached
        self.seqs[request_id] = seq
        self.scheduler.add_running(seq)
        if seq.num_output_tokens >= self.targets[request_id]:
            self._finish(seq)
        self.kick()

    def acknowledged(self, request_id: str) -> None:
        """The decode worker took the pages: free ours."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.blocks.free_table(held.table)
            self._done(request_id, DoneReason.HANDED_OFF)
            self.kick()

    def _abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
        held = self.held.pop(request_id, None)
        if held is not None:
            self.blocks.free_table(held.table)
        entry = self.expected.pop(request_id, None)
        if entry is not None:
            self.blocks.free_table(entry.pinned)
        self.prefill_tasks.pop(request_id, None)

    def _done(self, request_id: str, reason: DoneReason) -> None:
        self.finished += 1
        self.send(RequestDone(worker_id=self.spec.worker_id, request_id=request_id, reason=reason))

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "length")
        self.seqs.pop(seq.request_id, None)
        self.prefill_tasks.pop(seq.request_id, None)
        self._done(seq.request_id, DoneReason.FINISHED)

    # ---- steps ----------------------------------------------------------------------------
    def kick(self) -> None:
        """Start a step now if idle and there is work (the worker's step loop)."""
        if self.busy or not self.scheduler.has_work():
            return
        plan = self.scheduler.schedule()
        if plan.empty:  # pages are held elsewhere (transfers): try again shortly
            self.busy = True
            self.loop.after(0.001, self._retry)
            return
        duration = self.step_time(shape_of(plan))
        self.busy = self.stepping = True
        self.steps += 1
        self.busy_s += duration
        self.max_used_pages = max(self.max_used_pages, self.blocks.num_used_pages)
        self.loop.after(duration, lambda: self._step_done(plan))

    def _retry(self) -> None:
        self.busy = False
        self.kick()

    def _step_done(self, plan: StepPlan) -> None:
        self.busy = self.stepping = False
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.finished:  # aborted while the step ran
                continue
            seq.num_computed += chunk.num_tokens
            seq.num_cached_pages = self.blocks.cache_full_pages(
                seq.block_table, seq.token_ids, seq.num_cached_pages, seq.num_computed
            )
            if not chunk.samples:
                continue
            seq.append_token(PLACEHOLDER_TOKEN, None)
            seq.take_new_tokens()
            self.emit(seq.request_id, 1, self.loop.now)
            task = self.prefill_tasks.get(seq.request_id)
            if seq.num_output_tokens >= self.targets[seq.request_id]:
                self._finish(seq)  # (on a prefill worker: ended at its first token; the core aborts D)
            elif task is not None:
                self._hand_off(seq, task)
        self.kick()

    def _hand_off(self, seq: Sequence, task: PrefillTask) -> None:
        """Prefill done: hold the prompt's pages and send those the decode worker lacks."""
        prompt_pages = -(-seq.num_prompt_tokens // self.spec.page_size)
        table = self.blocks.fork(seq.block_table[:prompt_pages])
        self.scheduler.finish(seq, "prefilled")
        self.seqs.pop(seq.request_id, None)
        self.prefill_tasks.pop(seq.request_id, None)
        self.held[seq.request_id] = Held(table, task)
        pages = prompt_pages - task.skip_pages
        self.bytes_sent += pages * self.spec.page_bytes
        self.handoff(self, task, table, pages)


def shape_of(plan: StepPlan) -> StepShape:
    """The step's work, from the real plan, as the workers' step trace records it."""
    return StepShape(**step_shape(plan))
