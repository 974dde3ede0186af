"""A discrete-event loop in virtual time. Deterministic: events at the same time run in the
order they were scheduled (a sequence number breaks ties), and nothing reads a real clock."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """`at(t, fn)` runs `fn()` at virtual time t; `run(until)` advances time event by event."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.events_run = 0

    def at(self, time: float, fn: Callable[[], None]) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past ({time} < {self.now})")
        heapq.heappush(self._queue, (time, next(self._order), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, delay), fn)

    def run(self, until: float = float("inf"), stop: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order until none is left, the next is after `until`, or `stop()`."""
        while self._queue and self._queue[0][0] <= until and not stop():
            time, _, fn = heapq.heappop(self._queue)
            self.now = time
            self.events_run += 1
            fn()

    @property
    def pending(self) -> int:
        return len(self._queue)
