"""Stand-in for the stage ILP: split a sequence of layers into contiguous stages.

STAND-IN: the pipeline issue's stage ILP (``autopar/planner/stage_partition.py``) replaces this
through :class:`autopar.planner.components.Components`.

Problem: layers ``0..n-1`` with costs ``c_i >= 0``; choose ``k`` non-empty contiguous stages to

    minimize  max_j  sum_{i in stage j} c_i

:class:`MinMaxContiguousSplit` solves it exactly: the optimum is one of the O(n^2) contiguous
sums; bisection over their sorted values with the greedy feasibility test (pack layers left to
right while the stage stays <= X; feasible iff at most k stages) finds the smallest feasible X,
and the greedy packing at X is refined to exactly k stages by splitting the longest stages
(splitting never raises the maximum).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol, Sequence

__all__ = ["StagePartitioner", "MinMaxContiguousSplit"]


class StagePartitioner(Protocol):
    name: str

    def split(self, layer_costs: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
        """Inclusive (first, last) layer index of each of ``num_stages`` non-empty stages."""
        ...


class MinMaxContiguousSplit:
    """STAND-IN for the stage ILP: the exact min-max contiguous partition (see module doc)."""

    name = "min-max contiguous split (stand-in)"

    def split(self, layer_costs: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
        n = len(layer_costs)
        if not 1 <= num_stages <= n:
            raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages; "
                             f"use at most {n} stages")
        costs = [max(float(c), 0.0) for c in layer_costs]
        prefix = [0.0, *accumulate(costs)]
        sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
        lo, hi = 0, len(sums) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if len(_greedy(costs, sums[mid])) <= num_stages:
                hi = mid
            else:
                lo = mid + 1
        stages = _greedy(costs, sums[lo])
        while len(stages) < num_stages:  # split the widest splittable stage
            i = max((j for j, (a, b) in enumerate(stages) if b > a),
                    key=lambda j: (stages[j][1] - stages[j][0], -j))
            a, b = stages[i]
            stages[i:i + 1] = [(a, b - 1), (b, b)]
        return tuple(stages)


def _greedy(costs: list[float], limit: float) -> list[tuple[int, int]]:
    stages: list[tuple[int, int]] = []
    start, total = 0, 0.0
    eps = 1e-12 * max(limit, 1.0)
    for i, c in enumerate(costs):
        if i > start and total + c > limit + eps:
            stages.append((start, i - 1))
            start, total = i, 0.0
        total += c
    stages.append((start, len(costs) - 1))
    return stages
