"""Which GPUs each process of the mesh runs on (pure: no torch; the callers count the devices).

A GPU is named as CUDA_VISIBLE_DEVICES names it (an index, a UUID, a MIG name), so a name can be
handed on to a child process unchanged. Two levels use these functions:

    pagemesh up (services/launcher.py)          visible 0 1 2 3 4 5, workers of -tp 2 x -pp 1
      worker_gpu_groups: disjoint groups  ──▶   mixed-0: 0,1   mixed-1: 2,3   mixed-2: 4,5
      of tp x pp GPUs, round-robin              (a 4th worker shares 0,1 with mixed-0)
                                                  │ CUDA_VISIBLE_DEVICES=0,1
    the worker, rank 0 (tensor_parallel.py)       ▼
      rank_gpus: rank i ─▶ its i-th GPU         rank 0: 0 (cuda:0)   rank 1: 1 (its only GPU)

A worker of tp x pp ranks needs tp x pp distinct GPUs: NCCL refuses two ranks of one group on
one device, so too few is an error at start that names the numbers, never a silent doubling up.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one folder per GPU (its PCI address) while the driver runs


def nvidia_gpu_count(gpus_dir: str = NVIDIA_GPUS_DIR) -> int:
    """The NVIDIA GPUs of this machine as its driver lists them (0 without the driver), counted
    without torch: `pagemesh up` runs no model, and importing torch to ask cuda.device_count()
    cost it ~180 MB of memory for its whole life. CUDA_VISIBLE_DEVICES narrows them
    (`visible_gpu_ids`)."""
    try:
        return sum(1 for entry in os.scandir(gpus_dir) if entry.is_dir())
    except OSError:
        return 0


def visible_gpu_ids(cuda_visible_devices: str | None, device_count: int) -> list[str]:
    """The names of the `device_count` GPUs a process sees, given its CUDA_VISIBLE_DEVICES (None:
    unset, every GPU by index)."""
    listed = [d.strip() for d in (cuda_visible_devices or "").split(",") if d.strip()]
    return listed[:device_count] if listed else [str(i) for i in range(device_count)]


def too_few_gpus(visible: Sequence[str], tp: int, pp: int) -> str | None:
    """Why a worker of `tp` x `pp` ranks cannot run on the `visible` GPUs, or None if it can."""
    need = tp * pp
    if len(visible) >= need:
        return None
    names = ",".join(visible) or "none"
    return (
        f"a worker of -tp {tp} x -pp {pp} runs {need} ranks, one GPU each, but {len(visible)} "
        f"GPU{'s are' if len(visible) != 1 else ' is'} visible ({names}): make {need} visible "
        f"(CUDA_VISIBLE_DEVICES) or lower -tp / -pp"
    )


def rank_gpus(visible: Sequence[str], tp: int, pp: int) -> list[str]:
    """Rank i of a worker -> the GPU it runs on: the worker's i-th visible GPU (rank 0, the
    worker process, uses cuda:0, the first). ValueError, naming the numbers, when too few."""
    reason = too_few_gpus(visible, tp, pp)
    if reason is not None:
        raise ValueError(reason)
    return list(visible[: tp * pp])


def worker_gpu_groups(
    workers: Sequence[str], visible: Sequence[str], tp: int = 1, pp: int = 1, one_gpu: Collection[str] = ()
) -> dict[str, tuple[str, ...]]:
    """Worker -> the GPUs it sees. The `visible` GPUs are cut into disjoint groups of tp x pp (in
    order; a remainder too small for a group goes unused) and the workers take the groups in
    turn; more workers than groups share them, round-robin. A worker in `one_gpu` (a diffusion
    worker: one rank) takes its turn's group's first GPU. No GPUs: {} (the workers run on the
    CPU). ValueError, naming the numbers, when GPUs are visible but fewer than tp x pp."""
    if not visible:
        return {}
    reason = too_few_gpus(visible, tp, pp)
    if reason is not None:
        raise ValueError(reason)
    size = tp * pp
    groups = [tuple(visible[i : i + size]) for i in range(0, len(visible) - size + 1, size)]
    placement = {}
    for i, name in enumerate(workers):
        group = groups[i % len(groups)]
        placement[name] = group[:1] if name in one_gpu else group
    return placement
