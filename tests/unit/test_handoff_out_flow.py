"""workers/llm/handoff_out.py's bound on copies in flight: a burst of prefilled prompts does not
hold a copy of every one's pages until its decode worker takes them. Real sockets (a ROUTER stands
for the decode worker's KV endpoint), a tiny random Llama engine."""

from __future__ import annotations

import asyncio
import socket

import pytest
import structlog

from pagemesh.common.messages import DoneReason, KVPagesAck, KVPagesHeader
from pagemesh.common.sampling import SamplingParams
from pagemesh.common.transport import KV, Router
from pagemesh.tests.llm_tiny import tiny_engine, tiny_llama
from pagemesh.workers.llm.handoff_out import HandoffOut

PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 250 + 1 for j in range(10)] for i in range(4)}


class Ctx:
    worker_id = "prefill-test"
    log = structlog.get_logger()

    def __init__(self):
        self.inbox = []

    def post(self, command):
        self.inbox.append(command)


@pytest.fixture
def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(seed=5)


def prefilled_engine(model):
    engine = tiny_engine(model, max_model_len=128)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4), prefill_only=True)
    while any(engine.take_prefilled(rid) is None for rid in PROMPTS):
        engine.step()
    return engine


async def arrived(router: Router, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        _, msg, _ = await asyncio.wait_for(router.recv_with_frames(), 10)
        assert isinstance(msg, KVPagesHeader)
        ids.append(msg.request_id)
    return ids


async def nothing_more(router: Router) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(router.recv_with_frames(), 0.3)


def test_sends_wait_for_room_in_flight_and_go_in_order_as_acks_come(tiny_model, free_tcp_port):
    async def run():
        engine = prefilled_engine(tiny_model)
        endpoint = f"tcp://127.0.0.1:{free_tcp_port}"
        done: list[tuple[str, DoneReason]] = []
        ctx = Ctx()
        out = HandoffOut(ctx, engine, timeout=30, on_done=lambda r, why: done.append((r, why)))
        router = Router(endpoint, options=KV)
        try:
            for rid in PROMPTS:
                out.expect(rid, endpoint, 0)
            one = engine.export_prefilled("r0", 0)
            out.max_bytes_in_flight = sum(r.pages.numel() * r.pages.element_size() for r in one.ranks) + 1
            for rid in PROMPTS:  # as the worker's publish does at each prefill's end
                await out.send(rid)
            assert await arrived(router, 2) == ["r0", "r1"]  # the second goes: one copy was under the bound
            await nothing_more(router)
            assert list(out.waiting) == ["r2", "r3"] and len(out.outgoing) == 2
            await out.send_between_steps()  # between steps: still no room
            await nothing_more(router)

            await router.send(b"prefill-test", KVPagesAck(request_id="r0", ok=True, error=None))
            for _ in range(50):
                if ctx.inbox:
                    break
                await asyncio.sleep(0.05)
            for command in ctx.inbox:
                command()
            assert done == [("r0", DoneReason.HANDED_OFF)]
            await out.send_between_steps()
            assert await arrived(router, 1) == ["r2"]
            await nothing_more(router)

            out.forget("r3")  # aborted while it waited: never sent
            assert not out.waiting
            out.expire(float("inf"))  # the unacknowledged ones time out and give their pages back
            assert sorted(r for r, why in done if why is DoneReason.KV_TIMEOUT) == ["r1", "r2"]
            assert not out.outgoing
        finally:
            out.close()
            router.close()

    asyncio.run(run())


def test_a_waiting_send_times_out_like_a_sent_one(tiny_model, free_tcp_port):
    async def run():
        engine = prefilled_engine(tiny_model)
        endpoint = f"tcp://127.0.0.1:{free_tcp_port}"
        done: list[tuple[str, DoneReason]] = []
        out = HandoffOut(Ctx(), engine, timeout=30, on_done=lambda r, why: done.append((r, why)))
        router = Router(endpoint, options=KV)
        try:
            out.max_bytes_in_flight = 1
            for rid in ("r0", "r1"):
                out.expect(rid, endpoint, 0)
                await out.send(rid)
            assert await arrived(router, 1) == ["r0"] and list(out.waiting) == ["r1"]
            used = engine.blocks.num_used_pages
            out.expire(float("inf"))
            assert sorted(done) == [("r0", DoneReason.KV_TIMEOUT), ("r1", DoneReason.KV_TIMEOUT)]
            assert not out.waiting and not out.outgoing and "r1" not in out.targets
            assert engine.blocks.num_used_pages < used  # both gave their pages back
        finally:
            out.close()
            router.close()

    asyncio.run(run())
