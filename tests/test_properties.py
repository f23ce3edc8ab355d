"""Property tests (hypothesis, derandomized: the same examples on every run).

1. Random small transformers (family, layers, heads, kv-heads, head size, FFN, vocabulary,
   sequence) under random valid plans of world 4 (every dp x pp x tp, schedule, micro-batches,
   micro-batch size, ZeRO stage, sequence parallelism, recompute) compute the loss and, after one
   SGD step, the parameters of one plain PyTorch process. Bounded: 8 examples from a fixed seed
   on the shared LocalPool(4), no shrinking (each example is a parallelize on 4 ranks). (The
   first run found captures with batch == sequence length merging the two symbols.)
   Tolerance: loss 1e-5 relative, parameters 1e-5 absolute after one step of lr 0.5 (gradients
   ~0.1 computed in another summation order, ~1e-7 apart; a missing reduction or a wrong
   slice is off by O(lr x gradient)).
2. Random layer costs, memory limits and links give the stage-partition ILP the optimum of brute
   force (moved here from a seeded loop in tests/test_stage_partition.py).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, Phase, event, given, seed, settings
from hypothesis import strategies as st

from autopar.errors import InfeasiblePlanError
from autopar.plan_types import ScheduleKind
from autopar.planner.stage_partition import (
    LayerCosts,
    PartitionProblem,
    brute_force_partition,
    min_max_split,
    partition_stages,
)

import reliability_jobs as jobs

MESHES = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]  # dp, pp, tp


@st.composite
def model_and_plan(draw):
    dp, pp, tp = draw(st.sampled_from(MESHES))
    family = draw(st.sampled_from(["own_gpt", "gpt", "llama"]))
    heads = draw(st.sampled_from([4, 8] if tp == 4 else [2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(max(1, pp - 2), 3))
    shape = dict(layers=layers, hidden=heads * head_dim, heads=heads,
                 vocab=draw(st.sampled_from([64, 96, 128])), seq=32,
                 ffn_hidden=draw(st.sampled_from([32, 48, 64])))
    if family == "llama":
        shape["kv_heads"] = draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0]))
    schedules = ["1f1b"]
    if pp > 1:
        schedules += ["gpipe", "zb-h1"] + (["interleaved-1f1b"] if 2 * pp <= layers + 2 else [])
    schedule = draw(st.sampled_from(schedules))
    interleaved = schedule == "interleaved-1f1b"
    m = pp * draw(st.integers(1, 2)) if interleaved else draw(st.sampled_from([1, 2, 4]))
    mbs = draw(st.sampled_from([1, 2]))
    zero = draw(st.integers(0, 2 if schedule == "zb-h1" else 3))
    pins = dict(dp=dp, pp=pp, tp=tp, schedule=schedule, virtual_stages=2 if interleaved else 1,
                num_micro_batches=m, zero=zero,
                sequence_parallel=tp > 1 and draw(st.booleans()),
                recompute=draw(st.sampled_from(["none", "full"])))
    return dict(family=family, shape=shape, pins=pins, batch=dp * m * mbs,
                seq=draw(st.sampled_from([8, 16])), seed=draw(st.integers(0, 99)))


@pytest.mark.distributed
@seed(0)  # fixed: the same 8 cases on every run; they cover all 6 meshes, the 3 families and
# the 4 schedules, ZeRO 0, 1 and 3, sequence parallelism and full recompute
@settings(max_examples=8, derandomize=False, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=model_and_plan())
def test_random_models_and_plans_match_one_process(shared_pool4, case):
    out = shared_pool4.run(jobs.property_case, case, timeout_s=600)
    got = out[0]
    assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-5), case
    assert got["max_diff"] <= 1e-5, (case, got["worst"], got["max_diff"])
    assert not got["missing"], (case, got["missing"])
    assert len({r["loss"] for r in out}) == 1, case


KINDS = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B,
         ScheduleKind.ZB_H1]
_REPEATED = LayerCosts("block", 1.0, 2.0, 0.9, 4.0, 3.0, 1.0)


@st.composite
def partition_problems(draw, kind: ScheduleKind):
    v = 2 if kind.interleaved else 1
    p = draw(st.integers(2, 4 if v == 1 else 3))
    n = draw(st.integers(p * v, min(p * v + 5, 10)))
    layers = []
    for i in range(n):
        if draw(st.integers(0, 9)) < 3:  # some repeated layers, so segments are exercised
            layers.append(_REPEATED)
            continue
        f = draw(st.floats(0.2, 3.0))
        b = f * draw(st.floats(1.5, 2.5))
        layers.append(LayerCosts(f"l{i}", f, b, b * draw(st.floats(0.3, 0.6)),
                                 draw(st.floats(0, 10)), draw(st.floats(0, 5)),
                                 draw(st.floats(0, 4))))
    m = p * draw(st.integers(1, 3))
    memory = draw(st.floats(8, 150)) if draw(st.integers(0, 2)) else math.inf  # bytes per rank
    return PartitionProblem(tuple(layers), p, m, kind, v, memory, 2.0,
                            draw(st.sampled_from([math.inf, 4.0])), draw(st.floats(0, 0.2)))


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.differing_executors])
@given(data=st.data())
def test_stage_ilp_equals_brute_force(kind, data):
    problem = data.draw(partition_problems(kind))
    try:
        reference = brute_force_partition(problem)
    except InfeasiblePlanError:
        event("infeasible")
        with pytest.raises(InfeasiblePlanError, match="fits"):
            partition_stages(problem)
        return
    event("memory-bound" if problem.device_memory < math.inf else "no memory limit")
    result = partition_stages(problem)
    assert result.status == "optimal"
    assert result.step_time == pytest.approx(reference.step_time, rel=1e-7)
    assert result.extra["ilp_objective"] == pytest.approx(result.step_time, rel=1e-6)
    assert result.lp_bound <= result.step_time * (1 + 1e-7)
    assert max(result.rank_memory) <= problem.device_memory * (1 + 1e-9)
    assert sum(result.layers_per_stage) == len(problem.layers)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
@settings(max_examples=16, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.differing_executors])
@given(data=st.data())
def test_stage_ilp_from_a_start_on_either_solver_equals_brute_force(backend, data):
    """The ILP on HiGHS (the default) and on CBC (the fallback), started from any partition or
    from none: the brute-force optimum either way (a start only seeds the incumbent)."""
    from autopar import solver
    from autopar.planner.stage_partition import even_partition

    kind = data.draw(st.sampled_from(KINDS))
    problem = data.draw(partition_problems(kind))
    start = data.draw(st.sampled_from([None, "even", "min-max"]))
    initial = None
    if start == "even":
        initial = even_partition(len(problem.layers), problem.num_stages)
    elif start == "min-max":
        initial = min_max_split([x.forward + x.backward for x in problem.layers],
                                problem.num_stages)
    saved = solver._HIGHS
    solver._HIGHS = backend == "highs"
    try:
        try:
            reference = brute_force_partition(problem)
        except InfeasiblePlanError:
            with pytest.raises(InfeasiblePlanError, match="fits"):
                partition_stages(problem, initial=initial)
            return
        result = partition_stages(problem, initial=initial)
    finally:
        solver._HIGHS = saved
    assert result.extra["solver"] == backend
    assert result.status == "optimal"
    assert result.step_time == pytest.approx(reference.step_time, rel=1e-7)


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(blocks=st.integers(1, 40), block=st.floats(0.01, 10), ends=st.lists(
    st.floats(0, 30), min_size=2, max_size=2), stages=st.integers(1, 12))
def test_min_max_split_on_repeated_blocks_is_the_optimum(blocks, block, ends, stages):
    """An embedding, equal blocks and a head (the case the breakpoint snapping is for, where a
    plain bisection stalls on prefix sums equal up to rounding): the largest stage equals the
    optimum, found by trying every count of blocks next to the ends."""
    times = [ends[0], *[block] * blocks, ends[1]]
    if stages > len(times):
        return
    cut = min_max_split(times, stages)
    worst = max(sum(times[a:b + 1]) for a, b in cut)
    # the optimum: the smallest X a greedy packing fits in `stages` stages, X among stage sums
    sums = sorted({sum(times[a:b + 1]) for a in range(len(times)) for b in range(a, len(times))})
    def fits(x):
        count, acc = 1, 0.0
        for t in times:
            if t > x * (1 + 1e-12):
                return False
            if acc + t > x * (1 + 1e-12):
                count, acc = count + 1, t
            else:
                acc += t
        return count <= stages
    best = next(x for x in sums if fits(x))
    assert worst == pytest.approx(best, rel=1e-9)
