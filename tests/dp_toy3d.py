"""A hand-written 3D-parallel toy for the data-parallel layer's composition tests.

The model: token embedding E (tied to the LM head), blocks of ``x + s * (gelu(LN(x) W1^T + b1) W2^T)
+ b2``, logits ``x E^T``, cross-entropy. Run on a (dp, pp, tp) mesh exactly as Megatron-LM would:

- tp: W1, b1 split by rows (column-parallel), W2 by columns (row-parallel); the f operator
  (identity forward, all-reduce backward) before W1, and the scale ``s`` applied to each rank's
  partial product *before* the all-reduce, so its gradient on a tp rank is a partial sum (like a
  sequence-parallel norm): ``ParamSpec(sum_grad_over_tp=True)``. LN, b2, E: replicated over tp.
- pp: blocks split over stages; E on the first stage, a tied copy as the LM head on the last
  (``ParamSpec(shared_with=(first, last))``); a minimal GPipe executor with blocking send/recv.
- dp: each replica takes its share of the global batch.

The reference is the same model in one process. Nothing here comes from autopar except the
data-parallel layer under test (and the mesh).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.runtime.data_parallel import DataParallel, DataParallelConfig, ParamSpec, TiedGroups
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.optim import OptimizerFactory

V, H, FF, SEQ = 32, 16, 32, 8


def full_params(layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    p = {"emb": torch.randn(V, H, generator=g) * 0.3}
    for i in range(layers):
        p[f"blocks.{i}.ln_w"] = 1 + 0.1 * torch.randn(H, generator=g)
        p[f"blocks.{i}.ln_b"] = 0.1 * torch.randn(H, generator=g)
        p[f"blocks.{i}.w1"] = torch.randn(FF, H, generator=g) / math.sqrt(H)
        p[f"blocks.{i}.b1"] = 0.1 * torch.randn(FF, generator=g)
        p[f"blocks.{i}.w2"] = torch.randn(H, FF, generator=g) / math.sqrt(FF)
        p[f"blocks.{i}.b2"] = 0.1 * torch.randn(H, generator=g)
        p[f"blocks.{i}.s"] = 1 + 0.1 * torch.randn(H, generator=g)
    return p


def tp_slice(name: str, t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This tp rank's part of full parameter ``name``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("w1", "b1"):
        return t.chunk(tp, dim=0)[tp_rank]
    if leaf == "w2":
        return t.chunk(tp, dim=1)[tp_rank]
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Block(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], tp_group) -> None:
        super().__init__()
        for k, v in tensors.items():
            setattr(self, k, nn.Parameter(v.clone()))
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (H,), self.ln_w, self.ln_b)
        h = _CopyToTP.apply(h, self.tp_group)
        u = F.gelu(F.linear(h, self.w1, self.b1))
        v = _ReduceFromTP.apply(self.s * F.linear(u, self.w2), self.tp_group)
        return x + v + self.b2


class Stage(nn.Module):
    """One pipeline stage of one tp rank: its blocks, the embedding and/or the (tied) head."""

    def __init__(self, full: dict[str, torch.Tensor], layers: range, first: bool, last: bool,
                 tp: int, tp_rank: int, tp_group) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.emb = nn.Parameter(full["emb"].clone()) if first else None
        self.head = nn.Parameter(full["emb"].clone()) if last and not first else None
        self.blocks = nn.ModuleList(
            Block({k.rsplit(".", 1)[-1]: tp_slice(k, v, tp, tp_rank) for k, v in full.items()
                   if k.startswith(f"blocks.{i}.")}, tp_group) for i in layers)
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = F.embedding(x, self.emb)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = F.linear(x, self.emb if self.first else self.head)
        return x

    def specs(self, mesh: ParallelMesh) -> list[ParamSpec]:
        tied = () if mesh.pp == 1 else (mesh.stage_rank(0), mesh.stage_rank(mesh.pp - 1))
        out = []
        for name, _ in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name in ("emb", "head"):
                out.append(ParamSpec(name, shared_with=tied))
            elif leaf in ("w1", "b1", "w2"):
                out.append(ParamSpec(name, replicated_over_tp=False))
            elif leaf == "s":
                out.append(ParamSpec(name, sum_grad_over_tp=mesh.tp > 1))
            else:
                out.append(ParamSpec(name))
        return out

    def full_name(self, name: str) -> str:
        if name in ("emb", "head"):
            return "emb"
        _, i, leaf = name.split(".")
        return f"blocks.{self.layers[int(i)]}.{leaf}"


def reference_forward(p: dict[str, torch.Tensor], tokens: torch.Tensor, layers: int) -> torch.Tensor:
    x = F.embedding(tokens, p["emb"])
    for i in range(layers):
        b = {k.rsplit(".", 1)[-1]: v for k, v in p.items() if k.startswith(f"blocks.{i}.")}
        h = F.layer_norm(x, (H,), b["ln_w"], b["ln_b"])
        x = x + b["s"] * F.linear(F.gelu(F.linear(h, b["w1"], b["b1"])), b["w2"]) + b["b2"]
    return F.linear(x, p["emb"])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpipe_step(stage: Stage, mesh: ParallelMesh, tokens, targets, micro_batches: int,
               engine: DataParallel | None) -> float:
    """Forward all micro-batches stage by stage, then backward them (GPipe, blocking p2p)."""
    prev = mesh.stage_rank(mesh.pp_rank - 1) if not stage.first else None
    nxt = mesh.stage_rank(mesh.pp_rank + 1) if not stage.last else None
    saved, total = [], 0.0
    for xm, ym in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)):
        if stage.first:
            inp = xm
        else:
            inp = torch.empty(xm.shape[0], SEQ, H)
            dist.recv(inp, src=prev)
            inp.requires_grad_()
        out = stage(inp)
        if stage.last:
            loss = _loss(out, ym) / micro_batches
            total += loss.item()
            out = loss
        else:
            dist.send(out.detach(), dst=nxt)
        saved.append((inp, out))
    for i, (inp, out) in enumerate(reversed(saved)):
        if engine is not None:
            engine.set_requires_gradient_sync(i == micro_batches - 1)
        if stage.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=nxt)
            out.backward(grad)
        if not stage.first:
            dist.send(inp.grad, dst=prev)
    return total


def train_toy(dp: int, pp: int, tp: int, *, zero: int = 0, shard_size: int | None = None,
              steps: int = 3, micro_batches: int = 1, optimizer: str = "adamw",
              max_grad_norm: float | None = 1.0, use_engine: bool = True) -> dict[str, Any]:
    """Train the toy on a (dp, pp, tp) mesh; every rank compares its parameters with one process.

    ``use_engine=False`` runs plain torch AdamW per rank with only the tied-gradient primitive
    (TiedGroups) and no data parallelism (dp must be 1)."""
    mesh = ParallelMesh(dp, pp, tp)
    layers = 2 * pp
    full = full_params(layers)
    per = layers // pp
    stage = Stage(full, range(mesh.pp_rank * per, (mesh.pp_rank + 1) * per),
                  mesh.pp_rank == 0, mesh.pp_rank == pp - 1, tp, mesh.tp_rank, mesh.tp_group)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)) if optimizer == "adamw" \
        else (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9))
    factory = OptimizerFactory(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}) \
        if optimizer == "adamw" else OptimizerFactory(torch.optim.SGD, {"lr": 0.2, "momentum": 0.9})
    engine = tied = opt = None
    if use_engine:
        engine = DataParallel(stage, mesh, factory, DataParallelConfig(
            zero=zero, shard_size=shard_size, max_grad_norm=max_grad_norm, bucket_mb=0.001),
            param_specs=stage.specs(mesh))
    else:
        assert dp == 1
        tied = TiedGroups({s.name: s for s in stage.specs(mesh)},
                          {n: p.shape for n, p in stage.named_parameters()}, mesh)
        opt = make(list(stage.parameters()))
    ref = {k: v.clone().requires_grad_() for k, v in full.items()}
    ref_opt = make(list(ref.values()))
    norms, ref_norms = [], []
    local = 2 * micro_batches
    for step in range(steps):
        g = torch.Generator().manual_seed(50 + step)
        tokens = torch.randint(0, V, (local * dp, SEQ + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        lo = mesh.dp_rank * local
        gpipe_step(stage, mesh, x[lo:lo + local], y[lo:lo + local], micro_batches, engine)
        if engine is not None:
            norm = engine.step()
            engine.zero_grad()
        else:
            tied.all_reduce_grads(dict(stage.named_parameters()))
            norm = None
            opt.step()
            opt.zero_grad()
        norms.append(None if norm is None else norm.item())
        ref_opt.zero_grad()
        _loss(reference_forward(ref, x, layers), y).backward()
        if max_grad_norm is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm=max_grad_norm).item())
        ref_opt.step()
    got = engine.full_parameters() if engine is not None else {
        n: p.detach() for n, p in stage.named_parameters()}
    diff = 0.0
    for name, value in got.items():
        full_name = stage.full_name(name)
        want = tp_slice(full_name, ref[full_name].detach(), tp, mesh.tp_rank)
        diff = max(diff, (value - want).abs().max().item())
    moved = max((ref[k].detach() - full[k]).abs().max().item() for k in full)
    if engine is not None:
        engine.close()
    return {"diff": diff, "moved": moved, "norms": norms, "ref_norms": ref_norms,
            "names": sorted(got)}
