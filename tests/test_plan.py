"""Plan vocabulary: validation with the numbers and the fix, JSON round trip."""

from __future__ import annotations

import pytest

from autopar.errors import InvalidPlanError, PlanMismatchError
from autopar.plan_types import GemmSharding, Plan, Prediction, RecomputeKind, ScheduleKind, StagePlan


def test_round_trip():
    plan = Plan(dp=2, tp=2, pp=2, virtual_stages=2, micro_batch_size=1, num_micro_batches=4,
                schedule="interleaved-1f1b", recompute="selective", zero=1, sequence_parallel=True,
                stages=tuple(StagePlan(i, (i, i), i % 2, i // 2) for i in range(4)),
                gemm_sharding={"linear": "column"})
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.schedule is ScheduleKind.INTERLEAVED_1F1B
    assert again.recompute is RecomputeKind.SELECTIVE
    assert again.gemm_sharding["linear"] is GemmSharding.COLUMN
    assert plan.world_size == 8 and plan.global_batch == 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=0), "tp must be a positive integer"),
    (dict(zero=4), "zero must be 0, 1, 2 or 3"),
    (dict(schedule="interleaved-1f1b", virtual_stages=1), "needs virtual_stages >= 2"),
    (dict(schedule="interleaved-1f1b", virtual_stages=2, pp=2, num_micro_batches=3),
     "divisible by pp"),
    (dict(virtual_stages=2), "needs the interleaved-1f1b"),
    (dict(schedule="zb-v", virtual_stages=2), "needs a pipeline"),  # pp = 1
    (dict(sequence_parallel=True), "needs tp > 1"),
    (dict(pp=2, stages=(StagePlan(0, (0, 1), 0),)), "expected pp x virtual_stages = 2"),
    (dict(pp=2, stages=(StagePlan(0, (0, 1), 0), StagePlan(1, (3, 4), 1))), "not contiguous"),
    (dict(schedule="2f2b"), "is not a valid ScheduleKind"),
    (dict(zero=True), "zero must be"),
    (dict(dp=2.0), "dp must be a positive integer"),
    (dict(recompute="some"), "is not a valid RecomputeKind"),
    (dict(gemm_sharding={"linear": "diagonal"}), "is not a valid GemmSharding"),
])
def test_invalid_plans_say_why(kwargs, match):
    with pytest.raises(InvalidPlanError, match=match) as err:
        Plan(**kwargs)
    assert isinstance(err.value, ValueError)  # the dataclass convention (STYLE.md)
    assert err.value.fix


def test_unknown_fields_and_versions():
    with pytest.raises(InvalidPlanError, match="unknown plan field"):
        Plan.from_json({"dp": 1, "bogus": 3})
    with pytest.raises(PlanMismatchError, match="format version 99"):
        Plan.from_json({"format_version": 99})
    with pytest.raises(PlanMismatchError, match="written by autopar 9.4.0"):
        Plan.from_json({**Plan().to_json(), "autopar_version": "9.4.0"})
    with pytest.raises(InvalidPlanError, match="stage is malformed"):
        Plan.from_json({"stages": [{"index": 0}]})


def test_plan_files_json_and_yaml(tmp_path):
    plan = Plan(dp=2, num_micro_batches=2, model_fingerprint="0.1:abc")
    for name in ("plan.json", "plan.yaml"):
        assert Plan.load(plan.save(tmp_path / name)) == plan
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidPlanError, match="not a valid plan file"):
        Plan.load(tmp_path / "bad.json")
    with pytest.raises(InvalidPlanError, match="cannot read"):
        Plan.load(tmp_path / "missing.json")


def test_prediction_round_trip():
    p = Prediction(1.5, 1000.0, 120.0, 0.4, 2**30, {"compute_s": 1.0}, {"weights": 10})
    assert Prediction.from_json(p.to_json()) == p


def test_hybrid_shard_size_round_trips_and_old_json_reads():
    plan = Plan(dp=4, zero=3, zero_shard_size=2, num_micro_batches=2)
    data = plan.to_json()
    assert data["zero_shard_size"] == 2 and Plan.from_json(data) == plan
    plain = Plan(dp=4, zero=3).to_json()
    assert "zero_shard_size" not in plain  # plans without it serialize as before
    assert Plan.from_json(plain).zero_shard_size is None
    for kwargs, match in ((dict(dp=4, zero=3, zero_shard_size=3), "divides dp"),
                          (dict(dp=4, zero=3, zero_shard_size=1), ">= 2"),
                          (dict(dp=4, zero=0, zero_shard_size=2), "needs zero >= 1")):
        with pytest.raises(ValueError, match=match):
            Plan(**kwargs)
