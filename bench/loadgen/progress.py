"""A progress bar: tqdm when installed, else a plain one on stderr."""

from __future__ import annotations

import sys
import time


class _Plain:
    def __init__(self, total: int | None, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self._shown = 0.0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._shown >= 0.5 or self.n == self.total:
            self._shown = now
            of = f"/{self.total}" if self.total else ""
            width = 30
            bar = "#" * (width * self.n // self.total) if self.total else ""
            sys.stderr.write(f"\r{self.desc} [{bar:<{width if self.total else 0}}] {self.n}{of}")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, enabled: bool = True):
    """An object with `update(n)` and `close()`."""
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr)
