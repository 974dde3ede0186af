"""services/scheduler/pause.py: a pause of the scheduler process, found once by whichever of its
loops runs first after it."""

from pagemesh.services.scheduler.pause import PauseClock


def test_a_tick_late_by_more_than_an_interval_is_a_pause_excused_once():
    clock = PauseClock(1.0, now=100.0)
    assert clock.overslept(101.5) == 0.0  # due at 101: late by half an interval (a busy loop)
    clock.sleeping(101.5)  # due at 102.5
    assert clock.overslept(104.0) == 1.5  # a message read first after the pause
    assert clock.overslept(104.1) == 0.0  # the tick right after it: already excused
    clock.sleeping(104.1)
    assert clock.overslept(105.2) == 0.0


def test_a_message_read_while_the_tick_sleeps_is_no_pause():
    clock = PauseClock(1.25, now=0.0)
    assert [clock.overslept(t) for t in (0.1, 1.0, 1.25, 2.5)] == [0.0] * 4
