"""LogLimiter: which repeated warnings are written, and the count of those left out."""

from pagemesh.common.log_limit import LogLimiter


def test_a_burst_is_written_then_silence_until_the_interval_ends_and_the_next_line_counts_the_rest():
    limit = LogLimiter(burst=3, interval_s=10.0)
    decisions = [limit.admit("malformed", now) for now in (0.0, 0.1, 0.2, 0.3, 5.0, 9.9)]
    assert decisions == [0, 0, 0, None, None, None]
    assert limit.admit("malformed", 10.0) == 3  # a new interval: written, saying 3 were left out
    assert limit.admit("malformed", 10.1) == 0
    assert limit.admit("malformed", 25.0) == 0  # nothing was left out of the last interval


def test_kinds_are_limited_apart():
    limit = LogLimiter(burst=1, interval_s=10.0)
    assert limit.admit("no keys", 0.0) == 0
    assert limit.admit("no keys", 1.0) is None
    assert limit.admit("wrong key", 1.0) == 0
    assert limit.admit("wrong key", 2.0) is None
    assert limit.admit("no keys", 11.0) == 1
