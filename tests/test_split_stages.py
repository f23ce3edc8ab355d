"""The stage split pass: stage modules chained in one process reproduce the captured graph's loss
and gradients; what crosses each cut is the hidden state only; bad stage ranges are refused."""

from __future__ import annotations

import pytest
import torch

from autopar import capture
from autopar.errors import PassError, PlanMismatchError
from autopar.ir import META_KEY, NodeInfo, NodeKind, info
from autopar.passes.infra import PassContext, PassManager
from autopar.passes.split_stages import (
    StageInputKind,
    split_into_stages,
    split_stages,
)
from autopar.plan_types import Plan, ScheduleKind, StagePlan
from conftest import build_own_gpt, build_tiny


@pytest.fixture(scope="module")
def deep_models():
    """family -> (model, loss_fn, inputs, targets, captured), 4 blocks each (6 layers)."""
    out = {}
    gen = torch.Generator().manual_seed(5)
    for family in ("gpt", "bert", "llama"):
        zm = build_tiny(family, layers=4)
        inputs, targets = zm.example_inputs(batch=4, seq=16, generator=gen)
        out[family] = (zm.model, zm.loss_fn, inputs, targets,
                       capture(zm.model, inputs, zm.loss_fn, example_targets=targets))
    model, loss_fn = build_own_gpt(layers=4)
    tokens = torch.randint(0, 128, (4, 17), generator=gen)
    inputs, targets = (tokens[:, :-1],), (tokens[:, 1:],)
    out["own_gpt"] = (model, loss_fn, inputs, targets,
                      capture(model, inputs, loss_fn, example_targets=targets))
    return out


