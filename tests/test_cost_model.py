"""Compute model: roofline GEMM times with wave quantization, the TP pattern stand-in's layout
and collectives, and model FLOPs against Megatron-LM's formula."""

from __future__ import annotations

import math

import pytest

from autopar import Cluster, capture, models
from autopar.plan import GemmSharding, RecomputeKind, ScheduleKind
from autopar.planner.comm import Collective, collective_time, mesh_span
from autopar.planner.cost_model import (Candidate, CostModel, ModelCosts, TrainingSetup,
                                        gemm_time, price_layer, wave_efficiency)

A100 = Cluster.load("a100-80g")
RATE = 312e12 * 0.869


def _waves_by_assignment(batch, m, n, sms, tile):
    """Brute force: hand the output tiles to SMs round-robin; a GEMM lasts as long as the
    busiest SM, which computes whole tiles."""
    tm, tn = tile
    tm = min(tm, max(16, 2 ** math.ceil(math.log2(m))))  # skinny kernels: tile shrunk to fit
    tn = min(tn, max(16, 2 ** math.ceil(math.log2(n))))
    per_sm = [0] * sms
    for i in range(batch * math.ceil(m / tm) * math.ceil(n / tn)):
        per_sm[i % sms] += 1
    return batch * m * n / (max(per_sm) * sms * tm * tn)


@pytest.mark.parametrize("batch, m, n", [(1, 2048, 4608), (1, 2048, 12288), (1, 8192, 2304),
                                         (1, 100, 100), (16, 512, 512), (1, 13824, 128)])
def test_wave_quantization_matches_tile_assignment(batch, m, n):
    want = max(_waves_by_assignment(batch, m, n, 108, t)
               for t in ((256, 128), (128, 256), (128, 128)))
    assert wave_efficiency(batch, m, n, 108) == pytest.approx(want)
    assert wave_efficiency(batch, m, n, 0) == 1.0


def test_gemm_roofline_regimes():
    # compute-bound, one full wave of 128x128 tiles on 108 SMs
    assert wave_efficiency(1, 128 * 108, 1024, 108) == pytest.approx(1.0)
    t = gemm_time(A100, "bf16", 1, 128 * 108, 1024, 8192)
    eff = wave_efficiency(1, 128 * 108, 1024, 108)
    assert t == pytest.approx(2 * 128 * 108 * 1024 * 8192 / (RATE * eff))
    # memory-bound: a matrix-vector product streams the matrix
    t = gemm_time(A100, "bf16", 1, 1, 16384, 16384)
    assert t == pytest.approx(2 * (16384 + 16384 * 16384 + 16384) / (2.039e12 * 0.85))
    # tiny: the kernel floor
    assert gemm_time(A100, "bf16", 1, 8, 8, 8) == pytest.approx(3e-6)


@pytest.fixture(scope="module")
def shallow():
    out = {}
    for name, kw in (("gpt3-1.3b", {}), ("bert-large", {}), ("llama-7b", {})):
        spec = models.resolve_spec(name)
        zm = models.build(name, device="meta", layers=2)
        inputs, targets = zm.example_inputs(batch=2, seq=16)
        captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
        out[name] = (spec, ModelCosts(captured, depth=spec.layers))
    return out


def _block_gemms(costs):
    t = costs.template(2)
    rep = costs.captured.layers[t.representative]
    from autopar.ir import info

    return {info(costs.captured.node(n)).module_path.replace(rep.name + ".", ""): g
            for n, g in t.sharding.gemms.items()}


def test_megatron_pattern_per_family(shallow):
    gpt = _block_gemms(shallow["gpt3-1.3b"][1])
    assert gpt == {"attn.c_attn": GemmSharding.COLUMN, "attn.c_proj": GemmSharding.ROW,
                   "mlp.c_fc": GemmSharding.COLUMN, "mlp.c_proj": GemmSharding.ROW}
    llama = _block_gemms(shallow["llama-7b"][1])
    assert llama == {"self_attn.q_proj": GemmSharding.COLUMN,
                     "self_attn.k_proj": GemmSharding.COLUMN,
                     "self_attn.v_proj": GemmSharding.COLUMN,
                     "self_attn.o_proj": GemmSharding.ROW, "mlp.gate_proj": GemmSharding.COLUMN,
                     "mlp.up_proj": GemmSharding.COLUMN, "mlp.down_proj": GemmSharding.ROW}
    bert = _block_gemms(shallow["bert-large"][1])
    assert sorted(bert.values()).count(GemmSharding.COLUMN) == 4
    # BERT's masked-LM transform feeds a LayerNorm: it stays replicated; the decoder is split
    costs = shallow["bert-large"][1]
    post = costs.template(costs.num_layers - 1).sharding.gemms
    assert sorted(g.value for g in post.values()) == ["column", "replicate"]


