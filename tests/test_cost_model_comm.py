"""Collective and point-to-point costs, against nccl-tests' bus-bandwidth convention and NCCL's
tuning model (latency terms)."""

from __future__ import annotations

import math

import pytest

from autopar import Cluster
from autopar.cluster import GroupSpan
from autopar.planner.comm import (TREE_BANDWIDTH_FACTOR, Algorithm, Collective,
                                  collective_time, mesh_span, p2p_time)

A100 = Cluster.load("a100-80g").with_devices(1024)
GiB = 2**30


def busbw(op, nbytes, n, seconds):
    """nccl-tests (doc/PERFORMANCE.md): algbw = S / t; busbw = algbw x 2(n-1)/n for
    all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all (whose S is one rank's
    buffer, 1/n of the full tensor the cost model is given)."""
    factor = 2 * (n - 1) / n if op is Collective.ALL_REDUCE else (n - 1) / n
    if op is Collective.ALL_TO_ALL:
        nbytes = nbytes / n
    return nbytes / seconds * factor


@pytest.mark.parametrize("op", list(Collective))
def test_large_collectives_in_a_node_reach_the_nvlink_bus_bandwidth(op):
    span = GroupSpan(8, 1, 8)
    size = 4 * GiB * (8 if op is Collective.ALL_TO_ALL else 1)  # 4 GiB per rank's buffer
    t = collective_time(A100, op, size, span)
    # within 0.2%: the latency terms (tens of us) against ~30 ms of transfer
    assert busbw(op, size, 8, t.seconds) == pytest.approx(300e9 * 0.8, rel=2e-3)


def test_data_parallel_groups_across_nodes_use_one_nic_each():
    """tp=8 inside each node: a dp group has one rank per node, so its ring runs at one NIC."""
    span = mesh_span(A100, 128, 1, 8, "dp")
    assert span == GroupSpan(128, 128, 1)
    t = collective_time(A100, Collective.ALL_REDUCE, 4 * GiB, span)
    assert busbw(Collective.ALL_REDUCE, 4 * GiB, 128, t.seconds) == pytest.approx(
        25e9 * 0.9, rel=2e-3)
    assert t.algorithm is Algorithm.RING


def test_latency_terms_follow_the_nccl_tuning_model():
    """Empty-ish message: base latency + (intra steps x NVLink hop) + (inter steps x net hop)."""
    one = 4.0
    span = GroupSpan(16, 2, 8)
    t = collective_time(A100, Collective.ALL_REDUCE, one, span, Algorithm.RING).seconds
    lat = 3.6e-6 + 2 * (16 - 2) * 2.5e-6 + 2 * (2 - 1) * 2.5e-6
    assert t == pytest.approx(lat, rel=1e-3)
    tree = collective_time(A100, Collective.ALL_REDUCE, one, GroupSpan(1024, 128, 8),
                           Algorithm.TREE).seconds
    assert tree == pytest.approx(3.6e-6 + 2 * (7 * 2.5e-6 + math.ceil(math.log2(128)) * 2.5e-6),
                                 rel=1e-3)


def test_cheapest_algorithm_wins():
    wide = GroupSpan(1024, 128, 8)
    small = collective_time(A100, Collective.ALL_REDUCE, 1024, wide)
    big = collective_time(A100, Collective.ALL_REDUCE, 8 * GiB, wide)
    assert small.algorithm in (Algorithm.TREE, Algorithm.HIERARCHICAL)
    assert big.algorithm is Algorithm.RING
    for nbytes in (1024, 2**20, 2**30):
        best = collective_time(A100, Collective.ALL_REDUCE, nbytes, wide).seconds
        for algo in Algorithm:
            assert best <= collective_time(A100, Collective.ALL_REDUCE, nbytes, wide,
                                           algo).seconds + 1e-15
    tree = collective_time(A100, Collective.ALL_REDUCE, 8 * GiB, GroupSpan(8, 1, 8),
                           Algorithm.TREE)
    assert tree.bus_bandwidth == pytest.approx(240e9 * TREE_BANDWIDTH_FACTOR)


def test_hierarchical_is_its_three_phases():
    span = GroupSpan(64, 8, 8)
    s = 2**28
    h = collective_time(A100, Collective.ALL_REDUCE, s, span, Algorithm.HIERARCHICAL).seconds
    rs = collective_time(A100, Collective.REDUCE_SCATTER, s, GroupSpan(8, 1, 8)).seconds
    ar = collective_time(A100, Collective.ALL_REDUCE, s / 8, GroupSpan(8, 8, 1),
                         Algorithm.RING).seconds
    ag = collective_time(A100, Collective.ALL_GATHER, s, GroupSpan(8, 1, 8)).seconds
    assert h == pytest.approx(rs + ar + ag)


