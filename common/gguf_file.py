"""One parse of a GGUF file per process.

gguf's reader parses every metadata field eagerly (SmolLM2's 49k-token vocabulary and its merges
field by field): ~4 s on this CPU. A worker reads the same file for its tokenizer, its model
config and its weights, so each parse after the first is taken from here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def read_gguf(path: str | Path) -> Any:
    """The file's `gguf.GGUFReader` (read-only: its tensors are memory-mapped)."""
    return _read(str(Path(path).resolve()))


@functools.lru_cache(maxsize=4)
def _read(path: str) -> Any:
    import gguf  # imported here: only GGUF loading needs it (a GPU image may lack it)

    return gguf.GGUFReader(path)