@pytest.mark.parametrize("name", ["gpt3-1.3b", "bert-large", "llama-7b"])
@pytest.mark.parametrize("sp", [False, True])
def test_four_collectives_of_bsh_per_block(shallow, name, sp):
    """MISSION.md: TP needs 4 all-reduces of b s h per layer per micro-batch (forward and
    backward); with sequence parallelism each becomes an all-gather + reduce-scatter."""
    spec, costs = shallow[name]
    block = costs.template(2)
    kinds = sorted(kind.value for kind, _ in block.sites)
    assert kinds == ["f", "f", "g", "g"]
    cluster = A100.with_devices(8)
    span = mesh_span(cluster, 1, 1, 8, "tp")
    b, s = 2, 1024
    lc = price_layer(block, cluster, "bf16", 8, sp, b, s, 4, span)
    nbytes = b * s * spec.hidden * 2
    if sp:
        one = (collective_time(cluster, Collective.ALL_GATHER, nbytes, span).seconds
               + collective_time(cluster, Collective.REDUCE_SCATTER, nbytes, span).seconds)
        # each all-reduce becomes an all-gather on one side and a reduce-scatter on the other
        assert lc.tp_forward_s + lc.tp_backward_s == pytest.approx(4 * one)
    else:
        ar = collective_time(cluster, Collective.ALL_REDUCE, nbytes, span).seconds
        assert lc.tp_forward_s == pytest.approx(2 * ar)
        assert lc.tp_backward_s == pytest.approx(2 * ar)


def test_model_flops_equal_megatron(shallow):
    """Narayanan et al. 2021: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) FLOPs per step (no
    recompute), i.e. 3 x (24 s h^2 + 4 s^2 h) per layer + 6 s h V per sequence."""
    spec, costs = shallow["gpt3-1.3b"]
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(8, 2048))
    l, h, s, v = spec.layers, spec.hidden, 2048, spec.vocab
    want = 72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert cm.model_flops_per_sequence == pytest.approx(want, rel=1e-3)


def test_tensor_parallel_splits_the_work(shallow):
    """A block's GEMM time at tp=t is its tp=1 time over t (same wave efficiency by
    construction here: the shapes are multiples of 128 x t), backward about twice forward."""
    _, costs = shallow["gpt3-1.3b"]
    block = costs.template(2)
    cluster = A100.with_devices(8)
    one = price_layer(block, cluster, "bf16", 1, False, 4, 2048, 4, mesh_span(cluster, 8, 1, 1,
                                                                              "tp"))
    two = price_layer(block, cluster, "bf16", 2, True, 4, 2048, 4, mesh_span(cluster, 4, 1, 2,
                                                                             "tp"))
    assert two.forward_s == pytest.approx(one.forward_s / 2, rel=0.05)
    assert 1.8 < (one.backward_s + one.weight_s) / one.forward_s < 2.4


def test_candidate_checks_name_the_problem(shallow):
    _, costs = shallow["llama-7b"]
    cm = CostModel(costs, A100.with_devices(48), TrainingSetup(96, 2048))
    c = Candidate(2, 3, 8, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0, False)
    assert "does not fit inside a node" in cm.evaluate(c).infeasible
    c = Candidate(48, 1, 1, 1, 5, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0, False)
    assert "not divisible by dp x micro-batch" in cm.evaluate(c).infeasible
    c = Candidate(1, 8, 6, 2, 32, ScheduleKind.INTERLEAVED_1F1B, RecomputeKind.NONE, 0, False)
    assert "divisible by pp" in cm.evaluate(c).infeasible
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(8, 2048))
    c = Candidate(8, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0, False)
    ev = cm.evaluate(c)
    assert ev.infeasible and "GiB usable" in ev.infeasible  # 6.7B x 16 bytes > 80 GB


def test_measured_tables_replace_the_roofline():
    """A calibrated device prices a GEMM at its measured rate (exactly at a measured shape,
    between its neighbours elsewhere) and attention from its (s, d) table."""
    from autopar.planner.cost_model import table_rate

    cpu = Cluster.load("tests/fixtures/calibration/cpu-2proc.json")
    for m, n, k, rate in cpu.device.gemm_table[:5]:
        assert gemm_time(cpu, "fp32", 1, m, n, k) == pytest.approx(
            max(2 * m * n * k / rate, cpu.device.kernel_floor_s))
    rows = [(1.0, 1.0, 10.0), (4.0, 1.0, 20.0)]
    assert table_rate(rows, (1, 1)) == 10.0 and table_rate(rows, (4, 1)) == 20.0
    assert 10.0 < table_rate(rows, (2, 1)) < 20.0
    assert table_rate(rows, (2, 1)) == pytest.approx(15.0)  # the middle, in log space
    assert table_rate(rows, (1024, 1)) == pytest.approx(20.0, rel=0.01)  # flat outside
