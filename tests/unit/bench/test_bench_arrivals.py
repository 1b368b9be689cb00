"""Arrival processes: all at once, or seeded Poisson."""

from __future__ import annotations

import itertools
import math

import pytest

from bench.serve.arrivals import arrival_offsets, parse_rate


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(4, math.inf, seed=0) == [0.0, 0.0, 0.0, 0.0]
    assert arrival_offsets(0, 2.0, seed=0) == []


def test_poisson_is_seeded_increasing_and_has_the_rate() -> None:
    a = arrival_offsets(5000, 20.0, seed=1)
    assert a == arrival_offsets(5000, 20.0, seed=1)
    assert a != arrival_offsets(5000, 20.0, seed=2)
    assert a[0] == 0.0
    assert all(x < y for x, y in itertools.pairwise(a))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(1 / 20.0, rel=0.05)


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)
    with pytest.raises(ValueError):
        parse_rate("-1")
    assert parse_rate("inf") == math.inf
    assert parse_rate("2.5") == 2.5
