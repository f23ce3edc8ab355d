"""Tensor parallelism end to end on real gloo processes: the generated per-rank source, run at
tp = 2 and 4 with sequence parallelism off and on, gives the single-process loss and every
parameter's gradient (gathered back to full shape).

Tolerance: fp32 throughout. A sharded program sums the same products in another order (a
row-parallel GEMM adds tp partial sums; vocab-parallel cross-entropy combines per-rank
log-sum-exps), so results differ from the single-process run by rounding only: a few ulps per
reduction, ~1e-7 relative after two layers forward and backward (measured: <= 1.3e-7 absolute
on gradients of scale ~0.3). We allow 1e-5 x the largest gradient, absolute, plus 1e-4
relative: two orders of magnitude above rounding and far below any real error (a missing
all-reduce halves a gradient; a wrong slice moves it by O(1)). The absolute part matters for
gradients that are exactly zero in exact arithmetic (BERT's key bias: softmax ignores it),
where the reference itself is rounding noise of ~1e-12.
"""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.local_pool import LocalPool
from autopar.ir import info, op_name
from autopar.sharding import Collective
from autopar.tensor_parallel import Direction, tensor_parallelize
from conftest import build_tiny
from tp_helpers import (TINY_COST, block_layers, build_cumsum_mlp, build_rms_gpt,
                        check_collectives, is_megatron_block, run_rank_programs)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def shared_pool4():
    with LocalPool(4, timeout_s=300) as pool:
        yield pool

ABS = 1e-5
REL = 1e-4


def _reference(model, loss_fn, inputs, targets):
    model.zero_grad()
    loss = loss_fn(model(*inputs), *targets)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.item(), grads


def _configs(models, tp, with_graph=()):
    """(key, per-rank sources, per-rank shards, inputs, targets, graph) for every model and
    sequence-parallel setting, plus the programs and references to check against."""
    configs, programs, refs = [], {}, {}
    for family, (model, loss_fn, inputs, targets, captured) in models.items():
        refs[family] = _reference(model, loss_fn, inputs, targets)
        for sp in (False, True):
            program = tensor_parallelize(captured, tp, sequence_parallel=sp, cost=TINY_COST)
            key = (family, sp)
            programs[key] = program
            graph = None
            if key in with_graph:  # also run the per-rank fx graph the passes produced
                graph = (program.gm, [p.attribute for p in program.layouts])
            configs.append((key, [program.source(r) for r in range(tp)],
                            [program.shard_state_dict(model, r) for r in range(tp)],
                            inputs, targets, graph))
    return configs, programs, refs


def _check(results, programs, refs, tp):
    report = []
    for key, program in programs.items():
        family, _ = key
        ref_loss, ref_grads = refs[family]
        losses = [results[r][key][0] for r in range(tp)]
        assert all(abs(loss - ref_loss) <= REL * abs(ref_loss) for loss in losses), (key, losses, ref_loss)
        graph_losses = [results[r][key][2] for r in range(tp) if results[r][key][2] is not None]
        assert all(abs(g - ref_loss) <= REL * abs(ref_loss) for g in graph_losses), (key, graph_losses)
        grads = program.gather_state_dict([results[r][key][1] for r in range(tp)],
                                          check_replicas=True, atol=1e-6)
        assert set(ref_grads) <= set(grads), (key, set(ref_grads) - set(grads))
        scale = max(g.abs().max().item() for g in ref_grads.values())
        worst = 0.0
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=REL, atol=ABS * scale,
                                       msg=lambda m: f"{key} {name}: {m}")
            worst = max(worst, (grads[name] - ref).abs().max().item())
        report.append(f"{family} tp={tp} sp={key[1]}: max |grad diff| {worst:.2e} (scale {scale:.2f})")
    print("\n".join(report))


