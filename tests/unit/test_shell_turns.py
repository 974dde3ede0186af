"""A message that reaches a worker while its step blocks the event loop's thread (a CPU step) is
handled before the next step starts, not one or two steps later: an abort frees its pages, a KV
acknowledgement its sender's, at the first step boundary after they came."""

from __future__ import annotations

import asyncio
import time

from pagemesh.common.messages import AbortRequest
from pagemesh.common.transport import Dealer, Router, ipc_address
from pagemesh.workers.shell.shell import let_other_loops_run


def test_a_message_that_came_during_a_step_is_handled_before_the_next(tmp_path):
    async def steps() -> list[int]:
        address = ipc_address(str(tmp_path), "control")
        with Router(address) as scheduler, Dealer(address, "worker-0") as worker:
            await worker.send(AbortRequest(request_id="hello", reason="connect"))
            identity, _ = await scheduler.recv()
            step = [0]
            handled_before_step: list[int] = []

            async def control_loop() -> None:  # as the shell's: receive, handle
                while True:
                    await worker.recv()
                    handled_before_step.append(step[0] + 1)

            control = asyncio.ensure_future(control_loop())
            for step[0] in range(1, 6):
                if step[0] == 2:
                    await scheduler.send(identity, AbortRequest(request_id="r-1", reason="client left"))
                time.sleep(0.05)  # the step holds the loop's thread; the abort arrives meanwhile
                await let_other_loops_run()
            control.cancel()
            return handled_before_step

    assert asyncio.run(steps()) == [3]  # came during step 2, handled before step 3
