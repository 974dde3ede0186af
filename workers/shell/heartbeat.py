"""Heartbeats that a long step cannot hold up.

    [event loop]   every interval: LoadSnapshot(load, finished, at=now) ──▶ shared slot
    [engine]       step_started = t ... step ... step_started = None   ──▶ shared slot
    [this thread]  every interval: Heartbeat(snapshot, busy_s) ──ThreadDealer──▶ scheduler

On a CPU the step runs on the event loop's thread, so a heartbeat sent from that loop waits for
the step to end: one step longer than the scheduler's heartbeat timeout (a loaded machine, a
long prefill) got a healthy worker dropped and its requests failed. This thread sends instead,
on a socket of its own, and torch releases the GIL while it computes, so the heartbeats go on.

What keeps a worker whose step never ends from looking alive forever: each heartbeat says how
long the worker has been busy (`busy_s`): the age of the step in progress, or how long the
event loop has not refreshed its snapshot (a loop blocked outside a step). The scheduler drops a
worker busy longer than its --step-timeout. A stopped process (SIGSTOP, a hang in C with the GIL
held) sends nothing, and the heartbeat timeout drops it as before.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pagemesh.common.messages import Heartbeat
from pagemesh.common.transport import ThreadDealer
from pagemesh.workers.shell.backend import Load


@dataclass(frozen=True)
class LoadSnapshot:
    """What the event loop last saw, and when (monotonic)."""

    load: Load
    requests_finished: int
    at: float


class LivenessState:
    """The slots the event loop and the engine write and the heartbeat thread reads. Each is
    one reference, replaced whole (a read sees the old or the new value, never half of one)."""

    def __init__(self, load: Load) -> None:
        self.snapshot = LoadSnapshot(load, 0, time.monotonic())
        self.step_started: float | None = None

    def busy_s(self, now: float, interval: float) -> float:
        """How long the worker has been inside one step, or its loop has not turned (beyond the
        refresh interval); 0 when neither."""
        step_started = self.step_started
        step_age = now - step_started if step_started is not None else 0.0
        loop_silence = now - self.snapshot.at - interval
        return max(0.0, step_age, loop_silence)


class HeartbeatThread:
    """Sends the worker's heartbeat every `interval` seconds from a daemon thread, until `stop()`."""

    def __init__(self, scheduler_address: str, worker_id: str, state: LivenessState, interval: float) -> None:
        self.worker_id = worker_id
        self.state = state
        self.interval = interval
        self.stopped = threading.Event()
        # its own identity on the scheduler's Router: the worker's id is its control socket's
        self.socket = ThreadDealer(scheduler_address, f"{worker_id}.heartbeat")
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5 * self.interval + 1)
        self.socket.close()

    def _run(self) -> None:
        while not self.stopped.is_set():
            now = time.monotonic()
            snap = self.state.snapshot
            self.socket.send(
                Heartbeat(
                    worker_id=self.worker_id,
                    running=snap.load.running,
                    waiting=snap.load.waiting,
                    time=time.time(),
                    requests_finished=snap.requests_finished,
                    kv=snap.load.kv,
                    produced=snap.load.produced,
                    feature_cache=snap.load.feature_cache,
                    speculation=snap.load.speculation,
                    lora=snap.load.lora,
                    busy_s=float(self.state.busy_s(now, self.interval)),
                )
            )
            self.stopped.wait(self.interval)