def run_chain(split, tensors, inputs, targets, bindings=None):
    """Run the stages one after the other, then backward stage by stage through detached cuts
    (what the pipeline does across processes). Returns the loss and the parameter gradients."""
    # parameters are trainable leaves; buffers (a rotary inv_freq, say) are plain inputs: newer
    # transformers feed inv_freq through differentiable ops, so a leaf there would collect a grad
    params = {k: torch.nn.Parameter(v.detach().clone(),
                                    requires_grad=v.is_floating_point() and not buffer)
              for k, (v, buffer) in tensors.items()}
    acts: dict[str, torch.Tensor] = {}
    saved = []
    for stage in split.stages:
        leaves = [acts[c.name].detach().requires_grad_(c.requires_grad) for c in stage.inputs]
        it = iter(leaves)
        args = []
        for ph in stage.placeholders:
            if ph.kind in (StageInputKind.PARAMETER, StageInputKind.BUFFER):
                args.append(params[ph.key])
            elif ph.kind is StageInputKind.CONSTANT:
                args.append(split.constants[ph.key])
            elif ph.kind is StageInputKind.ACTIVATION:
                args.append(next(it))
            elif ph.kind is StageInputKind.INPUT:
                args.append(inputs[ph.key])
            elif ph.kind is StageInputKind.OTHER:
                args.append(bindings[ph.key])
            else:
                args.append(targets[ph.key])
        out = stage.gm(*args)
        if stage.returns_loss:
            loss = out
        else:
            for c, o in zip(stage.outputs, out):
                acts[c.name] = o
        saved.append((leaves, out))
    grads_in: dict[str, torch.Tensor] = {}
    for stage, (leaves, out) in zip(reversed(split.stages), reversed(saved)):
        if stage.returns_loss:
            out.backward()
        else:
            pairs = [(o, grads_in[c.name]) for o, c in zip(out, stage.outputs)
                     if c.requires_grad and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for x, c in zip(leaves, stage.inputs):
            if c.requires_grad:
                grads_in[c.name] = x.grad if x.grad is not None else torch.zeros_like(x)
    return loss.detach(), {k: p.grad for k, p in params.items() if p.grad is not None}


def _tensors(model):
    """fqn -> (tensor, is_buffer)."""
    tensors = {k: (v, False) for k, v in model.named_parameters(remove_duplicate=False)}
    tensors.update({k: (v, True) for k, v in model.named_buffers()})
    return tensors


@pytest.mark.parametrize("family", ["gpt", "bert", "llama", "own_gpt"])
@pytest.mark.parametrize("ranges", [[(0, 5)], [(0, 2), (3, 5)], [(0, 0), (1, 2), (3, 4), (5, 5)],
                                    [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]])
def test_chained_stages_equal_the_whole_graph(deep_models, family, ranges):
    model, loss_fn, inputs, targets, captured = deep_models[family]
    split = split_into_stages(captured.gm, captured.layers, ranges, constants=captured.constants)
    loss, grads = run_chain(split, _tensors(model), inputs, targets)
    # reference: eager model on the same batch (independent of the captured graph)
    model.zero_grad()
    ref = loss_fn(model(*inputs), *targets)
    ref.backward()
    # fp32, same ops in the same order: only tied-weight gradient sums are reordered
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
    named = dict(model.named_parameters(remove_duplicate=False))
    for fqn, grad in grads.items():
        torch.testing.assert_close(grad, named[fqn].grad, rtol=1e-5, atol=1e-7)
    assert set(grads) == set(split.param_stages)
    model.zero_grad()


@pytest.mark.parametrize("family", ["gpt", "bert", "llama", "own_gpt"])
def test_only_the_hidden_state_crosses(deep_models, family):
    """Masks, positions, rotary tables and sizes are recomputed on each stage, not sent."""
    *_, captured = deep_models[family]
    n = len(captured.layers)
    split = split_into_stages(captured.gm, captured.layers, [(i, i) for i in range(n)],
                              constants=captured.constants)
    for stage in split.stages[:-1]:
        (cut,) = stage.outputs
        assert str(cut.spec) == "float32[b, s, 64]" and cut.requires_grad
        assert cut.shape_at(b=2, s=16) == (2, 16, 64)
    assert split.stages[-1].returns_loss and split.stages[-1].outputs == ()
    if family in ("gpt", "bert", "llama"):  # they build a mask or rotary table in "pre"
        assert all(stage.recomputed for stage in split.stages[1:-1])
    # only the first stage reads the token ids for the embedding; targets only on the last
    readers = [any(p.kind is StageInputKind.TARGET for p in s.placeholders) for s in split.stages]
    assert readers == [False] * (n - 1) + [True]
    for stage in split.stages:  # each node annotated with its stage
        for node in stage.gm.graph.nodes:
            if node.op == "call_function" and node.name not in stage.recomputed:
                assert info(node).layer in {captured.layers[i].name
                                            for i in range(stage.layers[0], stage.layers[1] + 1)}


def test_tied_weights_are_held_by_both_stages(deep_models):
    *_, captured = deep_models["gpt"]
    split = split_into_stages(captured.gm, captured.layers, [(0, 2), (3, 5)])
    assert split.shared_params() == {"lm_head.weight": (0, 1)}
    assert "lm_head.weight" in split.stages[0].params and "lm_head.weight" in \
        split.stages[1].params


def test_a_pass_inserted_node_is_split_with_its_layer(deep_models):
    """Tensor-parallel passes add call_function nodes (collectives) that keep the layer of the
    op they serve; the split follows node.meta['autopar'].layer, whatever the node is."""
    model, loss_fn, inputs, targets, captured = deep_models["own_gpt"]
    gm = captured.gm
    import copy

    gm = copy.deepcopy(gm)
    added = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and "linear" in str(node.target):
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0))
            node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
            new.meta = dict(node.meta)
            new.meta[META_KEY] = NodeInfo(NodeKind.OP, info(node).value, layer=info(node).layer,
                                          requires_grad=info(node).requires_grad)
            added += 1
    gm.recompile()
    split = split_into_stages(gm, captured.layers, [(0, 2), (3, 5)], constants=captured.constants)
    assert sum(1 for s in split.stages for n in s.gm.graph.nodes
               if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 1.0) == added > 0
    loss, _ = run_chain(split, _tensors(model), inputs, targets)
    torch.testing.assert_close(loss, loss_fn(model(*inputs), *targets).detach())


