"""Memory model: model states against the ZeRO formulas (Rajbhandari et al. 2020) and torch's own parameter
count; activations against Korthikanti et al. 2022 and against the analysis pass."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar import Cluster, capture, models
from autopar.ir import evaluate, info
from autopar.plan_types import OptimizerProfile, RecomputeKind, ScheduleKind
from autopar.planner.comm import mesh_span
from autopar.planner.cost_model import (Candidate, CostModel, ModelCosts, TrainingSetup,
                                        price_layer)
from autopar.planner.memory import model_state_bytes, optimizer_step_bytes
from conftest import build_tiny

A100 = Cluster.load("a100-80g")


@pytest.mark.parametrize("params", [1, 124_439_808, 175e9])
@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_model_states_equal_the_zero_formulas(params, n):
    """The ZeRO paper's 16 bytes per parameter with fp16 gradients (ZeRO-1 4P + 12P/N, ZeRO-2
    2P + 14P/N, ZeRO-3 16P/N); with bf16 compute the gradients are fp32 (the runtime's
    MixedPrecision.grad_dtype; tests/test_zero.py measures them): 18P, 6P + 12P/N, 2P + 16P/N,
    18P/N."""
    P = params
    want = {0: 16 * P, 1: 4 * P + 12 * P / n, 2: 2 * P + 14 * P / n, 3: 16 * P / n}
    for zero, total in want.items():
        assert model_state_bytes(P, n, zero, "fp16").total == pytest.approx(total)
    want = {0: 18 * P, 1: 6 * P + 12 * P / n, 2: 2 * P + 16 * P / n, 3: 18 * P / n}
    for zero, total in want.items():
        assert model_state_bytes(P, n, zero, "bf16").total == pytest.approx(total)
    assert model_state_bytes(P, n, 0, "bf16").weights == 2 * P
    assert model_state_bytes(P, n, 0, "bf16").gradients == 4 * P
    assert model_state_bytes(P, n, 1, "bf16").optimizer == pytest.approx(12 * P / n)


def _capture(name, **kw):
    zm = models.build(name, device="meta", **kw)
    inputs, targets = zm.example_inputs(batch=2, seq=16)
    return zm, capture(zm.model, inputs, zm.loss_fn, example_targets=targets)


@pytest.fixture(scope="module")
def gpt2_small():
    zm, captured = _capture("gpt2-small", vocab=50304)  # padded: tp divides the vocabulary
    return zm, captured, ModelCosts(captured)


def _megatron_split_params(model, tp):
    """Independent count from torch's parameters: Megatron splits the QKV/FC1 weights and biases
    (columns), the projection weights (rows, biases replicated) and the vocabulary table; the
    sharding search finds that layout and also splits the position table by hidden (one
    all-gather of s x h per micro-batch costs less than holding its replicated state)."""
    total = 0.0
    for name, p in model.named_parameters():
        split = (name.endswith(("attn.c_attn.weight", "attn.c_attn.bias", "mlp.c_fc.weight",
                                "mlp.c_fc.bias", "attn.c_proj.weight", "mlp.c_proj.weight"))
                 or name in ("transformer.wte.weight", "transformer.wpe.weight"))
        total += p.numel() / tp if split else p.numel()
    return total


@pytest.mark.parametrize("tp, zero", [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 3), (4, 1)])
def test_rank_model_states_from_the_graph(gpt2_small, tp, zero):
    zm, _, costs = gpt2_small
    dp = 8 // tp
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(64, 1024))
    ev = cm.evaluate(Candidate(dp, tp, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.FULL,
                               zero, False))
    rank = ev.ranks[0]
    P = _megatron_split_params(zm.model, tp)
    assert P == pytest.approx(sum(p.numel() for p in zm.model.parameters()) if tp == 1 else P)
    states = rank.weights + rank.gradients + rank.optimizer
    # bf16 weights, fp32 gradients, fp32 master weights and Adam moments
    want = {0: 18 * P, 1: 6 * P + 12 * P / dp, 2: 2 * P + 16 * P / dp, 3: 18 * P / dp}[zero]
    assert states == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("state", [0.0, 4.0, 12.0])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_optimizers_own_state_replaces_adams_moments(gpt2_small, state, zero):
    """``TrainingSetup.optimizer_state_bytes`` (what the runtime measures on the optimizer it
    is given: plain SGD 0, SGD with momentum 4, AdamW with amsgrad 12; tests/test_zero.py
    holds the runtime's bytes to it): a rank's optimizer state is the fp32 master and that
    state per parameter, sharded from ZeRO-1 on; the memory floor the search screens with
    stays under the peak; a device too small for Adam's states fits plain SGD's."""
    import dataclasses

    zm, _, costs = gpt2_small
    P = sum(p.numel() for p in zm.model.parameters())
    c = Candidate(8, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.FULL, zero, False)
    ev = CostModel(costs, A100.with_devices(8),
                   TrainingSetup(64, 1024, optimizer=OptimizerProfile(state_bytes=state))
                   ).evaluate(c)
    rank = ev.ranks[0]
    assert rank.optimizer == pytest.approx((4 + state) * P / (8 if zero else 1), rel=1e-9)
    assert rank.weights + rank.gradients == pytest.approx((2 + 4) * P / (8 if zero == 3 else 1),
                                                          rel=1e-9)
    adam = CostModel(costs, A100.with_devices(8), TrainingSetup(64, 1024)).evaluate(c)
    assert adam.ranks[0].total - rank.total == pytest.approx(
        (8 - state) * P / (8 if zero else 1), rel=1e-9)
    cm = CostModel(costs, A100.with_devices(8),
                   TrainingSetup(64, 1024, optimizer=OptimizerProfile(state_bytes=state)))
    assert cm.memory_floor(c) <= rank.total
    if zero == 0 and state == 0.0:  # between SGD's 10 bytes a parameter and Adam's 18
        middle = (rank.total + adam.ranks[0].total) / 2
        small = dataclasses.replace(A100.device, memory_bytes=int(
            middle + A100.device.reserved_memory_bytes))
        cluster = dataclasses.replace(A100, device=small).with_devices(8)
        assert CostModel(costs, cluster, TrainingSetup(
            64, 1024, optimizer=OptimizerProfile(state_bytes=0.0))).evaluate(c).feasible
        assert not CostModel(costs, cluster, TrainingSetup(64, 1024)).evaluate(c).feasible


class _SharedTableBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, table):
        return torch.relu(self.proj(x) + table)


class _BlocksReadingOneTable(torch.nn.Module):
    """Every block adds one table held by the model, not by the block (DeBERTa's relative
    embeddings, read by every layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(16))
        self.blocks = torch.nn.ModuleList(_SharedTableBlock() for _ in range(4))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.table)
        return self.head(x)


