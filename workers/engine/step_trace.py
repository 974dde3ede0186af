"""A record of every engine step, for fitting the simulator's cost model to a running mesh.

Off unless the environment names a folder (`PAGEMESH_STEP_TRACE=DIR`, a bench switch: the
simulator's validation sets it on the mesh it starts). Each engine process then appends one JSON
line per step to `DIR/steps-<pid>.jsonl`:

    {"start": perf_counter s, "seconds": the step's wall time, **step_shape(plan)}

and one line `{"role": "prefill" | "decode" | "mixed"}` where the worker says its role (the
simulator fits one cost model per role).

`start` lets the reader see the gap to the next step (the worker's host time between steps:
publishing tokens, taking messages), which a cost model of a loaded mesh has to include.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

ENV = "PAGEMESH_STEP_TRACE"


class StepTrace:
    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        # line-buffered: a worker may end with os._exit (common.process.exit_fast), which flushes nothing
        self.file: IO[str] = open(folder / f"steps-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    @classmethod
    def from_env(cls) -> StepTrace | None:
        folder = os.environ.get(ENV)
        return cls(Path(folder)) if folder else None

    def record_role(self, role: str) -> None:
        self.file.write(json.dumps({"role": role}) + "\n")

    def record(self, plan, start: float, seconds: float) -> None:
        self.file.write(json.dumps({"start": start, "seconds": seconds, **step_shape(plan)}) + "\n")


def step_shape(plan) -> dict[str, int]:
    """A step's work, from its plan (the scheduler puts the decodes first): the features the
    simulator's linear cost model reads (bench.simulator.cost.StepShape)."""
    decodes = plan.chunks[: plan.num_decodes]
    prefills = plan.chunks[plan.num_decodes :]
    return {
        "prefill_tokens": sum(c.num_tokens for c in prefills),
        "prefill_attention": sum(c.num_tokens * (c.start + (c.num_tokens + 1) // 2) for c in prefills),
        "decode_rows": len(decodes),
        "decode_context": sum(c.start + 1 for c in decodes),
    }
