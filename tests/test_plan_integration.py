"""The planner prices what autopar builds: a searched plan's GEMM layout and per-layer
tensor-parallel communication are those of the program tensor_parallelize builds for it, and
autopar.parallelize builds the searched layout."""

from __future__ import annotations

from collections import Counter

import pytest

from autopar import Cluster, capture, models
from autopar.ir import evaluate
from autopar.planner.cost_model import CostModel, ModelCosts, TrainingSetup
from autopar.planner.search import SearchSpace, search
from autopar.tensor_parallel import tensor_parallelize

A100 = Cluster.load("a100-80g")


@pytest.fixture(scope="module")
def small_gpt():
    zm = models.build("gpt", device="meta", layers=3, hidden=256, heads=8, vocab=1024, seq=512)
    inputs, targets = zm.example_inputs(batch=2, seq=16)
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    return captured, ModelCosts(captured)


@pytest.mark.parametrize("sp", [False, True])
def test_predicted_tp_bytes_per_layer_equal_the_program_s_layer_comm(small_gpt, sp):
    captured, costs = small_gpt
    seq = 512
    # fp32 training: the graph's own precision, so bytes compare without re-pricing
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(32, seq, "fp32"))
    best = search(cm, SearchSpace(tp=2, pp=1, sequence_parallel=sp), top_k=2).best
    plan = best.plan
    assert plan.tp == 2 and plan.sequence_parallel is sp and plan.gemm_sharding
    # solved at the plan's micro-batch, as the planner solved it and parallelize builds it
    sizes = {"b": plan.micro_batch_size, "s": seq}
    program = tensor_parallelize(captured, plan.tp, sequence_parallel=plan.sequence_parallel,
                                 pins=plan.gemm_sharding, sizes=sizes)
    assert program.gemm_sharding == plan.gemm_sharding
    priced = cm.layer_costs(plan.tp, plan.sequence_parallel, plan.micro_batch_size)
    for lc, comm in zip(priced, program.layer_comm):
        built = Counter((c.collective.value.replace("_", "-"), c.direction.value,
                         round(float(evaluate(c.message_bytes, **sizes)))) for c in comm.calls)
        predicted = Counter((kind, direction, round(nbytes))
                            for kind, direction, nbytes in lc.tp_calls)
        assert predicted == built, comm.layer
    assert any(lc.tp_calls for lc in priced)


def test_plan_stages_and_layout_reach_the_json(small_gpt):
    """What the search decided survives the plan's JSON (what parallelize's ranks exchange)."""
    from autopar.plan_types import Plan, Prediction

    _, costs = small_gpt
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(32, 512))
    # one stage per rank (ZB-V's two chunks per rank are checked in tests/test_zb_v.py)
    best = search(cm, SearchSpace(tp=2, pp=2, virtual_stages=1), top_k=1).best
    again = Plan.from_json(best.plan.to_json())
    assert again == best.plan and again.gemm_sharding and len(again.stages) == 2
    pred = Prediction.from_json(best.prediction.to_json())
    assert pred.stage_partition["method"] == "ilp" and pred == best.prediction


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_parallelize_builds_the_searched_layout(shared_pool2):
    """autopar.parallelize with tp pinned and the rest searched (2 gloo processes): the program
    it builds has the searched plan's GEMM layout (its TP pass is pinned to it)."""

    import plan_jobs

    pool = shared_pool2
    per_rank = pool.run(plan_jobs.searched_layout, timeout_s=240)
    for rank in per_rank:
        assert rank["built"] == rank["planned"] and rank["planned"], rank
        assert rank["stage_method"] == "single stage"