@pytest.mark.parametrize("depth", [None, 8])
def test_a_table_every_block_reads_is_one_tensor(depth):
    """The repeated blocks' template names its last instance's weights, each repeat its own;
    the table they all read from outside is one tensor: the states of one rank holding every
    layer count it once (captured depth, and repeated to 8 blocks), fp32 Adam: 16 bytes per
    parameter of torch's own count."""
    model = _BlocksReadingOneTable()
    x = torch.randn(4, 16)
    captured = capture(model, (x,), torch.nn.functional.cross_entropy,
                       example_targets=(torch.randint(0, 3, (4,)),))
    costs = ModelCosts(captured, depth=depth)
    cm = CostModel(costs, Cluster.load("cpu").with_devices(1),
                   TrainingSetup(global_batch=4, seq=1, dtype="fp32"))
    rank = cm.evaluate(Candidate(1, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE,
                                 0, False)).ranks[0]
    block = sum(p.numel() for p in model.blocks[0].parameters())
    params = sum(p.numel() for p in model.parameters()) + ((depth or 4) - 4) * block
    assert rank.weights + rank.gradients + rank.optimizer == 16 * params


def test_graph_activations_equal_the_analysis_pass(gpt2_small):
    """At tp=1 and the graph's own precision the activation model is the analysis pass's
    saved bytes (which tests/test_analyze.py holds to torch's saved tensors)."""
    _, captured, costs = gpt2_small
    profile = costs.profile
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(24, 256, "fp32"))
    priced = cm.layer_costs(1, False, 3)
    for index in (0, 5, 12, 13):
        t = costs.template(index)
        want = evaluate(profile.layers[t.representative].saved_bytes, b=3, s=256)
        assert priced[index].act_bytes == pytest.approx(want), index