def test_other_placeholders_are_bound_by_name(deep_models):
    """A tensor-parallel program reads a communicator placeholder; the split passes any
    placeholder it does not know through as OTHER, bound by name when the stage runs."""
    import copy

    model, loss_fn, inputs, targets, captured = deep_models["own_gpt"]
    gm = copy.deepcopy(captured.gm)
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_before(first):
        scale = gm.graph.placeholder("scale")
    scale.meta[META_KEY] = NodeInfo("communicator", None)
    block = captured.layers[3]
    target = next(n for n in gm.graph.nodes if n.name == block.nodes[-1])
    with gm.graph.inserting_after(target):
        new = gm.graph.call_function(torch.ops.aten.mul.Tensor, (target, scale))
    target.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    new.meta[META_KEY] = NodeInfo(NodeKind.OP, info(target).value, layer=block.name,
                                  requires_grad=True)
    gm.recompile()
    split = split_into_stages(gm, captured.layers, [(0, 2), (3, 5)], constants=captured.constants)
    kinds = [[p.kind for p in s.placeholders] for s in split.stages]
    assert StageInputKind.OTHER not in kinds[0] and kinds[1][0] is StageInputKind.OTHER
    loss, _ = run_chain(split, _tensors(model), inputs, targets, bindings={"scale": 1.0})
    torch.testing.assert_close(loss, loss_fn(model(*inputs), *targets).detach())
    doubled, _ = run_chain(split, _tensors(model), inputs, targets, bindings={"scale": 2.0})
    assert not torch.allclose(doubled, loss)


def test_bad_stage_ranges_are_refused(deep_models):
    *_, captured = deep_models["gpt"]
    layers = captured.layers
    for ranges, match in [([(0, 2), (4, 5)], "contiguous"), ([(0, 2), (2, 5)], "contiguous"),
                          ([(0, 2), (3, 4)], "cover"), ([(0, 2), (3, 9)], "layers 0..5"),
                          ([], "no stages")]:
        with pytest.raises(PlanMismatchError, match=match):
            split_into_stages(captured.gm, layers, ranges)


def test_graph_without_loss_is_refused(deep_models):
    model, _, inputs, _, _ = deep_models["own_gpt"]
    captured = capture(model, inputs)
    with pytest.raises(PassError, match="one scalar loss"):
        split_into_stages(captured.gm, captured.layers, [(0, 2), (3, 5)])


def test_pass_form_reads_the_plan(deep_models):
    *_, captured = deep_models["bert"]
    plan = Plan(pp=2, num_micro_batches=4, schedule=ScheduleKind.ONE_F_ONE_B,
                stages=(StagePlan(0, (0, 2), 0), StagePlan(1, (3, 5), 1)))
    ctx = PassContext(captured=captured, plan=plan)
    PassManager([split_stages]).run(captured.gm, ctx)
    split = ctx.results["split_stages"]
    assert "stages_split" in ctx.properties and split.num_stages == 2
    assert [info(captured.node(n)).stage for n in captured.layers[4].nodes] == \
        [1] * len(captured.layers[4].nodes)
    with pytest.raises(PlanMismatchError, match="plan with stages"):
        PassManager([split_stages]).run(captured.gm, PassContext(captured=captured, plan=Plan()))


@pytest.mark.parametrize("sp", [False, True])
def test_cut_tensors_carry_their_tensor_parallel_placement(deep_models, sp):
    """On a tensor-parallel graph every crossing tensor carries its placement over the tp axis
    (from node.meta["autopar"]) and each rank's shape: the hidden state is replicated, or split
    along the sequence with sequence parallelism (each rank then sends 1/tp of it)."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.tensor_parallel import tensor_parallelize

    *_, captured = deep_models["own_gpt"]
    program = tensor_parallelize(captured, 2, sequence_parallel=sp, sizes={"b": 4, "s": 16})
    split = split_into_stages(program.gm, captured.layers, [(0, 2), (3, 5)],
                              constants=captured.constants)
    (cut,) = split.cut(0)
    assert cut.placement == (Shard(1) if sp else Replicate())
    assert cut.shape_at(b=4, s=16) == ((4, 8, 64) if sp else (4, 16, 64))
    assert split.stages[1].inputs == (cut,)
    plain = split_into_stages(captured.gm, captured.layers, [(0, 2), (3, 5)],
                              constants=captured.constants)
    assert plain.cut(0)[0].placement is None  # no tensor-parallel axis
