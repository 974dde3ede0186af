"""How often a repeated warning is written: at most `burst` lines of a kind per `interval_s`,
then silence until the interval ends, and the next line says how many were left out.

A peer that floods a socket with malformed messages, or one without keys that reconnects ten
times a second, must not fill the disk or bury the other lines of the log; the counts stay
exact (the caller counts every event, this only decides which ones are written). Pure: the
caller passes the clock."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Window:
    started: float
    written: int = 0
    left_out: int = 0


@dataclass
class LogLimiter:
    """`admit(kind, now)` -> None (leave this event out of the log) or the number of events of
    that kind left out since its last written line (0 when none was)."""

    burst: int
    interval_s: float
    _windows: dict[str, _Window] = field(default_factory=dict)

    def admit(self, kind: str, now: float) -> int | None:
        window = self._windows.get(kind)
        if window is None or now - window.started >= self.interval_s:
            left_out = window.left_out if window is not None else 0
            self._windows[kind] = _Window(started=now, written=1)
            return left_out
        if window.written < self.burst:
            window.written += 1
            return 0
        window.left_out += 1
        return None
