"""glibc malloc settings for a CPU inference process.

A prefill step allocates activations of megabytes per op (a 2048-token step: ~12 MB for the MLP's
gate/up output alone). glibc serves blocks that large with fresh mmap()s, or grows and trims its
heap around them, so the kernel zero-fills new pages on first touch every step: ~15% of a
2048-token prefill step on a 2-core CPU. Raising the mmap and trim thresholds keeps freed blocks
in the heap for the next step. The cost is address space that stays mapped after a large step
(at most the largest step's working set).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_done = False


def keep_freed_memory_for_reuse() -> bool:
    """Apply the settings once per process; False where this is not glibc (nothing changes)."""
    global _done
    if _done:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        log.warning("mallopt refused a setting; large CPU activations may be re-faulted every step")
    _done = ok
    return ok


def release_freed_memory() -> bool:
    """Give the memory freed so far back to the system (glibc's malloc_trim): once, after a worker
    loaded its model, whose file reading and repacking leave ~50-100 MB of freed temporaries that
    the thresholds above would otherwise keep for the process's life. False where this is not glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose memory comes from its own anonymous mmap: the kernel hands
    out zero pages on first touch, so the tensor costs nothing until it is written and then only
    the pages written. For the KV pool (2 GB by default): `torch.zeros` writes every byte at
    start, 2-20 s per worker on a loaded 2-core machine (each page's first touch is a fault, and
    a mesh starts two workers at once), and makes the whole pool resident before one request
    came. The mapping lives as long as the tensor (torch.frombuffer holds it)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))  # anonymous memory is zero-filled by the kernel
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
