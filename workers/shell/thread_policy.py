"""How many threads a CPU worker's next step runs: the count whose steps measured faster.

The best count is not the number of cores: when other processes want those cores, a step's
threads wait for each other at every parallel region while one of them is descheduled, and
fewer threads finish sooner. No setting chosen at start is right on a machine whose load
changes, so the policy measures. It runs windows of steps at the current count; now and then
(and at once when the throughput moves a lot at the same batch shape: the machine changed) it
runs one window at a neighbouring count (half or double) and keeps whichever served more tokens
per second of step time. A probe that loses doubles the wait before the next one (up to
`max_backoff`), so a quiet machine pays for a probe rarely.

    measure(n) ──window──▶ due, or the rate moved? ──no──▶ measure(n)
                                  │ yes
                                  ▼
                            probe(n') ──window──▶ n' faster by win_margin? ──▶ measure(n') or measure(n)

Two windows are compared only when their mean tokens per step are alike (`shape_tolerance`):
a decode step of 8 rows serves more tokens per second than one of 1 at any thread count. Fewer
threads are probed only when the window shows contention, where the caller can tell: its threads
waited in the run queue (the kernel's schedstat) for at least `contention_share` of its step
time, so a quiet machine pays for no probe at all.
Pure logic: no torch, no clock of its own (the caller passes `now`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadPolicyConfig:
    """The policy's knobs. `max_threads` is the most it uses (the worker's `--threads`)."""

    max_threads: int
    window_steps: int = 4  # a window holds at least this many steps ...
    window_seconds: float = 0.2  # ... and at least this much step time
    probe_every_seconds: float = 4.0  # from one probe to the next, times the backoff
    max_backoff: int = 8
    win_margin: float = 0.05  # a probe must serve this much more tokens/s to be kept
    shape_tolerance: float = 0.25  # mean tokens/step of two compared windows differ by at most this share
    change_ratio: float = 1.4  # same shape, rate this many times higher or lower: probe now
    contention_share: float = 0.05  # run-queue wait / step time that lets fewer threads be probed

    def __post_init__(self) -> None:
        if self.max_threads < 1:
            raise ValueError("max_threads: must be >= 1")


@dataclass
class Window:
    """Steps run at one thread count: their count, tokens and step time (seconds)."""

    threads: int
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    waited: float | None = 0.0  # seconds its threads waited for a CPU; None: not known

    @property
    def rate(self) -> float:
        """Tokens per second of step time."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def alike(self, other: Window, tolerance: float) -> bool:
        """Whether the two windows ran steps of about the same size (comparable rates)."""
        a, b = self.tokens_per_step, other.tokens_per_step
        return abs(a - b) <= tolerance * max(a, b)


class ThreadPolicy:
    """`observe()` each step's duration and tokens; it returns the thread count for the next
    step. `threads` is the count chosen (a probe's count runs only for its window)."""

    def __init__(self, config: ThreadPolicyConfig, now: float):
        self.config = config
        self.threads = config.max_threads
        self.window = Window(self.threads)
        self.baseline: Window | None = None  # the last full window at `threads`
        self.probing = False
        self.backoff = 1
        self.downward = True  # the next probe tries fewer threads (where both neighbours exist)
        self.next_probe = now + config.probe_every_seconds
        self.probes = 0
        self.switches = 0

    def observe(self, now: float, seconds: float, tokens: int, waited: float | None = None) -> int:
        """Record a step that ran `seconds` over `tokens` tokens at the count this returned last
        (`max_threads` at first), its threads having waited `waited` seconds for a CPU (None: not
        known, so contention is assumed possible); return the count for the next step."""
        w = self.window
        w.steps += 1
        w.tokens += tokens
        w.seconds += seconds
        w.waited = None if w.waited is None or waited is None else w.waited + waited
        if w.steps >= self.config.window_steps and w.seconds >= self.config.window_seconds:
            if self.probing:
                self._judge(w, now)
            else:
                self._measured(w, now)
        return self.window.threads

    def _measured(self, w: Window, now: float) -> None:
        cfg, previous = self.config, self.baseline
        self.baseline = w
        moved = (
            previous is not None
            and previous.rate > 0
            and w.alike(previous, cfg.shape_tolerance)
            and not 1 / cfg.change_ratio <= w.rate / previous.rate <= cfg.change_ratio
        )
        if moved:
            self.backoff = 1
        candidate = self._candidate(w) if moved or now >= self.next_probe else None
        if candidate is None:
            if now >= self.next_probe:  # nothing to try now: look again later
                self.next_probe = now + cfg.probe_every_seconds
            self.window = Window(self.threads)
            return
        self.probing = True
        self.probes += 1
        self.window = Window(candidate)

    def _judge(self, probe: Window, now: float) -> None:
        cfg, base = self.config, self.baseline
        self.probing = False
        if base is None or not probe.alike(base, cfg.shape_tolerance):
            self.next_probe = now  # the load changed meanwhile: measure again, then retry
        elif probe.rate > base.rate * (1 + cfg.win_margin):
            self.threads = probe.threads
            self.baseline = probe
            self.backoff = 1
            self.switches += 1
            self.next_probe = now + cfg.probe_every_seconds
        else:
            self.backoff = min(self.backoff * 2, cfg.max_backoff)
            self.downward = not self.downward  # try the other neighbour next time
            self.next_probe = now + cfg.probe_every_seconds * self.backoff
        self.window = Window(self.threads)

    def _candidate(self, w: Window) -> int | None:
        """The neighbouring count to probe: half `threads` if `w` shows contention, or double
        (within 1..max_threads)."""
        contended = w.waited is None or w.waited >= self.config.contention_share * w.seconds
        down = self.threads // 2 if self.threads > 1 and contended else None
        up = min(self.config.max_threads, self.threads * 2) if self.threads < self.config.max_threads else None
        if down is not None and up is not None:
            return down if self.downward else up
        return down if down is not None else up
