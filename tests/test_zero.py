"""ZeRO memory against the formulas of Rajbhandari et al. 2020, mixed precision, FSDP2 as reference, failure modes.

Memory: per-rank bytes of parameters, gradients and optimizer state, measured from the tensors
the rank holds, equal the mixed-precision Adam accounting (16P; ZeRO-1 4P + 12P/N; ZeRO-2
2P + 14P/N; ZeRO-3 16P/N; N the shard group size) within 5% on a model large enough for the
padding (< N elements per bucket) and Adam's per-tensor step counters to be negligible.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from autopar.errors import InvalidInputError
from autopar.runtime.data_parallel import DataParallel, DataParallelConfig
from autopar.runtime.local_pool import LocalPool, RemoteError
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.optim import MixedPrecision, OptimizerFactory
from autopar.runtime.zero import iter_unique_storages

from dp_harness import (assert_close_mixed_precision, build_model, compare, global_batch,
                        train_and_compare)


# -- memory ---------------------------------------------------------------------------------------
def _measure_memory(zero: int, shard_size: int | None, grad_dtype: torch.dtype,
                    optimizer: OptimizerFactory = OptimizerFactory(torch.optim.AdamW,
                                                                   {"lr": 1e-3})):
    from examples.gpt import GPT, GPTConfig, gpt_loss

    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=128, heads=4, vocab=256, seq=32))
    num_params = sum(p.numel() for p in model.parameters())
    engine = DataParallel(model, mesh, optimizer,
                          DataParallelConfig(zero=zero, shard_size=shard_size, bucket_mb=0.25,
                                             mixed_precision=MixedPrecision(grad_dtype=grad_dtype)))
    report = module_bytes = None
    for step in range(2):  # the second step measures: optimizer state exists, gradients reduced
        x, y = global_batch(step, 2, 256)
        gpt_loss(model(x), y).backward()
        if step == 1:
            engine.finish_gradient_sync()
            report = engine.memory_bytes()
            module_bytes = sum(iter_unique_storages(model.parameters()).values())
        engine.step()
        engine.zero_grad()
    engine.close()
    return num_params, report, module_bytes, engine.groups.shard_size


def _formula(zero: int, n: int, num_params: int, grad_bytes: int) -> dict[str, float]:
    """ZeRO (Rajbhandari et al. 2020, section 3): bf16 weights (2), gradients (grad_bytes: 2 for bf16), fp32 master + Adam m, v
    (12); ZeRO-1 shards the 12, ZeRO-2 also the gradients, ZeRO-3 also the weights."""
    p = num_params
    return {"params": 2 * p / (n if zero >= 3 else 1),
            "grads": grad_bytes * p / (n if zero >= 2 else 1),
            "optimizer": 12 * p / (n if zero >= 1 else 1)}


@pytest.mark.distributed
@pytest.mark.parametrize("zero,shard_size,grad_dtype", [
    (0, None, torch.bfloat16), (1, None, torch.bfloat16), (2, None, torch.bfloat16),
    (3, None, torch.bfloat16), (1, 2, torch.bfloat16), (2, 2, torch.bfloat16),
    (3, 2, torch.bfloat16), (1, None, torch.float32), (3, None, torch.float32)])
def test_memory_matches_mission_formulas(shared_pool4, zero, shard_size, grad_dtype):
    results = shared_pool4.run(_measure_memory, zero, shard_size, grad_dtype)
    grad_bytes = torch.tensor([], dtype=grad_dtype).element_size()
    for num_params, report, module_bytes, n in results:
        assert n == (shard_size or 4)
        want = _formula(zero, n, num_params, grad_bytes)
        got = {"params": report.params, "grads": report.grads, "optimizer": report.optimizer}
        for kind in want:
            assert got[kind] == pytest.approx(want[kind], rel=0.05), (kind, got, want)
        assert report.total == pytest.approx(sum(want.values()), rel=0.05)
        if grad_dtype == torch.bfloat16:  # the closed forms of the ZeRO paper themselves
            total = {0: 16 * num_params, 1: 4 * num_params + 12 * num_params / n,
                     2: 2 * num_params + 14 * num_params / n, 3: 16 * num_params / n}[zero]
            assert report.total == pytest.approx(total, rel=0.05)
        # The module's parameters are views into the buckets (no hidden copy); under ZeRO-3 they
        # are empty placeholders between uses.
        assert module_bytes == (0 if zero == 3 else report.params)


@pytest.mark.distributed
@pytest.mark.parametrize("zero,optimizer,options,state", [
    (0, torch.optim.SGD, {"lr": 0.1}, 0), (1, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 4),
    (3, torch.optim.AdamW, {"amsgrad": True}, 12), (2, torch.optim.Adagrad, {}, 4)])
def test_the_planner_counts_the_state_of_the_optimizer_given(shared_pool4, zero, optimizer,
                                                             options, state):
    """Another optimizer's state than Adam's two moments: what the factory measures on its
    probe (``state_bytes_per_param``) is the optimizer's own count, and the planner's model
    states with it (bf16 weights, fp32 gradients, fp32 masters and that state, sharded at the
    ZeRO stage) equal the bytes each rank holds after a step, within 5% (padding and scalar
    step counters), where Adam's 8 would count 8 - state bytes per parameter too many."""
    from autopar.planner.memory import model_state_bytes

    factory = OptimizerFactory(optimizer, options)
    assert factory.state_bytes_per_param() == state
    results = shared_pool4.run(_measure_memory, zero, None, torch.float32, factory)
    for num_params, report, _, n in results:
        want = model_state_bytes(num_params, n, zero, "bf16", state_bytes=state)
        assert report.optimizer == pytest.approx(want.optimizer, rel=0.05), (report, want)
        assert report.total == pytest.approx(want.total, rel=0.05)
        assert report.optimizer == pytest.approx((4 + state) * num_params / (n if zero else 1),
                                                 rel=0.05)


