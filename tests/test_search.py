"""Plan search: branch and bound equals exhaustive enumeration; pins, errors, determinism."""

from __future__ import annotations

import dataclasses
import re

import pytest

from autopar import Cluster, InfeasiblePlanError
from autopar.plan_types import RecomputeKind, ScheduleKind
from autopar.planner.cost_model import CostModel, TrainingSetup
from autopar.planner.planning import capture_model_costs
from autopar.planner.search import SearchSpace, enumerate_candidates, search

A100 = Cluster.load("a100-80g")
CPU = Cluster.load("tests/fixtures/calibration/cpu-2proc.json")


def small_gpu(memory_gib: float) -> Cluster:
    """A fake 4-device-per-node GPU with little memory, so memory decides."""
    d = A100.to_json()
    d["name"] = "fake-small"
    d["devices_per_node"] = 4
    d["device"]["memory_bytes"] = memory_gib * 2**30
    d["device"]["reserved_memory_bytes"] = 0
    d["inter_node"]["count"] = 4
    return Cluster.from_json(d)


@pytest.fixture(scope="module")
def costs():
    return {
        "gpt2-small": capture_model_costs("gpt2-small")[0],
        "bert-base": capture_model_costs("bert-base")[0],
        "gpt-tiny": capture_model_costs("gpt", layers=6, hidden=128, heads=4, vocab=512,
                                        seq=256)[0],
    }


def _top(result):
    return [e.candidate for e in (result.best, *result.alternatives)]


CASES = [
    ("gpt2-small", A100, 8, 64, 1024),
    ("gpt2-small", A100, 16, 32, 1024),
    ("bert-base", A100, 16, 256, 512),
    ("gpt2-small", "small4", 8, 16, 1024),
    ("gpt-tiny", CPU, 4, 8, 256),
]


@pytest.mark.parametrize("name, cluster, n, batch, seq", CASES)
def test_branch_and_bound_equals_exhaustive(costs, name, cluster, n, batch, seq):
    cluster = small_gpu(4) if cluster == "small4" else cluster
    cm = CostModel(costs[name], cluster.with_devices(n), TrainingSetup(batch, seq,
                                                                      cluster.device.default_dtype))
    fast = search(cm, top_k=5, refine=0)
    full = search(cm, top_k=5, refine=0, exhaustive=True)
    assert _top(fast) == _top(full)
    assert full.evaluated > fast.evaluated or fast.pruned["bound"] == 0
    # and exhaustive search is the minimum over every candidate, priced one by one
    priced = [cm.evaluate(c) for c in enumerate_candidates(cm)]
    # the per-candidate bound the search prunes with never exceeds the first pass's price, nor
    # the memory floor its screen skips with the busiest rank's peak
    for e in priced:
        if e.prediction is not None:
            assert cm.lower_bound(e.candidate) <= e.prediction.step_time_s * (1 + 1e-12), e
        if e.ranks:
            peak = max(r.total for r in e.ranks)
            assert cm.memory_floor(e.candidate) <= peak * (1 + 1e-12), (e.candidate, peak)
    feasible = [e for e in priced if e.feasible]
    best = min(feasible, key=lambda e: (e.step_time_s, e.candidate.key()))
    assert full.best.candidate == best.candidate
    assert full.candidates == len(priced)


@pytest.mark.parametrize("name, cluster, n, batch, seq", [CASES[1], CASES[3]])
def test_the_first_pass_on_several_processes_equals_one(costs, name, cluster, n, batch, seq):
    """Forked pricing workers (each a share of the groups, pruning against its own k-th best)
    give the same top k, predictions and memory verdicts as one process, and exhaustive search;
    the small-device case has candidates that do not fit. Two runs on two workers write the
    same best per mesh (no share sees another's timing)."""
    cluster = small_gpu(4) if cluster == "small4" else cluster
    setup = TrainingSetup(batch, seq, cluster.device.default_dtype)
    one = search(CostModel(costs[name], cluster.with_devices(n), setup), top_k=5, refine=0,
                 workers=1)
    two = search(CostModel(costs[name], cluster.with_devices(n), setup), top_k=5, refine=0,
                 workers=2)
    again = search(CostModel(costs[name], cluster.with_devices(n), setup), top_k=5, refine=0,
                   workers=2)
    assert [e.candidate for e in again.best_per_mesh] == [e.candidate for e in two.best_per_mesh]
    assert again.evaluated == two.evaluated
    # the plan document says how many processes priced (the counts depend on it)
    from autopar.planner import search as search_module

    assert one.processes == 1 and one.to_json()["processes"] == 1
    assert two.processes == search_module._workers(2, two.candidates)
    full = search(CostModel(costs[name], cluster.with_devices(n), setup), top_k=5, refine=0,
                  exhaustive=True, workers=2)
    assert _top(one) == _top(two) == _top(full)
    assert [e.prediction for e in (one.best, *one.alternatives)] == \
        [e.prediction for e in (two.best, *two.alternatives)]
    assert full.evaluated == full.candidates - full.pruned["structure"]
    # every candidate priced once over the shares; the counts add up as on one process
    for r in (one, two):
        assert r.evaluated + r.pruned["bound"] + r.pruned["structure"] == r.candidates
    assert (one.pruned["memory"] > 0) == (two.pruned["memory"] > 0)
    # the best plan's mesh has it as its best on both
    for r in (one, two):
        c = r.best.candidate
        assert min((e for e in r.best_per_mesh if (e.candidate.dp, e.candidate.tp,
                                                    e.candidate.pp) == (c.dp, c.tp, c.pp)),
                   key=lambda e: e.step_time_s).candidate == c


