"""The torch side of the thread policy: times a CPU worker's steps, reads how long the process's
threads waited for a CPU (Linux schedstat), and sets torch's (and so the C kernels' OpenMP)
thread count between steps, as `ThreadPolicy` decides."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from pagemesh.common.cpu_threads import thread_policy
from pagemesh.workers.shell.thread_policy import ThreadPolicy, ThreadPolicyConfig

T = TypeVar("T")


class StepThreads:
    """Runs steps under a `ThreadPolicy` whose most threads are torch's count when built (what
    the worker was given). `torch.set_num_threads` is called only at a step boundary, and only
    when the count changes, on the thread that runs the steps (OpenMP's count is per thread)."""

    def __init__(
        self,
        max_threads: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        run_delay: Callable[[], float | None] | None = None,
    ):
        self.clock = clock
        self.run_delay = run_delay or process_run_delay
        self.policy = ThreadPolicy(ThreadPolicyConfig(max_threads or torch.get_num_threads()), clock())
        self.current = self.policy.threads
        if torch.get_num_threads() != self.current:  # the policy's count from the first step on
            torch.set_num_threads(self.current)
        self.delay = self.run_delay()

    def run(self, step: Callable[[], T], tokens: Callable[[], int]) -> T:
        """`step()`, timed; `tokens()` is a running count of tokens served, read before and after."""
        before, started = tokens(), self.clock()
        result = step()
        now, delay = self.clock(), self.run_delay()
        # the wait since the last step's end (a thread that exited takes its count along: never < 0)
        waited = None if delay is None or self.delay is None else max(0.0, delay - self.delay)
        self.delay = delay
        wanted = self.policy.observe(now, now - started, tokens() - before, waited)
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
        return result


def process_run_delay() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed (the
    second field of /proc/self/task/*/schedstat); None where the kernel does not say."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat", "rb") as f:
                    total += int(f.read().split()[1])
            except FileNotFoundError:  # the thread ended meanwhile
                continue
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


def step_threads_for(device: torch.device, environ=os.environ) -> StepThreads | None:
    """A StepThreads for a CPU worker under PAGEMESH_THREAD_POLICY=adaptive; None on CUDA (the
    GPU runs the step), under another policy, or with one thread."""
    if device.type != "cpu" or thread_policy(environ) != "adaptive" or torch.get_num_threads() < 2:
        return None
    return StepThreads()