@pytest.fixture(scope="module")
def eager_gpt():
    """A GPT-3-style block with explicit softmax and dropout: what Korthikanti et al. assume."""
    spec = dict(layers=2, hidden=1024, heads=16, vocab=1024, seq=2048)
    _, captured = _capture("gpt", attention="eager", dropout=0.1, **spec)
    return spec, ModelCosts(captured)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("b, s", [(1, 2048), (4, 512)])
def test_activations_reproduce_korthikanti(eager_gpt, tp, b, s):
    """Korthikanti et al. 2022, Table 2, per layer at 16-bit precision, with the layout the
    sharding search finds (Megatron's):

    none            s b h (34 + 5 a s / h)            TP: s b h (10 + 24/t + 5 a s/(h t))
    TP + SP         s b h (34/t + 5 a s/(h t))
    selective       TP: s b h (10 + 24/t)             TP + SP: 34 s b h / t
    full            2 s b h                           (+SP: 2 s b h / t)

    Tolerance 0.1%: the graph also keeps LayerNorm's fp32 mean and rstd (2 x 2 b s floats per
    layer, 8/(34 h) of the total at 16 bits) and the 0-d attention scale, which the paper leaves
    out. With SP the column-parallel GEMMs (QKV and FC1) keep their input's sequence shard and
    gather it again in the backward, as Megatron-LM does (runtime/tp.py ``saved_gathers``), so
    SP is the paper's too."""
    spec, costs = eager_gpt
    h, a = spec["hidden"], spec["heads"]
    # the layout is solved once, at b = 1, s = 2048 (it does not depend on b or s here), priced at
    # each (b, s)
    cm = CostModel(costs, A100.with_devices(8), TrainingSetup(8, 2048, "fp16"))
    block = costs.template(2)
    span = mesh_span(cm.cluster, 1, 1, tp, "tp")
    sbh = s * b * h
    core = 5 * a * s * s * b
    for sp in ([False, True] if tp > 1 else [False]):
        split = costs.split(block, cm.layout(tp, sp, 1), tp)
        lc = price_layer(block, split, cm.cluster, "fp16", tp, b, s, 4, span)
        if sp:
            none, selective = 34 * sbh / tp + core / tp, 34 * sbh / tp
            full = 2 * sbh / tp
        else:
            none = sbh * (10 + 24 / tp) + core / tp
            selective = sbh * (10 + 24 / tp)
            full = 2 * sbh
        assert lc.act_bytes == pytest.approx(none, rel=1e-3), ("none", sp)
        assert lc.act_selective_bytes == pytest.approx(selective, rel=1e-3), ("selective", sp)
        assert lc.ckpt_bytes == pytest.approx(full, rel=1e-3), ("full", sp)


