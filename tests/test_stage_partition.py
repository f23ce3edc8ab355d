"""The stage partition ILP: fast on GPT-3 175B, memory by the schedule, inputs built from a
captured graph. (Equal to brute force and never below its LP bound on random instances:
tests/test_properties.py.)"""

from __future__ import annotations

import itertools
import math
import random
import resource
import time

import pytest

from autopar.errors import InfeasiblePlanError
from autopar.passes.analyze import analyze
from autopar.passes.split_stages import split_into_stages
from autopar.plan_types import Plan, ScheduleKind
from autopar.planner.stage_partition import (
    LayerCosts,
    brute_force_partition,
    PartitionProblem,
    cut_points,
    even_partition,
    in_flight_vectors,
    min_max_split,
    modeled_step_time,
    partition_stages,
    problem_from_profile,
    rank_memory,
    stages_for_plan,
)
from autopar.runtime.schedules import build_schedule
from autopar.runtime.simulator import Durations, simulate

KINDS = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B,
         ScheduleKind.ZB_H1]


@pytest.mark.parametrize("kind", KINDS)
def test_model_equals_simulator_on_equal_stages(kind):
    """On equal stages without transfers the objective is the simulator's step time."""
    for p, per_stage in [(2, 2), (4, 1), (4, 3)]:
        v = 2 if kind.interleaved else 1
        layer = LayerCosts("block", 1.0 / v, 2.0 / v, 1.0 / v)
        problem = PartitionProblem((layer,) * (p * v * per_stage), p, 2 * p, kind, v)
        ranges = even_partition(len(problem.layers), p * v)
        durations = Durations.uniform(p * v, per_stage / v, 2.0 * per_stage / v,
                                      weight=1.0 * per_stage / v)
        sim = simulate(build_schedule(kind, p, 2 * p, v), durations)
        assert modeled_step_time(problem, ranges) == pytest.approx(sim.step_time)
        assert partition_stages(problem).step_time == pytest.approx(sim.step_time)


def test_model_tracks_simulator_with_transfers():
    """1F1B with transfers: the loop constraints give the simulator's steady state, the model
    over-estimating by at most 2% (measured 1.6% at the worst here: p=2, a transfer half the
    forward time; < 0.4% from p=4 on)."""
    for p in (2, 4, 8):
        for tau in (0.1, 0.5):
            layer = LayerCosts("block", 1.0, 2.0, boundary_bytes=tau)
            problem = PartitionProblem((layer,) * p, p, 4 * p, ScheduleKind.ONE_F_ONE_B,
                                       link_bandwidth=1.0)
            sim = simulate(build_schedule("1f1b", p, 4 * p), Durations.uniform(p, p2p=tau))
            modeled = modeled_step_time(problem, even_partition(p, p))
            assert 0 <= modeled / sim.step_time - 1 < (0.02 if p == 2 else 0.004)


def gpt3_175b_layers(tp: int = 8) -> tuple[LayerCosts, ...]:
    """GPT-3 175B (96 x h=12288, 96 heads, vocab 50257, s=2048) per rank of a tp=8 group of
    A100s at 50% of 312 TFLOP/s, micro-batch 1, selective recompute activations
    (Korthikanti et al.: s b h (10 + 24/t) bytes per layer), fp16 boundaries."""
    h, V, s, b = 12288, 50257, 2048, 1
    flops_s = 312e12 * 0.5 * tp
    block = 24 * b * s * h * h + 4 * b * s * s * h
    head = 2 * b * s * h * V
    pre = LayerCosts("pre", 4 * b * s * h / flops_s, 8 * b * s * h / flops_s, 0.0,
                     (V * h + s * h) / tp, 2 * s * b * h, 2 * s * b * h)
    blk = LayerCosts("block", block / flops_s, 2 * block / flops_s, block / flops_s,
                     (12 * h * h + 13 * h) / tp, s * b * h * (10 + 24 / tp), 2 * s * b * h)
    post = LayerCosts("post", head / flops_s, 2 * head / flops_s, head / flops_s,
                      V * h / tp + 2 * h, 4 * s * b * V / tp + 4 * s * b * h, 0.0)
    return (pre,) + (blk,) * 96 + (post,)


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and its finished children (CBC)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.mark.parametrize("kind,v,pipelines", [
    (ScheduleKind.ONE_F_ONE_B, 1, (8, 16, 32, 64)), (ScheduleKind.ZB_H1, 1, (8, 16, 32, 64)),
    (ScheduleKind.GPIPE, 1, (8, 16, 32, 64)), (ScheduleKind.INTERLEAVED_1F1B, 2, (8, 16, 32))])
