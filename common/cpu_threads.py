"""How a worker process's CPU threads wait and how many it runs: the choice, made before torch loads.

torch and the C kernels (kernels/cpu/) share one OpenMP runtime (GNU libgomp), which reads its
environment once, when it is loaded, that is when torch is imported. By default its threads
spin at the end of every parallel region waiting for the next one. On a machine where anything
else wants a core, a spinning thread holds the core that the thread it waits for needs, and a
2-thread worker lost 96-99% of its speed beside two CPU hogs (issue 36). So a worker process
sets `OMP_WAIT_POLICY=PASSIVE` (threads sleep at once) before it imports torch, unless the user
set OpenMP's wait policy themselves.

    PAGEMESH_THREAD_POLICY   passive (default): passive waits, the thread count the worker was
                             given; adaptive: passive waits, and the step loop adapts the count
                             (`pagemesh.workers.shell.thread_policy`; with OMP_WAIT_POLICY=ACTIVE
                             set as well, the spin is back and the count guards against collapse);
                             fixed: the old behaviour (OpenMP's default spin-waits, a fixed count)

docs/perf/threads.md has the measurements behind the default. No torch here: the launcher
imports this module."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

THREAD_POLICY_ENV = "PAGEMESH_THREAD_POLICY"
THREAD_POLICIES = ("passive", "adaptive", "fixed")
# set unless the user set either: OMP_WAIT_POLICY, or GOMP_SPINCOUNT (libgomp's finer form of it)
PASSIVE_WAITS = {"OMP_WAIT_POLICY": "PASSIVE"}
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit),
    not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def thread_policy(environ: Mapping[str, str] = os.environ) -> str:
    """`passive`, `adaptive` or `fixed`, from PAGEMESH_THREAD_POLICY (ValueError for another value)."""
    policy = environ.get(THREAD_POLICY_ENV, "passive").strip().lower() or "passive"
    if policy not in THREAD_POLICIES:
        raise ValueError(f"{THREAD_POLICY_ENV}: must be one of {', '.join(THREAD_POLICIES)}, not {policy!r}")
    return policy


def openmp_waits(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The OpenMP variables a worker process adds to its environment: passive waits, unless the
    user chose a wait policy; nothing under the fixed policy."""
    if thread_policy(environ) == "fixed" or any(name in environ for name in USER_WAIT_SETTINGS):
        return {}
    return dict(PASSIVE_WAITS)


def prepare_worker_threads(environ: MutableMapping[str, str] = os.environ) -> None:
    """Call first thing in a worker process's entry, before torch is imported: sets the OpenMP
    waits (and so passes them to rank processes it starts). RuntimeError if torch is already
    loaded, since OpenMP would not read them then."""
    waits = openmp_waits(environ)
    if waits and "torch" in sys.modules:
        raise RuntimeError("prepare_worker_threads: torch is already imported; OpenMP read its environment")
    environ.update(waits)