@pytest.mark.parametrize("optimizer,options,moved,calls", [
    # torch/optim/adamw.py's for-loop, per parameter tensor: param.mul_ (weight decay) 8,
    # exp_avg.lerp_(grad) 12, exp_avg_sq.mul_ 8, .addcmul_(grad, grad) 16, sqrt() 8, / bias
    # correction 8, .add_(eps) 8, param.addcdiv_(exp_avg, denom) 16: 84 bytes, 8 calls
    (torch.optim.AdamW, {}, 84, 8),
    (torch.optim.AdamW, {"foreach": True}, 84, 8),  # the same ops, batched
    # amsgrad: torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq) 12 more
    (torch.optim.AdamW, {"amsgrad": True}, 96, 9),
    # one kernel: weights, gradients and both moments read, weights and moments written
    (torch.optim.AdamW, {"fused": True}, 28, 1),
    # torch/optim/sgd.py: buf.mul_(momentum) 8, .add_(grad) 12, param.add_(buf) 12
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 32, 3),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, 20, 1),
    (torch.optim.SGD, {"lr": 0.1}, 12, 1),  # param.add_(grad)
    # torch/optim/adagrad.py: state_sum.addcmul_ 16, sqrt() 8, .add_(eps) 8, param.addcdiv_ 16
    (torch.optim.Adagrad, {}, 48, 4)])
def test_the_step_cost_counted_on_the_probe_is_what_torch_runs(optimizer, options, moved,
                                                               calls):
    """``OptimizerFactory.step_cost``: the bytes an optimizer's step reads and writes per
    parameter element and its ATen calls per parameter tensor, counted under a dispatch mode on
    the probe's second step, equal what torch's implementation of each optimizer does by hand
    count of its source (each op reading its operands and writing its result; in-place ops
    read and write their destination); the fused kernels read their gradients only."""
    step = OptimizerFactory(optimizer, options).step_cost()
    assert (step.bytes_per_param, step.ops_per_tensor) == (moved, calls)