def test_gpt3_175b_onto_8_to_64_stages_in_seconds(kind, v, pipelines):
    """Solved to optimality in under 5 s each. The solver's time limit (60 s) is far above that,
    so a slow solve fails the time assertion instead of ending early as "time limit (feasible)".
    Time is CPU time, this process's (HiGHS runs in it) and its children's (CBC, the fallback);
    the machine is shared: wall time under load says little about the solve."""
    layers = gpt3_175b_layers()
    for p in pipelines:
        m = p if kind is ScheduleKind.GPIPE else 2 * p
        problem = PartitionProblem(layers, p, m, kind, v, 80 * 2**30, 16.0, 100e9 / 8, 5e-6)
        start = _cpu_seconds()
        result = partition_stages(problem, time_limit_s=60.0)
        elapsed = _cpu_seconds() - start
        assert result.status == "optimal", (kind, p, result.status)
        assert elapsed < 5.0, (kind, p, elapsed)
        assert result.num_variables <= 8 * p * v  # segments, not layers x stages
        assert result.lp_bound <= result.step_time
        assert max(result.rank_memory) <= 80 * 2**30
        baseline = even_partition(len(layers), p * v)
        if max(rank_memory(problem, baseline)) <= 80 * 2**30:
            assert result.step_time <= modeled_step_time(problem, baseline) * (1 + 1e-9)


def test_heavy_embedding_and_head_get_fewer_blocks():
    """GPT-2 small proportions: the LM head costs ~4.5 blocks, so the last stage takes fewer
    blocks than an even split would give it, and the step is faster than the even split."""
    h, V, s = 768, 50257, 1024
    block = LayerCosts("block", 24 * s * h * h + 4 * s * s * h, 2 * (24 * s * h * h + 4 * s * s * h),
                       boundary_bytes=0.0)
    pre = LayerCosts("pre", 4 * s * h, 8 * s * h)
    head = LayerCosts("post", 2 * s * h * V, 4 * s * h * V)
    problem = PartitionProblem((pre,) + (block,) * 12 + (head,), 4, 8)
    result = partition_stages(problem)
    blocks = [n - (i == 0) - (i == 3) for i, n in enumerate(result.layers_per_stage)]
    assert blocks[-1] < min(blocks[1:-1])
    assert result.step_time < modeled_step_time(problem, even_partition(14, 4))


def test_memory_follows_the_schedule():
    """1F1B's stage i keeps p - i micro-batches, GPipe all m: with memory tight the first stage
    takes fewer activation-heavy layers, and GPipe can be infeasible where 1F1B fits."""
    layer = LayerCosts("block", 1.0, 2.0, params=0.0, activation_bytes=1.0)
    problem = PartitionProblem((layer,) * 16, 4, 8, ScheduleKind.ONE_F_ONE_B,
                               device_memory=14.0)
    assert in_flight_vectors(problem) == [[(4,)], [(3,)], [(2,)], [(1,)]]
    result = partition_stages(problem)
    assert result.layers_per_stage[0] < result.layers_per_stage[-1]
    assert list(result.rank_memory) == rank_memory(problem, result.ranges)
    assert max(result.rank_memory) <= 14.0
    gpipe = PartitionProblem((layer,) * 16, 4, 8, ScheduleKind.GPIPE, device_memory=14.0)
    with pytest.raises(InfeasiblePlanError, match="fits") as err:
        partition_stages(gpipe)
    assert "fix" in str(err.value)
    with pytest.raises(InfeasiblePlanError, match="at least one layer"):
        partition_stages(PartitionProblem((layer,) * 3, 4, 8))
    with pytest.raises(ValueError, match="interleaved"):
        PartitionProblem((layer,) * 8, 2, 4, ScheduleKind.ONE_F_ONE_B, stages_per_rank=2)


