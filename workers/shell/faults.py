"""Faults injected on purpose, for tests only: off unless the test-only environment variables
below are set. Nothing in a deployment sets them.

    PAGEMESH_TEST_STEP_DELAY_S=SECONDS  every step of work first sleeps this long (a step slower
                                        than the heartbeat timeout; the loop's thread is held)
    PAGEMESH_TEST_FAIL_STEP=N           the Nth step of work raises (an exception in the forward
                                        pass: the engine is dead)
    PAGEMESH_TEST_KV_SEND_DELAY_S=SECS  a prefill worker holds each request's packed KV pages this
                                        long before they go out (the event loop stays free): a
                                        window in which the test kills it mid-transfer
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

DELAY_ENV = "PAGEMESH_TEST_STEP_DELAY_S"
FAIL_ENV = "PAGEMESH_TEST_FAIL_STEP"
KV_SEND_DELAY_ENV = "PAGEMESH_TEST_KV_SEND_DELAY_S"


def kv_send_delay_s() -> float:
    """Seconds a KV handoff waits between packing its pages and sending them (0: none)."""
    return float(os.environ.get(KV_SEND_DELAY_ENV, "0"))


class InjectedFault(RuntimeError):
    """The exception PAGEMESH_TEST_FAIL_STEP raises in a step."""


@dataclass
class StepFaults:
    delay_s: float = 0.0
    fail_at_step: int = 0  # 0: never
    steps: int = 0

    @classmethod
    def from_environment(cls) -> StepFaults:
        return cls(delay_s=float(os.environ.get(DELAY_ENV, "0")), fail_at_step=int(os.environ.get(FAIL_ENV, "0")))

    def before_step(self) -> None:
        """Called at the start of each step, on the thread that runs it."""
        self.steps += 1
        if self.delay_s > 0:
            time.sleep(self.delay_s)  # holds the step's thread as a long forward pass does
        if self.steps == self.fail_at_step:
            raise InjectedFault(f"injected fault in step {self.steps} ({FAIL_ENV})")
