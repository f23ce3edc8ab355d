"""Selective activation recompute in one process (passes/recompute.py, runtime/recompute.py).

The model: HF GPT-2 with eager attention (explicit softmax: what Korthikanti et al.'s activation
formulas assume) and dropout 0.1, 2 blocks of hidden h=64 with a=4 heads, at b=2, s=32 (so that
``s`` differs from the head size 16 and from h), turned into autopar's per-rank program (tp=1:
its plan-independent dropout) and cut like a pipeline's middle stage: the two blocks (layers
1-2), receiving the hidden state. Per micro-batch of that stage:

- structure: one attention core per block, ``Q K^T`` ... ``P V``; the tensor-parallel program
  (tp=2, SP) has the same cores with no collective inside; fused attention without dropout has
  none;
- memory: the bytes autograd keeps (caught with saved-tensor hooks, as
  tests/test_analyze.py does; non-reentrant checkpointing saves a region's inputs through them
  too, so the count is complete) equal the cost model's prediction for no recompute and for
  selective recompute, and no kept tensor is ``s^2``;
- numerics: selective recompute gives the same loss and gradients, bit for bit, also when the
  weight gradient is taken later under another micro-batch's dropout state (ZB-H1's ``W``).

Measured (fp32, this config, per micro-batch of the stage): none 788,480 bytes, selective
593,925 (-24.7%: 2 blocks x 12 a s^2 b less 2,053 bytes of mask index vectors), full 16,896
(the stage's input and token ids).
"""

from __future__ import annotations

import functools

import pytest
import torch

from autopar import capture
from autopar.cluster import Cluster
from autopar.ir import op_name
from autopar.passes.recompute import attention_cores, recompute_attention_cores
from autopar.passes.split_stages import StageInputKind, split_into_stages
from autopar.planner.cost_model import CostModel, ModelCosts, TrainingSetup
from autopar.runtime.tp import TPGroup
from autopar.tensor_parallel import tensor_parallelize
from conftest import build_tiny

B, S, H, HEADS, BLOCKS = 2, 32, 64, 4, (1, 2)  # BLOCKS: the stage's layers (pre=0, post=3)
CORE_OPS = ["matmul", "mul", "add", "softmax", "to", "dropout", "matmul"]


@pytest.fixture(scope="module")
def eager_gpt():
    zm = build_tiny("gpt", attention="eager", dropout=0.1)
    inputs, targets = zm.example_inputs(batch=B, seq=S, generator=torch.Generator().manual_seed(2))
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    return zm, inputs, captured


def _middle_stage(captured, selective):
    program = tensor_parallelize(captured, 1)
    split = split_into_stages(program.gm, captured.layers, [(0, 0), BLOCKS, (3, 3)],
                              constants=captured.constants)
    stage = split.stages[1]
    cores = recompute_attention_cores(stage.gm) if selective else []
    return program, stage, cores


def _stage_args(program, stage, captured, inputs, tp):
    full = program.full_tensors(captured.model)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    args, params = [], []
    for ph in stage.placeholders:
        if ph.kind is StageInputKind.PARAMETER:
            params.append(torch.nn.Parameter(full[ph.key].detach().clone()))
            args.append(params[-1])
        elif ph.kind is StageInputKind.ACTIVATION:
            args.append(x)
        elif ph.kind is StageInputKind.INPUT:
            args.append(inputs[ph.key])
        elif ph.kind is StageInputKind.OTHER:
            args.append(tp)
        else:
            raise AssertionError(f"unexpected stage input {ph}")
    return args, x, params


