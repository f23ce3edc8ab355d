"""The schedule model: the runtime's simulator over the executor's action lists, fed with the
cost model's per-stage durations, against the textbook bubbles; the closed-form first pass
against the simulator; activation in-flight counts against the action lists."""

from __future__ import annotations

import random

import pytest

from autopar.plan_types import ScheduleKind
from autopar.planner.schedule_model import (PipelineWork, closed_form_pipeline_time,
                                            in_flight_micro_batches, simulate_pipeline,
                                            simulated_pipeline_time)
from autopar.runtime.schedules import build_schedule

S = ScheduleKind


def work(schedule, p, v, m, f=1.0, b=2.0, w=0.0, c=0.0):
    n = p * v
    return PipelineWork(schedule, p, v, m, (f / v,) * n, (b / v,) * n, (w / v,) * n,
                        (c,) * (n - 1))


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 24)])
def test_gpipe_and_1f1b_bubble(p, m):
    """Narayanan et al. 2021: (m + p - 1)(tf + tb), a bubble of (p - 1)/m of the ideal time."""
    for sched in (S.GPIPE, S.ONE_F_ONE_B):
        wk = work(sched, p, 1, m)
        pipe, sim = simulated_pipeline_time(wk)
        assert sim.bubble_fraction == pytest.approx((p - 1) / m)
        assert pipe.total_s == pytest.approx((m + p - 1) * 3.0)
        assert pipe.bubble_s == pytest.approx((p - 1) * 3.0) and pipe.method == "simulated"
        assert closed_form_pipeline_time(wk).total_s == pytest.approx(pipe.total_s)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16)])
def test_interleaved_bubble(p, v, m):
    """Bubble (p - 1)/(v m): step (m + (p - 1)/v)(tf + tb)."""
    wk = work(S.INTERLEAVED_1F1B, p, v, m)
    pipe, sim = simulated_pipeline_time(wk)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m))
    assert pipe.total_s == pytest.approx((m + (p - 1) / v) * 3.0)
    assert closed_form_pipeline_time(wk).total_s == pytest.approx(pipe.total_s)


@pytest.mark.parametrize("p, m, f, b, w", [(4, 8, 1, 1, 1), (4, 16, 1, 1, 1), (8, 16, 1, 1, 1),
                                           (2, 4, 1, 1, 1), (4, 12, 1.0, 1.2, 0.8)])
def test_zero_bubble_h1(p, m, f, b, w):
    """Qi et al. 2024: ZB-H1's bubble is (p - 1)(tf + tb - tw) (1F1B's (p - 1)(tf + tb + tw));
    ``b`` is the input-gradient part here, ``w`` the weight gradient."""
    wk = work(S.ZB_H1, p, 1, m, f, b, w)
    pipe, _ = simulated_pipeline_time(wk)
    assert pipe.total_s == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
    assert closed_form_pipeline_time(wk).total_s == pytest.approx(pipe.total_s)
    one = simulated_pipeline_time(work(S.ONE_F_ONE_B, p, 1, m, f, b + w))[0]
    assert pipe.total_s < one.total_s


@pytest.mark.parametrize("sched, v", [(S.GPIPE, 1), (S.ONE_F_ONE_B, 1), (S.ZB_H1, 1),
                                      (S.INTERLEAVED_1F1B, 2)])
def test_point_to_point_closed_form_bounds_the_simulator(sched, v):
    """The first pass prices Megatron's synchronous send/recv; the executor's sends are
    asynchronous, so the simulator can only be faster, and never faster than without
    communication; what the transfers add is reported as pp_comm."""
    for p, m in ((2, 4), (4, 8), (4, 16)):
        c, wgt = 0.05, 0.7 if sched is S.ZB_H1 else 0
        closed = closed_form_pipeline_time(work(sched, p, v, m, w=wgt, c=c))
        pipe, _ = simulated_pipeline_time(work(sched, p, v, m, w=wgt, c=c))
        free = simulate_pipeline(work(sched, p, v, m, w=wgt)).step_time
        assert free < pipe.total_s <= closed.total_s + 1e-9
        assert pipe.p2p_s == pytest.approx(pipe.total_s - free)
        assert closed.p2p_s == pytest.approx(2 * (v * m + p - 2) * c)


