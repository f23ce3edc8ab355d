"""The cost model against published Megatron-LM runs (benchmarks/published_runs.py): three of its
eighteen rows, one per kind (data parallel alone, a deep pipeline, selective recompute with
sequence parallelism). Nothing in the model was set from these runs; the bound is the goal the
model is held to (10% on any run), not a fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import published_runs  # noqa: E402


@pytest.mark.parametrize("label", published_runs.QUICK)
def test_a_published_run_is_predicted_within_ten_percent(label):
    run = next(r for r in published_runs.RUNS if r.label == label)
    ev = published_runs.predict(run)
    assert ev.feasible, ev.infeasible  # never refuse a configuration published as run
    error = ev.prediction.step_time_s / run.published_step_s() - 1
    assert abs(error) <= 0.10, (label, error)


def test_the_published_step_time_is_the_papers_flop_count_over_the_throughput():
    """Narayanan et al. 2021 report throughput; 1T at 163 TFLOP/s on 3072 GPUs is 502 PFLOP/s
    in aggregate (their abstract), which the step time must reproduce."""
    run = next(r for r in published_runs.RUNS if r.label == "1008B")
    l, h, b, s, v = run.layers, run.hidden, run.batch, published_runs.SEQ, published_runs.VOCAB
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert flops / run.published_step_s() == pytest.approx(163e12 * 3072, rel=1e-12)
    assert flops / run.published_step_s() == pytest.approx(502e15, rel=0.01)