def test_finalists_refined_on_several_processes_equal_one(costs):
    """The finalists' stage ILPs and simulations on forked processes: the same refined
    predictions, in the same order, as on one process (and cached in the cost model alike)."""
    setup = TrainingSetup(64, 1024)
    one = search(CostModel(costs["gpt2-small"], A100.with_devices(16), setup), SearchSpace(pp=4),
                 top_k=3, workers=1)
    cm = CostModel(costs["gpt2-small"], A100.with_devices(16), setup)
    two = search(cm, SearchSpace(pp=4), top_k=3, workers=2)
    assert _top(one) == _top(two)
    for a, b in zip((one.best, *one.alternatives), (two.best, *two.alternatives)):
        assert a.refined and b.refined
        assert a.prediction.step_time_s == b.prediction.step_time_s
        assert [s.layers for s in a.plan.stages] == [s.layers for s in b.plan.stages]
        assert cm._refined[b.candidate].prediction == b.prediction  # adopted from a worker


def test_search_workers_setting(monkeypatch):
    """``$AUTOPAR_SEARCH_WORKERS`` sets the processes of a search that does not pass ``workers``
    (a bad value is a named error); small spaces stay on one process; a daemonic process (a
    LocalPool rank, which may not fork children) always searches on one."""
    import multiprocessing

    from autopar.errors import InvalidInputError
    from autopar.planner import search as search_module

    monkeypatch.setattr(search_module, "_cores", lambda: 2)
    monkeypatch.delenv("AUTOPAR_SEARCH_WORKERS", raising=False)
    assert search_module._workers(None, 10) == 1
    assert search_module._workers(None, search_module.PARALLEL_MIN_CANDIDATES) == 2
    assert search_module._workers(3, 10) == 3 and search_module._workers(5, 2) == 2
    monkeypatch.setenv("AUTOPAR_SEARCH_WORKERS", "1")
    assert search_module._workers(None, 10**6) == 1
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv("AUTOPAR_SEARCH_WORKERS", bad)
        with pytest.raises(InvalidInputError, match="AUTOPAR_SEARCH_WORKERS"):
            search_module._workers(None, 10)
    monkeypatch.undo()
    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    assert search_module._cores() == 1 and search_module._workers(4, 10**6) == 1


def _exit_at_two(state, item):
    import os

    if item == 2:
        os._exit(3)
    return state + item


def test_forked_workers_answer_in_order_and_a_dead_one_is_an_error():
    """The search's forked map: answers in the items' order, computed from the inherited
    state; a worker process that dies raises (BrokenProcessPool), it does not hang."""
    from concurrent.futures.process import BrokenProcessPool

    from autopar.planner.search import _forked_map

    assert _forked_map(_exit_at_two, 10, [0, 1, 3, 5], 2) == [10, 11, 13, 15]
    with pytest.raises(BrokenProcessPool):
        _forked_map(_exit_at_two, 10, [0, 1, 2, 3], 2)


_FORK_AFTER_THREADS = """
import torch
from autopar.planner.search import _forked_map

def parallel_op(state, item):
    return int((torch.arange(state + item) >= 5).sum())  # parallel_for over 50k elements

torch.set_num_threads(2)
a = torch.randn(512, 512)
(a @ a).sum()
torch.arange(10**6).sum()
print(_forked_map(parallel_op, 50304, [0, 1, 2], 2))
"""


