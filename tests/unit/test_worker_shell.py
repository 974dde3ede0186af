"""The worker shell over real sockets, with the scheduler's side played by a Router in the test
and the smallest worker kind there is (a counter): what every worker kind gets from the shell."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pagemesh.common import transport as t
from pagemesh.common.messages import (
    AbortRequest,
    DoneReason,
    GenerateTask,
    Heartbeat,
    HeldRequest,
    ImageModelInfo,
    Registered,
    RegisterWorker,
    RequestDone,
    UnknownWorker,
    WorkerKind,
    WorkerRole,
    WorkerStopped,
)
from pagemesh.common.process import ProcessFailed
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.shell.backend import Load, Registration
from pagemesh.workers.shell.config import ShellConfig
from pagemesh.workers.shell.faults import DELAY_ENV, FAIL_ENV
from pagemesh.workers.shell.shell import WorkerShell

TIMEOUT_S = 20.0


IMAGES = ImageModelInfo(
    sizes=["8x8"], samplers=["ddim"], default_sampler="ddim", default_steps=4, max_steps=8, conditioning="a digit"
)


class CountingBackend:
    """Each task is `max_tokens` steps of work; a step does one unit of every task."""

    task_types = (GenerateTask,)
    step_inline = True

    def __init__(self, ctx):
        self.ctx = ctx
        self.left: dict[str, int] = {}
        self.steps = 0
        self.events: list[str] = []
        self.finished_at: dict[str, tuple[int, dict[str, int]]] = {}  # request -> (step, what the others had left)

    def registration(self):
        return Registration(
            kind=WorkerKind.DIFFUSION, role=WorkerRole.MIXED, model="counter", max_running=4, images=IMAGES
        )

    def add(self, task):
        self.left[task.request_id] = task.sampling.max_tokens
        self.events.append(f"add {task.request_id}")

    def abort(self, request_id):
        self.events.append(f"abort {request_id}")
        if self.left.pop(request_id, None) is not None:
            self.ctx.done(request_id, DoneReason.FINISHED)

    def has_work(self):
        return bool(self.left)

    def step(self):
        self.steps += 1
        for rid in list(self.left):
            self.left[rid] -= 1
        return [rid for rid, n in self.left.items() if n == 0]

    def stalled(self):
        return False

    async def publish(self, finished):
        for rid in finished:
            del self.left[rid]
            self.finished_at[rid] = (self.steps, dict(self.left))
            self.ctx.done(rid, DoneReason.FINISHED)

    async def between_steps(self):
        pass

    def load(self):
        return Load(running=len(self.left), waiting=0)

    def held(self):
        return [HeldRequest(request_id=rid, reply_to="tok") for rid in sorted(self.left)]

    def registered_again(self):
        self.events.append("registered again")

    def background(self):
        return []

    def close(self):
        pass


def task(rid: str, steps: int) -> GenerateTask:
    return GenerateTask(request_id=rid, prompt_token_ids=[1], sampling=SamplingParams(max_tokens=steps), reply_to="tok")


@contextlib.asynccontextmanager
async def worker_and_scheduler(tmp_path, drain_timeout: float = 30.0):
    with t.Router(t.ipc_address(str(tmp_path), "sched")) as scheduler:
        shell = WorkerShell(
            ShellConfig(
                worker_id="w0",
                scheduler_address=t.ipc_address(str(tmp_path), "sched"),
                heartbeat_interval=0.05,
                drain_timeout=drain_timeout,
            ),
            CountingBackend,
        )
        running = asyncio.create_task(shell.run())
        try:
            yield shell, scheduler
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            shell.close()


async def next_of(router: t.Router, kind: type):
    while True:
        identity, msg = await router.recv()
        if isinstance(msg, kind):
            return identity, msg


def test_registration_tasks_aborts_and_heartbeats(tmp_path):
    async def main():
        async with worker_and_scheduler(tmp_path) as (shell, scheduler):
            identity, reg = await next_of(scheduler, RegisterWorker)
            assert (reg.worker_id, reg.kind, reg.role, reg.model, reg.kv, reg.held, reg.images) == (
                "w0",
                WorkerKind.DIFFUSION,
                WorkerRole.MIXED,
                "counter",
                None,
                None,
                IMAGES,
            )
            await scheduler.send(identity, Registered(worker_id="w0"))
            await scheduler.send(identity, task("a", 3))
            await scheduler.send(identity, task("b", 100_000))
            _, done = await next_of(scheduler, RequestDone)
            assert done == RequestDone(worker_id="w0", request_id="a", reason=DoneReason.FINISHED)
            assert shell.backend.finished_at["a"] == (3, {"b": 100_000 - 3})  # a and b advanced together
            await scheduler.send(identity, AbortRequest(request_id="b", reason="client gone"))
            _, done = await next_of(scheduler, RequestDone)
            assert done.request_id == "b"
            while True:  # the heartbeats count what left, and the load is the backend's
                _, beat = await next_of(scheduler, Heartbeat)
                if beat.requests_finished == 2:
                    break
            assert (beat.running, beat.waiting, beat.kv) == (0, 0, None)
            assert shell.backend.events == ["add a", "add b", "abort b"]

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_restarted_scheduler_gets_the_registration_again_with_what_the_worker_holds(tmp_path):
    async def main():
        async with worker_and_scheduler(tmp_path) as (shell, scheduler):
            identity, reg = await next_of(scheduler, RegisterWorker)
            await scheduler.send(identity, Registered(worker_id="w0"))
            await scheduler.send(identity, task("long", 100_000))
            await scheduler.send(identity, task("other", 100_000))
            for _ in range(3):  # every heartbeat after a restart gets this answer: one registration
                await scheduler.send(identity, UnknownWorker(worker_id="w0"))
            _, again = await next_of(scheduler, RegisterWorker)
            assert again.instance == reg.instance  # the same process
            assert again.held == [
                HeldRequest(request_id="long", reply_to="tok"),
                HeldRequest(request_id="other", reply_to="tok"),
            ]
            await scheduler.send(identity, AbortRequest(request_id="long", reason="x"))
            await next_of(scheduler, RequestDone)
            assert shell.backend.events.count("registered again") == 1

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_heartbeats_go_on_while_a_step_holds_the_loops_thread(tmp_path, monkeypatch):
    # each step sleeps 1 s on the event loop's thread (step_inline), as a long forward pass
    # holds it: the heartbeats still come, every 0.05 s, and say how long the step has run
    monkeypatch.setenv(DELAY_ENV, "1.0")

    async def main():
        async with worker_and_scheduler(tmp_path) as (shell, scheduler):
            identity, _ = await next_of(scheduler, RegisterWorker)
            await scheduler.send(identity, Registered(worker_id="w0"))
            await scheduler.send(identity, task("slow", 2))
            busy: list[float] = []
            while True:
                sender, msg = await scheduler.recv()
                if isinstance(msg, Heartbeat):
                    assert sender == b"w0.heartbeat"  # their own socket, not the loop's
                    busy.append(msg.busy_s)
                elif isinstance(msg, RequestDone):
                    break
            during = [b for b in busy if b > 0]
            # two 1 s steps: many heartbeats inside them, the longest reporting most of a step
            assert len(during) >= 4 and 0.5 < max(during) < 30, busy
            assert any(b2 > b1 for b1, b2 in zip(during, during[1:], strict=False))  # it grows in a step

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_an_exception_in_a_step_tells_the_scheduler_and_ends_the_process(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "2")  # the second step raises

    async def main():
        with t.Router(t.ipc_address(str(tmp_path), "sched")) as scheduler:
            shell = WorkerShell(
                ShellConfig(
                    worker_id="w0", scheduler_address=t.ipc_address(str(tmp_path), "sched"), heartbeat_interval=0.05
                ),
                CountingBackend,
            )
            running = asyncio.create_task(shell.run())
            try:
                identity, reg = await next_of(scheduler, RegisterWorker)
                await scheduler.send(identity, Registered(worker_id="w0"))
                await scheduler.send(identity, task("a", 5))
                sender, stopped = await next_of(scheduler, WorkerStopped)
                assert sender == b"w0"  # in order with the worker's other messages
                assert stopped.worker_id == "w0" and stopped.instance == reg.instance
                assert stopped.error == "InjectedFault: injected fault in step 2 (PAGEMESH_TEST_FAIL_STEP)"
                with pytest.raises(ProcessFailed):  # the process exits non-zero (run_until_signalled)
                    await running
                assert shell.backend.steps == 1  # the failed step never ran
            finally:
                running.cancel()
                shell.close()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


@pytest.mark.parametrize("drain_timeout", [30.0, 0.2])
def test_a_drain_finishes_what_the_worker_holds_then_says_goodbye(tmp_path, drain_timeout):
    async def main():
        async with worker_and_scheduler(tmp_path, drain_timeout) as (shell, scheduler):
            identity, reg = await next_of(scheduler, RegisterWorker)
            await scheduler.send(identity, Registered(worker_id="w0"))
            steps = 2_000 if drain_timeout > 1 else 100_000  # done within the timeout, or not
            await scheduler.send(identity, task("a", steps))
            while not shell.backend.steps:  # it is working on it
                await asyncio.sleep(0.01)
            draining = asyncio.create_task(shell.drain())
            seen = []
            while not seen or not isinstance(seen[-1], WorkerStopped):
                sender, msg = await scheduler.recv()
                if sender == b"w0" and isinstance(msg, RequestDone | WorkerStopped):
                    seen.append(msg)
            await draining
            finished = [RequestDone(worker_id="w0", request_id="a", reason=DoneReason.FINISHED)]
            goodbye = [WorkerStopped(worker_id="w0", instance=reg.instance, error=None)]
            # past the timeout, the scheduler fails what is left when it gets the goodbye
            assert seen == (finished + goodbye if drain_timeout > 1 else goodbye)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
