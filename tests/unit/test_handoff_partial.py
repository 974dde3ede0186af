"""A decode worker whose sender lost a pipeline stage mid-transfer: stage 0's pages came, stage
1's never will (its rank died and took the prefill worker down). The decode side does not
import half a model's KV, holds the prefix pages it pinned only until the transfer deadline,
then frees them and ends the request with KV_TIMEOUT: it never waits forever."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from pagemesh.common.messages import DecodeTask, DoneReason, KVPagesHeader
from pagemesh.common.sampling import SamplingParams
from pagemesh.common.transport import ipc_address
from pagemesh.workers.engine.block_manager import BlockManager
from pagemesh.workers.engine.kv_handoff import HandoffPages, KVLayout
from pagemesh.workers.llm.handoff import HandoffIn

PAGE, LAYERS = 4, 4  # a prefill worker of two stages: layers [0, 2) and [2, 4)
PROMPT = list(range(100, 110))  # 3 pages; the first 2 full ones are cached on the decode worker


class Context:
    """The parts of the shell's WorkerContext a handoff uses: its log and where requests end."""

    worker_id = "decode-0"

    def __init__(self) -> None:
        self.log = SimpleNamespace(warning=lambda event, **fields: None)
        self.ended: list[tuple[str, DoneReason]] = []

    def done(self, request_id: str, reason: DoneReason, detail: str | None = None) -> None:
        self.ended.append((request_id, reason))


def stage_header(layers: range) -> KVPagesHeader:
    return KVPagesHeader(
        request_id="r",
        seq_index=0,
        num_tokens=len(PROMPT),
        layer_start=layers.start,
        layer_end=layers.stop,
        num_pages=1,
        dtype="float32",
        page_shape=[2, PAGE, 1, 2],
        checksum=0,
        first_token_ids=[7],
        last=True,
        page_indices=[2],
    )


def engine_over(blocks: BlockManager) -> SimpleNamespace:
    """The engine's handoff API over these pages, but no import_pages: an import attempt would fail
    the request as KV_REJECTED, not time it out."""
    pages = HandoffPages(blocks, KVLayout(LAYERS, tp_size=1, pp_size=2, pool_shape=(2, 16, 2, PAGE, 1, 2)))
    return SimpleNamespace(
        kv_layout=pages.kv_layout, pin_prefix_pages=pages.pin_prefix_pages, free_pages=pages.free_pages
    )


def decode_task(skip_pages: int = 0) -> DecodeTask:
    return DecodeTask(
        request_id="r",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(temperature=0, max_tokens=4),
        reply_to="tok-0",
        prefill_worker_id="prefill-0",
        skip_pages=skip_pages,
    )


def test_half_a_transfer_is_never_imported_and_the_deadline_frees_the_pinned_pages(tmp_path):
    blocks = BlockManager(16, PAGE)
    table: list[int] = []
    blocks.grow(table, len(PROMPT))
    blocks.cache_full_pages(table, PROMPT, 0, len(PROMPT))
    blocks.free_table(table)  # cached, unreferenced: what an earlier request left
    free_before = blocks.num_free_pages
    engine, ctx = engine_over(blocks), Context()

    async def run() -> None:
        handoff = HandoffIn(ctx, engine, ipc_address(str(tmp_path), "kv"), 30.0, lambda task: None)
        try:
            handoff.task(decode_task(skip_pages=2))
            handoff.pages(stage_header(range(0, 2)), [], b"prefill-0")  # stage 1's part never comes
            assert blocks.num_free_pages == free_before - 2  # the two prefix pages are pinned
            assert ctx.ended == [] and [h.request_id for h in handoff.held()] == ["r"]
            deadline = handoff.incoming["r"].deadline
            handoff.expire(deadline - 1)
            assert ctx.ended == []  # still within the deadline: waiting is right
            handoff.expire(deadline + 1)
        finally:
            handoff.close()

    asyncio.run(run())
    assert ctx.ended == [("r", DoneReason.KV_TIMEOUT)]
    assert blocks.num_free_pages == free_before
    blocks.check_invariants()


def test_a_task_waits_longer_for_its_pages_than_a_transfer_for_its_parts(tmp_path):
    """The pages come after the prompt's prefill, which a burst can make longer than a transfer:
    a task alone waits TASK_WAIT_TIMEOUTS transfer timeouts; once a part came, the rest have one."""
    from pagemesh.workers.llm.handoff_in import TASK_WAIT_TIMEOUTS

    engine, ctx = engine_over(BlockManager(16, PAGE)), Context()

    async def run() -> None:
        handoff = HandoffIn(ctx, engine, ipc_address(str(tmp_path), "kv"), 30.0, lambda task: None)
        try:
            start = time.monotonic()
            handoff.task(decode_task())
            handoff.expire(start + 30.0 * TASK_WAIT_TIMEOUTS - 1)
            assert ctx.ended == []  # a prefill still running: no timeout yet
            handoff.pages(stage_header(range(0, 2)), [], b"prefill-0")
            assert handoff.incoming["r"].deadline <= time.monotonic() + 30.0
            handoff.expire(time.monotonic() + 31.0)
        finally:
            handoff.close()

    assert TASK_WAIT_TIMEOUTS > 1
    asyncio.run(run())
    assert ctx.ended == [("r", DoneReason.KV_TIMEOUT)]