def test_forked_workers_run_torch_after_the_parent_s_threads_started():
    """A worker forked after its parent ran a multi-threaded op (the parent's OpenMP team
    started; GNU OpenMP is not fork-safe) runs torch's parallel ops: each worker is one thread
    (``torch.set_num_threads(1)``), so ``at::parallel_for`` runs inline. Before, the first
    parallel op in a worker waited forever (``autopar plan`` of a GPT-2 config: padding its
    vocabulary while solving a layout). In a fresh interpreter (the suite runs one thread), under
    a deadline: a hang is a failure, not a stuck suite."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _FORK_AFTER_THREADS], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the parent and its stuck workers
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip() == "[50299, 50300, 50301]"


def test_memory_decides_on_a_small_device(costs):
    cm = CostModel(costs["gpt2-small"], small_gpu(4).with_devices(8), TrainingSetup(128, 1024))
    result = search(cm, exhaustive=True, refine=0)
    assert result.pruned["memory"] > 0
    assert result.best.prediction.peak_memory_bytes <= 4 * 2**30
    assert any("GiB usable" in reason for _, reason in result.infeasible_examples)


@pytest.mark.parametrize("offload", [None, "none"])
def test_the_memory_screen_changes_nothing_but_the_candidates_priced(costs, monkeypatch, offload):
    """The first pass skips a candidate whose memory floor (sums over the whole model, no stage
    cut) is over the device before pricing it; on a small device where memory decides, the
    search finds the same plans, best per mesh, prune counts and examples as pricing every
    candidate, offload searched or not."""
    import autopar.planner.search as search_module

    cm = CostModel(costs["gpt2-small"], small_gpu(2).with_devices(16), TrainingSetup(64, 1024))
    space = SearchSpace(offload=offload)
    screened = search(cm, space, top_k=5)
    monkeypatch.setattr(search_module._Pricing, "_over_memory", lambda self, c, found: False)
    priced = search(cm, space, top_k=5)
    assert screened.evaluated < priced.evaluated
    assert screened.pruned == priced.pruned and screened.pruned["memory"] > 0
    assert screened.infeasible_examples == priced.infeasible_examples
    for a, b in zip((screened.best, *screened.alternatives, *screened.best_per_mesh),
                    (priced.best, *priced.alternatives, *priced.best_per_mesh), strict=True):
        assert (a.candidate, a.step_time_s, a.prediction) == (b.candidate, b.step_time_s,
                                                             b.prediction)


def test_finalists_are_cut_by_the_stage_ilp_and_timed_by_the_runtime_simulator(costs):
    """The search is deterministic; its plan's stages are what partition_stages gives on the
    cost model's inputs (the prediction carries the ILP's objective, LP bound and gap), and its
    pipeline time is runtime/simulator.py's run of runtime/schedules.py's action lists (what the
    executor runs) with the plan's per-stage costs."""
    from autopar.planner.stage_partition import partition_stages
    from autopar.runtime.schedules import build_schedule
    from autopar.runtime.simulator import Durations, simulate

    cm = CostModel(costs["gpt2-small"], A100.with_devices(16), TrainingSetup(64, 1024))
    a = search(cm, SearchSpace(pp=4))
    cm2 = CostModel(costs["gpt2-small"], A100.with_devices(16), TrainingSetup(64, 1024))
    b = search(cm2, SearchSpace(pp=4))
    assert _top(a) == _top(b)
    assert a.best.prediction == b.best.prediction
    best = a.best
    assert best.refined and all(ev.refined for ev in a.alternatives)
    # the same inputs as the search's: the problem and the first pass's cut as the start (ties
    # between optimal cuts go to the solution the start leads to)
    part = partition_stages(cm.partition_problem(best.candidate),
                            initial=cm.sums.staging(best.candidate).cuts)
    assert [s.layers for s in best.plan.stages] == list(part.ranges)
    info = best.prediction.stage_partition
    assert info["method"] == "ilp" and info["status"] == "optimal"
    assert info["objective_s"] == pytest.approx(part.step_time)
    assert info["lp_bound_s"] <= info["objective_s"] * (1 + 1e-9)
    # proven optimal by branch and bound: the certificate is a zero gap, whatever the (looser)
    # LP relaxation says; the brute force agrees (tests/test_stage_partition.py)
    assert info["proven_optimal"] and info["gap"] == 0.0 and part.gap == 0.0
    plan, st = best.plan, best.stages
    zb = plan.schedule.spec.splits_backward  # ZB-H1 and ZB-V run I and W apart
    durations = Durations(tuple(x.forward_s for x in st),
                          tuple(x.backward_s + x.weight_s for x in st),
                          tuple(x.backward_s if zb else x.backward_s + x.weight_s for x in st),
                          tuple(x.weight_s for x in st), tuple(x.p2p_s for x in st[:-1]))
    sim = simulate(build_schedule(plan.schedule, plan.pp, plan.num_micro_batches,
                                  plan.virtual_stages), durations)
    breakdown = best.prediction.breakdown
    assert sim.step_time == pytest.approx(best.step_time_s - breakdown["dp_comm_s"]
                                          - breakdown["optimizer_s"] - breakdown["loss_comm_s"])
    assert info["simulated_pipeline_s"] == pytest.approx(sim.step_time)


