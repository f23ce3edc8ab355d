"""Workers for the data-parallel / ZeRO tests: train on every rank, compare with one process.

Each function runs on every rank of a LocalPool. The reference is the single-process run of the
same model on the global batch, computed on rank 0 alongside (tiny models, so it is cheap).

Tolerances. fp32: a data-parallel run sums the same per-example gradients in another order
(an all-reduce of per-rank sums instead of one big batch), which changes each gradient element by
a few fp32 ulps. SGD passes that on unchanged (1e-7-ish). Adam divides by sqrt(v) + eps, so an
element whose true gradient is ~0 (the attention key bias: softmax is invariant to it) has a
gradient of pure rounding noise (~1e-10) that Adam turns into a step of lr * noise / eps. With
torch's default eps = 1e-8 that is a step of ~lr * 1e-2 that differs between *any* two summation
orders, single-process ones included; the tests use eps = 1e-5 (LLaMA's published AdamW setting),
where it is ~1e-7 per step, and require every element within 1e-5 after 3 steps (parameters move
by ~3e-2: three orders of magnitude of headroom for a real error to show). Two single-process
runs that differ only in the summation order (``noise``) are measured alongside: they disagree by
up to ~2e-6 on these models, the same as the parallel run.

Mixed precision: each rank's bf16 forward/backward on its micro-batch is the very computation the
single-process mixed-precision run does on that micro-batch, and both accumulate in fp32, so the
parallel run is compared with that run (``vs_split``) to the fp32 tolerance above; against the
single process on the whole batch in bf16 only the losses are compared: they are bf16 numbers
(8 significant bits) rounded differently, so to two bf16 ulps (2^-6 relative).

Adam is invariant to a constant gradient scale, so these tests cannot see a wrong averaging
factor; the clipped-SGD tests (linear in the gradient, norms compared exactly) do.
"""

from __future__ import annotations

import copy

import torch.utils.checkpoint
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.data_parallel import DataParallel, DataParallelConfig
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.optim import MixedPrecision, OptimizerFactory

LR = 1e-2
SEQ = 16