def test_recompute_and_schedule_set_the_peak(gpt2_small):
    """1F1B's first rank holds p micro-batches, GPipe all m, each rank also the largest
    backward transient of its layers; full recompute keeps 2 s b h per block plus one block
    being recomputed."""
    _, _, costs = gpt2_small
    cm = CostModel(costs, A100.with_devices(4), TrainingSetup(32, 1024))

    def acts(sched, rec):
        ev = cm.evaluate(Candidate(1, 1, 4, 1, 1, sched, rec, 0, False))
        return ev, [r.activations for r in ev.ranks]

    ev, one = acts(ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE)
    _, gpipe = acts(ScheduleKind.GPIPE, RecomputeKind.NONE)
    zb_ev, zb = acts(ScheduleKind.ZB_H1, RecomputeKind.NONE)
    per_mb = [sum(st.activation_bytes for st in ev.stages if st.pp_rank == r) for r in range(4)]
    costs1 = cm.layer_costs(1, False, 1)

    def transient(stages):  # the largest backward transient among a rank's layers
        return [max(costs1[i].transient_bytes for st in stages if st.pp_rank == r
                    for i in range(st.layers[0], st.layers[1] + 1)) for r in range(4)]

    extra = transient(ev.stages)
    assert extra[3] == 2 * 1024 * 50304 * 2  # the logits' gradients, at the head
    assert one == pytest.approx([per_mb[r] * (4 - r) + extra[r] for r in range(4)])
    assert gpipe == pytest.approx([x * 32 + e for x, e in zip(per_mb, extra)])
    # ZB-H1: rank r defers its weight gradients by r micro-batches: p in flight on every rank
    assert zb == pytest.approx([x * 4 + e for x, e in zip(per_mb, extra)])
    # the finalists' memory comes from the schedule's action lists, per local stage: the same
    refined = cm.refine(ev)
    stage_acts = [sum(st.activation_bytes for st in refined.stages if st.pp_rank == r)
                  for r in range(4)]
    extra = transient(refined.stages)
    assert [r.activations for r in refined.ranks] == pytest.approx(
        [stage_acts[r] * (4 - r) + extra[r] for r in range(4)])
    ev_full, full = acts(ScheduleKind.ONE_F_ONE_B, RecomputeKind.FULL)
    lc = cm.layer_costs(1, False, 1)[5]
    assert lc.ckpt_bytes == pytest.approx(2 * 1024 * 768)  # 2 s b h at b = 1
    # full recompute lowers the peak, and the first rank (p micro-batches in flight) holds
    # their stage inputs only; the stage cuts may differ between the two (each split balances
    # its own stage times), so ranks are not compared one by one
    assert max(full) <= max(one) and full[0] < one[0] / 4


def test_shallow_capture_extended_equals_full_capture(gpt2_small):
    """Capturing 2 blocks and repeating the last is the same as capturing all 12."""
    zm, _, full = gpt2_small
    _, shallow_captured = _capture("gpt2-small", layers=2, vocab=50304)
    shallow = ModelCosts(shallow_captured, depth=12)
    assert shallow.num_layers == full.num_layers == 14
    assert shallow.layer_names == full.layer_names
    # the parameters of the whole model, the tied table once: torch's own count
    assert shallow.total_params == full.total_params == \
        sum(p.numel() for p in zm.model.parameters())
    cluster = A100.with_devices(16)
    a = CostModel(full, cluster, TrainingSetup(64, 1024))
    b = CostModel(shallow, cluster, TrainingSetup(64, 1024))
    for cand in [Candidate(16, 1, 1, 1, 4, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 1, False),
                 Candidate(2, 2, 4, 1, 2, ScheduleKind.ZB_H1, RecomputeKind.SELECTIVE, 0, True),
                 Candidate(1, 4, 4, 3, 1, ScheduleKind.INTERLEAVED_1F1B, RecomputeKind.FULL, 0,
                           False)]:
        for price in (lambda cm, c: cm.evaluate(c), lambda cm, c: cm.refine(cm.evaluate(c))):
            x, y = price(a, cand), price(b, cand)
            assert x.infeasible == y.infeasible
            assert x.prediction.step_time_s == pytest.approx(y.prediction.step_time_s,
                                                             rel=1e-12)
            assert x.prediction.peak_memory_bytes == y.prediction.peak_memory_bytes
            assert x.plan.stages == y.plan.stages