@pytest.mark.parametrize("optimizer,options,gpu,grows,held", [
    # torch/optim/adamw.py's for-loop (a CPU's default): denom = (exp_avg_sq.sqrt() /
    # bias_correction2_sqrt).add_(eps), the square root and the quotient (4 + 4 bytes an element
    # of the tensor stepped) while the previous tensor's denom (4) is still bound: 12 per element
    # of the largest tensor, nothing that grows with the tensors stepped
    (torch.optim.AdamW, {}, False, 0, 12),
    # _multi_tensor_adam (a GPU's default): torch._foreach_sqrt(exp_avg_sqs), one fp32 square
    # root of every moment at once, divided and added to in place
    (torch.optim.AdamW, {}, True, 4, 0),
    (torch.optim.AdamW, {"foreach": True}, False, 4, 0),
    (torch.optim.AdamW, {"fused": True}, True, 0, 0),  # one kernel, nothing allocated
    (torch.optim.AdamW, {"foreach": False}, True, 0, 12),  # pinned: a GPU runs it too
    # torch/optim/sgd.py: momentum and update in place
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, True, 0, 0),
    # weight decay: grad = grad.add(param, alpha=wd), one tensor's at a time (rebound before
    # the next one's), or device_grads = torch._foreach_add(...) of every tensor at once
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, False, 0, 4),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, True, 4, 0),
    # torch/optim/adagrad.py's for-loop: std = state_sum.sqrt().add_(eps), param.addcdiv_:
    # 4, and the previous tensor's std 4
    (torch.optim.Adagrad, {}, False, 0, 8)])
def test_the_step_temporaries_counted_on_the_probe_are_torchs(optimizer, options, gpu, grows,
                                                             held):
    """``OptimizerFactory.step_cost``'s temporaries: the bytes per element of every tensor
    stepped that a step holds at its peak, and per element of the largest one, from the peaks
    over two and three probe tensors, equal a count by hand of torch's source for each kernel
    (``gpu``: a kernel left to torch is counted as the foreach path a GPU takes)."""
    step = OptimizerFactory(optimizer, options).step_cost(gpu=gpu)
    assert (step.temporary_bytes, step.tensor_temporary_bytes) == (grows, held)


# -- mixed precision ------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("family,zero,shard_size", [
    ("own_gpt", 0, None), ("own_gpt", 3, None), ("gpt", 1, None), ("gpt", 2, None),
    ("llama", 0, None), ("llama", 3, None), ("llama", 3, 2)])
def test_mixed_precision_matches_single_process(shared_pool4, family, zero, shard_size):
    """bf16 compute, fp32 master weights, fp32 gradient accumulation and reduction."""
    out = shared_pool4.run(train_and_compare, family, zero=zero, shard_size=shard_size,
                    mp=MixedPrecision(), micro_batches=2 if zero == 2 else 1)[0]
    assert_close_mixed_precision(out)


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_bf16_gradient_reduction(shared_pool4, zero):
    """Gradients reduced in bf16 (the 16-bytes-per-parameter setting). A bf16 sum of 4 terms in
    another order than the reference's fp32 accumulation errs by up to ~3 bf16 ulps (2^-8 each)
    per element; SGD passes that on linearly, so the parameter update agrees with the
    single-process run to a few percent in L2 (measured ~0.4%; a missing or double-counted rank
    would be off by 25% or more)."""
    out = shared_pool4.run(train_and_compare, "gpt", zero=zero, optimizer="sgd",
                    mp=MixedPrecision(grad_dtype=torch.bfloat16))[0]
    assert out["param_dtypes"] == ["torch.bfloat16"]
    assert out["rel_l2_vs_split"] < 0.03, out
    assert out["moved"] > 0.1


