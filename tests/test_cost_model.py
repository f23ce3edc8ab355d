"""Compute model: roofline GEMM times with wave quantization, the sharding search's layout and
collectives as the cost model prices them, and model FLOPs against Megatron-LM's formula."""

from __future__ import annotations

import math

import pytest
import torch

from autopar import Cluster, capture, models
from autopar.plan_types import GemmSharding, OptimizerProfile, RecomputeKind, ScheduleKind
from autopar.planner.comm import Collective, collective_time, mesh_span
from autopar.planner.cost_model import (Candidate, CostModel, ModelCosts, TrainingSetup,
                                        gemm_time, wave_efficiency)

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


def _split_k_by_assignment(batch, m, n, k, sms, tile, splits):
    """Brute force: the tiles each cut into ``splits`` K-slices of equal depth, handed to SMs
    round-robin; the GEMM lasts as long as the busiest SM (whole slices)."""
    tm, tn = tile
    tm = min(tm, max(16, 2 ** math.ceil(math.log2(m))))
    tn = min(tn, max(16, 2 ** math.ceil(math.log2(n))))
    per_sm = [0] * sms
    for i in range(batch * math.ceil(m / tm) * math.ceil(n / tn) * splits):
        per_sm[i % sms] += 1
    return batch * m * n * splits / (max(per_sm) * sms * tm * tn)


@pytest.mark.parametrize("batch, m, n, k", [(1, 64, 576, 100352), (1, 256, 256, 4096),
                                            (4, 64, 64, 8192), (1, 64, 576, 512),
                                            (1, 2048, 4608, 12288)])
def test_split_k_fills_the_sms_a_small_output_leaves_idle(batch, m, n, k):
    """A weight gradient of a convolution (64 x 576 outputs summed over 100k pixels) has 5
    tiles for 108 SMs: cut K into slices (split-K, as cuBLAS and CUTLASS do), each at least
    SPLIT_K_MIN deep. Reference: brute-force assignment of every tile's slices to the SMs, best
    tile and power-of-two split up to one wave; a GEMM with enough tiles is not split."""
    from autopar.planner.kernels import SPLIT_K_MIN, gemm_tiling

    best = (0.0, 1)
    for tile in ((256, 128), (128, 256), (128, 128)):
        s = 1
        while True:
            tiles = batch * math.ceil(m / min(tile[0], max(16, 2 ** math.ceil(math.log2(m))))) \
                * math.ceil(n / min(tile[1], max(16, 2 ** math.ceil(math.log2(n)))))
            if s > 1 and (tiles * s > 108 or k / s < SPLIT_K_MIN):
                break
            eff = min(_split_k_by_assignment(batch, m, n, k, 108, tile, s), 1.0)
            if eff > best[0] + 1e-12:
                best = (eff, s)
            s *= 2
    assert gemm_tiling(batch, m, n, k, 108) == pytest.approx(best)
    if batch * m * n >= 108 * 128 * 128:
        assert gemm_tiling(batch, m, n, k, 108)[1] == 1
    assert gemm_tiling(1, 64, 576, 100352, 108)[0] > 0.6  # 5 tiles x 16 slices of 6272
    assert wave_efficiency(1, 64, 576, 108) < 0.05  # one partial wave of 5 tiles


