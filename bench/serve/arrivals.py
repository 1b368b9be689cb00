"""When each conversation starts, as offsets in seconds from the start of the run.

``rate = inf`` sends everything at once (a throughput test: the server's queue does the pacing).
A finite rate is a Poisson process: exponential gaps with mean ``1 / rate``, seeded so two runs
(or two systems) see exactly the same arrival times. A cap on concurrency is not an arrival
process: the driver applies it on top (a conversation waits for a free seat before it is sent).
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Start offsets of ``n`` conversations: all zero for ``rate = inf``, else Poisson arrivals.

    The first arrival is at 0 so a run never starts with idle time.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def parse_rate(text: str) -> float:
    """``"inf"`` or a positive number of requests per second (the CLI's ``--request-rate``)."""
    rate = float(text)
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return rate
