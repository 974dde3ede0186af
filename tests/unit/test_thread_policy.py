"""The adaptive thread count (workers/shell/thread_policy.py) and the OpenMP environment a
worker sets before torch loads (common/cpu_threads.py): exact decisions, no clock, no torch."""

from __future__ import annotations

import pytest

from pagemesh.common.cpu_threads import openmp_waits, prepare_worker_threads, thread_policy
from pagemesh.workers.shell.thread_policy import ThreadPolicy, ThreadPolicyConfig

# windows of 2 steps whatever their duration; a probe is due 10 s after the last decision
CONFIG = ThreadPolicyConfig(max_threads=2, window_steps=2, window_seconds=0.0, probe_every_seconds=10.0)


class Clock:
    """Steps back to back: `now` advances by each step's duration."""

    def __init__(self, policy: ThreadPolicy, now: float = 0.0):
        self.policy, self.now = policy, now

    def steps(self, n: int, seconds: float, tokens: int = 1) -> list[int]:
        """Run n steps of `seconds` each; the counts the policy returned after each."""
        out = []
        for _ in range(n):
            self.now += seconds
            out.append(self.policy.observe(self.now, seconds, tokens))
        return out


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_less_often():
    policy = ThreadPolicy(CONFIG, now=0.0)
    clock = Clock(policy)
    assert clock.steps(4, 1.0) == [2, 2, 2, 2]  # windows end at 2 s and 4 s: no probe due yet
    assert clock.steps(6, 1.0) == [2, 2, 2, 2, 2, 1]  # the window ending at 10 s starts a probe at 1 thread
    assert policy.probing and policy.probes == 1
    assert clock.steps(2, 1.8) == [1, 2]  # 1 thread: 0.56 tokens/s against 1.0: back to 2
    assert (policy.threads, policy.switches, policy.backoff) == (2, 0, 2)
    assert policy.next_probe == pytest.approx(13.6 + 20.0)  # the wait doubled
    assert clock.steps(20, 1.0)[-1] == 1  # the window ending at 33.6 s probes again
    assert clock.steps(2, 1.8) == [1, 2]
    assert policy.backoff == 4


def test_oversubscribed_threads_give_way_to_fewer():
    policy = ThreadPolicy(CONFIG, now=0.0)
    clock = Clock(policy)
    assert clock.steps(10, 1.0)[-1] == 1
    assert clock.steps(2, 0.5) == [1, 1]  # 1 thread serves twice the tokens/s: kept
    assert (policy.threads, policy.switches, policy.backoff) == (1, 1, 1)
    assert policy.baseline is not None and policy.baseline.threads == 1
    assert clock.steps(4, 0.5) == [1, 1, 1, 1]


def test_a_probe_must_win_by_the_margin():
    policy = ThreadPolicy(CONFIG, now=0.0)
    clock = Clock(policy)
    clock.steps(10, 1.0)
    assert clock.steps(2, 0.96) == [1, 2]  # 4% faster: within the 5% margin, not worth a switch
    assert policy.threads == 2


def test_when_the_rate_moves_at_the_same_shape_it_probes_at_once():
    policy = ThreadPolicy(CONFIG, now=0.0)
    clock = Clock(policy)
    clock.steps(10, 1.0)
    clock.steps(2, 0.5)  # now at 1 thread, next probe due at 21 s
    assert policy.threads == 1 and policy.next_probe == pytest.approx(21.0)
    assert clock.steps(2, 0.5) == [1, 1]  # same rate: no probe
    assert clock.steps(2, 0.3) == [1, 2]  # 1.67x faster (the hogs left): probe 2 threads now, at 12.6 s
    assert clock.steps(2, 0.1) == [2, 2]  # and 2 threads win
    assert (policy.threads, policy.switches) == (2, 2)


def test_a_probe_over_a_differently_sized_batch_decides_nothing():
    policy = ThreadPolicy(CONFIG, now=0.0)
    clock = Clock(policy)
    clock.steps(10, 1.0, tokens=1)
    assert clock.steps(2, 1.0, tokens=8) == [1, 2]  # 8 tokens a step against 1: not comparable
    assert (policy.threads, policy.switches, policy.backoff) == (2, 0, 1)
    assert policy.next_probe == pytest.approx(12.0)  # retried after the next window at 2 threads
    assert clock.steps(2, 1.0, tokens=8) == [2, 1]


def test_the_window_needs_its_step_time_as_well_as_its_steps():
    config = ThreadPolicyConfig(max_threads=2, window_steps=2, window_seconds=0.5, probe_every_seconds=0.0)
    policy = ThreadPolicy(config, now=0.0)
    clock = Clock(policy)
    assert clock.steps(5, 0.1) == [2, 2, 2, 2, 1]  # 5 steps make 0.5 s


