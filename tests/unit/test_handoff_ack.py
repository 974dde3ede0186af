"""The decode side's KV acknowledgement when the prefill worker that sent the pages is gone
(killed after sending; the chaos soak of bench/chaos.py found it): the acknowledgement is
dropped with a warning, where it was an unretrieved task's UnknownPeer error and traceback."""

from __future__ import annotations

import asyncio

from pagemesh.common.messages import KVPagesAck
from pagemesh.common.transport import ipc_address
from pagemesh.workers.llm.handoff import HandoffIn


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.warnings.append((event, fields))


class Context:
    worker_id = "decode-0"

    def __init__(self) -> None:
        self.log = Log()


def test_an_acknowledgement_to_a_gone_sender_is_dropped_with_a_warning(tmp_path):
    ctx = Context()

    async def acknowledge_to_nobody() -> None:
        handoff = HandoffIn(ctx, None, ipc_address(str(tmp_path), "kv"), 1.0, lambda task: None)
        try:
            await handoff._acknowledge(b"prefill-0", KVPagesAck(request_id="r-1", ok=True, error=None))
        finally:
            handoff.close()

    asyncio.run(acknowledge_to_nobody())  # raises nothing
    assert ctx.log.warnings == [("kv sender gone: acknowledgement dropped", {"request_id": "r-1"})]