def test_single_rank_and_p2p():
    assert collective_time(A100, Collective.ALL_REDUCE, GiB, GroupSpan(1, 1, 1)).seconds == 0
    intra = p2p_time(A100, 2**30, inter_node=False)
    inter = p2p_time(A100, 2**30, inter_node=True)
    assert intra == pytest.approx(2.5e-6 + 2**30 / 240e9)
    assert inter == pytest.approx(2.5e-6 + 2**30 / 22.5e9)


def test_a_measured_collective_replaces_the_link_inside_a_node_only():
    """gloo's reduce-scatter, as calibrate measures it, has its own hop latency and bus
    bandwidth: a0 + (n-1) hop + (n-1)/n S / B inside a node; across nodes (and for the
    collectives the cluster does not list) the links' ring, unchanged."""
    import dataclasses

    from autopar.cluster import CollectiveSpec

    spec = CollectiveSpec(latency_s=4e-4, bus_bandwidth=0.4e9)
    base = Cluster.load("cpu").with_devices(4)
    cl = dataclasses.replace(base, collectives={**base.collectives, "reduce-scatter": spec})
    size, n = 8 * 2**20, 4
    inside = GroupSpan(n, 1, n)
    t = collective_time(cl, Collective.REDUCE_SCATTER, size, inside, Algorithm.RING).seconds
    assert t == pytest.approx(cl.collective_latency_s + (n - 1) * spec.latency_s
                              + (n - 1) / n * size / spec.bus_bandwidth)
    for op in (Collective.ALL_REDUCE, Collective.ALL_GATHER):
        assert collective_time(cl, op, size, inside).seconds == \
            collective_time(base, op, size, inside).seconds
    two_nodes = dataclasses.replace(A100, collectives={"reduce-scatter": spec})
    across = GroupSpan(16, 2, 8)
    assert collective_time(two_nodes, Collective.REDUCE_SCATTER, size, across,
                           Algorithm.RING).seconds == \
        collective_time(A100, Collective.REDUCE_SCATTER, size, across, Algorithm.RING).seconds
    # the hierarchical algorithm's intra-node phases are inside a node: the measured figures
    hier = collective_time(two_nodes, Collective.REDUCE_SCATTER, size, across,
                           Algorithm.HIERARCHICAL).seconds
    assert hier > collective_time(A100, Collective.REDUCE_SCATTER, size, across,
                                  Algorithm.HIERARCHICAL).seconds


def test_collectives_among_more_processes_than_cores_share_the_cores():
    """On a CPU host gloo's copies and sums run on the cores the processes compute on: with
    more processes on a node than cores, a collective priced on its own runs its bandwidth term
    at the processes' share of the cores (Host.collective_share, Cluster.compute_share), not its
    latencies; with a core per process, and on GPUs, the share is 1."""
    from autopar.planner.host import Host

    cpu = Cluster.load("cpu")
    assert cpu.cores_per_node == 2
    size = 8 * 2**20
    for n in (2, 4, 8):
        cl = cpu.with_devices(n)
        span = GroupSpan(n, 1, n)
        share = min(1.0, 2 / n * (cl.oversubscription_efficiency if n > 2 else 1.0))
        assert Host(cl).collective_share() == pytest.approx(share)
        for op, steps in ((Collective.ALL_REDUCE, 2), (Collective.ALL_GATHER, 1),
                          (Collective.REDUCE_SCATTER, 1)):
            spec = cl.collectives.get(op.value)
            bus = spec.bus_bandwidth if spec else cl.intra_node.bandwidth
            hop = spec.latency_s if spec else cl.intra_node.latency_s
            t = collective_time(cl, op, size, span, Algorithm.RING, core_share=share).seconds
            assert t == pytest.approx(cl.collective_latency_s + steps * (n - 1) * hop
                                      + steps * (n - 1) / n * size / (bus * share)), (op, n)
    # GPUs compute and communicate on their own: no share (8 GPUs of a node at NVLink's bus
    # bandwidth, as in the first test)
    assert Host(A100).collective_share() == 1.0