def test_a_convolution_is_priced_as_its_implicit_gemm():
    """A convolution's time is its implicit GEMM's (M = batch x output pixels, N = output
    channels per group, K = input channels per group x kernel: NVIDIA's convolution guide) at
    the GEMM rate of that shape, its bytes those it moves (input, weight, output once): a
    3 x 3 convolution of ResNet-50's first stage is compute-bound at the GEMM rate, its
    weight gradient split over K, and a depthwise one (N = 1) costs its bytes or its tiles'
    waste. Priced through the captured layer and ``price_layer`` on the A100 preset, against
    those closed forms; under tp 2 the column split halves N, the grouped one the groups."""
    import torch.nn as nn

    from autopar import capture
    from autopar.planner.cost_model import ModelCosts
    from autopar.planner.kernels import conv_times, gemm_tiling
    from autopar.planner.layer_costs import price_layer

    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
            self.dw = nn.Conv2d(64, 64, 7, padding=3, groups=64, bias=False)
            self.pool = nn.AdaptiveAvgPool2d(1)  # a layer of its own, with the loss

        def forward(self, x):
            return self.pool(self.dw(self.conv(x)))

    x = torch.randn(2, 64, 56, 56)
    captured = capture(Convs(), (x,), lambda out: out.square().mean())
    costs = ModelCosts(captured)
    d = A100.device
    rate = d.peak("bf16") * d.gemm_efficiency
    b = 32
    pixels = b * 56 * 56
    moved = 2 * (2 * pixels * 64)  # bf16 input and output; the weights are small
    want_f = {"conv": 2 * pixels * 64 * 576 / (rate * gemm_tiling(1, pixels, 64, 576, 108)[0]),
              "dw": conv_times(A100, "bf16", 64, pixels, 1, 49, 49, b,
                                moved + 2 * 64 * 49)[0]}
    want_w = {"conv": 2 * pixels * 64 * 576 / (rate * gemm_tiling(1, 64, 576, pixels, 108)[0])}
    for i, name in enumerate(costs.layer_names):
        if name not in want_f:
            continue
        tmpl = costs.template(i)
        lc = price_layer(tmpl, costs.split(tmpl, None, 1), A100, "bf16", 1, b, 1, 4, None)
        assert lc.forward_s >= want_f[name]
        # plus at most one other node of the layer at the kernel floor (3 us)
        assert lc.forward_s == pytest.approx(want_f[name], abs=d.kernel_floor_s * 1.01), name
        if name == "conv":
            # plus the gradient's accumulation into .grad (a small weight: the kernel floor)
            assert lc.weight_s == pytest.approx(want_w[name] + d.kernel_floor_s, rel=1e-6)
            assert lc.weight_s < 2 * lc.forward_s  # split-K: not 20 x its forward
    assert want_f["conv"] > 2 * pixels * 64 * 576 / rate * 0.99  # compute-bound at the rate
    # tp 2: the plain convolution by columns (N = 32), the depthwise one by groups (32 of 64)
    import dataclasses

    from autopar.planner.layer_templates import Split

    for name, dims in (("conv", (1, pixels, 32, 576, 9, b)),
                       ("dw", (32, pixels, 1, 49, 49, b))):
        i = costs.layer_names.index(name)
        tmpl = costs.template(i)
        split = costs.split(tmpl, None, 1)
        halved = dataclasses.replace(split, gemm=[Split.COLUMN, *split.gemm[1:]],
                                     divisor=[2, *split.divisor[1:]], cache={})
        term = tmpl.terms[0]
        moved = tmpl.values(b, 1)[term.index + 4] * 2 / 4 / 2  # bf16 of the fp32 graph, half
        lc = price_layer(tmpl, halved, A100, "bf16", 2, b, 1, 4, None)
        assert lc.forward_s == pytest.approx(conv_times(A100, "bf16", *dims, moved)[0],
                                             abs=d.kernel_floor_s * 1.01), name


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


