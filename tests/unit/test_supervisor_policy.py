"""`pagemesh up`'s restart decisions (services/supervisor.py), with no processes and no clock."""

from __future__ import annotations

from pagemesh.services.supervisor import RestartPolicy


def test_a_child_that_was_ready_is_started_again_at_once_every_time():
    policy = RestartPolicy(limit=3, window_s=100.0)
    assert [policy.died("mixed-0", True, t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] == [0.0] * 5


def test_deaths_at_start_pause_longer_each_time_and_the_limit_within_the_window_gives_up():
    policy = RestartPolicy(limit=3, window_s=100.0)
    assert policy.died("tokenizer", False, 0.0) == 1.0
    assert policy.died("tokenizer", False, 10.0) == 2.0
    assert policy.died("scheduler", False, 10.0) == 1.0  # counted per child
    assert policy.died("tokenizer", False, 20.0) is None  # the third within 100 s
    assert policy.deaths_at_start("tokenizer") == 3


def test_deaths_at_start_outside_the_window_or_before_a_ready_do_not_count():
    policy = RestartPolicy(limit=3, window_s=100.0)
    assert policy.died("w", False, 0.0) == 1.0
    assert policy.died("w", False, 50.0) == 2.0
    assert policy.died("w", False, 120.0) == 2.0  # the one at 0 s is out of the window: not the third
    assert policy.died("w", True, 160.0) == 0.0  # it got ready since: the slate is clean
    assert policy.died("w", False, 170.0) == 1.0
    assert policy.died("w", False, 171.0) == 2.0