# -- torch FSDP2 as reference -------------------------------------------------------------------
def _versus_fsdp2(mixed: bool, steps: int = 3):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    reference, _, _ = build_model("own_gpt")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else MixedPrecisionPolicy()
    for block in reference.blocks:
        fully_shard(block, mesh=mesh.device_mesh["dp"], mp_policy=policy)
    fully_shard(reference, mesh=mesh.device_mesh["dp"], mp_policy=policy)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
                          DataParallelConfig(zero=3, mixed_precision=MixedPrecision() if mixed else None))
    for step in range(steps):
        x, y = global_batch(step, 2 * mesh.dp, vocab)
        xs, ys = x[2 * mesh.dp_rank:][:2], y[2 * mesh.dp_rank:][:2]
        loss_fn(model(xs), ys).backward()
        engine.step()
        engine.zero_grad()
        loss_fn(reference(xs), ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.full_parameters()
    want = {n: p.full_tensor().detach() for n, p in reference.named_parameters()}
    engine.close()
    return compare(got, want)


@pytest.mark.distributed
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_zero3_matches_torch_fsdp2(shared_pool2, mixed):
    """fully_shard per block + root, SGD: the same parameters as our ZeRO-3. In bf16 both gather
    bf16 copies of the fp32 master, compute in bf16 and reduce fp32 gradients, so they agree to
    fp32 rounding too."""
    for diff, _ in shared_pool2.run(_versus_fsdp2, mixed):
        assert diff < 1e-6


# -- failure modes -------------------------------------------------------------------------------
def _prefetch_against_none(steps: int = 3):
    """ZeRO-3 on the own GPT (2 blocks and the root: 3 units), with and without prefetch, from
    the same weights on the same batches: the parameters after every step, how many gathers ran
    ahead, and the most units gathered at once (seen at every unit's entry)."""
    from examples.gpt import GPT, GPTConfig, gpt_loss

    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    out = {}
    for prefetch in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32))
        engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.AdamW, {"lr": 1e-3}),
                              DataParallelConfig(zero=3, prefetch=prefetch))
        most = [0]

        def count(module, args):
            gathered = sum(all(b.gathered or b.prefetching for b in u.buckets)
                           for u in engine.units)
            most[0] = max(most[0], gathered)

        hooks = [u.module.register_forward_pre_hook(count) for u in engine.units]
        states = []
        for step in range(steps):
            x, y = global_batch(step, 4, 128)
            gpt_loss(model(x), y).backward()
            engine.step()
            engine.zero_grad()
            states.append({k: v.clone() for k, v in engine.full_parameters().items()})
        for h in hooks:
            h.remove()
        out[prefetch] = dict(states=states, most=most[0], units=len(engine.units),
                             prefetched=engine.unit_order.prefetched if prefetch else 0)
        engine.close()
    return out


def test_zero3_prefetch_changes_timing_not_numbers(shared_pool2):
    """With prefetch (the default), entering a unit launches the gather of the unit that ran
    after it, in forward and in backward, from the second step on (the order is learnt in the
    first): the parameters after every step equal the run without prefetch bit for bit, and one
    unit more than without prefetch is gathered at a unit's entry (the next one)."""
    for r in shared_pool2.run(_prefetch_against_none):
        assert r[True]["units"] == 3
        for got, want in zip(r[True]["states"], r[False]["states"]):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
        # steps 2 and 3: forward root -> block 0 -> block 1 and backward root -> block 1 ->
        # block 0 prefetch two units each way (the root stays gathered from forward to backward)
        assert r[True]["prefetched"] == 2 * 2 * 2, r[True]["prefetched"]
        # gathered at a unit's entry: the root (kept from forward to backward) and the unit,
        # plus, with prefetch, the next one: never more
        assert (r[False]["most"], r[True]["most"]) == (2, 3)


def _zero1_second_sync():
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.AdamW, {"lr": 1e-3}),
                          DataParallelConfig(zero=1))
    x, y = global_batch(0, 2, vocab)
    try:
        for _ in range(2):  # two synced backwards in one step
            loss_fn(model(x), y).backward()
    except InvalidInputError as exc:
        return str(exc)
    finally:
        engine.zero_grad()
        engine.close()
    return "no error"


@pytest.mark.distributed
def test_zero1_rejects_a_second_reduction_per_step(shared_pool2):
    for message in shared_pool2.run(_zero1_second_sync):
        assert "no_sync()" in message