def _saved(fn, args, params):
    """(bytes, shapes) of the distinct non-parameter storages autograd keeps for ``fn(*args)``."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages, shapes = {}, []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(storages.values()), shapes


def test_one_core_per_block_and_none_in_fused_attention(eager_gpt, tiny_models):
    _, _, captured = eager_gpt
    for tp, sp in ((1, False), (2, True)):  # heads sharded: the core stays local to each rank
        gm = tensor_parallelize(captured, tp, sequence_parallel=sp).gm
        cores = attention_cores(gm)
        assert [c.layer for c in cores] == ["transformer.h.0", "transformer.h.1"], (tp, sp)
        gm_nodes = {n.name: n for n in gm.graph.nodes}
        for core in cores:
            assert [op_name(gm_nodes[n]) for n in core.nodes] == CORE_OPS, core
            assert len(core.outputs) == 1 and core.recomputed_masks, core  # P V; its own mask
    for family in ("gpt", "llama", "bert", "own_gpt"):  # sdpa without dropout: nothing s^2
        assert attention_cores(tiny_models[family][4].gm) == [], family


def test_saved_bytes_drop_by_the_attention_core_as_the_cost_model_predicts(eager_gpt):
    _, inputs, captured = eager_gpt
    tp = TPGroup()
    tp.rng.set_rows(0, B)
    measured, shapes = {}, {}
    for mode in ("none", "selective", "full"):
        program, stage, _ = _middle_stage(captured, mode == "selective")
        args, x, params = _stage_args(program, stage, captured, inputs, tp)
        fn = stage.gm
        if mode == "full":  # what PipelineExecutor(recompute=True) does with a stage
            fn = functools.partial(torch.utils.checkpoint.checkpoint, stage.gm,
                                   use_reentrant=False)
        _, measured[mode], shapes[mode] = _saved(fn, args, params)
    costs = CostModel(ModelCosts(captured), Cluster.load("cpu"),
                      TrainingSetup(B, S, "fp32")).layer_costs(1, False, B)
    blocks = [costs[i] for i in range(BLOCKS[0], BLOCKS[1] + 1)]
    # autopar's dropout keeps its mask as x's dtype (x * mask: 4 bytes here), the model prices
    # the 1-byte mask of a fused kernel (tests/test_analyze.py says the same of torch's CPU
    # dropout): 3 bytes more per element of the attention-probability mask and of the two
    # hidden-state masks of each block
    probs_mask, hidden_masks = B * HEADS * S * S, 2 * B * S * H
    wider_masks = 3 * len(blocks) * (probs_mask + hidden_masks)
    assert measured["none"] == sum(c.act_bytes for c in blocks) + wider_masks
    # Selective: the model's number, plus what the regions read to rebuild their causal mask
    # ([b, 1, s, 1] and [b, 1, 1, s] int64 index vectors, shared by the stage's regions:
    # 32 b s + 5 bytes here), at most 64 b s bytes
    extra = measured["selective"] - (sum(c.act_selective_bytes for c in blocks)
                                     + 3 * len(blocks) * hidden_masks)
    assert 0 <= extra <= 64 * B * S, extra
    # the drop is the attention core: softmax output, mask and dropped-out probabilities, 4
    # bytes each here (Korthikanti et al.'s 5 a s^2 b at 16 bits with a 1-byte mask)
    drop = measured["none"] - measured["selective"]
    assert drop == len(blocks) * 12 * B * HEADS * S * S - extra
    # no s^2 tensor is kept (scores [b a, s, s], probabilities and masks [b, a, s, s], the
    # causal mask [b, 1, s, s]); without recompute some are
    quadratic = lambda shape: sum(d == S for d in shape) >= 2  # noqa: E731
    assert any(map(quadratic, shapes["none"]))
    assert not any(map(quadratic, shapes["selective"])), shapes["selective"]
    # full recompute keeps the stage's inputs only: the hidden state and the token ids
    assert measured["full"] == B * S * H * 4 + B * S * 8
    print(f"\nsaved bytes per micro-batch: {measured}")


def test_selective_recompute_gives_the_same_gradients_under_deferred_weight_passes(eager_gpt):
    """The stage's loss-like output and its gradients, without and with selective recompute.
    The selective run computes input gradients first and weight gradients later, after another
    micro-batch's rows were set (ZB-H1's W runs after later micro-batches' F and I): the
    regions recompute under the dropout state of their forward. Same ops on the same values:
    equal to the bit."""
    _, inputs, captured = eager_gpt
    results = []
    for selective in (False, True):
        program, stage, cores = _middle_stage(captured, selective)
        assert len(cores) == (2 if selective else 0)
        tp = TPGroup()
        tp.rng.set_rows(0, B)
        args, x, params = _stage_args(program, stage, captured, inputs, tp)
        (out,) = stage.gm(*args)
        root = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
        if not selective:
            root.backward()
            results.append((out.detach(), x.grad, [p.grad for p in params]))
            continue
        (grad_x,) = torch.autograd.grad(root, [x], retain_graph=True)  # I
        tp.rng.set_rows(B, B)  # another micro-batch ran meanwhile
        tp.rng.step = 1
        grads = torch.autograd.grad(root, params)  # W
        assert (tp.rng.rows, tp.rng.step) == ((B, B), 1)  # the regions put the state back
        results.append((out.detach(), grad_x, list(grads)))
    (out0, gx0, gp0), (out1, gx1, gp1) = results
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(gp0, gp1))


class _ReturnsProbabilities(torch.nn.Module):
    """Attention whose probabilities are also read after ``P V`` (as a model returning its
    attention weights does): the region must hand them out as a second output."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        probs = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1)
        return (probs @ self.v(x) * 2 + probs.mean(-1, keepdim=True)).sum()


def test_a_core_read_after_it_ends_returns_both_outputs():
    torch.manual_seed(0)
    model = _ReturnsProbabilities()
    x = torch.randn(2, 5, 8, requires_grad=True)
    captured = capture(model, (x,))
    (core,) = recompute_attention_cores(captured.gm)
    assert core.outputs == ("softmax", "matmul_1")  # the probabilities stay alive: read later
    params = [v.detach().clone().requires_grad_(True) for v in captured.placeholder_values()]
    (out,) = captured.gm(*params, x)
    grads = torch.autograd.grad(out, params)
    ref = model(x)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    assert torch.equal(out, ref)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(grads, ref_grads))
