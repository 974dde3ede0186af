"""A simulated mesh: the real scheduler core between a tokenizer stand-in and SimWorkers, in
virtual time. Messages between the core and workers take `control_latency_s`; KV handoffs take
the transfer model's time; tokens reach their client `delivery_latency_s` after their step.
A step's time comes from one model for every worker (a function of the step's shape), or from a
`MeshStepCost`: the model of the worker's role, slowed by the other workers mid-step, with its
jitter drawn from a generator seeded per worker (`seed`), so a run stays deterministic, and by the
host's slowdown of that moment, its recorded sequence entered at a seeded offset.

The cluster is the tokenizer too (it sends ScheduleRequest and receives RequestFailed), so a
run goes: arrival → ScheduleRequest → core.handle → tasks → workers → steps → tokens → done.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagemesh.bench.loadgen.stream import RequestResult
from pagemesh.bench.simulator.clock import EventLoop
from pagemesh.bench.simulator.cost import StepShape, TransferModel
from pagemesh.bench.simulator.role_cost import MeshStepCost
from pagemesh.bench.simulator.worker import SimWorker, WorkerSpec
from pagemesh.bench.simulator.workload import SimRequest
from pagemesh.common.messages import Message, RequestFailed, ScheduleRequest, WorkerRole
from pagemesh.common.sampling import SamplingParams
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.core import SchedulerCore
from pagemesh.services.scheduler.placement import PlacementPolicy

TOKENIZER = b"sim-tokenizer"
HOST_STREAM = 1 << 20  # the host slowdown's generator: apart from the workers' jitter streams (their index)
REPLY_TO = "sim://tokenizer"


@dataclass(frozen=True)
class ClusterSpec:
    workers: tuple[WorkerSpec, ...]
    placement: PlacementPolicy = PlacementPolicy()
    max_queue: int = 1 << 20  # a simulated queue refuses nothing unless asked
    transfer: TransferModel = TransferModel(2e9, 0.002)
    control_latency_s: float = 0.0005  # one hop between processes over zmq
    delivery_latency_s: float = 0.001  # worker → tokenizer → gateway → client, per token batch
    # the fixed time a request spends outside the steps and hops modelled here (the HTTP request,
    # the gateway, tokenizing, detokenizing): measured per mesh (bench.simulator.validate)
    request_overhead_s: float = 0.0
    tick_s: float = 1.25  # the scheduler's expiry tick (heartbeat timeout / 4)
    step_jitter: bool = True  # a MeshStepCost's jitter and host slowdown (off: every step its modelled time)
    # the host slowdown's trace-clock time at virtual time 0: replay the machine's slowdown as it
    # was at each moment of a recorded run (validation), not from a seeded offset (None)
    host_clock_s: float | None = None


@dataclass
class Trace:
    """One request as its client saw it."""

    request: SimRequest
    token_times: list[float] = field(default_factory=list)
    failed: str = ""

    def result(self) -> RequestResult:
        r = RequestResult(prompt_len=len(self.request.prompt_token_ids), output_len=self.request.output_len)
        r.start = self.request.arrival_s
        done = len(self.token_times) >= self.request.output_len and not self.failed
        r.success, r.error = done, self.failed or ("" if done else "unfinished")
        if self.token_times:
            r.ttft = self.token_times[0] - r.start
            r.latency = self.token_times[-1] - r.start
            r.itl = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        r.output_tokens = len(self.token_times)
        r.chunks = len(self.token_times)
        return r


class Cluster:
    def __init__(self, spec: ClusterSpec, step_time: Callable[[StepShape], float] | MeshStepCost, seed: int = 0):
        self.spec = spec
        self.loop = EventLoop()
        self.core = SchedulerCore(
            SchedulerConfig(address="sim://scheduler", max_queue=spec.max_queue, placement=spec.placement),
            "sim",
            now=0.0,
        )
        self.workers: dict[str, SimWorker] = {}
        # where in the host's recorded slowdown this run starts: seeded, the same for every worker
        self.host_offset_s = 0.0
        if isinstance(step_time, MeshStepCost):
            self.host_offset_s = float(np.random.default_rng([seed, HOST_STREAM]).random()) * step_time.host.span_s
        for index, ws in enumerate(spec.workers):
            timing = (
                self._role_step_time(step_time, ws, seed, index) if isinstance(step_time, MeshStepCost) else step_time
            )
            self.workers[ws.worker_id] = SimWorker(ws, self.loop, timing, self._to_core, self._emit, self._handoff)
        self.traces: dict[str, Trace] = {}

    def _role_step_time(self, cost: MeshStepCost, ws: WorkerSpec, seed: int, index: int):
        model = cost.for_role(ws.role.value)
        draws = np.random.default_rng([seed, index])

        def step_time(shape: StepShape) -> float:
            others = sum(1 for w in self.workers.values() if w.stepping and w.spec.worker_id != ws.worker_id)
            if not self.spec.step_jitter:
                return model.step_time(shape, others)
            if self.spec.host_clock_s is None:
                host = cost.host.at(self.loop.now + self.host_offset_s)
            else:
                host = cost.host.at_clock(self.spec.host_clock_s + self.loop.now)
            return model.step_time(shape, others, draws.random()) * host

        return step_time

    # ---- wiring ---------------------------------------------------------------------------
    def _deliver(self, outputs: list[tuple[object, Message]]) -> None:
        for destination, msg in outputs:
            if destination == TOKENIZER:
                if isinstance(msg, RequestFailed):
                    self.loop.after(self.spec.control_latency_s, lambda m=msg: self._failed(m))
            elif destination in self.workers:
                worker = self.workers[destination]
                self.loop.after(self.spec.control_latency_s, lambda w=worker, m=msg: w.receive(m))

    def _to_core(self, msg: Message) -> None:
        self.loop.after(self.spec.control_latency_s, lambda: self._deliver(self.core.handle(b"w", msg, self.loop.now)))

    def _emit(self, request_id: str, n: int, at: float) -> None:
        trace = self.traces.get(request_id)
        if trace is not None:
            trace.token_times.extend([at + self.spec.delivery_latency_s] * n)

    def _failed(self, msg: RequestFailed) -> None:
        trace = self.traces.get(msg.request_id)
        if trace is not None:
            trace.failed = f"{msg.status} {msg.message}"

    def _handoff(self, prefill: SimWorker, task, table: list[int], pages: int) -> None:
        decode = self.workers[task.decode_worker_id]
        took = self.spec.transfer.time(pages * prefill.spec.page_bytes)
        self.loop.after(took, lambda: decode.pages_arrived(task.request_id, 1, pages))
        self.loop.after(took + self.spec.transfer.latency_s, lambda: prefill.acknowledged(task.request_id))

    def _tick(self) -> None:
        self._deliver(self.core.tick(self.loop.now))
        if self._open():
            self.loop.after(self.spec.tick_s, self._tick)

    def _open(self) -> bool:
        return any(not self._ended(t) for t in self.traces.values()) or self.loop.pending > 0

    @staticmethod
    def _ended(trace: Trace) -> bool:
        return bool(trace.failed) or len(trace.token_times) >= trace.request.output_len

    # ---- a run ----------------------------------------------------------------------------
    def run(self, requests: list[SimRequest], horizon_s: float = math.inf) -> list[Trace]:
        """Register the workers, send every request at its arrival, run until all ended (or the
        horizon). Returns the traces in arrival order."""
        for worker in self.workers.values():
            self._deliver(self.core.handle(b"w", worker.registration(), 0.0))
            worker.heartbeat()
        for req in requests:
            self.traces[req.request_id] = Trace(req)
            self.loop.at(req.arrival_s, lambda r=req: self._arrive(r))
        self.loop.at(self.spec.tick_s, self._tick)
        self.loop.run(until=horizon_s, stop=lambda: all(self._ended(t) for t in self.traces.values()))
        return list(self.traces.values())

    def _arrive(self, req: SimRequest) -> None:
        msg = ScheduleRequest(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling=SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True),
            reply_to=REPLY_TO,
            arrival_time=self.loop.now,
        )
        self.loop.after(
            self.spec.control_latency_s + self.spec.request_overhead_s,
            lambda: self._deliver(self.core.handle(TOKENIZER, msg, self.loop.now)),
        )

    def kv_pages_in_use(self) -> dict[str, int]:
        return {wid: w.blocks.num_used_pages for wid, w in self.workers.items()}


def roles(mixed: int, prefill: int, decode: int) -> list[tuple[str, WorkerRole]]:
    """Worker ids and roles, named as `pagemesh up` names them."""
    out = [(f"mixed-{i}", WorkerRole.MIXED) for i in range(mixed)]
    out += [(f"prefill-{i}", WorkerRole.PREFILL) for i in range(prefill)]
    out += [(f"decode-{i}", WorkerRole.DECODE) for i in range(decode)]
    return out
