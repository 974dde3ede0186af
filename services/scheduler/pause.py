"""Whether the scheduler process itself did not run for a while (SIGSTOP, starved of CPU). Pure
Python. The expiry tick is due every interval; a loop that runs more than one more interval
after it was due finds a pause. The heartbeats of that time wait in the socket, unread: the
pause is not the workers' silence, and whichever loop runs first after it (the tick, or a
message read before the tick) has it excused, once.
"""

from __future__ import annotations


class PauseClock:
    def __init__(self, interval: float, now: float):
        self.interval = interval
        self.due = now + interval  # when the expiry tick should next run

    def sleeping(self, now: float) -> None:
        """The tick goes to sleep for an interval at `now`."""
        self.due = now + self.interval

    def overslept(self, now: float) -> float:
        """The seconds of a pause that ended by `now` and was not yet excused; 0.0 if none."""
        late = now - self.due
        if late <= self.interval:
            return 0.0
        self.due = now
        return late