def test_unequal_stages_closed_form_near_simulation():
    """With unequal stages the first pass (bottleneck rank x m + the others' fill and drain)
    approximates the simulator. On stages within +-10% of each other and m >= 2p it stays
    within 10% of the simulated schedule (measured worst: 8%, interleaved at m = 2p); the
    search re-prices its finalists with the simulator."""
    rng = random.Random(0)
    worst = 0.0
    for _ in range(120):
        p = rng.choice([2, 3, 4, 6])
        sched = rng.choice([S.GPIPE, S.ONE_F_ONE_B, S.INTERLEAVED_1F1B, S.ZB_H1])
        v = 2 if sched is S.INTERLEAVED_1F1B else 1
        m = p * rng.choice([2, 4, 8])
        n = p * v
        f = tuple(rng.uniform(0.9, 1.1) for _ in range(n))
        b = tuple(2 * x * rng.uniform(0.9, 1.1) for x in f)
        w = tuple(x / 2 for x in f) if sched is S.ZB_H1 else (0.0,) * n
        wk = PipelineWork(sched, p, v, m, f, b, w, (0.0,) * (n - 1))
        closed, sim = closed_form_pipeline_time(wk), simulate_pipeline(wk)
        worst = max(worst, abs(closed.total_s / sim.step_time - 1))
    assert worst < 0.10, worst


@pytest.mark.parametrize("sched, p, v, m", [(S.GPIPE, 4, 1, 8), (S.ONE_F_ONE_B, 4, 1, 8),
                                            (S.ONE_F_ONE_B, 4, 1, 2), (S.ZB_H1, 4, 1, 8),
                                            (S.ZB_H1, 4, 1, 2), (S.INTERLEAVED_1F1B, 4, 2, 8),
                                            (S.INTERLEAVED_1F1B, 4, 2, 4),
                                            (S.INTERLEAVED_1F1B, 3, 3, 6),
                                            (S.ONE_F_ONE_B, 8, 1, 16)])
def test_in_flight_counts_match_the_action_lists(sched, p, v, m):
    """The first pass's closed-form in-flight counts are the peaks of the executor's lists
    (ZB-H1 keeps p on every rank; interleaved with m = p runs every forward first)."""
    schedule = build_schedule(sched, p, m, v, communication=False)
    for r in range(p):
        assert in_flight_micro_batches(sched, p, v, m, r) * v == schedule.peak_in_flight(r), r


def test_bad_work_is_rejected():
    with pytest.raises(ValueError, match="expected pp x virtual_stages"):
        PipelineWork(S.ONE_F_ONE_B, 2, 1, 4, (1.0,), (1.0,), (0.0,))
    with pytest.raises(ValueError, match="divisible by pp"):
        work(S.INTERLEAVED_1F1B, 4, 2, 6)


def test_the_simulator_runs_a_first_stages_whole_backward_in_its_weight_action():
    """``first_backward_in_weight`` (the runtime below ZeRO-3: runtime/split_backward.py,
    ``by_layer``): the simulated timeline gives stage 0's I no time and its W the whole
    backward, the other stages their halves; where the lists come from list scheduling (ZB-V
    with m < 2p - 1) that moves the step, so the flag is not a no-op. (The cost model sets it
    below ZeRO-3 only: tests/test_cost_model_cpu.py.)"""
    from autopar.runtime.schedules import ActionKind
    from autopar.runtime.simulator import Durations, simulate

    p, m, n = 4, 4, 8
    rng = random.Random(2)  # a draw where the placement moves the step (3%)
    f = tuple(rng.uniform(0.5, 2) for _ in range(n))
    b = tuple(rng.uniform(0.5, 2) for _ in range(n))
    w = tuple(rng.uniform(0.3, 2) for _ in range(n))
    halves = PipelineWork(S.ZB_V, p, 2, m, f, b, w)
    whole = PipelineWork(S.ZB_V, p, 2, m, f, b, w, first_backward_in_weight=True)
    sim = simulate_pipeline(whole)
    ref = simulate(build_schedule(S.ZB_V, p, m, 2),
                   Durations(f, tuple(x + y for x, y in zip(b, w)), (0.0, *b[1:]),
                             (b[0] + w[0], *w[1:]), (0.0,) * (n - 1)))
    assert sim.step_time == pytest.approx(ref.step_time, rel=1e-12)
    spans = {(e.action.stage, e.action.kind): e.end - e.start for e in sim.events}
    assert spans[(0, ActionKind.BACKWARD_INPUT)] == 0.0
    assert spans[(0, ActionKind.BACKWARD_WEIGHT)] == pytest.approx(b[0] + w[0])
    assert spans[(1, ActionKind.BACKWARD_INPUT)] == pytest.approx(b[1])
    assert simulate_pipeline(halves).step_time != pytest.approx(sim.step_time, rel=1e-6)
