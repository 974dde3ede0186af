"""The worker shell: one worker process, whatever it serves, around a `WorkerBackend`.

    scheduler ──tasks / AbortRequest / Registered / UnknownWorker──▶ [control loop] ─┐
    the backend's own loops (KV pages, deadlines) ──post(command)───────────────────┤ inbox
                                                                                     ▼
    [engine loop]  run the inbox → backend.between_steps() → backend.step() → backend.publish()
    [snapshot loop] the backend's load, every interval, for the heartbeat thread
    [heartbeat thread] Heartbeat(load, busy_s) every interval, on a socket of its own

Only the engine loop touches the backend, and only between steps; every other loop queues
commands in the inbox. On a CPU the step runs on the loop's own thread (zmq's I/O threads
receive meanwhile); on CUDA in a compute thread. Either way the heartbeats go on during a long
step (workers/shell/heartbeat.py). An exception out of the engine loop (the forward pass
failed) is the engine's death: the shell tells the scheduler (`WorkerStopped`, so it fails the
requests held here at once) and the process exits non-zero. Messages are dispatched by type
through one table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from pagemesh.common.liveness import new_instance
from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    Message,
    Ready,
    Registered,
    RegisterWorker,
    RequestDone,
    UnknownWorker,
    WorkerStopped,
)
from pagemesh.common.process import ProcessFailed, wait_until_idle
from pagemesh.common.transport import Dealer, Push
from pagemesh.workers.shell.backend import WorkerBackend
from pagemesh.workers.shell.config import ShellConfig
from pagemesh.workers.shell.faults import StepFaults
from pagemesh.workers.shell.heartbeat import HeartbeatThread, LivenessState, LoadSnapshot

STALL_WAIT = 0.05  # seconds a stalled backend waits for news before trying again
REGISTER_RETRY = 1.0  # seconds between registrations while the scheduler does not answer

log = structlog.get_logger()
# Turns of the event loop from "a message came during a blocking step" to "its handler ran": the
# selector sees the socket readable and zmq's callback completes the recv future; the future's
# callback wakes the waiting loop; that loop runs its handler (which posts into the inbox). With
# one turn, an abort or KV ack that came during step k was handled only after step k+2
# (tests/unit/test_shell_turns.py).
TURNS_TO_HANDLE_A_MESSAGE = 3


async def let_other_loops_run() -> None:
    """Between two steps on the loop's own thread: let every loop woken by a message that came
    during the step run its handler before the next step starts."""
    for _ in range(TURNS_TO_HANDLE_A_MESSAGE):
        await asyncio.sleep(0)


class WorkerShell:
    """Runs one backend in the mesh; is the backend's `WorkerContext`."""

    def __init__(self, config: ShellConfig, backend_factory: Callable[[WorkerShell], WorkerBackend]):
        self.config = config
        self.worker_id = config.worker_id
        self.scheduler = Dealer(config.scheduler_address, config.worker_id)
        self.pushes: dict[str, Push] = {}
        self.inbox: list[Callable[[], None]] = []
        self.wake = asyncio.Event()
        self.requests_finished = 0
        self.instance = new_instance()  # tells the scheduler this process from an earlier one
        self.registered_again_at = float("-inf")
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.backend = backend_factory(self)
        self.liveness = LivenessState(self.backend.load())
        self.heartbeats: HeartbeatThread | None = None
        self.faults = StepFaults.from_environment()  # test-only switches; off unless set
        reg = self.backend.registration()
        self.log = log.bind(worker=config.worker_id, kind=reg.kind, role=reg.role)
        self.registration = RegisterWorker(
            worker_id=config.worker_id,
            kind=reg.kind,
            role=reg.role,
            model=reg.model,
            max_running=reg.max_running,
            kv=reg.kv,
            instance=self.instance,
            images=reg.images,
            ranks=reg.ranks,
            pipeline_stages=reg.pipeline_stages,
            embeds_endpoint=reg.embeds_endpoint,
        )
        self.handlers: dict[type, Callable[[Any], None]] = {
            **{t: self._on_task for t in self.backend.task_types},
            AbortRequest: self._on_abort,
            Registered: lambda msg: None,
            UnknownWorker: self._on_unknown,
        }

    # ---- WorkerContext ----------------------------------------------------------------------
    def post(self, command: Callable[[], None]) -> None:
        self.inbox.append(command)
        self.wake.set()

    def to_scheduler(self, msg: Message) -> None:
        asyncio.ensure_future(self.scheduler.send(msg))

    def push(self, address: str, msg: Message):
        sock = self.pushes.get(address)
        if sock is None:
            sock = self.pushes[address] = Push(address)
        return sock.send(msg)

    def done(self, request_id: str, reason: DoneReason, detail: str | None = None) -> None:
        self.requests_finished += 1
        self.to_scheduler(RequestDone(worker_id=self.worker_id, request_id=request_id, reason=reason, detail=detail))

    # ---- lifecycle --------------------------------------------------------------------------
    async def run(self) -> None:
        await self._register()
        self.heartbeats = HeartbeatThread(
            self.config.scheduler_address, self.worker_id, self.liveness, self.config.heartbeat_interval
        )
        self.heartbeats.start()
        loops = [self._control_loop(), self._snapshot_loop(), self._engine_loop(), *self.backend.background()]
        if self.config.ready_address:
            with Push(self.config.ready_address) as ready:
                await ready.send(Ready(service="worker", name=self.worker_id))
        self.log.info("worker ready", kv=self.registration.kv)
        await asyncio.gather(*loops)

    async def _register(self) -> None:
        while True:  # the scheduler may start after us: register until it answers
            await self.scheduler.send(self.registration)
            try:
                reply = await asyncio.wait_for(self.scheduler.recv(), timeout=REGISTER_RETRY)
            except TimeoutError:
                continue
            if isinstance(reply, Registered):
                return

    async def drain(self) -> None:
        """SIGTERM: finish what this worker holds (within the drain timeout), then tell the
        scheduler it leaves, so that it drops the worker at once and fails what is left."""
        idle = await wait_until_idle(lambda: not self.inbox and not self.backend.has_work(), self.config.drain_timeout)
        self.log.info("drained" if idle else "drain timed out", held=len(self.backend.held()))
        self._stop_heartbeats()  # none after the goodbye: the scheduler would ask it to register
        await self.scheduler.send(WorkerStopped(worker_id=self.worker_id, instance=self.instance))

    def _stop_heartbeats(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.stop()
            self.heartbeats = None

    def close(self) -> None:
        self._stop_heartbeats()
        self.backend.close()
        for sock in [self.scheduler, *self.pushes.values()]:
            sock.close()
        self.compute.shutdown(wait=False)

    # ---- the scheduler's messages -----------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            msg = await self.scheduler.recv()
            handler = self.handlers.get(type(msg))
            if handler is None:
                self.log.warning("unexpected message", type=type(msg).__name__)
            else:
                handler(msg)

    def _on_task(self, task: Message) -> None:
        self.post(lambda: self.backend.add(task))

    def _on_abort(self, msg: AbortRequest) -> None:
        self.post(lambda: self.backend.abort(msg.request_id))

    def _on_unknown(self, msg: UnknownWorker) -> None:
        """A restarted scheduler: register with it again. Every heartbeat queued while it was
        down gets this answer: register at most once a second."""
        if time.monotonic() - self.registered_again_at < REGISTER_RETRY:
            return
        self.registered_again_at = time.monotonic()
        self.log.warning("scheduler does not know this worker: registering again")

        def register_again() -> None:  # after the commands already queued: it lists what it holds then
            self.to_scheduler(dataclasses.replace(self.registration, held=self.backend.held()))
            self.backend.registered_again()

        self.post(register_again)

    # ---- the engine loop --------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        try:
            await self._run_engine()
        except Exception as e:  # the engine is dead: its state cannot be trusted any more
            await self._engine_failed(e)

    async def _run_engine(self) -> None:
        loop = asyncio.get_running_loop()
        backend = self.backend
        while True:
            while self.inbox:
                self.inbox.pop(0)()
            await backend.between_steps()
            if not backend.has_work():
                self.wake.clear()
                if not self.inbox:
                    await self.wake.wait()
                continue
            if backend.step_inline:
                result = self._step()
                await let_other_loops_run()  # what came during the step is in the inbox before the next
            else:
                result = await loop.run_in_executor(self.compute, self._step)
            if backend.stalled():  # nothing could run: wait for a message (an ack frees pages)
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), STALL_WAIT)
                except TimeoutError:
                    pass
            await backend.publish(result)

    def _step(self) -> Any:
        """backend.step(), its start time published for the heartbeats (busy_s)."""
        self.liveness.step_started = time.monotonic()
        try:
            self.faults.before_step()
            return self.backend.step()
        finally:
            self.liveness.step_started = None

    async def _engine_failed(self, error: Exception) -> None:
        """Tell the scheduler first (it fails what this worker holds, and takes it out of
        placement), then end the process with a non-zero code."""
        detail = f"{type(error).__name__}: {error}"
        self.log.exception("engine failed: the worker stops", error=detail)
        self._stop_heartbeats()
        await self.scheduler.send(WorkerStopped(worker_id=self.worker_id, instance=self.instance, error=detail))
        raise ProcessFailed(f"worker {self.worker_id}: engine failed: {detail}")

    async def _snapshot_loop(self) -> None:
        """What the heartbeat thread reports; its freshness also shows that this loop turns."""
        while True:
            self.liveness.snapshot = LoadSnapshot(self.backend.load(), self.requests_finished, time.monotonic())
            await asyncio.sleep(self.config.heartbeat_interval)