def test_the_optimizer_step_moves_what_its_kernel_moves():
    """On a GPU preset (no measured rate), an AdamW step of P parameters streams what torch's
    kernel moves: the fused kernel reads weights, gradients and both moments once and writes
    three (28 bytes), foreach runs the for-loop's nine ops batched (84: each op's operands read
    and its result written, torch/optim/adamw.py); torch's default on a GPU is foreach. The
    step of a one-device plan is priced so."""
    from autopar.plan_types import OptimizerKernel, OptimizerStep
    from autopar.planner.kernels import offloaded_optimizer_time, optimizer_time

    P = 355e6  # GPT-2 medium
    stream = A100.device.memory_bandwidth * A100.device.memory_efficiency
    assert optimizer_time(A100, P, kernel=OptimizerKernel.FUSED) == pytest.approx(28 * P / stream)
    for kernel in (None, OptimizerKernel.FOREACH, OptimizerKernel.FOR_LOOP):
        assert optimizer_time(A100, P, kernel=kernel) == pytest.approx(84 * P / stream)
    # another optimizer's step streams what it moves (SGD with momentum: 32 bytes, foreach)
    sgd = OptimizerStep(32.0, 3.0)
    assert optimizer_time(A100, P, step=sgd) == pytest.approx(32 * P / stream)
    assert offloaded_optimizer_time(A100, P, "none", 2.0, step=sgd) == \
        pytest.approx(32 * P / stream)
    zm = models.build("gpt2-small", device="meta", layers=2)
    inputs, targets = zm.example_inputs(batch=2, seq=16)
    costs = ModelCosts(capture(zm.model, inputs, zm.loss_fn, example_targets=targets))
    one = A100.with_devices(1)
    steps = {}
    for kernel in (None, "fused"):
        cm = CostModel(costs, one, TrainingSetup(8, 1024, "bf16",
                                                 optimizer=OptimizerProfile(kernel)))
        ev = cm.evaluate(Candidate(1, 1, 1, 1, 8, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE,
                                   0, False))
        steps[kernel] = ev.prediction.breakdown["optimizer_s"]
    assert steps[None] == pytest.approx(3 * steps["fused"])