def _assert_sharded(programs):
    """The numbers above must come from sharded programs, not from every rank computing the
    whole model: Megatron's layout in every block and its collectives per block forward (2
    all-reduces; with SP 2 all-gathers + 2 reduce-scatters). LLaMA with 2 kv heads at tp 4 cannot
    split keys and values by head: their projections are split by columns and the outputs are
    all-gathered (2 more), or, with SP, re-split by all-to-alls (hidden -> sequence for k and v,
    then sequence -> heads after the grouped-query expand: 4)."""
    for (family, sp), program in programs.items():
        want = {Collective.ALL_GATHER: 2, Collective.REDUCE_SCATTER: 2} if sp else \
            {Collective.ALL_REDUCE: 2}
        if family == "llama":  # kv_heads 2 < tp 4
            want = {**want, Collective.ALL_TO_ALL: 4} if sp else {**want, Collective.ALL_GATHER: 2}
        blocks = block_layers(program)
        assert len(blocks) == 2
        for comm in program.layer_comm:
            if comm.layer not in blocks:
                continue
            assert is_megatron_block(program, comm.layer), (family, sp, comm.layer)
            got = {c: comm.count(c, Direction.FORWARD) for c in Collective}
            assert {c: n for c, n in got.items() if n} == want, (family, sp, got)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_and_backward(world, shared_pool2, shared_pool4):
    """Each TPGroup collective and its backward (Megatron's f and g, all-gather / reduce-scatter
    / all-to-all, the block-interleaved layout of fused QKV, vocab-parallel embedding and
    cross-entropy, also over targets all ignored) against the full computation on one rank:
    rounding-level agreement."""
    pool = shared_pool2 if world == 2 else shared_pool4
    for rank, errs in enumerate(pool.run(check_collectives, timeout_s=120)):
        assert len(errs) == 28
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}  # NaN too
        assert not bad, (rank, bad)


def test_tp2_matches_single_process(tiny_models, shared_pool2):
    """The fixture's models, plus the own GPT with torch's nn.RMSNorm (``aten.rms_norm``, its
    own sharding rule: replicated weight, sequence-split under SP), plus a prefix-sum mixer
    whose ``cumsum`` runs on hidden shards by the strategy borrowed from DTensor."""
    models = dict(tiny_models)
    models["rms_gpt"] = build_rms_gpt()
    models["cumsum"] = build_cumsum_mlp()
    configs, programs, refs = _configs(models, 2, with_graph={("gpt", False), ("llama", True),
                                                             ("cumsum", False)})
    for sp in (False, True):  # borrowed, sharded, and one all-reduce per block forward
        program = programs[("cumsum", sp)]
        cumsums = [info(n).strategy for n in program.sharded.graph.nodes
                   if n.op == "call_function" and op_name(n) == "cumsum"]
        assert [s.name for s in cumsums] == ["dtensor"] * 2, cumsums
        assert all(type(s.output).__name__ == "Shard" and s.output.dim == 2 for s in cumsums)
        for comm in program.layer_comm:
            if comm.layer in block_layers(program):
                got = {c: n for c in Collective if (n := comm.count(c, Direction.FORWARD))}
                if sp:  # the first block's input arrives whole: it has no all-gather
                    assert got.pop(Collective.REDUCE_SCATTER) == 1, got
                    assert got in ({}, {Collective.ALL_GATHER: 1}), got
                else:
                    assert got == {Collective.ALL_REDUCE: 1}, got
    results = shared_pool2.run(run_rank_programs, configs, timeout_s=300)
    _check(results, programs, refs, 2)


def test_tp4_matches_single_process(tiny_models, shared_pool4):
    """tp=4: GPT-2, BERT and the own GPT as in the fixture (4 heads); LLaMA twice: the
    fixture's kv_heads=2 < tp (keys and values cannot be split by head: the search replicates
    or gathers them) and heads=8, kv_heads=4 (grouped-query attention split by kv head)."""
    models = dict(tiny_models)
    zm = build_tiny("llama", heads=8, kv_heads=4)
    gen = torch.Generator().manual_seed(2)
    inputs, targets = zm.example_inputs(batch=2, seq=16, generator=gen)
    from autopar import capture

    models["llama_kv4"] = (zm.model, zm.loss_fn, inputs, targets,
                           capture(zm.model, inputs, zm.loss_fn, example_targets=targets))
    configs, programs, refs = _configs(models, 4, with_graph={("bert", True)})
    _assert_sharded(programs)
    results = shared_pool4.run(run_rank_programs, configs, timeout_s=300)
    _check(results, programs, refs, 4)
    kv4 = programs[("llama_kv4", False)]
    kv_weights = [p.placement for p in kv4.layouts if p.fqn.endswith(("k_proj.weight", "v_proj.weight"))]
    assert kv_weights and all(type(p).__name__ == "Shard" and p.dim == 0 for p in kv_weights)


def test_sequence_parallel_keeps_the_shard_of_a_gathered_gemm_input(shared_pool2, shared_pool4):
    """Under saved_gathers (active around every stage's forward) the column-parallel GEMMs after
    a sequence-parallel all-gather save this rank's shard, not the gathered input (Korthikanti
    et al. 2022, section 4.2.2): three GEMMs reading it save it three times, each time the
    shard's bytes, and the backward gathers it once more, once for the three; the gradients
    are the same as when autograd keeps the gathered tensor (bitwise: the same ops)."""
    from tp_helpers import check_saved_gathers

    for pool in (shared_pool2, shared_pool4):
        for diff, kept, gathers, shard_bytes in pool.run(check_saved_gathers, timeout_s=120):
            assert diff == 0.0
            assert kept == [shard_bytes] * 3
            assert gathers == 1


