"""Mixture-of-experts: the experts captured as one operation, expert parallelism against one
process, and the named errors.

Numerics (fp32): the experts operation equals the module it replaces within 1e-6 (the same
GEMMs, rows grouped by expert; only the order of the k additions per token can differ); parallel
runs equal one process within 1e-5 relative on the loss and 1e-5 absolute on every parameter after
2 AdamW steps (measured <= 5e-7: the all-to-all moves rows unchanged, reductions sum in another
order). The reference splits each batch into the micro-batches of the parallel run (dp x m) and
averages their losses, as the parallel run does: the load-balancing loss of examples/moe.py is
not a mean over tokens, so one big batch would differ (Megatron-LM computes it per micro-batch
too).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.captured import CaptureMethod
from autopar.errors import InvalidPlanError, ShardingError
from autopar.moe import UnsupportedMoEError, experts_as_operations, find_experts
from autopar.runtime.moe import experts_reference, moe_experts

import moe_jobs as jobs


def _dense_reference(x, index, weights, gate_up, down, act=torch.nn.functional.silu):
    """Token by token, slot by slot: out[t] = sum_j w[t, j] * down[e] @ (act(g) * u)."""
    out = torch.zeros_like(x)
    inner = down.shape[-1]
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if not 0 <= e < gate_up.shape[0]:
                continue
            h = gate_up[e] @ x[t]
            out[t] = out[t] + weights[t, j] * (down[e] @ (act(h[:inner]) * h[inner:]))
    return out


def test_operation_equals_token_by_token_sum():
    torch.manual_seed(0)
    T, H, I, E, k = 12, 8, 6, 4, 2
    x = torch.randn(T, H, dtype=torch.float64)
    index = torch.randint(0, E, (T, k))
    index[3, 1] = E  # transformers' sentinel: no expert
    weights = torch.rand(T, k, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, H, dtype=torch.float64)
    down = torch.randn(E, H, I, dtype=torch.float64)
    want = _dense_reference(x, index, weights, gate_up, down)
    torch.testing.assert_close(experts_reference(x, index, weights, gate_up, down), want)
    torch.testing.assert_close(moe_experts(x, index, weights, gate_up, down, "silu", True), want)
    # the operation's backward (recomputed with autograd) against the dense sum's
    leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    moe_experts(leaves[0], index, *leaves[1:], "silu", True).square().sum().backward()
    dense = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    _dense_reference(dense[0], index, *dense[1:]).square().sum().backward()
    for got, ref in zip(leaves, dense):
        torch.testing.assert_close(got.grad, ref.grad)


@pytest.mark.parametrize("name", ["mixtral", "example"])
def test_captured_experts_equal_the_module(name):
    """Each recognized experts module, computing through the operation, gives the output and
    the gradients of its own forward."""
    model, _ = jobs.make_model(name)
    found = find_experts(model)
    assert [f.num_experts for f in found] == [4, 4]
    assert all(f.act == "silu" and f.gated for f in found)
    modules = dict(model.named_modules())
    tokens = jobs.batches(1)[0][0][0]
    for spec in found:
        experts = modules[spec.path]
        torch.manual_seed(1)
        x = torch.randn(tokens.numel(), spec.hidden, requires_grad=True)
        index = torch.stack([torch.randperm(4)[:2] for _ in range(x.shape[0])])
        weights = torch.rand(x.shape[0], 2, requires_grad=True)
        want = experts(x, index, weights)
        grads_want = torch.autograd.grad(want.square().sum(),
                                         [x, weights, *experts.parameters()])
        with experts_as_operations(model):
            got = experts(x, index, weights)
        grads = torch.autograd.grad(got.square().sum(), [x, weights, *experts.parameters()])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, grads_want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # and outside the capture the module is its own again
    assert "forward" not in vars(modules[found[0].path])


def test_capture_keeps_the_router_as_a_graph():
    model, loss_fn = jobs.make_model("mixtral")
    (x,), (y,) = jobs.batches(1)[0]
    captured = autopar.capture(model, (x,), loss_fn, example_targets=(y,))
    ops = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert sum(n.target is torch.ops.autopar.moe_experts.default for n in ops) == 2
    assert sum("topk" in str(n.target) for n in ops) == 2  # the routers stay ordinary ops
    assert captured.method is CaptureMethod.EXPORT  # batch and sequence stay symbolic
    # the captured program computes the model's loss
    torch.testing.assert_close(captured.gm(*[p.detach() for p in model.parameters()],
                                           *[b for b in model.buffers()], x, y)[0],
                               loss_fn(model(x), y), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Expert parallelism against one process (4 gloo ranks, one pool for every plan)
# ---------------------------------------------------------------------------------------------

#: (model, pins, micro-batches of the reference: dp x m)
EP_PLANS = [
    ("mixtral", dict(dp=4, tp=1, pp=1, num_micro_batches=1, ep=2), 4),  # 2 ranks per expert
    ("mixtral", dict(dp=2, tp=2, pp=1, num_micro_batches=1, ep=2), 2),
    ("mixtral", dict(dp=2, tp=1, pp=2, num_micro_batches=2, ep=2, schedule="1f1b"), 4),
    ("mixtral", dict(dp=4, tp=1, pp=1, num_micro_batches=1, ep=2, zero=3), 4),
    ("example", dict(dp=4, tp=1, pp=1, num_micro_batches=1, ep=4), 4),  # one expert per rank
    ("example", dict(dp=2, tp=1, pp=2, num_micro_batches=2, ep=2, schedule="1f1b"), 4),
]


@pytest.mark.distributed
def test_expert_parallel_trains_as_one_process(shared_pool4, tmp_path):
    """Every plan of EP_PLANS against one process; then a checkpoint saved at ep 2 resumes at
    ep 1 x tp 2 and at ep 4 with ZeRO-2 to the same losses, transformers loads the safetensors
    it wrote (under transformers' own names, one tensor per expert) and writes them back the
    same, and a model built on the meta device reads them (each layer's experts fused on the
    way, as transformers fuses them) and keeps only its experts."""

    pool = shared_pool4
    per_rank = pool.run(jobs.train, [(name, plan) for name, plan, _ in EP_PLANS],
                        timeout_s=900)
    resumed = pool.run(jobs.checkpoint_round_trip, str(tmp_path / "ckpt"), timeout_s=600)
    runs = resumed[0]
    assert runs.pop("meta_read_equal")  # a meta model read its slices of save_pretrained's files
    assert runs.pop("meta_expert_bytes") == 2 * (4 * 192 * 64 + 4 * 64 * 96) * 4 // 2
    saved = runs.pop("ep=2, tp=1")
    for what, losses in runs.items():
        assert losses == pytest.approx(saved, rel=1e-6), what
    import transformers as tf

    loaded = tf.MixtralForCausalLM.from_pretrained(tmp_path / "ckpt-hf")
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 192, 64)
    # autopar wrote the checkpoint's names, as transformers does: one tensor per expert
    # (block_sparse_moe.experts.E.w1 / w2 / w3), which transformers fuses on load and the meta
    # model above read through the same conversion (autopar/hf_names.py)
    from safetensors import safe_open

    loaded.save_pretrained(tmp_path / "resaved")
    keys = {}
    for which in ("ckpt-hf", "resaved"):
        with safe_open(tmp_path / which / "model.safetensors", "pt") as f:
            keys[which] = {k: f.get_tensor(k) for k in f.keys()}
    assert set(keys["ckpt-hf"]) == set(keys["resaved"])
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys["ckpt-hf"]
    for k, value in keys["resaved"].items():
        assert torch.equal(keys["ckpt-hf"][k], value), k
    for k, (name, plan, micro) in enumerate(EP_PLANS):
        what = f"{name} {plan}"
        errors = [r[k]["error"] for r in per_rank if "error" in r[k]]
        assert not errors, f"{what}: {errors[0]}"
        result = per_rank[0][k]
        assert len({r[k]["losses"][-1] for r in per_rank}) == 1, what
        ref = jobs.reference(name, micro_batches=micro)
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
        for key, want in ref["state"].items():
            if torch.is_floating_point(want):
                torch.testing.assert_close(result["state"][key], want, rtol=0, atol=1e-5,
                                           msg=f"{what}: {key}")
        if plan["tp"] == plan["pp"] == 1:  # every rank holds 1/ep of the experts, all else
            model, _ = jobs.make_model(name)
            experts = sum(p.numel() for n, p in model.named_parameters()
                          if n.endswith(("gate_up_proj", "down_proj"))) * 4
            dense = sum(p.numel() for p in model.parameters()) * 4 - experts
            assert {r[k]["expert_bytes"] for r in per_rank} == {experts // plan["ep"]}, what
            assert {r[k]["held"] - r[k]["expert_bytes"] >= dense for r in per_rank} == {True}


# ---------------------------------------------------------------------------------------------
# Bad input: named errors with the fix
# ---------------------------------------------------------------------------------------------

class _LoopedExperts(nn.Module):
    """A MoE whose experts are a ModuleList walked by a data-dependent loop."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        index = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(index == e).squeeze(-1)
            if rows.numel():
                out[rows] = expert(x[rows])
        return out


def _explains(err) -> None:
    assert err.summary and (err.expected or err.found) and err.fix, str(err)


def test_an_unrecognized_moe_is_named_with_the_layout_to_use():
    with pytest.raises(UnsupportedMoEError, match="ModuleList") as info:
        autopar.capture(_LoopedExperts(), (torch.randn(6, 8),), dynamic=False)
    _explains(info.value)
    assert "gate_up_proj" in info.value.expected and "examples/moe.py" in info.value.fix


def test_top_k_larger_than_the_experts():
    from examples.moe import MoELM

    model = MoELM(num_experts=2, top_k=3)
    with pytest.raises(UnsupportedMoEError, match="more experts per token") as info:
        autopar.capture(model, (torch.randint(0, 128, (2, 8)),))
    _explains(info.value)


def test_a_transformers_layout_autopar_does_not_implement():
    model, _ = jobs.make_model("mixtral")
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(UnsupportedMoEError, match="layout") as info:
        find_experts(model)
    assert "has_bias=True" in info.value.found
    _explains(info.value)


def test_ep_that_does_not_divide_dp_or_the_experts_or_a_dense_model(tiny_models):
    """Pins are checked before any work; the experts (4 in the Mixtral here) when the plan is
    decided, on rank 0, and every rank raises the same error."""
    model, loss_fn = jobs.make_model("mixtral")
    (x,), (y,) = jobs.batches(1)[0]
    kwargs = dict(example_inputs=(x,), example_targets=(y,), loss_fn=loss_fn,
                  optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(InvalidPlanError, match="borrows its ranks") as info:
        autopar.parallelize(model, plan=dict(dp=1, ep=2), **kwargs)
    _explains(info.value)
    captured = autopar.capture(model, (x,), loss_fn, example_targets=(y,))
    from autopar.agreement import check_ep

    with pytest.raises(ShardingError, match="does not divide the 4 experts") as info:
        check_ep(3, captured)
    _explains(info.value)
    dense = tiny_models["gpt"][4]
    with pytest.raises(InvalidPlanError, match="no mixture-of-experts") as info:
        check_ep(2, dense)
    _explains(info.value)


# ---------------------------------------------------------------------------------------------
# What the planner knows of the experts
# ---------------------------------------------------------------------------------------------

def test_saved_activations_are_what_autograd_keeps():
    """The analysis pass's saved tensors of the experts operation equal the bytes autograd keeps
    when the runtime runs it (counted by saved-tensor hooks, each storage once, weights out)."""
    from autopar.ir import info
    from autopar.passes.analyze import analyze, saved_tensors
    from autopar.runtime.moe import EPGroup

    model, loss_fn = jobs.make_model("mixtral")
    (x,), (y,) = jobs.batches(1)[0]
    captured = autopar.capture(model, (x,), loss_fn, example_targets=(y,))
    analyze(captured)
    node = next(n for n in captured.gm.graph.nodes if n.target is torch.ops.autopar.moe_experts.default)
    sizes = {"b": x.shape[0], "s": x.shape[1]}
    from autopar.ir import evaluate

    predicted = sum(evaluate(spec.nbytes, **sizes) for _, spec in saved_tensors(node, "moe_experts"))
    experts = model.model.layers[0].mlp.experts
    weights = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    T, k = x.numel(), 2
    h = torch.randn(T, 64, requires_grad=True)
    index = torch.stack([torch.randperm(4)[:k] for _ in range(T)])
    w = torch.rand(T, k, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        EPGroup().experts(h, index, w, experts.gate_up_proj, experts.down_proj, "silu", True)
    assert sum(seen.values()) == predicted
    assert evaluate(info(node).spec.shape[0], **sizes) == T  # every token of the batch


def test_cost_model_divides_the_experts_by_ep():
    """Per-rank model state of a Mixtral on 8 ranks against the closed form: experts / ep
    unsharded, sharded over the dp / ep ranks holding them (ZeRO-3 states: dense / dp +
    experts / dp, whatever ep); and four all-to-alls per block at ep > 1, none at ep 1."""
    from autopar.cluster import Cluster
    from autopar.plan_types import RecomputeKind, ScheduleKind
    from autopar.planner.candidates import Candidate
    from autopar.planner.cost_model import CostModel, ModelCosts, TrainingSetup

    model, loss_fn = jobs.make_model("mixtral")
    (x,), (y,) = jobs.batches(1)[0]
    captured = autopar.capture(model, (x,), loss_fn, example_targets=(y,))
    costs = ModelCosts(captured)
    assert costs.num_experts == 4
    cm = CostModel(costs, Cluster.load("h100-80g").with_devices(8),
                   TrainingSetup(global_batch=16, seq=16, dtype="bf16"))
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    w, g, o = 2, 4, 12  # bf16 weights, fp32 gradients, fp32 master + Adam moments
    for ep in (1, 2, 4):
        for zero in (0, 3):
            c = Candidate(8, 1, 1, 1, 1, ScheduleKind.ONE_F_ONE_B, RecomputeKind.NONE, zero,
                          False, ep=ep)
            r = cm.evaluate(c).ranks[0]
            # the search's memory floor (one pipeline rank): these states, plus activations
            # no more than the rank's peak holds
            assert r.states * (1 - 1e-12) <= cm.memory_floor(c) <= r.total * (1 + 1e-12)
            held = dense + experts / ep
            if zero == 0:
                want = (w * held, g * held, o * held)
            else:
                want = tuple(b * (dense / 8 + experts / ep / (8 // ep)) for b in (w, g, o))
            assert (r.weights, r.gradients, r.optimizer) == pytest.approx(want), (ep, zero)
            costs_ep = cm.layer_costs(1, False, 1, 8, 1, ep=ep)
            a2a = [call for lc in costs_ep for call in lc.tp_calls if call[0] == "all-to-all"]
            assert len(a2a) == (4 * 2 if ep > 1 else 0)


def test_autopar_plan_searches_ep_for_a_mixtral_8x7b_config(tmp_path, capsys):
    """A Mixtral-8x7B-shaped config.json (32 blocks of 8 experts, top-2) on 64 H100s: the plan
    splits the experts (ep > 1, each rank's experts and their states divided by ep), the table
    has an ep column, and explain says why against the best plan of every other ep."""
    import json

    import transformers as tf

    from autopar.cli import main

    tf.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                     max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
                     architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(tmp_path), "--cluster", "h100-80g", "--gpus", "64",
                 "--global-batch", "256", "--seq", "4096", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    ep = doc["plan"]["ep"]
    assert ep in (2, 4, 8) and doc["model"]["experts"] == 8
    assert f"{8 // ep}/8 experts" in table
    assert doc["prediction"]["breakdown"]["ep_comm_s"] > 0
    assert main(["explain", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"ep={ep} splits each block's 8 experts" in text and "all-to-all" in text
    assert "the best plan at ep=1" in text
