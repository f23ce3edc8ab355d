"""The stage split stand-in (until the stage ILP lands) equals brute-force enumeration."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.planner.stage_split import MinMaxContiguousSplit


def brute_force(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_min_max_split_equals_enumeration():
    rng = random.Random(7)
    split = MinMaxContiguousSplit()
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.uniform(0, 10), float(rng.randint(1, 4))]) for _ in range(n)]
        stages = split.split(costs, k)
        assert len(stages) == k
        assert stages[0][0] == 0 and stages[-1][1] == n - 1
        assert all(b[0] == a[1] + 1 and a[0] <= a[1] for a, b in zip(stages, stages[1:]))
        worst = max(sum(costs[a:b + 1]) for a, b in stages)
        assert worst == pytest.approx(brute_force(costs, k)), (costs, k, stages)


def test_too_many_stages():
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4"):
        MinMaxContiguousSplit().split([1, 2, 3], 4)