@pytest.fixture(scope="module")
def shallow():
    out = {}
    for name in ("gpt3-1.3b", "bert-large", "llama-7b"):
        spec = models.resolve_spec(name)
        vocab = -(-spec.vocab // 128) * 128  # padded as autopar plan does: tp divides it
        zm = models.build(name, device="meta", layers=2, vocab=vocab)
        inputs, targets = zm.example_inputs(batch=2, seq=16)
        captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
        out[name] = (spec, ModelCosts(captured, depth=spec.layers))
    return out


def _cost_model(costs, n=8, batch=8, seq=1024, dtype="bf16"):
    return CostModel(costs, A100.with_devices(n), TrainingSetup(batch, seq, dtype))


def _gemms(costs, layer, layout):
    """module path (inside the layer) -> the sharding search's choice for its GEMMs."""
    rep = costs.captured.layers[costs.template(layer).representative]
    from autopar.ir import info

    return {info(costs.captured.node(n)).module_path.replace(rep.name + ".", ""): g
            for n, g in layout.gemm_sharding.items() if n in rep.nodes}


def test_the_sharding_search_finds_megatron_per_family(shallow):
    """The cost model's layout is the sharding ILP's (passes/shard.py), solved once per (tp, sp)
    and micro-batch on the captured graph: Megatron's column/row pairs in every family."""
    gpt3 = shallow["gpt3-1.3b"][1]
    gpt = _gemms(gpt3, 2, _cost_model(gpt3).layout(8, False, 1))
    assert gpt == {"attn.c_attn": GemmSharding.COLUMN, "attn.c_proj": GemmSharding.ROW,
                   "mlp.c_fc": GemmSharding.COLUMN, "mlp.c_proj": GemmSharding.ROW}
    llama_costs = shallow["llama-7b"][1]
    llama = _gemms(llama_costs, 2, _cost_model(llama_costs).layout(8, True, 1))
    assert llama == {"self_attn.q_proj": GemmSharding.COLUMN,
                     "self_attn.k_proj": GemmSharding.COLUMN,
                     "self_attn.v_proj": GemmSharding.COLUMN,
                     "self_attn.o_proj": GemmSharding.ROW, "mlp.gate_proj": GemmSharding.COLUMN,
                     "mlp.up_proj": GemmSharding.COLUMN, "mlp.down_proj": GemmSharding.ROW}
    bert_costs = shallow["bert-large"][1]
    layout = _cost_model(bert_costs, seq=512).layout(8, False, 1)
    bert = _gemms(bert_costs, 2, layout)
    assert sorted(g.value for g in bert.values()) == ["column"] * 4 + ["row"] * 2
    # the masked-LM decoder (the vocabulary GEMM) is split by columns
    post = _gemms(bert_costs, bert_costs.num_layers - 1, layout)
    assert GemmSharding.COLUMN in post.values()


@pytest.mark.parametrize("name", ["gpt3-1.3b", "bert-large", "llama-7b"])
@pytest.mark.parametrize("sp", [False, True])
def test_four_collectives_of_bsh_per_block(shallow, name, sp):
    """Narayanan et al. 2021 (Megatron-LM, section 3.1): TP needs 4 all-reduces of b s h per layer per micro-batch (forward and
    backward); with sequence parallelism each becomes an all-gather + reduce-scatter (and the
    norm weights' and row biases' gradients, used on sequence shards, get an all-reduce of h
    elements each). The cost model prices the program's own collectives."""
    spec, costs = shallow[name]
    b, s, tp = 2, 1024, 8
    cm = _cost_model(costs, seq=s)
    lc = cm.layer_costs(tp, sp, b)[2]
    bsh = b * s * spec.hidden * 2  # bf16
    big = sorted((kind, direction) for kind, direction, nbytes in lc.tp_calls if nbytes == bsh)
    small = [(kind, nbytes) for kind, _, nbytes in lc.tp_calls if nbytes != bsh]
    if sp:
        assert big == sorted([("all-gather", "forward"), ("reduce-scatter", "backward")] * 2
                             + [("reduce-scatter", "forward"), ("all-gather", "backward")] * 2)
        assert small and all(kind == "all-reduce" and nbytes <= 4 * spec.hidden
                             for kind, nbytes in small)
    else:
        assert big == [("all-reduce", "backward")] * 2 + [("all-reduce", "forward")] * 2
        assert small == []
    span = mesh_span(cm.cluster, 1, 1, tp, "tp")
    fwd = sum(collective_time(cm.cluster, Collective(kind), nbytes, span).seconds
              for kind, d, nbytes in lc.tp_calls if d == "forward")
    bwd = sum(collective_time(cm.cluster, Collective(kind), nbytes, span).seconds
              for kind, d, nbytes in lc.tp_calls if d == "backward")
    assert (lc.tp_forward_s, lc.tp_backward_s) == pytest.approx((fwd, bwd))


def test_model_flops_equal_megatron(shallow):
    """Narayanan et al. 2021: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) FLOPs per step (no
    recompute), i.e. 3 x (24 s h^2 + 4 s^2 h) per layer + 6 s h V per sequence."""
    spec, costs = shallow["gpt3-1.3b"]
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(8, 2048))
    l, h, s, v = spec.layers, spec.hidden, 2048, -(-spec.vocab // 128) * 128
    want = 72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert cm.model_flops_per_sequence == pytest.approx(want, rel=1e-3)


def test_tensor_parallel_splits_the_work(shallow):
    """A block's GEMM time at tp=t is its tp=1 time over t (same wave efficiency by
    construction here: the shapes are multiples of 128 x t), backward about twice forward."""
    _, costs = shallow["gpt3-1.3b"]
    cm = _cost_model(costs, seq=2048)
    one = cm.layer_costs(1, False, 4)[2]
    two = cm.layer_costs(2, True, 4)[2]
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


def test_a_tp_the_model_does_not_divide_is_refused_with_the_search_s_reason(shallow):
    """The sharding search's own check (tensor_parallelize, strict): heads and vocabulary must
    divide by tp, as the runtime requires (16 heads over tp=3, on 6-device nodes)."""
    _, costs = shallow["gpt3-1.3b"]
    cm = CostModel(costs, A100.with_devices(6, devices_per_node=6), TrainingSetup(8, 1024))
    c = Candidate(2, 3, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0, False)
    reason = cm.evaluate(c).infeasible
    assert "ShardingError" in reason and "16 heads" in reason


def test_zero3_under_a_split_backward_pays_a_third_gather(shallow):
    """ZeRO-3 gathers a stage's parameters for its forward and its backward; a zero-bubble
    schedule's weight-gradient action gathers them once more (the input-gradient action's end
    freed them: runtime/data_parallel.py), so its data-parallel time is at least 1F1B's at the
    same shape, and ZeRO-2 (nothing gathered) pays no such term."""
    _, costs = shallow["llama-7b"]
    cm = CostModel(costs, A100.with_devices(64), TrainingSetup(256, 2048))

    def dp_comm(schedule, zero):
        ev = cm.evaluate(Candidate(16, 1, 4, 1, 1, schedule, RecomputeKind.FULL, zero, False))
        assert not ev.infeasible, ev.infeasible
        return ev.prediction.breakdown["dp_comm_s"]

    zb3, one3 = dp_comm(ScheduleKind.ZB_H1, 3), dp_comm(ScheduleKind.ONE_F_ONE_B, 3)
    assert zb3 > one3 > dp_comm(ScheduleKind.ONE_F_ONE_B, 2)
    assert dp_comm(ScheduleKind.ZB_H1, 2) == pytest.approx(dp_comm(ScheduleKind.ONE_F_ONE_B, 2))


def test_zero3_kept_gathered_trades_memory_for_gathers(shallow):
    """reshard_after_forward=False (FSDP's option): the backward gathers nothing, so the data-
    parallel time falls by the backward's all-gathers, and the rank holds its whole stage's
    weights gathered (bf16: 2 bytes per parameter) instead of two layers'. Below ZeRO-3 the
    flag changes nothing, and the search only offers it at ZeRO-3."""
    from autopar.planner.search import SearchSpace, enumerate_candidates

    _, costs = shallow["llama-7b"]
    cm = CostModel(costs, A100.with_devices(64), TrainingSetup(256, 2048))

    def evaluate(zero, reshard):
        ev = cm.evaluate(Candidate(16, 1, 4, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.FULL,
                                   zero, False, reshard_after_forward=reshard))
        assert not ev.infeasible, ev.infeasible
        return ev

    kept, freed = evaluate(3, False), evaluate(3, True)
    assert kept.plan.reshard_after_forward is False and freed.plan.reshard_after_forward
    assert kept.prediction.breakdown["dp_comm_s"] < freed.prediction.breakdown["dp_comm_s"]
    # LLaMA-7B's block: 4 x 4096^2 attention + 3 x 4096 x 11008 MLP + two norms; 8 blocks per
    # rank at pp=4, and at most the 32000 x 4096 embedding or head beside them. The peak rank
    # holds them gathered in bf16 where the resharded run holds two blocks.
    block = 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096
    extra = kept.prediction.peak_memory_bytes - freed.prediction.peak_memory_bytes
    assert 2 * 6 * block <= extra <= 2 * (8 * block + 32000 * 4096), extra
    two = evaluate(2, False)
    assert two.prediction.step_time_s == evaluate(2, True).prediction.step_time_s
    space = enumerate_candidates(cm, SearchSpace(dp=16, tp=1, pp=4))
    assert {c.reshard_after_forward for c in space if c.zero < 3} == {True}
    assert {c.reshard_after_forward for c in space if c.zero == 3} == {True, False}


def test_a_shallow_capture_extends_to_the_real_depth_with_the_real_names(shallow):
    """The two captured blocks of LLaMA-7B stand for its 32: 34 layers whose block names are the
    model's own (``model.layers.0`` .. ``model.layers.31``), in the plan report's spelling, and
    the captured block's template reused for every added one."""
    from autopar.ir import next_block_names

    spec, costs = shallow["llama-7b"]
    blocks = [n for n, k in zip(costs.layer_names, costs.kinds) if k.value == "block"]
    assert blocks == [f"model.layers.{i}" for i in range(spec.layers)]
    assert costs.num_layers == spec.layers + 2
    assert len({id(costs.template(i)) for i in range(2, spec.layers + 1)}) == 1
    assert next_block_names("3", 2) == ["4", "5"]  # an nn.Sequential's children
    assert next_block_names("enc.block", 2) == ["enc.block_1", "enc.block_2"]
