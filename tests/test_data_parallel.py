"""Data parallelism and ZeRO 0-3 against the single-process run (real gloo processes).

Numerics: own GPT, HF GPT-2 and LLaMA (tiny) replicated over dp = 2 and 4, ZeRO 0 to 3 and
hybrid sharding, 3 AdamW steps, parameters and losses compared with one process on the global
batch (tolerance: dp_harness's docstring). Composition: a hand-written Megatron-style toy on
every world-4 (dp, pp, tp) shape, tied embedding across stages, tp-replicated and tp-partial
parameters, global-norm clipping compared with torch.nn.utils.clip_grad_norm_. References from
torch itself: DistributedDataParallel.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from autopar.errors import InvalidInputError
from autopar.runtime.data_parallel import (DataParallel, DataParallelConfig, ParamSpec,
                                           default_units)
from autopar.runtime.local_pool import LocalPool, RemoteError
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.optim import MixedPrecision, OptimizerFactory

from dp_harness import (assert_close_to_single_process, build_model, compare, global_batch,
                        train_and_compare)
from dp_toy3d import train_toy

FAMILIES = ["own_gpt", "gpt", "llama"]


# -- numerics on real models ----------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_dp2_adamw_matches_single_process(shared_pool2, family, zero):
    out = shared_pool2.run(train_and_compare, family, zero=zero)[0]
    assert_close_to_single_process(out)


@pytest.mark.distributed
@pytest.mark.parametrize("zero,shard_size", [(0, None), (1, None), (2, None), (3, None),
                                             (1, 2), (2, 2), (3, 2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_dp4_adamw_matches_single_process(shared_pool4, family, zero, shard_size):
    out = shared_pool4.run(train_and_compare, family, zero=zero, shard_size=shard_size)[0]
    assert_close_to_single_process(out)


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_gradient_accumulation_syncs_once(shared_pool2, zero):
    """Two micro-batches per rank, the first under no_sync: the same as one process."""
    out = shared_pool2.run(train_and_compare, "gpt", zero=zero, micro_batches=2)[0]
    assert_close_to_single_process(out)


@pytest.mark.distributed
@pytest.mark.parametrize("zero,shard_size", [(0, None), (1, None), (2, None), (3, None), (3, 2)])
def test_clipping_matches_torch_clip_grad_norm(shared_pool4, zero, shard_size):
    """SGD (linear in the gradient, so scale errors show) with clipping at 0.5: the global norm
    equals torch.nn.utils.clip_grad_norm_ on one process, and so do the parameters. fp32 sums in
    another order differ by a few ulps: 1e-5 relative on norms, 1e-6 on parameters (moved ~0.1)."""
    out = shared_pool4.run(train_and_compare, "own_gpt", zero=zero, shard_size=shard_size,
                    optimizer="sgd", max_grad_norm=0.5)[0]
    assert len(out["norms"]) == len(out["ref_norms"]) == 3
    for got, want in zip(out["norms"], out["ref_norms"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert min(out["ref_norms"]) > 0.5  # clipping was active
    assert out["diff"] < 1e-6 < 1e-2 < out["moved"]


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 3])
def test_activation_recompute(shared_pool2, zero):
    """Blocks under torch.utils.checkpoint: their forward runs again inside backward, where
    ZeRO-3 must keep the unit gathered (and not free it after the recomputed forward)."""
    out = shared_pool2.run(train_and_compare, "own_gpt", zero=zero, recompute=True)[0]
    assert_close_to_single_process(out)


def _launch_points():
    """How many parameter gradients had arrived when each bucket's reduction was launched."""
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.1}),
                          DataParallelConfig(bucket_mb=0.05))
    arrived, points = [0], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: arrived.__setitem__(0, arrived[0] + 1))
    for b in engine.buckets:
        launch = b.launch_reduce
        b.launch_reduce = lambda launch=launch: (points.append(arrived[0]), launch())
    x, y = global_batch(0, 2, vocab)
    loss_fn(model(x), y).backward()
    engine.step()
    engine.close()
    return points, len(list(model.parameters())), len(engine.buckets)


@pytest.mark.distributed
def test_reductions_overlap_backward(shared_pool2):
    """Buckets are reduced while backward still runs: the first launch happens before the
    first quarter of the gradients has arrived, every bucket once, in order."""
    points, num_params, num_buckets = shared_pool2.run(_launch_points)[0]
    assert num_buckets >= 4 and len(points) == num_buckets
    assert points[0] < num_params / 4 and points == sorted(points)


# -- 3D composition: every world-4 shape -------------------------------------------------------------
WORLD4_SHAPES = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]