def test_weights_tied_across_pipeline_stages_sum_their_gradients_once():
    """A GPT's embedding (first stage) and LM head (last stage) share one weight: after the
    data-parallel reduction its two gradients are summed with one all-reduce over the two
    pipeline ranks holding it (runtime/data_parallel.py), exposed before the step. Without
    pipeline parallelism, or with the tied layers on one rank, there is nothing to sum."""
    import dataclasses

    from autopar.plan_types import RecomputeKind, ScheduleKind
    from autopar.planner.cost_model import Candidate, CostModel, TrainingSetup
    from autopar.planner.memory import STATE_BYTES
    from autopar.planner.planning import capture_model_costs

    shape = dict(layers=2, hidden=64, heads=4, vocab=256, seq=32)
    costs = capture_model_costs("gpt", **shape)[0]
    tied = [f for f in costs.template(0).params if f in costs.template(costs.num_layers - 1).params]
    assert tied == ["lm_head.weight"]
    for devices, per_node in ((2, 2), (2, 1)):  # one node, then the two stages on two nodes
        cluster = dataclasses.replace(A100.with_devices(8), devices_per_node=per_node,
                                      nodes=devices // per_node)
        cm = CostModel(costs, cluster, TrainingSetup(8, shape["seq"], "bf16"))
        for pp, dp in ((2, 1), (1, 2)):
            c = Candidate(dp, 1, pp, 1, 2, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0,
                          False)
            st = cm.sums.staging(c)
            got = cm._tied_sum_time(c, st)
            if pp == 1:
                assert got == 0.0
                continue
            grad_bytes = shape["vocab"] * shape["hidden"] * STATE_BYTES["bf16"][1]
            span = GroupSpan(2, 2 // per_node, per_node)
            assert got == pytest.approx(collective_time(cluster, Collective.ALL_REDUCE,
                                                        grad_bytes, span).seconds)
            ev = cm.refine(cm.evaluate(c))
            with_sum = ev.prediction.breakdown["dp_comm_s"]
            plain = CostModel(costs, cluster, TrainingSetup(8, shape["seq"], "bf16"))
            plain._tied_sum_time = lambda *a: 0.0  # the same plan without the sum
            assert with_sum - plain.refine(plain.evaluate(c)).prediction.breakdown[
                "dp_comm_s"] == pytest.approx(got)


def test_gradients_reduced_after_the_backward_expose_every_bucket():
    """Cluster ``overlap_grad_reduce: false`` (Megatron-LM's local DDP of 2021-2022): the
    data-parallel all-reduce follows the backward, so all of it is exposed: the 25 MB buckets'
    all-reduces summed, each priced by planner/comm.py. Overlapped (the default), only the last
    bucket and what the backward cannot hide are, plus the SM share of the rest."""
    import dataclasses

    from autopar.errors import ClusterSpecError
    from autopar.plan_types import RecomputeKind, ScheduleKind
    from autopar.planner.cost_model import (DDP_BUCKET_BYTES, Candidate, CostModel,
                                            TrainingSetup)
    from autopar.planner.memory import STATE_BYTES
    from autopar.planner.planning import capture_model_costs

    costs = capture_model_costs("gpt2-small")[0]
    after = dataclasses.replace(A100.with_devices(8), overlap_grad_reduce=False)
    assert Cluster.from_json(after.to_json()).overlap_grad_reduce is False
    with pytest.raises(ClusterSpecError, match="overlap_grad_reduce"):
        Cluster.from_json({**A100.to_json(), "overlap_grad_reduce": "no"})
    c = Candidate(8, 1, 1, 1, 4, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0, False)
    times = {}
    for cluster in (A100.with_devices(8), after):
        cm = CostModel(costs, cluster, TrainingSetup(64, 1024, "bf16"))
        times[cluster.overlap_grad_reduce] = cm.evaluate(c).prediction.breakdown["dp_comm_s"]
    params = cm.sums.staging(c).ranks[0].params  # the whole model on one rank, the tied table once
    from autopar import models

    real = models.build("gpt2-small", device="meta", vocab=costs.template(0).params[
        "lm_head.weight"] // 768).model  # the planner's vocabulary (padded)
    assert params == sum(t.numel() for t in real.parameters())
    grads = params * STATE_BYTES["bf16"][1]
    span = GroupSpan(8, 1, 8)
    whole, rest = divmod(grads, DDP_BUCKET_BYTES)
    expected = (whole * collective_time(after, Collective.ALL_REDUCE, DDP_BUCKET_BYTES,
                                        span).seconds
                + collective_time(after, Collective.ALL_REDUCE, rest, span).seconds)
    assert times[False] == pytest.approx(expected, rel=1e-6)
    assert times[True] < times[False]