def test_a_cut_between_two_blocks_sends_the_tables_they_read():
    """What a pipeline cut after each layer sends, priced from the templates (one per repeated
    block, built from its last instance), against the analysis pass's own boundary tensors of
    every layer of the captured graph: a cut between two rotary blocks also sends the cos / sin
    tables made before the blocks, a cut after the last block only the hidden state. fp32, tp 1:
    bytes exactly."""
    zm, captured = _capture("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=128,
                            seq=64)
    costs = ModelCosts(captured)
    cm = CostModel(costs, Cluster.load("cpu"), TrainingSetup(global_batch=8, seq=48,
                                                             dtype="fp32"))
    b = 2
    priced = cm.layer_costs(1, False, b)
    sizes = {"b": b, "s": 48}
    want = [sum(evaluate(info(captured.node(n)).spec.nbytes, **sizes)
                for n in layer.boundary_tensors) for layer in costs.profile.layers]
    blocks = [i for i, k in enumerate(costs.kinds) if k.value == "block"]
    assert len(blocks) == 4
    # the middle blocks send more than the hidden state (the rotary tables), the last does not
    assert want[blocks[0]] > want[blocks[-1]]
    assert [lc.boundary_bytes for lc in priced] == pytest.approx(want, rel=1e-12)


def test_backward_transients_and_the_fp32_loss_under_mixed_precision():
    """Memory a layer's backward holds on top of the saved activations: the gradient of its
    largest gradient-carrying tensor and that of its input (2 x the tensor). Captured as
    parallelize captures under mixed precision (bf16 compute, the loss in fp32), in closed
    form: the embedding's output b s h in bf16, a GPT-2 block's MLP intermediate b s 4h in
    bf16, and the head's logits b s V in fp32 (the upcast the loss reads). The fp32 tensors of
    such a capture keep 4 bytes at the bf16 training precision (the layer norms' statistics and
    the loss's saved softmax); measured on an H200 these terms took GPT-2 medium's predicted
    peak from -25% to +2% (benchmarks/gpu_memory.py)."""
    from autopar.api import _capture as capture_as_trained

    zm = build_tiny("gpt")
    h, V = zm.model.config.n_embd, zm.model.config.vocab_size
    b, s = 4, 16
    inputs, targets = zm.example_inputs(batch=b, seq=s)
    mixed = ModelCosts(capture_as_trained(zm.model, inputs, zm.loss_fn, targets, True))
    plain = ModelCosts(capture_as_trained(zm.model, inputs, zm.loss_fn, targets, False))
    setup = TrainingSetup(global_batch=b, seq=s, dtype="bf16")
    one = Cluster.load("h100-80g").with_devices(1)
    lm, lp = (CostModel(c, one, setup).layer_costs(1, False, b) for c in (mixed, plain))
    assert [lc.transient_bytes for lc in lm] == [2 * b * s * h * 2, 2 * b * s * 4 * h * 2,
                                                  2 * b * s * 4 * h * 2, 2 * b * s * V * 4]
    # from an fp32 capture nothing says which tensors stay fp32: all at the training precision
    assert lp[-1].transient_bytes == 2 * b * s * V * 2
    head = mixed.template(len(lm) - 1)
    assert {t.owner for t in head.saved if t.wide} >= {"cross_entropy_loss"}
    assert not any(t.wide for t in plain.template(len(lp) - 1).saved)
    # the wide tensors make the mixed capture's saved bytes larger, never smaller
    assert all(a.act_bytes >= p.act_bytes for a, p in zip(lm, lp))
    assert lm[-1].act_bytes > lp[-1].act_bytes
    # and the rank's peak holds the largest transient (no recompute, one micro-batch)
    cm = CostModel(mixed, one, setup)
    ev = cm.evaluate(Candidate(1, 1, 1, 1, b, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0,
                               False))
    assert ev.ranks[0].activations == pytest.approx(sum(lc.act_bytes for lc in lm)
                                                    + 2 * b * s * V * 4)


