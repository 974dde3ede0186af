"""How `pagemesh up` keeps its processes running, as compose's `restart: unless-stopped` does.

    a child exits ──▶ had it reported READY since it started?
                        yes ──▶ start it again, same arguments (so the same worker id), at once
                        no  ──▶ a death at start: start it again after a pause that doubles each
                                time; the RESTART_LIMIT-th within RESTART_WINDOW_S stops the
                                mesh, and the launcher prints the child's last log lines

A worker started again registers under its id as a new process (a new instance id): the
scheduler ends what the old one held, and the mesh serves on. Each child's stderr (its log)
goes through the launcher, which writes it on and keeps its last TAIL_LINES lines.
`RestartPolicy` is the decision alone (no processes, no clock); `Supervisor` applies it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections import deque
from dataclasses import dataclass, field

from pagemesh.common.python_command import python_module
from pagemesh.services.log_relay import LogRelay

RESTART_LIMIT = 3  # deaths before READY ...
RESTART_WINDOW_S = 300.0  # ... within this long: the child cannot start; the mesh stops
FIRST_PAUSE_S = 1.0  # before starting again a child that died at start; doubles up to MAX_PAUSE_S
MAX_PAUSE_S = 8.0
TAIL_LINES = 30
DRAIN_GRACE_S = 10.0  # beyond --drain-timeout, for a draining group to exit (then SIGINT, SIGKILL)


class KeepsDying(RuntimeError):
    """A child died at start RESTART_LIMIT times within RESTART_WINDOW_S."""


@dataclass
class RestartPolicy:
    """When to start an exited child again. Times are monotonic seconds from the caller."""

    limit: int = RESTART_LIMIT
    window_s: float = RESTART_WINDOW_S
    early_deaths: dict[str, list[float]] = field(default_factory=dict)

    def died(self, name: str, was_ready: bool, now: float) -> float | None:
        """The pause before starting `name` again; None once it keeps dying at start."""
        if was_ready:
            self.early_deaths.pop(name, None)
            return 0.0
        deaths = [t for t in self.early_deaths.get(name, []) if now - t <= self.window_s] + [now]
        self.early_deaths[name] = deaths
        if len(deaths) >= self.limit:
            return None
        return min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** (len(deaths) - 1))

    def deaths_at_start(self, name: str) -> int:
        return len(self.early_deaths.get(name, []))


class Supervisor:
    """Starts the children, relays their logs, and starts again those that exit (`check`).
    `children` (name -> its current process) is shared with the caller."""

    def __init__(
        self,
        children: dict[str, subprocess.Popen],
        policy: RestartPolicy | None = None,
        relay: LogRelay | None = None,
        env: dict[str, str] | None = None,
    ):
        self.children = children
        self.policy = policy or RestartPolicy()
        self.relay = relay or LogRelay()  # each child's lines out whole, and its last ones kept
        self.env = env or {}  # for every child
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.tails: dict[str, deque[str]] = {}
        self.ready: set[str] = set()
        self.due: dict[str, float] = {}  # exited children -> when to start them again
        self.restarts = 0

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Start `pagemesh ARGV` as the child `name` (again, with the same command, via `check`)."""
        self.commands[name] = (argv, env or {})
        self.ready.discard(name)
        proc = subprocess.Popen(
            [*python_module("pagemesh.services.cli"), *argv],
            env={**os.environ, **self.env, **(env or {})},
            stderr=subprocess.PIPE,
        )
        self.relay.attach(proc, self.tails.setdefault(name, deque(maxlen=TAIL_LINES)))
        self.children[name] = proc

    def mark_ready(self, name: str) -> None:
        self.ready.add(name)

    def check(self, now: float) -> list[str]:
        """Notice exited children and start again those that are due; returns what it did, in
        words. Raises KeepsDying (with the child's log tail) when one cannot start."""
        said = []
        for name, proc in self.children.items():
            if name in self.due or proc.poll() is None:
                continue
            pause = self.policy.died(name, name in self.ready, now)
            if pause is None:
                raise KeepsDying(
                    f"{name} exited with code {proc.returncode} before it was ready, "
                    f"{self.policy.deaths_at_start(name)} times in a row; its last log lines:\n" + self.tail(name)
                )
            self.due[name] = now + pause
            said.append(f"{name} exited with code {proc.returncode}; starting it again in {pause:.0f}s")
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                self.spawn(name, *self.commands[name])
                self.restarts += 1
        return said

    def tail(self, name: str) -> str:
        return "".join(self.tails.get(name, ()))


async def drain_in_order(
    children: dict[str, subprocess.Popen], groups: list[list[str]], timeout: float, hurry: asyncio.Event
) -> None:
    """SIGTERM each group of children in turn, and wait (up to `timeout` + DRAIN_GRACE_S) for it
    to exit before the next: the gateways stop admitting and finish what is in flight, then the
    workers finish what they hold, then the rest go. Returns early once `hurry` is set (a second
    SIGTERM): the caller then stops what is left at once."""
    for group in groups:
        procs = [children[name] for name in group if name in children]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + timeout + DRAIN_GRACE_S
        while any(p.poll() is None for p in procs) and asyncio.get_running_loop().time() < deadline:
            try:
                await asyncio.wait_for(hurry.wait(), 0.1)
                return
            except TimeoutError:
                pass