def test_from_a_captured_graph_to_stages(tiny_models):
    """Inputs from the analysis; the answer feeds the plan and the stage split."""
    model, loss_fn, inputs, targets, captured = tiny_models["own_gpt"]
    profile = analyze(captured)
    problem = problem_from_profile(captured, profile, num_ranks=2, num_microbatches=4,
                                   micro_batch_size=1, seq=16, flops_per_s=1e12,
                                   link_bandwidth=1e9)
    assert [l.name for l in problem.layers] == [l.name for l in captured.layers]
    hidden = 64
    for layer in problem.layers[:-1]:  # only the hidden state is sent; the mask is recomputed
        assert layer.boundary_bytes == 1 * 16 * hidden * 4
    post = problem.layers[-1]
    assert post.params == profile.layers[-1].params + 128 * hidden  # a copy of the tied embedding
    assert problem.layers[1].forward == pytest.approx(
        profile.layers[1].at(b=1, s=16)["flops"] / 1e12)
    result = partition_stages(problem)
    plan = Plan(pp=2, num_micro_batches=4, stages=result.stage_plans())
    split = split_into_stages(captured.gm, captured.layers, [s.layers for s in plan.stages])
    assert split.num_stages == 2


def test_cut_points_find_the_residual_stream(tiny_models):
    *_, captured = tiny_models["own_gpt"]
    points = cut_points(captured, b=2, s=16)
    boundaries = [c for c in points if c.layer_boundary]
    blocks = [l for l in captured.layers if l.is_block]
    # after pre and after every block but the last one is followed by post: one tensor crosses
    assert len(boundaries) == len(captured.layers) - 1
    assert all(c.nbytes == 2 * 16 * 64 * 4 and len(c.crossing) == 1 for c in boundaries)
    inside = [c for c in points if not c.layer_boundary and c.layer == blocks[0].name]
    assert inside, "the residual after attention is a single-tensor cut inside a block"


def random_problem(rng: random.Random, kind: ScheduleKind) -> PartitionProblem:
    v = 2 if kind.interleaved else 1
    p = rng.randint(2, 4) if v == 1 else rng.randint(2, 3)
    num_layers = rng.randint(p * v, min(p * v + 5, 10))
    layers = []
    repeated = LayerCosts("block", 1.0, 2.0, 0.9, 4.0, 3.0, 1.0)
    for i in range(num_layers):
        if rng.random() < 0.3:  # some repeated layers, so segments are exercised
            layers.append(repeated)
            continue
        f = rng.uniform(0.2, 3.0)
        b = f * rng.uniform(1.5, 2.5)
        layers.append(LayerCosts(f"l{i}", f, b, b * rng.uniform(0.3, 0.6), rng.uniform(0, 10),
                                 rng.uniform(0, 5), rng.uniform(0, 4)))
    m = p * rng.randint(1, 3)
    memory = rng.choice([math.inf, rng.uniform(30, 150)])
    return PartitionProblem(tuple(layers), p, m, kind, v, memory, 2.0,
                            rng.choice([math.inf, 4.0]), rng.uniform(0, 0.2))


@pytest.mark.parametrize("p,v", [(8, 6), (10, 8)])
def test_deeply_interleaved_gpt3_175b_is_proven_optimal_with_a_tight_bound(p, v):
    """48 and 80 stages for 98 layers (GPT-3 175B at pp 8 x v 6 and pp 10 x v 8, as the plan
    search refines them). Without the whole-layer bound (C8) the LP relaxation spread the 96
    blocks fractionally (1.2 per stage against 2 whole ones), sat ~39% below the optimum, and
    both programs ran to their time limit, the first returning a cut 12% slower. With it: proven
    optimal in seconds, and the bound is the answer (the certificate explain prints). The answer
    is checked against independent cuts: the min-max split and equal layer counts."""
    layers = gpt3_175b_layers()
    problem = PartitionProblem(layers, p, 2 * p, ScheduleKind.INTERLEAVED_1F1B, v, 80 * 2**30,
                               16.0, 100e9 / 8, 5e-6)
    start = _cpu_seconds()
    result = partition_stages(problem, time_limit_s=60.0)
    elapsed = _cpu_seconds() - start
    assert result.status == "optimal" and elapsed < 5.0, (result.status, elapsed)
    assert result.step_time * (1 - 1e-6) <= result.lp_bound <= result.step_time * (1 + 1e-9)
    times = [layer.forward + layer.backward for layer in layers]
    for other in (min_max_split(times, p * v), even_partition(len(layers), p * v)):
        if max(rank_memory(problem, other)) <= 80 * 2**30:
            assert result.step_time <= modeled_step_time(problem, other) * (1 + 1e-9)