class _NewStorageBytes(TorchDispatchMode):
    """Live bytes of the storages the ops run inside allocate (not those of ``known`` tensors),
    and their peak: what an operation allocates on top of the tensors it is given."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.alive: set[int] = set()  # new storages not yet freed (the allocator reuses addresses)
        self.live = self.peak = 0

    def _free(self, ptr: int, n: int) -> None:
        self.alive.discard(ptr)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
            if ptr is not None and ptr not in self.known and ptr not in self.alive:
                self.alive.add(ptr)
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, ptr, n)
        return out


def _buckets(*sizes: int) -> list[torch.nn.Parameter]:
    buckets = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in buckets:
        p.grad = torch.randn_like(p)
    return buckets


def _second_step_peak(opt: torch.optim.Optimizer, buckets: list[torch.nn.Parameter]) -> int:
    """The most bytes ``opt``'s second step holds at once beyond its parameters, gradients and
    state (the first step builds the state)."""
    opt.step()
    held = buckets + [p.grad for p in buckets] + [
        v for state in opt.state.values() for v in state.values()]
    counter = _NewStorageBytes(held)
    with counter:
        opt.step()
    return counter.peak


@pytest.mark.parametrize("kernel", ["foreach", "for-loop", "fused"])
def test_optimizer_step_temporary_is_torchs(kernel):
    """What torch's AdamW allocates during a step, counted op by op: the foreach path (CUDA's
    default) one fp32 temporary per stepped element, the for-loop path (the CPU's) two of the
    largest tensor, here flat buckets as the runtime steps them, the fused kernel none:
    ``optimizer_step_bytes`` of each kernel."""
    from autopar.plan_types import OptimizerKernel

    buckets = _buckets(300_000, 120_000, 7)
    options = {"foreach": {"foreach": True}, "for-loop": {"foreach": False},
               "fused": {"fused": True}}[kernel]
    peak = _second_step_peak(torch.optim.AdamW(buckets, lr=1e-3, **options), buckets)
    stepped = sum(p.numel() for p in buckets)
    # the defaults: foreach on a GPU (separate_host), the for-loop on a CPU
    want = {"foreach": optimizer_step_bytes(stepped, "none", separate_host=True),
            "for-loop": optimizer_step_bytes(300_000, "none", separate_host=False),
            "fused": optimizer_step_bytes(stepped, "none", separate_host=True,
                                          kernel=OptimizerKernel.FUSED)}[kernel]
    # the step counters and bias corrections: a few scalar tensors per bucket
    assert want <= peak <= want + 64 * len(buckets)
    assert optimizer_step_bytes(stepped, "optimizer", separate_host=True) == 0.0


@pytest.mark.parametrize("optimizer,options,gpu", [
    (torch.optim.AdamW, {}, False), (torch.optim.AdamW, {}, True),
    (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}, True),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, False),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, True),
    (torch.optim.SGD, {"lr": 0.1}, True), (torch.optim.Adagrad, {}, False),
    (torch.optim.RMSprop, {"momentum": 0.9}, True)])
def test_counted_step_temporaries_predict_the_step_peak(optimizer, options, gpu):
    """The temporaries ``step_cost`` counts on 64 x 64 probes predict what a step over other
    tensors allocates (five buckets of 30,000 elements and one of 7, counted by storage as
    the test above counts them): ``optimizer_step_bytes`` with the counted step, where AdamW's
    kernel formula would price SGD's and Adagrad's steps as AdamW's."""
    from autopar.runtime.optim import OptimizerFactory

    step = OptimizerFactory(optimizer, options).step_cost(gpu=gpu)
    buckets = _buckets(*(30_000,) * 5, 7)
    opt = optimizer(buckets, **options)
    if gpu:  # the path torch takes for CUDA tensors, on these CPU ones
        for group in opt.param_groups:
            if group.get("foreach") is None:
                group["foreach"] = True
    peak = _second_step_peak(opt, buckets)
    stepped = sum(p.numel() for p in buckets)
    want = optimizer_step_bytes(stepped, "none", separate_host=gpu, step=step, largest=30_000)
    # the scalar step counters and bias corrections: a few bytes per bucket
    assert want <= peak <= want + 64 * len(buckets), (step, peak)


def test_a_cpu_ranks_step_temporary_is_its_largest_parameters():
    """On a CPU the for-loop AdamW steps one parameter at a time: its temporaries are those of
    the rank's largest parameter (12 bytes an element, counted on probes), not of every
    parameter it steps (a 0.3M-parameter GPT whose tied 512 x 64 embedding is its largest
    tensor). Against the same model's real AdamW step counted by storage: the prediction is a
    bound within the 4 bytes the previous tensor's denominator adds (8 of 12 where the next
    tensor is smaller)."""
    from autopar.runtime.optim import OptimizerFactory

    spec = dict(layers=6, hidden=64, heads=4, vocab=512, seq=32, dropout=0.0)
    _, captured = _capture("gpt", **spec)
    profile = OptimizerFactory(torch.optim.AdamW, {"lr": 1e-3}).profile(gpu=False)
    cm = CostModel(ModelCosts(captured), Cluster.load("cpu").with_devices(1),
                   TrainingSetup(8, 32, "fp32", optimizer=profile))
    ev = cm.evaluate(Candidate(1, 1, 1, 1, 8, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, 0,
                               False))
    model = models.build("gpt", **spec).model
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    peak = _second_step_peak(torch.optim.AdamW(params, lr=1e-3), params)
    largest = max(p.numel() for p in params)
    assert largest == 512 * 64 and ev.ranks[0].optimizer_step == 12 * largest
    assert peak <= ev.ranks[0].optimizer_step <= 1.5 * peak
    # every parameter's 12 bytes, as priced before: 10x what the step holds
    assert 12 * sum(p.numel() for p in params) > 10 * peak


def test_the_step_temporary_sets_the_peak_when_activations_are_small(gpt2_small):
    """A rank's peak is its states plus the larger of its activations (with ZeRO-3's buffers)
    and the optimizer step's temporary: 4 bytes per stepped parameter on a GPU, the rank's
    ZeRO share; the stage ILP's memory constraint (C7) bounds the same sum."""
    _, _, costs = gpt2_small
    cm = CostModel(costs, A100.with_devices(4), TrainingSetup(4, 128))
    for zero, dp in ((0, 4), (1, 4), (3, 4)):
        ev = cm.evaluate(Candidate(dp, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B,
                                   RecomputeKind.FULL, zero, False))
        r = ev.ranks[0]
        P = sum(p.numel() for p in gpt2_small[0].model.parameters())
        assert r.optimizer_step == pytest.approx(4 * P / (dp if zero else 1))
        assert r.total == pytest.approx(r.states + max(r.activations + r.buffers,
                                                       r.optimizer_step))
        assert ev.prediction.peak_memory_bytes == int(r.total)
        if zero == 0:  # 2 x 128 tokens of GPT-2 small: the temporary is the larger
            assert r.optimizer_step > r.activations + r.buffers
    off = cm.evaluate(Candidate(4, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.FULL,
                                0, False, offload="optimizer"))
    assert off.ranks[0].optimizer_step == 0.0


def test_the_stage_ilp_bounds_the_step_temporary():
    """Two ranks, the last layer three times the others: the time-optimal cut puts three layers
    on rank 0, which the activations alone allow; once the optimizer step's temporary is priced
    (C7) it no longer fits, and the ILP, the closed form and brute force agree on the cut."""
    from autopar.planner.stage_partition import (LayerCosts, PartitionProblem,
                                                 brute_force_partition, partition_stages)
    from autopar.planner.stage_problem import rank_memory

    layers = [LayerCosts(f"l{i}", t, 2 * t, 0.0, params=100.0, activation_bytes=10.0)
              for i, t in enumerate((1.0, 1.0, 1.0, 3.0))]
    base = dict(layers=layers, num_ranks=2, num_microbatches=4, device_memory=8 * 300 + 100,
                state_bytes_per_param=8.0)
    loose = PartitionProblem(**base)
    tight = PartitionProblem(**base, step_bytes_per_param=4.0)
    assert partition_stages(loose).ranges == ((0, 2), (3, 3))
    assert max(rank_memory(tight, [(0, 2), (3, 3)])) == pytest.approx(8 * 300 + 4 * 300)
    got = partition_stages(tight)
    assert got.ranges == brute_force_partition(tight).ranges == ((0, 1), (2, 3))
    assert max(got.rank_memory) <= tight.device_memory


def test_the_searchs_memory_screen_reads_the_peak_of_every_rank(gpt2_small):
    """The search screens memory first (``evaluate(memory_first=True)``) with the busiest rank
    only; reference: the full evaluation's per-rank memory (``rank_memory``). Over ZeRO
    stages, resharding, offload, schedules and pipeline depths on a device made small enough
    that most do not fit: an over-memory candidate is returned with the same peak (exactly:
    the same sums), the same busiest rank and reason, and the least any rank needs without
    its optimizer state; one that fits is the full evaluation."""
    import dataclasses

    _, _, costs = gpt2_small
    small = dataclasses.replace(A100.device, memory_bytes=3 * 2**30)
    cluster = dataclasses.replace(A100, device=small).with_devices(8)
    cm = CostModel(costs, cluster, TrainingSetup(64, 1024))
    seen = {True: 0, False: 0}
    for pp, v, schedule in ((1, 1, ScheduleKind.ONE_F_ONE_B), (4, 1, ScheduleKind.ONE_F_ONE_B),
                            (2, 2, ScheduleKind.INTERLEAVED_1F1B), (4, 1, ScheduleKind.ZB_H1)):
        for zero in (0, 1, 2, 3):
            for reshard in ((True, False) if zero == 3 else (True,)):
                for offload in ("none", "optimizer"):
                    for recompute in (RecomputeKind.NONE, RecomputeKind.FULL):
                        c = Candidate(8 // pp, 1, pp, v, 1, schedule, recompute, zero, False,
                                      reshard_after_forward=reshard, offload=offload)
                        full = cm.evaluate(c)
                        screened = cm.evaluate(c, memory_first=True)
                        seen[full.feasible] += 1
                        if full.feasible:
                            assert screened == full
                            continue
                        peak = max(full.ranks, key=lambda r: r.total)
                        assert screened.ranks == (peak,)
                        assert screened.infeasible == full.infeasible
                        assert screened.extra["peak_memory_bytes"] == peak.total
                        assert screened.extra["least_without_optimizer_bytes"] == min(
                            r.total - r.optimizer for r in full.ranks)
    assert seen[True] >= 5 and seen[False] >= 20, seen


def test_receives_posted_ahead_are_charged_per_transport(gpt2_small):
    """A receive posted ahead of its compute holds a boundary tensor (b s h at the precision's
    activation bytes, per tp rank) on top of the activations: on NCCL (paired by order, each
    receive posted where its send is) as many as the lists hold (interleaved 1F1B at p = 4: 3
    on the first rank, 2 on the others; 1F1B one on every rank but the first, GPipe none), on
    gloo one per rank (posted one compute ahead); reference: the counts on the lowered lists
    (tests/test_schedules.py) and the executor's (tests/test_pipeline.py)."""
    import dataclasses

    _, _, costs = gpt2_small
    gloo = dataclasses.replace(A100, backend="gloo").with_devices(4)

    def buffers(cluster, schedule, v):
        cm = CostModel(costs, cluster, TrainingSetup(32, 1024, dtype="fp32"))
        ev = cm.evaluate(Candidate(1, 1, 4, v, 1, schedule, RecomputeKind.NONE, 0, False))
        return [r.buffers for r in ev.ranks]

    boundary = 1 * 1024 * 768 * 4  # b s h in fp32
    nccl = A100.with_devices(4)
    assert buffers(nccl, ScheduleKind.INTERLEAVED_1F1B, 2) == [3 * boundary] + [2 * boundary] * 3
    assert buffers(nccl, ScheduleKind.ONE_F_ONE_B, 1) == [0.0] + [boundary] * 3
    assert buffers(nccl, ScheduleKind.GPIPE, 1) == [0.0] * 4
    assert buffers(gloo, ScheduleKind.ONE_F_ONE_B, 1) == [boundary] * 4
