"""The scheduler process's loop over real sockets, with fake workers and a fake tokenizer: what a
restarted scheduler must do for requests an earlier process placed."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common import transport as t
from pagemesh.common.messages import (
    AbortRequest,
    HeldRequest,
    KVPoolInfo,
    MigrateRequest,
    Ping,
    Pong,
    Registered,
    RegisterWorker,
    RequestFailed,
)
from pagemesh.services.scheduler.config import SchedulerConfig
from pagemesh.services.scheduler.service import SchedulerService

TIMEOUT_S = HANG_S  # bounds a hang only; a loaded machine may take long to load the vocabulary


@contextlib.asynccontextmanager
async def scheduler(tmp_path, heartbeat_timeout: float = 5.0, worker_return_wait: float = 30.0):
    service = SchedulerService(
        SchedulerConfig(
            t.ipc_address(str(tmp_path), "sched"),
            heartbeat_timeout=heartbeat_timeout,
            worker_return_wait=worker_return_wait,
        )
    )
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        service.close()


async def registered_worker(address: str, worker_id: str, instance: str = "", held=None) -> t.Dealer:
    worker = t.Dealer(address, worker_id)
    await worker.send(
        RegisterWorker(
            worker_id=worker_id,
            kind="llm",
            role="mixed",
            model="m",
            max_running=8,
            kv=KVPoolInfo(page_size=16, num_pages=100, kv_endpoint=""),
            instance=instance or f"{worker_id}-instance",
            held=held,
        )
    )
    assert await worker.recv() == Registered(worker_id=worker_id)
    return worker


def test_pings_are_answered_with_the_process_instance(tmp_path):
    async def main():
        async with scheduler(tmp_path) as service:
            with t.Dealer(service.config.address, "tok0") as tokenizer:
                await tokenizer.send(Ping(sender="tok0"))
                assert await tokenizer.recv() == Pong(service="scheduler", instance=service.instance)
        assert len(service.instance) == 32

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_an_abort_of_an_unknown_request_goes_to_the_worker_it_names_only(tmp_path):
    async def main():
        async with scheduler(tmp_path) as service:
            w0 = await registered_worker(service.config.address, "w0")
            w1 = await registered_worker(service.config.address, "w1")
            with w0, w1, t.Dealer(service.config.address, "tok0") as tokenizer:
                # placed by an earlier scheduler process: this one only knows where from the abort
                await tokenizer.send(AbortRequest(request_id="lost", reason="unknown to the tokenizer", worker_id="w1"))
                assert await w1.recv() == AbortRequest(request_id="lost", reason="unknown to the tokenizer")
                await tokenizer.send(AbortRequest(request_id="gone", reason="client disconnected"))  # names no worker
                await tokenizer.send(
                    AbortRequest(request_id="x", reason="unknown to the tokenizer", worker_id="nobody")
                )  # not registered
                await tokenizer.send(
                    AbortRequest(request_id="lost2", reason="unknown to the tokenizer", worker_id="w0")
                )
                assert await w0.recv() == AbortRequest(request_id="lost2", reason="unknown to the tokenizer")
                with contextlib.suppress(asyncio.TimeoutError):
                    extra = await asyncio.wait_for(w1.recv(), 0.3)
                    raise AssertionError(f"w1 got {extra}")

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_requests_a_worker_reports_holding_are_migrated_when_it_goes(tmp_path):
    """A restarted scheduler learns from a worker registering again which requests it runs, and
    from its tokenizers' pings where to report them: they move (or fail) if the worker goes."""

    async def main():
        async with scheduler(tmp_path) as service:
            with t.Dealer(service.config.address, "tok0") as tokenizer:
                held = [HeldRequest(request_id="streaming", reply_to="ipc:///tok0-out")]
                first = await registered_worker(service.config.address, "w0", "first", held)
                first.close()
                again = await registered_worker(service.config.address, "w0", "second")  # w0 restarted
                with again:  # the failure waits for the tokenizer's first ping: it says where it is
                    await tokenizer.send(Ping(sender="tok0", address="ipc:///tok0-out"))
                    migrate = await asyncio.wait_for(tokenizer.recv(), TIMEOUT_S)
                    assert migrate == MigrateRequest(
                        request_id="streaming", reason="worker w0 restarted", lost_worker_ids=["w0"]
                    )
                    assert isinstance(await tokenizer.recv(), Pong)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_request_sent_again_after_a_restart_is_placed_once(tmp_path):
    from pagemesh.common.messages import GenerateTask, ScheduleRequest
    from pagemesh.common.sampling import SamplingParams

    async def main():
        async with scheduler(tmp_path) as service:
            with (
                await registered_worker(service.config.address, "w0") as worker,
                t.Dealer(service.config.address, "tok0") as tokenizer,
            ):
                request = ScheduleRequest(
                    request_id="r1",
                    prompt_token_ids=[1, 2, 3],
                    sampling=SamplingParams(),
                    reply_to="ipc:///tok0-out",
                    arrival_time=1.0,
                )
                await tokenizer.send(request)
                task = await asyncio.wait_for(worker.recv(), TIMEOUT_S)
                assert isinstance(task, GenerateTask) and task.request_id == "r1"
                await tokenizer.send(request)  # the tokenizer saw this process start: it sends it again
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(worker.recv(), 0.3)
                assert len(service.core.placed) == 1

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_just_started_scheduler_holds_requests_for_workers_yet_to_register(tmp_path):
    """A restarted scheduler gets requests sent again before its workers have registered again:
    they wait for a heartbeat timeout instead of being refused; then, with no worker, they are."""
    from pagemesh.common.messages import GenerateTask, ScheduleRequest
    from pagemesh.common.sampling import SamplingParams

    async def main():
        # after the loss, refused once the return wait (2 s here, 30 s by default) is over
        async with scheduler(tmp_path, heartbeat_timeout=0.5, worker_return_wait=2.0) as service:
            with t.Dealer(service.config.address, "tok0") as tokenizer:
                await tokenizer.send(
                    ScheduleRequest(
                        request_id="early",
                        prompt_token_ids=[1, 2],
                        sampling=SamplingParams(),
                        reply_to="ipc:///tok0-out",
                        arrival_time=1.0,
                    )
                )
                with await registered_worker(service.config.address, "w0") as worker:
                    task = await asyncio.wait_for(worker.recv(), TIMEOUT_S)
                    assert isinstance(task, GenerateTask) and task.request_id == "early"
                while "w0" in service.core.registry.workers:  # w0 stops heartbeating: dropped, the start long past
                    await asyncio.sleep(0.05)
                await tokenizer.send(
                    ScheduleRequest(
                        request_id="late",
                        prompt_token_ids=[1, 2],
                        sampling=SamplingParams(),
                        reply_to="ipc:///tok0-out",
                        arrival_time=1.0,
                    )
                )
                refused = await asyncio.wait_for(tokenizer.recv(), TIMEOUT_S)
                while not (isinstance(refused, RequestFailed) and refused.request_id == "late"):
                    refused = await asyncio.wait_for(tokenizer.recv(), TIMEOUT_S)  # (the early one failed too)
                assert "no workers are available" in refused.message

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_request_read_first_after_a_pause_of_the_scheduler_finds_its_worker_alive(tmp_path):
    """The process stopped (starved, or SIGSTOP) for longer than the heartbeat timeout: the
    request that waited in its socket may be read before its expiry tick runs. The pause is
    excused first, so the worker whose heartbeats it could not read is not taken for dead (the
    request was refused with a 503, 'no workers are available', when only the tick excused it)."""
    import time

    from pagemesh.common.messages import GenerateTask, Heartbeat, ScheduleRequest
    from pagemesh.common.sampling import SamplingParams

    timeout = 0.5

    async def main():
        async with scheduler(tmp_path, heartbeat_timeout=timeout) as service:
            with (
                await registered_worker(service.config.address, "w0") as worker,
                t.Dealer(service.config.address, "tok0") as tokenizer,
            ):
                for _ in range(8):  # past the start-up grace window, heartbeating
                    await worker.send(
                        Heartbeat(worker_id="w0", running=0, waiting=0, time=0.0, requests_finished=0, kv=None)
                    )
                    await asyncio.sleep(timeout / 4)
                assert service.core.registry.is_alive(service.core.registry.workers["w0"], time.monotonic())
                await tokenizer.send(
                    ScheduleRequest(
                        request_id="r1",
                        prompt_token_ids=[1, 2],
                        sampling=SamplingParams(),
                        reply_to="ipc:///tok0-out",
                        arrival_time=1.0,
                    )
                )
                time.sleep(3 * timeout)  # the whole process (this loop is the scheduler's) does not run
                placed, refused = asyncio.ensure_future(worker.recv()), asyncio.ensure_future(tokenizer.recv())
                await asyncio.wait([placed, refused], timeout=TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
                assert not refused.done(), refused.result()  # RequestFailed: no workers are available
                refused.cancel()
                assert isinstance(placed.result(), GenerateTask) and placed.result().request_id == "r1"

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
