"""`pagemesh up`'s children write their logs into pipes; the launcher relays them whole.

Several processes writing to one terminal or pipe may split each other's lines: a write of more
than PIPE_BUF (4 KiB) bytes is not atomic, and a record with a traceback or a large value is
longer than that, so a line could hold pieces of two records (issue 20 saw two JSON objects on
one line). Here each child has its own pipe; one thread per child reads whole lines from it, and
every line goes out with one write under one lock, so lines never mix.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from typing import IO


class LogRelay:
    """Relay each attached process's stderr to `out`, line by line."""

    def __init__(self, out: IO[bytes] | None = None):
        self._out = out if out is not None else sys.stderr.buffer
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def attach(self, proc: subprocess.Popen, tail: deque[str] | None = None) -> None:
        """`proc` was started with stderr=PIPE (bytes). `tail` keeps its last lines (decoded)."""
        thread = threading.Thread(target=self._relay, args=(proc.stderr, tail), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _relay(self, pipe: IO[bytes], tail: deque[str] | None) -> None:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):  # the process ended mid-line
                line += b"\n"
            if tail is not None:
                tail.append(line.decode("utf-8", "replace"))
            with self._lock:
                self._out.write(line)
                self._out.flush()
        pipe.close()

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until every child's last lines are out; call after they exited."""
        for thread in self._threads:
            thread.join(timeout)