def test_many_cores_climb_down_by_halves_and_turn_back_up_after_a_loss():
    config = ThreadPolicyConfig(max_threads=8, window_steps=1, window_seconds=0.0, probe_every_seconds=1.0)
    policy = ThreadPolicy(config, now=0.0)
    clock = Clock(policy)
    assert clock.steps(1, 1.0) == [4]  # due at 1 s: half of 8
    assert clock.steps(1, 0.5) == [4]  # 4 won
    assert clock.steps(1, 0.5) == [4]  # measured at 4; next due at 2.5 s
    assert clock.steps(1, 0.5) == [2]  # the same direction: 2
    assert clock.steps(1, 0.6) == [4]  # 2 lost: back at 4, the wait doubled (next at 5.1 s)
    assert clock.steps(4, 0.5) == [4, 4, 4, 8]  # and the next probe goes the other way
    assert clock.steps(1, 0.55) == [4]  # 8 lost too
    assert (policy.threads, policy.probes, policy.switches, policy.backoff) == (4, 3, 1, 4)


def test_fewer_threads_are_probed_only_when_the_threads_waited_for_a_cpu():
    policy = ThreadPolicy(CONFIG, now=0.0)
    quiet = [policy.observe(float(t), 1.0, 1, waited=0.04) for t in range(1, 21)]  # 4% of step time waiting
    assert quiet == [2] * 20 and policy.probes == 0
    assert policy.next_probe == pytest.approx(30.0)  # looked at 10 s and 20 s: nothing to try, looks again
    assert [policy.observe(float(t), 1.0, 1, waited=0.04) for t in range(21, 29)] == [2] * 8
    assert [policy.observe(float(t), 1.0, 1, waited=0.06) for t in (29, 30)] == [2, 1]  # 6% of 2 s: contended
    assert policy.probes == 1


def test_one_thread_has_nothing_to_probe():
    policy = ThreadPolicy(ThreadPolicyConfig(max_threads=1, window_steps=1, window_seconds=0.0), now=0.0)
    assert Clock(policy).steps(50, 1.0) == [1] * 50
    assert policy.probes == 0


def test_openmp_waits_are_passive_unless_the_user_chose_or_asked_for_the_old_behaviour():
    assert openmp_waits({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_waits({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_waits({"GOMP_SPINCOUNT": "10000"}) == {}
    assert openmp_waits({"PAGEMESH_THREAD_POLICY": "fixed"}) == {}
    assert thread_policy({"PAGEMESH_THREAD_POLICY": " Fixed "}) == "fixed"
    assert thread_policy({}) == "passive"
    assert openmp_waits({"PAGEMESH_THREAD_POLICY": "adaptive"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    with pytest.raises(ValueError, match="must be one of passive, adaptive, fixed, not 'spin'"):
        thread_policy({"PAGEMESH_THREAD_POLICY": "spin"})


def test_prepare_worker_threads_refuses_once_torch_has_loaded_openmp():
    import torch  # noqa: F401  (loaded: OpenMP has read its environment)

    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="torch is already imported"):
        prepare_worker_threads(environ)
    assert environ == {}
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    prepare_worker_threads(environ)  # nothing to set: fine whenever
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_step_threads_sets_torchs_count_between_steps_as_the_policy_decides():
    import torch

    from pagemesh.workers.shell.step_threads import StepThreads

    before = torch.get_num_threads()
    now, seen = [0.0], []

    def step() -> None:  # an oversubscribed machine: a step takes 0.125 s at 2 threads, 0.0625 s at 1
        seen.append(torch.get_num_threads())
        now[0] += 0.125 if seen[-1] == 2 else 0.0625

    try:
        # the default ThreadPolicyConfig; the threads wait for a CPU a tenth of the time: contended
        threads = StepThreads(max_threads=2, clock=lambda: now[0], run_delay=lambda: now[0] / 10)
        for _ in range(40):
            threads.run(step, lambda: len(seen))  # a token a step
        # windows of 4 steps (>= 0.2 s); the probe is due at 4 s (after step 32); 1 thread wins
        assert seen == [2] * 32 + [1] * 8
        assert (threads.current, threads.policy.switches) == (1, 1)
    finally:
        torch.set_num_threads(before)


def test_the_run_queue_wait_is_read_from_the_kernel():
    from pagemesh.workers.shell.step_threads import process_run_delay

    first = process_run_delay()
    assert first is not None and first >= 0.0  # Linux with schedstat (every CI runner)
    assert process_run_delay() >= first