@pytest.mark.distributed
@pytest.mark.parametrize("dp,pp,tp,zero", [(*shape, zero) for shape in WORLD4_SHAPES
                                           for zero in ([0, 1, 2, 3] if shape[0] > 1 else [0])])
def test_toy_3d_every_world4_shape(shared_pool4, dp, pp, tp, zero):
    """Tied embedding/head across stages, tp-sharded, tp-replicated and tp-partial parameters,
    two micro-batches with no_sync, clipped SGD: parameters and global norm as one process.
    Tolerance 1e-6: fp32 sums in another order (pipeline/tp all-reduces), parameters move ~0.07."""
    outs = shared_pool4.run(train_toy, dp, pp, tp, zero=zero, micro_batches=2, optimizer="sgd")
    for out in outs:
        assert out["diff"] < 1e-6 < 1e-2 < out["moved"], out
        for got, want in zip(out["norms"], out["ref_norms"]):
            assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.distributed
def test_toy_3d_world8_dp2_pp2_tp2():
    """World 8 as (dp, pp, tp) = (2, 2, 2), ZeRO 0-3 in one pool (starting 8 processes on a
    small machine takes ~20 s, so one test runs them all)."""
    with LocalPool(8, timeout_s=180) as pool:
        for zero in range(4):
            for out in pool.run(train_toy, 2, 2, 2, zero=zero, micro_batches=2, optimizer="sgd"):
                assert out["diff"] < 1e-6 < 1e-2 < out["moved"], (zero, out)
                for got, want in zip(out["norms"], out["ref_norms"]):
                    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.distributed
def test_toy_3d_adamw_and_hybrid(shared_pool4):
    """AdamW (the toy has no zero-gradient elements, so no noise amplification: 1e-5) on dp x pp
    with ZeRO-3, and hybrid ZeRO-2 (shard 2 x replicate 2)."""
    for out in shared_pool4.run(train_toy, 2, 2, 1, zero=3, micro_batches=2):
        assert out["diff"] < 1e-5 and out["moved"] > 1e-2, out
    for out in shared_pool4.run(train_toy, 4, 1, 1, zero=2, shard_size=2, optimizer="sgd"):
        assert out["diff"] < 1e-6 and out["moved"] > 1e-2, out


@pytest.mark.distributed
def test_tied_gradient_primitive_two_stages(shared_pool2):
    """Rank 0 holds the embedding, rank 1 the LM head copy; TiedGroups sums their gradients and
    plain torch AdamW on each rank keeps both copies equal to the single-process tied weight."""
    outs = shared_pool2.run(train_toy, 1, 2, 1, use_engine=False, max_grad_norm=None)
    assert outs[0]["names"] != outs[1]["names"]  # different stages, one of them holds "head"
    for out in outs:
        assert out["diff"] < 1e-5 and out["moved"] > 1e-2, out


def _two_ties_built_in_opposite_orders(zero: int):
    """Two pipeline stages sharing two tied weights, each stage registering them in the other
    order (so its buckets come in the other order): the engine on each rank, and the copies
    equal to stage 0's afterwards."""
    mesh = ParallelMesh(1, 2, 1, timeout=timedelta(seconds=20))  # a regression: a named error
    torch.manual_seed(1 + dist.get_rank())  # different values: the broadcast must make them equal
    module = torch.nn.Module()
    names = ["a", "b"] if mesh.pp_rank == 0 else ["b", "a"]
    for name in names:
        module.register_parameter(name, torch.nn.Parameter(torch.randn(8)))
    module.register_parameter("own", torch.nn.Parameter(torch.randn(4)))
    specs = [ParamSpec(n, shared_with=(0, 1), tie_id=n) for n in names] + [ParamSpec("own")]
    engine = DataParallel(module, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.1}),
                          DataParallelConfig(zero=zero), param_specs=specs)
    try:
        return {n: engine.full_parameter(n) for n in ("a", "b")}
    finally:
        engine.close()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 3])
def test_ties_in_opposite_bucket_orders_are_broadcast_in_one_order(shared_pool2, zero):
    """Each tied bucket is broadcast over its tie's group as it is built; built in bucket order
    the two stages waited on each other's group (found on DeBERTa-v2 at pp 2)."""
    first, second = shared_pool2.run(_two_ties_built_in_opposite_orders, zero, timeout_s=60)
    for name in ("a", "b"):
        assert torch.equal(first[name], second[name]), name


def _toy_without_tie_is_wrong():
    """Negative control: without the tied spec the copies drift from the reference."""
    import dp_toy3d as toy

    original = toy.Stage.specs

    def untied(self, mesh):
        return [ParamSpec(s.name, s.replicated_over_tp, s.sum_grad_over_tp) for s in
                original(self, mesh)]

    toy.Stage.specs = untied
    try:
        return toy.train_toy(1, 2, 1, optimizer="sgd", max_grad_norm=None)
    finally:
        toy.Stage.specs = original