def _non_elementwise_optimizer_under_zero():
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, _, _ = build_model("own_gpt")
    DataParallel(model, mesh, OptimizerFactory(torch.optim.Adafactor, {"lr": 1e-2}),
                 DataParallelConfig(zero=2))


@pytest.mark.distributed
def test_non_elementwise_optimizer_is_refused_under_sharding(shared_pool2):
    with pytest.raises(RemoteError, match="Adafactor cannot run on ZeRO shards"):
        shared_pool2.run(_non_elementwise_optimizer_under_zero)


def _one_rank_skips_the_step():
    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    engine = DataParallel(model, mesh, OptimizerFactory(torch.optim.SGD, {"lr": 0.1}),
                          DataParallelConfig(zero=2))
    if dist.get_rank() == 0:
        x, y = global_batch(0, 2, vocab)
        loss_fn(model(x), y).backward()  # launches reduce-scatters rank 1 never joins
        engine.step()
    return dist.get_rank()


@pytest.mark.distributed
def test_mismatched_ranks_time_out_not_hang():
    pool = LocalPool(2, timeout_s=60, collective_timeout_s=4)
    start = time.monotonic()
    try:
        with pytest.raises(RemoteError, match="timed out on gradient reduction"):
            pool.run(_one_rank_skips_the_step)
    finally:
        pool.kill()
    assert time.monotonic() - start < 40



# -- checkpoints: save on one dp size / stage, load on another ------------------------------------
def _train_save_or_resume(path: str, zero: int, shard_size, resume: bool, bucket_mb: float,
                          total_steps: int = 3, global_batch_size: int = 8):
    """Without resume: 2 AdamW steps, then save. With resume: load, then the last step. Rank 0
    returns the parameters (after load, and at the end) and the single-process run's."""
    from dp_harness import SingleProcess, make_optimizer

    mesh = ParallelMesh(dist.get_world_size(), 1, 1)
    model, loss_fn, vocab = build_model("own_gpt")
    factory = make_optimizer("adamw")
    reference = SingleProcess(model, loss_fn, factory) if dist.get_rank() == 0 else None
    engine = DataParallel(model, mesh, factory, DataParallelConfig(zero=zero, shard_size=shard_size,
                                                                   bucket_mb=bucket_mb))
    local = global_batch_size // mesh.dp
    steps = range(2, total_steps) if resume else range(2)
    loaded = None
    if resume:
        engine.load_checkpoint(path)
        loaded = engine.full_parameters()
    for step in steps:
        x, y = global_batch(step, global_batch_size, vocab)
        lo = mesh.dp_rank * local
        loss_fn(model(x[lo:lo + local]), y[lo:lo + local]).backward()
        engine.step()
        engine.zero_grad()
    if not resume:
        engine.save_checkpoint(path)
    final = engine.full_parameters()
    engine.close()
    if reference is None:
        return None
    for step in range(total_steps if resume else 2):
        reference.step(*global_batch(step, global_batch_size, vocab))
    return loaded, final, reference.parameters()


@pytest.mark.distributed
@pytest.mark.parametrize("save_zero,save_shard,load_zero", [(2, 2, 3), (3, None, 1), (0, None, 2)])
def test_checkpoint_reshards_across_dp_sizes(shared_pool4, shared_pool2, tmp_path, save_zero, save_shard,
                                             load_zero):
    """Parameters and AdamW state saved by 4 ranks load into 2 ranks with another ZeRO stage and
    bucket size: the parameters come back bit for bit, and the resumed third step lands where
    the uninterrupted single-process run does (1e-5: see dp_harness)."""
    path = str(tmp_path / "ckpt")
    _, saved, _ = shared_pool4.run(_train_save_or_resume, path, save_zero, save_shard, False, 0.05)[0]
    loaded, final, want = shared_pool2.run(_train_save_or_resume, path, load_zero, None, True, 0.2)[0]
    assert compare(loaded, saved)[0] == 0.0
    diff, frac = compare(final, want)
    assert diff < 1e-5 and frac < 1e-3
    assert compare(final, saved)[0] > 1e-3  # the resumed step did move the parameters