def test_pins_are_respected(costs):
    cm = CostModel(costs["gpt2-small"], A100.with_devices(16), TrainingSetup(64, 1024))
    space = SearchSpace(tp=2, pp=2, schedule="interleaved-1f1b", recompute="selective", zero=1,
                        sequence_parallel=True)
    best = search(cm, space).best
    plan = best.plan
    assert (plan.tp, plan.pp, plan.schedule, plan.recompute, plan.zero, plan.sequence_parallel) \
        == (2, 2, ScheduleKind.INTERLEAVED_1F1B, RecomputeKind.SELECTIVE, 1, True)
    assert plan.dp == 4 and plan.virtual_stages >= 2
    assert len(plan.stages) == plan.pp * plan.virtual_stages
    assert all(c.tp <= 8 for c in enumerate_candidates(cm))  # tp stays inside a node


def test_impossible_pins_and_models_raise(costs):
    cm = CostModel(costs["gpt2-small"], A100.with_devices(16), TrainingSetup(64, 1024))
    with pytest.raises(InfeasiblePlanError, match="matches the pinned choices") as info:
        search(cm, SearchSpace(tp=3))
    assert info.value.fix
    with pytest.raises(InfeasiblePlanError, match="well formed"):
        search(cm, SearchSpace(tp=16))  # tp larger than a node
    tiny = CostModel(costs["gpt2-small"], small_gpu(0.05).with_devices(4), TrainingSetup(8, 1024))
    with pytest.raises(InfeasiblePlanError, match="no plan fits in memory") as info:
        search(tiny)
    assert "leanest" in info.value.found
    # a small memory in its own unit (it printed as "0.0 GiB" before)
    assert re.search(r"within \d+\.\d\d (KiB|MiB|GiB) per device", info.value.expected), \
        info.value.expected
    assert "devices" in info.value.fix


def test_search_space_validates():
    with pytest.raises(ValueError, match="zero must be"):
        SearchSpace(zero=5)
    with pytest.raises(ValueError, match="positive integer"):
        SearchSpace(tp=0)
    assert dataclasses.replace(SearchSpace(), tp=2).pins() == {"tp": 2}


def test_full_recompute_under_a_split_backward_steps_and_holds_as_1f1b(costs):
    """A stage whose blocks full recompute checkpoints runs its whole backward at I, its W
    empty (``PipelineExecutor.runs_whole_at_input``: a W split into weight groups recomputed
    each block once per group). Priced so: ZB-H1's I then falls where 1F1B's B does and frees
    the activations there, so ZB-H1 + full recompute is 1F1B + full recompute's step time and
    memory, on every rank (the schedule's lists, simulated, are the independent reference);
    and the search offers the pair again (left out while the runtime recomputed per group)."""
    cm = CostModel(costs["gpt-tiny"], A100.with_devices(8), TrainingSetup(32, 256, "bf16"))
    found = enumerate_candidates(cm)
    assert any(c.schedule.spec.splits_backward and c.recompute is RecomputeKind.FULL
               for c in found)
    one_f_one_b = next(c for c in found if c.pp == 4 and c.schedule is ScheduleKind.ONE_F_ONE_B
                       and c.recompute is RecomputeKind.FULL)
    zb = one_f_one_b._replace(schedule=ScheduleKind.ZB_H1)
    base, split = cm.evaluate(one_f_one_b), cm.evaluate(zb)
    st = cm.sums.staging(zb)
    assert all(st.whole_at_input) and not any(st.weight)
    assert split.stages == base.stages
    assert split.prediction.step_time_s == pytest.approx(base.prediction.step_time_s, rel=1e-12)
    # the same memory, but for the receives NCCL's lowering posts ahead: ZB-H1's first rank
    # also holds one once m > p (its empty W still stands between a gradient and its I)
    m = 32 // (zb.dp * zb.micro_batch_size)
    ahead = [(ScheduleKind.ZB_H1.spec.receives_ahead(4, 1, m, r)
              - ScheduleKind.ONE_F_ONE_B.spec.receives_ahead(4, 1, m, r)) * rs.received_bytes
             for r, rs in enumerate(st.ranks)]
    assert ahead[0] > 0 and not any(ahead[1:])
    assert [r.total for r in split.ranks] == pytest.approx(
        [r.total + extra for r, extra in zip(base.ranks, ahead)], rel=1e-12)
    # without recompute the split still fills the bubble, and holds p micro-batches on each rank
    plain = one_f_one_b._replace(recompute=RecomputeKind.NONE)
    zb_plain = plain._replace(schedule=ScheduleKind.ZB_H1)
    assert cm.evaluate(zb_plain).prediction.step_time_s < cm.evaluate(plain).prediction.step_time_s
    assert not any(cm.sums.staging(zb_plain).whole_at_input)
