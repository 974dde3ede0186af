"""Which requests share the next denoising forward. Pure Python (no torch: tests/unit/test_purity.py).

A request is a `Member`: its arrival order, its latent shape and the rows it puts in a forward
(n images, twice that with classifier-free guidance). Requests wait in arrival order, are
admitted to the running set, and each `plan(now)` returns the group that runs one step:

    waiting (FIFO) ──admit──▶ running ──plan──▶ group: one shape, oldest first, ≤ max_batch_rows rows

step     every step regroups the running set: the requests of one latent shape share the forward
         whatever their step, step count or sampler; newcomers join at the next step and finished
         requests leave at once. Shapes take turns: the shape served longest ago goes next (a
         shape never served first, by its oldest request), so no shape starves behind another.
request  the baseline: when nothing runs, the oldest waiting request and the compatible requests
         behind it start together, once the gathering window since its arrival has passed or the
         batch is full; the batch runs (members leave as they finish) until all are done, and
         arrivals meanwhile wait.
serial   one request at a time, in arrival order.

Within a group, requests are taken oldest first and one that does not fit in the row budget is
skipped for a younger one that does (first fit); the oldest always runs, alone if it is bigger
than the budget. First fit starves nobody: a skipped request gets older until it is taken first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagemesh.workers.diffusion.engine.config import EngineConfig


@dataclass(frozen=True, kw_only=True)
class Member:
    """One request as the batcher sees it."""

    request_id: str
    order: int  # arrival order: smaller is older
    shape: tuple[int, ...]  # one image's latent shape; equal shapes may share a forward
    rows: int  # rows it puts in each forward
    arrival: float  # monotonic seconds (request mode's gathering window)


class Batcher:
    """Waiting and running requests, and the choice of each step's group (see the module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Member] = deque()
        self.running: list[Member] = []  # in arrival order
        self.batch_open = False  # request/serial mode: a batch is running, nobody joins it
        self.last_served: dict[tuple[int, ...], int] = {}  # step mode: shape -> plan number
        self.plans = 0
        self._plan = self._plan_step if config.batching == "step" else self._plan_batch
        self._batch_size = 1 if config.batching == "serial" else config.max_running
        self._window = 0.0 if config.batching == "serial" else config.request_wait_s

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, member: Member) -> None:
        self.waiting.append(member)

    def remove(self, request_id: str) -> bool:
        """A request leaves (finished or aborted), from wherever it is; False if unknown."""
        for queue in (self.running, self.waiting):
            for member in queue:
                if member.request_id == request_id:
                    queue.remove(member)
                    if not self.running:
                        self.batch_open = False
                    return True
        return False

    def plan(self, now: float) -> list[Member]:
        """The group that runs the next forward; empty when nothing can run now (request mode's
        window is open, or there is no work)."""
        self.plans += 1
        return self._plan(now)

    # ---- step mode ------------------------------------------------------------------------
    def _plan_step(self, now: float) -> list[Member]:
        while self.waiting and len(self.running) < self.config.max_running:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return []
        groups: dict[tuple[int, ...], list[Member]] = {}
        for member in self.running:
            groups.setdefault(member.shape, []).append(member)
        shape = min(groups, key=lambda s: (self.last_served.get(s, -1), groups[s][0].order))
        self.last_served = {s: n for s, n in self.last_served.items() if s in groups}
        self.last_served[shape] = self.plans
        return self._fit(groups[shape], self.config.max_batch_rows, len(groups[shape]))

    # ---- request and serial modes ---------------------------------------------------------
    def _plan_batch(self, now: float) -> list[Member]:
        if self.batch_open:
            return list(self.running)
        if not self.waiting:
            return []
        head = self.waiting[0]
        compatible = [m for m in self.waiting if m.shape == head.shape]
        batch = self._fit(compatible, self.config.max_batch_rows, self._batch_size)
        full = len(batch) < len(compatible) or len(batch) == self._batch_size
        if not full and now - head.arrival < self._window:
            return []
        for member in batch:
            self.waiting.remove(member)
        self.running = batch
        self.batch_open = True
        return list(batch)

    @staticmethod
    def _fit(candidates: list[Member], max_rows: int, max_members: int) -> list[Member]:
        """Oldest first, first fit within `max_rows` and `max_members`; the first candidate always."""
        group = [candidates[0]]
        rows = candidates[0].rows
        for member in candidates[1:]:
            if len(group) == max_members:
                break
            if rows + member.rows <= max_rows:
                group.append(member)
                rows += member.rows
        return group