def test_a_parallelized_model_under_sequence_parallelism_keeps_shards(shared_pool2):
    """Through parallelize and the executor: a 2-block GPT under tp 2 with SP keeps the gathered
    inputs of its column-parallel GEMMs as shards (QKV and FC1 of each block: 4; the search
    splits this small head by rows), as many as the cost model counts, and the loss is the one
    without SP."""
    from autopar import Cluster, capture, models
    from autopar.planner.cost_model import CostModel, TrainingSetup
    from autopar.planner.model_costs import ModelCosts
    from tp_helpers import count_saved_gathers

    with_sp = shared_pool2.run(count_saved_gathers, True, timeout_s=300)
    without = shared_pool2.run(count_saved_gathers, False, timeout_s=300)
    assert [k for k, _ in with_sp] == [4, 4], with_sp
    assert [k for k, _ in without] == [0, 0]
    zm = models.build("gpt", dropout=0.0, layers=2, hidden=64, heads=4, vocab=128, seq=32)
    tokens = torch.randint(0, 128, (4, 33))
    costs = ModelCosts(capture(zm.model, (tokens[:, :-1],), zm.loss_fn,
                               example_targets=(tokens[:, 1:],)))
    layout = CostModel(costs, Cluster.load("cpu").with_devices(2),
                       TrainingSetup(4, 32, "fp32")).layout(2, True, 4)
    assert sum(sum(costs.split(costs.template(i), layout, 2).regather)
               for i in range(costs.num_layers)) == 4
    assert with_sp[0][1] == pytest.approx(without[0][1], rel=1e-6)


class _ConvNet(torch.nn.Module):
    """A small network of convolutions: a plain stem, a depthwise, a grouped and a pointwise
    convolution, a 1-D one over the flattened pixels, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4, bias=False)
        self.pw = nn.Conv2d(8, 16, 1, bias=False)
        self.c1 = nn.Conv1d(16, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = torch.nn.functional.gelu
        x = gelu(self.grouped(gelu(self.dw(gelu(self.stem(x))))))
        x = gelu(self.c1(self.pw(x).flatten(2)))
        return self.head(x.mean(-1))


def test_convolutions_split_by_channel_match_single_process(shared_pool2):
    """Convolutions split as Megatron splits linear layers (passes/sharding_rules.py
    ``_conv``): column (output channels), row (input channels, a partial sum all-reduced) and
    grouped (a depthwise or grouped convolution's groups divided over the ranks, no
    collective), pinned in two layouts and as the search picks; loss and every parameter's
    gradient equal one process's (fp32; 1e-4 relative, 1e-5 absolute: the sums of a split
    reduction in another order)."""
    from autopar import capture

    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    model = _ConvNet()
    loss_fn = torch.nn.functional.cross_entropy
    inputs, targets = (torch.randn(2, 3, 8, 8, generator=gen),), (torch.tensor([1, 4]),)
    captured = capture(model, inputs, loss_fn, example_targets=targets)
    convs = [n.name for n in captured.gm.graph.nodes
             if n.op == "call_function" and op_name(n) in ("conv1d", "conv2d")]
    stem, dw, grouped, pw, c1 = convs
    layouts = {
        "columns then a row": ({stem: "column", dw: "column", grouped: "column", pw: "row",
                                c1: "column"}, ["column", "grouped", "grouped", "row", "column"]),
        "column, row": ({stem: "column", dw: "column", grouped: "column", pw: "column",
                         c1: "row"}, ["column", "grouped", "grouped", "column", "row"]),
        "searched": ({}, None),
    }
    ref = _reference(model, loss_fn, inputs, targets)
    configs, programs = [], {}
    for key, (pins, names) in layouts.items():
        program = tensor_parallelize(captured, 2, cost=TINY_COST, pins=pins)
        got = [info(n).strategy.name for n in program.sharded.graph.nodes
               if n.op == "call_function" and op_name(n) in ("conv1d", "conv2d")]
        if names is not None:
            assert got == names, (key, got)
        programs[(key, False)] = program
        configs.append(((key, False), [program.source(r) for r in range(2)],
                        [program.shard_state_dict(model, r) for r in range(2)], inputs, targets,
                        None))
    dw_weight = next(p for p in programs[("columns then a row", False)].layouts
                     if p.fqn == "dw.weight")
    assert dw_weight.local_shape == (4, 1, 3, 3)  # half the groups on each rank
    results = shared_pool2.run(run_rank_programs, configs, timeout_s=300)
    _check(results, programs, {key: ref for key in layouts}, 2)