@pytest.mark.distributed
def test_tied_spec_is_what_makes_it_right(shared_pool2):
    outs = shared_pool2.run(_toy_without_tie_is_wrong)
    assert max(out["diff"] for out in outs) > 1e-3


# -- torch DDP as reference ---------------------------------------------------------------------
def _versus_ddp(steps: int = 3, backwards: int = 1, zero: int = 0):
    """``backwards`` per step, each synced (no ``no_sync``): DDP all-reduces after every one
    and accumulates the averages."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    reference = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD,
                                                        {"lr": 0.5, "momentum": 0.9}),
                          DataParallelConfig(zero=zero))
    try:
        for step in range(steps):
            ref_opt.zero_grad()
            for k in range(backwards):
                x, y = global_batch(step * backwards + k, 2 * mesh.dp, vocab)
                xs, ys = x[2 * mesh.dp_rank:][:2], y[2 * mesh.dp_rank:][:2]
                loss_fn(model(xs), ys).backward()
                loss_fn(reference(xs), ys).backward()
            engine.step()
            engine.zero_grad()
            ref_opt.step()
        got = engine.full_parameters()
    finally:
        engine.close()
    want = {n: p.detach() for n, p in reference.module.named_parameters()}
    return compare(got, want)


@pytest.mark.distributed
def test_zero0_matches_torch_ddp(shared_pool2):
    """Same gloo all-reduce of the same gradients: SGD parameters agree to fp32 rounding."""
    for diff, _ in shared_pool2.run(_versus_ddp):
        assert diff < 1e-6


@pytest.mark.distributed
def test_every_backward_synced_matches_torch_ddp(shared_pool2):
    """Two backwards per step, both synced (gradient accumulation without no_sync), as DDP
    allows. ZeRO-0's second reduction summed the first's average again, which came back dp
    times (parameters 0.1 off DDP's at dp 2, silently) until 2026-11-29; ZeRO-2 and 3
    reduce-scatter each backward into the shard. ZeRO-1, one reduce-scatter per step, refuses
    it by name."""
    for zero in (0, 2, 3):
        for diff, _ in shared_pool2.run(_versus_ddp, 3, 2, zero):
            assert diff < 1e-6, zero
    with pytest.raises(RemoteError, match="after this step's ZeRO-1 reduction"):
        shared_pool2.run(_versus_ddp, 3, 2, 1)


def _step_per_bucket_or_not(zero: int, mixed: bool):
    """Two engines from the same weights, one stepping bucket by bucket: (parameters equal
    bit for bit after 3 AdamW steps, optimizer.step calls per step of each, buckets)."""
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    runs = []
    for per_bucket in (True, False):
        model, loss_fn, vocab = build_model("own_gpt")
        mp = MixedPrecision(torch.bfloat16) if mixed else None
        engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.AdamW,
                                                            {"lr": 1e-2, "eps": 1e-5}),
                              DataParallelConfig(zero=zero, bucket_mb=0.01, mixed_precision=mp,
                                                 step_per_bucket=per_bucket))
        calls = []
        engine.optimizer.register_step_post_hook(lambda *_: calls.append(1))
        for step in range(3):
            x, y = global_batch(step, 2 * mesh.dp, vocab)
            loss_fn(model(x[2 * mesh.dp_rank:][:2]), y[2 * mesh.dp_rank:][:2]).backward()
            engine.step()
            engine.zero_grad()
        runs.append((engine.full_parameters(), len(calls) // 3,
                     sum(b.requires_grad for b in engine.buckets)))
        engine.close()
    (a, calls_a, buckets), (b, calls_b, _) = runs
    return all(torch.equal(a[n], b[n]) for n in a), calls_a, calls_b, buckets


@pytest.mark.distributed
@pytest.mark.parametrize("zero, mixed", [(0, False), (1, True), (2, False), (3, True)])
def test_the_step_bucket_by_bucket_is_the_same_step(shared_pool2, zero, mixed):
    """Stepping each bucket as its reduction comes in (the CPU default) gives every parameter
    bit for bit what one step after all the reductions gives, at every ZeRO stage, with fp32
    and bf16 compute; the optimizer runs once per bucket, and once when asked not to."""
    for equal, per_bucket, whole, buckets in shared_pool2.run(_step_per_bucket_or_not, zero, mixed):
        assert buckets > 2 and equal
        assert (per_bucket, whole) == (buckets, 1)


# -- robustness ---------------------------------------------------------------------------------
class _WithUnused(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


def _train_with_unused_parameter(zero: int):
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    wrapped = _WithUnused(model)
    before = wrapped.unused.weight.detach().clone()
    engine = DataParallel(wrapped, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.1}),
                          DataParallelConfig(zero=zero, bucket_mb=0.01))
    for step in range(2):
        x, y = global_batch(step, 2 * mesh.dp, vocab)
        loss_fn(wrapped(x[2 * mesh.dp_rank:][:2]), y[2 * mesh.dp_rank:][:2]).backward()
        engine.step()
        engine.zero_grad()
    after = engine.full_parameters()["unused.weight"]
    engine.close()
    return bool(torch.equal(after, before))


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 3])
def test_unused_parameters_do_not_hang(shared_pool2, zero):
    """The end-of-backward callback reduces buckets whose parameters got no gradient (zeros)."""
    assert shared_pool2.run(_train_with_unused_parameter, zero) == [True, True]


def _assigned_weight_gradients(zero: int):
    """Weight gradients computed with torch.autograd.grad and assigned to .grad (no hooks fire),
    as a zero-bubble W pass might: the step must use them, not zeros."""
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.5}),
                          DataParallelConfig(zero=zero))
    x, y = global_batch(0, 2 * mesh.dp, vocab)
    lo = 2 * mesh.dp_rank
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_fn(model(x[lo:lo + 2]), y[lo:lo + 2]), params)
    for p, g in zip(params, grads):
        p.grad = g
    engine.step()
    loss_fn(reference(x), y).backward()
    ref_opt.step()
    got = engine.full_parameters()
    engine.close()
    return compare(got, {n: p.detach() for n, p in reference.named_parameters()})[0]


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradients_assigned_outside_backward(shared_pool2, zero):
    assert max(shared_pool2.run(_assigned_weight_gradients, zero)) < 1e-6


def _backward_after_step_without_zero_grad():
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.1}))
    x, y = global_batch(0, 2, vocab)
    loss_fn(model(x), y).backward()
    engine.step()
    try:
        loss_fn(model(x), y).backward()
    except InvalidInputError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


@pytest.mark.distributed
def test_backward_after_step_needs_zero_grad(shared_pool2):
    for message in shared_pool2.run(_backward_after_step_without_zero_grad):
        assert "zero_grad()" in message


def _tp_mesh_without_specs():
    mesh = ParallelMesh(1, 1, dist.get_world_size())
    model, _, _ = build_model("own_gpt")
    DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.1}))


@pytest.mark.distributed
def test_tensor_parallel_needs_param_specs(shared_pool2):
    with pytest.raises(RemoteError, match="param_specs are needed"):
        shared_pool2.run(_tp_mesh_without_specs)


# -- no processes ---------------------------------------------------------------------------------
def test_config_validation():
    with pytest.raises(ValueError, match="zero must be"):
        DataParallelConfig(zero=4)
    with pytest.raises(ValueError, match="needs zero >= 1"):
        DataParallelConfig(zero=0, shard_size=2)
    with pytest.raises(ValueError, match="shard_size must be"):
        DataParallelConfig(zero=3, shard_size=1)
    with pytest.raises(ValueError, match="bucket_mb"):
        DataParallelConfig(bucket_mb=0)
    assert DataParallelConfig(zero=2).zero == 2
    assert DataParallelConfig.shard_size_for_node(8, pp=2, tp=2, dp=4) == 2


def test_param_spec_validation():
    with pytest.raises(ValueError, match="at least two distinct"):
        ParamSpec("w", shared_with=(3,))
    with pytest.raises(ValueError, match="already complete"):
        ParamSpec("w", replicated_over_tp=False, sum_grad_over_tp=True)
    assert ParamSpec("w", shared_with=(5, 1)).shared_with == (1, 5)


def test_optimizer_factory():
    with pytest.raises(ValueError, match="closure"):
        OptimizerFactory(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="Optimizer subclass"):
        OptimizerFactory(object)
    assert OptimizerFactory(torch.optim.AdamW).is_elementwise
    assert not OptimizerFactory(torch.optim.Adafactor).is_elementwise
    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = OptimizerFactory(torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1},
                           group_options=lambda n: {"weight_decay": 0.0} if n.endswith("bias")
                           else {}).build([("fc.weight", w), ("fc.bias", b)])
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]
    with pytest.raises(InvalidInputError, match="could not build"):
        OptimizerFactory(torch.optim.SGD, {"learning_rate": 0.1}).build([("w", w)])


def test_default_units_are_the_blocks_and_the_root():
    model, _, _ = build_model("llama")
    units = default_units(model)
    assert units[-1] is model and len(units) == 1 + len(model.model.layers)