class Recomputed(torch.nn.Module):
    """A block run under activation checkpointing: its forward is recomputed inside backward."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, *args, **kwargs):
        # No early stop: the whole forward (and its module hooks) reruns inside backward.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(self.block, x, *args, use_reentrant=False,
                                                     **kwargs)


def build_model(family: str, recompute: bool = False):
    """(model, loss_fn, vocab) with deterministic weights (same on every rank)."""
    from conftest import build_own_gpt, build_tiny

    if family == "own_gpt":
        model, loss_fn = build_own_gpt()
        vocab = model.config.vocab
        if recompute:
            model.blocks = torch.nn.ModuleList(Recomputed(b) for b in model.blocks)
        return model, loss_fn, vocab
    assert not recompute
    zm = build_tiny(family)
    return zm.model, zm.loss_fn, zm.spec.vocab


def global_batch(step: int, batch: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_optimizer(kind: str) -> OptimizerFactory:
    if kind == "adamw":
        return OptimizerFactory(torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1, "eps": 1e-5})
    if kind == "sgd":
        return OptimizerFactory(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})
    raise ValueError(kind)


class SingleProcess:
    """The reference: the model trained in one process, optionally in mixed precision
    (bf16 compute copy, fp32 master weights updated by the optimizer; a frozen parameter is
    held as its bf16 copy alone), optionally clipped."""

    def __init__(self, model, loss_fn, optimizer: OptimizerFactory, mp: bool = False,
                 max_grad_norm: float | None = None) -> None:
        self.model = copy.deepcopy(model)
        self.loss_fn = loss_fn
        self.mp = mp
        self.max_grad_norm = max_grad_norm
        self.names = [n for n, _ in self.model.named_parameters()]
        params = dict(self.model.named_parameters())
        if mp:
            self.master = {n: p.detach().clone().float() for n, p in params.items()
                           if p.requires_grad}
            for p in params.values():
                p.data = p.data.to(torch.bfloat16)
            tensors = list(self.master.values())
        else:
            self.master = params
            tensors = list(params.values())
        self.opt = optimizer.optimizer_class(tensors, **optimizer.options)
        self.norms: list[float] = []
        self.losses: list[float] = []

    def step(self, x, y, micro_batches: int = 1) -> None:
        params = dict(self.model.named_parameters())
        for p in params.values():
            p.grad = None
        total = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = self.loss_fn(self.model(xs), ys) / micro_batches
            loss.backward()
            total += loss.item()
            if self.mp:  # fp32 accumulation of each micro-batch's bf16 gradient
                for n, p in params.items():
                    if n not in self.master:
                        continue
                    g = p.grad.float()
                    self.master[n].grad = g if self.master[n].grad is None else self.master[n].grad + g
                    p.grad = None
        self.losses.append(total)
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(self.master.values()), self.max_grad_norm)
            self.norms.append(norm.item())
        self.opt.step()
        self.opt.zero_grad()
        if self.mp:
            with torch.no_grad():
                for n, p in params.items():
                    if n in self.master:
                        p.copy_(self.master[n])

    def parameters(self) -> dict[str, torch.Tensor]:
        if not self.mp:
            return {n: t.detach() for n, t in self.master.items()}
        return {n: (self.master[n] if n in self.master else p).detach().float()
                for n, p in self.model.named_parameters()}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max abs difference, fraction of elements differing by more than 1e-6)."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    diffs = torch.cat([(got[n].float() - want[n].float()).abs().flatten() for n in want])
    return diffs.max().item(), (diffs > 1e-6).float().mean().item()


def train_and_compare(family: str, *, zero: int = 0, shard_size: int | None = None,
                      steps: int = 3, micro_batches: int = 1, local_batch: int = 2,
                      optimizer: str = "adamw", mp: MixedPrecision | None = None,
                      max_grad_norm: float | None = None, bucket_mb: float = 0.05,
                      dp: int | None = None, recompute: bool = False) -> dict[str, Any] | None:
    """Train ``steps`` data-parallel steps; rank 0 returns the comparison with one process."""
    world = dist.get_world_size()
    dp = dp or world
    mesh = ParallelMesh(dp, world // dp, 1)
    model, loss_fn, vocab = build_model(family, recompute)
    factory = make_optimizer(optimizer)
    rank0 = dist.get_rank() == 0
    if rank0:
        reference = SingleProcess(model, loss_fn, factory, mp=mp is not None,
                                  max_grad_norm=max_grad_norm)
        split = SingleProcess(model, loss_fn, factory, mp=mp is not None,
                              max_grad_norm=max_grad_norm)
        init = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    # With recompute the ZeRO-3 units are the inner blocks, whose forward hooks then also fire
    # during the recomputation inside backward.
    units = [m.block for m in model.blocks] if recompute else None
    engine = DataParallel(model, mesh, factory, DataParallelConfig(
        zero=zero, shard_size=shard_size, mixed_precision=mp, max_grad_norm=max_grad_norm,
        bucket_mb=bucket_mb), units=units)
    norms, losses = [], []
    for step in range(steps):
        x, y = global_batch(step, local_batch * dp, vocab)
        lo = mesh.dp_rank * local_batch
        xs, ys = x[lo:lo + local_batch], y[lo:lo + local_batch]
        total = torch.zeros(1)
        for i, (xm, ym) in enumerate(zip(xs.chunk(micro_batches), ys.chunk(micro_batches))):
            last = i == micro_batches - 1
            engine.set_requires_gradient_sync(last)
            loss = loss_fn(model(xm), ym) / micro_batches
            loss.backward()
            total += loss.detach().float()
        dist.all_reduce(total, group=mesh.dp_group)
        losses.append(total.item() / dp)
        norm = engine.step()
        norms.append(None if norm is None else norm.item())
        engine.zero_grad()
        if rank0:
            reference.step(x, y)
            split.step(x, y, micro_batches=dp * micro_batches)
    full = engine.full_parameters()
    memory = engine.memory_bytes()
    if not rank0:
        return None
    want = reference.parameters()
    diff, frac = compare(full, want)
    noise, noise_frac = compare(split.parameters(), want)
    vs_split, vs_split_frac = compare(full, split.parameters())
    split_params = split.parameters()
    step_norm = torch.cat([(split_params[n].float() - init[n]).flatten() for n in want]).norm()
    err_norm = torch.cat([(full[n].float() - split_params[n].float()).flatten() for n in want]).norm()
    moved = max((want[n].float() - init[n]).abs().max().item() for n in want)
    return {"diff": diff, "frac": frac, "noise": noise, "noise_frac": noise_frac, "moved": moved,
            "vs_split": vs_split, "vs_split_frac": vs_split_frac,
            "rel_l2_vs_split": (err_norm / step_norm).item(),
            "norms": norms, "ref_norms": reference.norms, "losses": losses,
            "ref_losses": reference.losses, "memory": memory,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def assert_close_to_single_process(out: dict[str, Any]) -> None:
    """fp32: every element within 1e-5 of the single-process run (see the module docstring)."""
    assert out["moved"] > 1e-2, out  # the comparison has teeth: 1000x the tolerance
    assert out["diff"] <= 1e-5, out
    assert out["frac"] <= 1e-3, out  # and the bulk agrees to 1e-6
    for got, want in zip(out["losses"], out["ref_losses"]):
        assert abs(got - want) <= 1e-5 * abs(want), out


def assert_close_mixed_precision(out: dict[str, Any]) -> None:
    """bf16 compute, fp32 master: as the single-process mixed-precision run on the same
    micro-batches to fp32 tolerance; losses (bf16 numbers, averaged over ranks) as the
    whole-batch bf16 run to two bf16 ulps (2^-6 relative)."""
    assert out["param_dtypes"] == ["torch.bfloat16"], out
    assert out["moved"] > 1e-2, out
    assert out["vs_split"] <= 1e-5, out
    for got, want in zip(out["losses"], out["ref_losses"]):
        assert abs(got - want) <= 2 ** -6 * abs(want), out  # two bf16 ulps