def test_min_max_split_equals_enumeration_and_bounds_the_ilp():
    """The search's first pass: the contiguous split with the least busy busiest stage (equal
    to enumeration), whose busiest stage bounds the ILP's steady state from below, so the
    objective with that steady state and no transfers is a lower bound of the ILP's."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.uniform(0, 10), float(rng.randint(1, 4))]) for _ in range(n)]
        stages = min_max_split(costs, k)
        assert len(stages) == k and stages[0][0] == 0 and stages[-1][1] == n - 1
        assert all(b[0] == a[1] + 1 and a[0] <= a[1] for a, b in zip(stages, stages[1:]))
        worst = max(sum(costs[a:b + 1]) for a, b in stages)
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                   for cuts in itertools.combinations(range(1, n), k - 1))
        assert worst == pytest.approx(best), (costs, k, stages)
    for trial in range(12):
        problem = random_problem(rng, KINDS[trial % 4])
        if not math.isinf(problem.device_memory):
            continue
        times = [layer.forward + layer.backward for layer in problem.layers]
        cut = min_max_split(times, problem.num_stages)
        y, m, v = max(sum(times[a:b + 1]) for a, b in cut), problem.num_microbatches, \
            problem.stages_per_rank
        # the objective of the module docstring with Y (Y_F + Y_B) at its smallest possible value
        bound = {ScheduleKind.GPIPE: (m - 1) * y + sum(times),
                 ScheduleKind.ONE_F_ONE_B: (m - 1) * y + sum(times),
                 ScheduleKind.INTERLEAVED_1F1B: (m - 1 / v) * v * y + sum(times) / v,
                 ScheduleKind.ZB_H1: (m - 1) * y + sum(t - 2 * layer.weight_grad for t, layer
                                                        in zip(times, problem.layers))
                 }[problem.schedule]
        assert partition_stages(problem, lp_bound=False).step_time >= bound * (1 - 1e-9)
    with pytest.raises(InfeasiblePlanError, match="cannot cut 3 layers into 4"):
        min_max_split([1, 2, 3], 4)


def test_stages_for_a_plan_without_stages(tiny_models):
    """What autopar.parallelize does with a plan given without stages: the same ILP, on
    FLOP-proportional times."""
    model, loss_fn, inputs, targets, captured = tiny_models["own_gpt"]
    plan = Plan(pp=2, num_micro_batches=4)
    stages = stages_for_plan(captured, plan)
    problem = problem_from_profile(captured, analyze(captured), num_ranks=2, num_microbatches=4,
                                   micro_batch_size=1, seq=captured.example_size_kwargs()["s"],
                                   flops_per_s=1e12)
    assert [s.layers for s in stages] == list(partition_stages(problem).ranges)
    assert [(s.pp_rank, s.chunk) for s in stages] == [(0, 0), (1, 0)]
    (one,) = stages_for_plan(captured, Plan())
    assert one.layers == (0, len(captured.layers) - 1)


def test_one_micro_batch_has_no_steady_state_and_still_solves():
    """m = 1: the objective's (m - 1) Y term vanishes and CBC leaves Y unset; the partition is
    still the brute-force optimum (this was a TypeError)."""
    layers = (LayerCosts("pre", 1.0, 2.0), *[LayerCosts("block", 2.0, 4.0)] * 4,
              LayerCosts("post", 3.0, 6.0))
    for kind in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1, ScheduleKind.GPIPE):
        problem = PartitionProblem(layers, 2, 1, kind)
        result = partition_stages(problem)
        assert result.step_time == pytest.approx(brute_force_partition(problem).step_time)
