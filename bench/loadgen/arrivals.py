"""When requests arrive: gaps between arrivals for a target request rate.

With `burstiness` b the gaps follow a gamma distribution of shape b and mean 1/rate (scale
1/(rate*b)): b = 1 is a Poisson process, b < 1 burstier, b > 1 more regular. An infinite rate
means every request is sent at once (a concurrency cap, if any, then paces them).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator


def arrival_gaps(rate: float, burstiness: float = 1.0, rng: random.Random | None = None) -> Iterator[float]:
    """Endless seconds between consecutive arrivals; the first request waits one gap too."""
    if not rate > 0:
        raise ValueError("request-rate: must be > 0 (inf sends all at once)")
    if not burstiness > 0:
        raise ValueError("burstiness: must be > 0")
    if math.isinf(rate):
        return itertools.repeat(0.0)
    rng = rng or random.Random()
    scale = 1.0 / (rate * burstiness)
    return (rng.gammavariate(burstiness, scale) for _ in itertools.count())


def arrival_times(rate: float, burstiness: float = 1.0, rng: random.Random | None = None) -> Iterator[float]:
    """Endless arrival times in seconds from the start (running sums of the gaps)."""
    return itertools.accumulate(arrival_gaps(rate, burstiness, rng))
