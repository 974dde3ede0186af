"""pagemesh.bench.loadgen.arrivals: gap statistics of the arrival process with a seeded RNG."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pagemesh.bench.loadgen.arrivals import arrival_gaps, arrival_times

N = 20000


def _gaps(rate, burstiness, seed=0):
    return list(itertools.islice(arrival_gaps(rate, burstiness, random.Random(seed)), N))


@pytest.mark.parametrize("rate, burstiness", [(4.0, 1.0), (10.0, 0.25), (0.5, 4.0)])
def test_gap_mean_is_one_over_rate_and_cv_is_one_over_sqrt_burstiness(rate, burstiness):
    gaps = _gaps(rate, burstiness)
    mean = statistics.fmean(gaps)
    cv = statistics.pstdev(gaps) / mean
    # Standard error of the mean is cv/sqrt(N) of it: <= 1.5% here; 5 sigma bounds.
    assert mean == pytest.approx(1 / rate, rel=5 * (1 / math.sqrt(burstiness)) / math.sqrt(N))
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_arrivals_in_unit_windows_have_mean_equal_variance():
    times = list(itertools.takewhile(lambda t: t < 2000, arrival_times(5.0, 1.0, random.Random(1))))
    counts = [0] * 2000
    for t in times:
        counts[int(t)] += 1
    assert statistics.fmean(counts) == pytest.approx(5.0, rel=0.03)
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, rel=0.1)


def test_seeded_and_cumulative():
    assert _gaps(3.0, 1.0, seed=5)[:10] == _gaps(3.0, 1.0, seed=5)[:10]
    gaps = _gaps(3.0, 1.0, seed=5)[:10]
    times = list(itertools.islice(arrival_times(3.0, 1.0, random.Random(5)), 10))
    assert times == pytest.approx(list(itertools.accumulate(gaps)))


def test_infinite_rate_sends_at_once_and_bad_values_are_refused():
    assert list(itertools.islice(arrival_times(math.inf), 4)) == [0.0] * 4
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_gaps(rate, b)
