"""Jobs for tests/test_batch_norm.py (run on every rank of a LocalPool, importable by name), and
the one-process reference: a small ResNet (He et al. 2016: basic blocks of two 3 x 3
convolutions, each followed by BatchNorm, with an identity shortcut) whose BatchNorms update
their running statistics in every training forward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from conftest import train_one_process

LR = 1e-2
EPS = 1e-5  # see parallelize_jobs.EPS: Adam's epsilon vs reordered fp32 sums
STEPS = 2
SEED = 5


def drop_path_timm(x: torch.Tensor, keep: float) -> torch.Tensor:
    """Stochastic depth (Huang et al. 2016) as timm and torchvision draw it."""
    mask = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(keep)
    return x * mask / keep


def drop_path_hf(x: torch.Tensor, keep: float) -> torch.Tensor:
    """Stochastic depth as Hugging Face's ``drop_path`` draws it."""
    mask = (keep + torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype, device=x.device)).floor()
    return x.div(keep) * mask


class BasicBlock(nn.Module):
    def __init__(self, channels: int, regularize: str = "") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=0.3)
        #: "timm" or "hf": channel dropout and stochastic depth drawn that way
        self.regularize = regularize
        self.drop = nn.Dropout2d(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        if self.regularize:
            y = self.drop(y)
        y = self.bn2(self.conv2(y))
        if self.regularize == "timm" and self.training:
            y = drop_path_timm(y, 0.7)
        elif self.regularize == "hf" and self.training:
            y = drop_path_hf(y, 0.7)
        return F.relu(x + y)


class ResNet(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 2, classes: int = 10,
                 regularize: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        kinds = ("timm", "hf") if regularize else ("", "")
        self.blocks = nn.ModuleList(BasicBlock(channels, kinds[i % 2]) for i in range(blocks))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def build(regularize: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return ResNet(regularize=regularize)


def batches(steps: int = STEPS) -> list[tuple[tuple, tuple]]:
    gen = torch.Generator().manual_seed(3)
    return [((torch.randn(8, 3, 8, 8, generator=gen),),
             (torch.randint(0, 10, (8,), generator=gen),)) for _ in range(steps)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def reference(micro_batches: int) -> dict:
    """One process on the parallel run's ``micro_batches`` chunks of each batch (dp x m), in
    order: losses, the final state (running statistics included), and the loss of the first
    batch in evaluation (``model.eval()``: normalized by the running statistics)."""
    model = build()
    data = batches()
    losses, state = train_one_process(model, loss_fn, _optimizer(model.parameters()), data,
                                      micro_batches=micro_batches)
    model.eval()
    with torch.no_grad():
        evaluated = float(loss_fn(model(*data[0][0]), *data[0][1]))
    return dict(losses=losses, state=state, eval=evaluated)


def train(configs: list[dict]) -> list[dict | None]:
    """Each plan: parallelize, :data:`STEPS` steps, then an evaluation of the first batch and
    the full state dict (rank 0's; every rank's running statistics are compared through
    ``agree``: their spread over the ranks)."""
    out = []
    data = batches()
    for pins in configs:
        pins = dict(pins)
        compile_backend = pins.pop("compile", False)
        mixed = pins.pop("mixed_precision", False)
        regularize = pins.pop("regularize", False)
        pm = autopar.parallelize(build(regularize), example_inputs=data[0][0],
                                 example_targets=data[0][1], seed=SEED,
                                 loss_fn=loss_fn, plan=pins, compile=compile_backend,
                                 mixed_precision=mixed,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
        losses = [pm.train_step(*d) for d in data]
        evaluated = pm.eval_step(*data[0])
        evaluated_again = pm.eval_step(*data[0])  # evaluation updates nothing
        pm.verify(*data[0])  # raises naming the first layer that differs from one process
        state = pm.state_dict()
        # what each rank holds of the statistics, max over the ranks minus min
        mine = torch.cat([v.double().reshape(-1) for k, v in sorted(pm.executor.buffers.items())
                          if "running" in k]) if pm.executor.buffers else torch.zeros(0)
        spread = 0.0
        if mine.numel():
            hi, lo = mine.clone(), mine.clone()
            group = pm.mesh.dp_group
            if group is not None:
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            spread = float((hi - lo).abs().max())
        pm.close()
        out.append(dict(losses=losses, eval=evaluated, eval_again=evaluated_again,
                        state=state if pm.mesh.rank == 0 else None, spread=spread))
    return out


def resume(args) -> dict:
    """Train one step under plan ``a``, save, load under plan ``b`` (a fresh model) and train
    the second step there: the final state and the evaluation of the first batch (the running
    statistics must come back with the weights)."""
    path, a, b = args
    data = batches()
    out = {}
    for step, pins in ((0, a), (1, b)):
        pm = autopar.parallelize(build(), example_inputs=data[0][0], example_targets=data[0][1],
                                 seed=SEED, loss_fn=loss_fn, plan=dict(pins),
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
        if step:
            pm.load(path)
        out.setdefault("losses", []).append(pm.train_step(*data[step]))
        if not step:
            pm.save(path)
        else:
            out["eval"] = pm.eval_step(*data[0])
            out["state"] = pm.state_dict()
        pm.close()
    return out
