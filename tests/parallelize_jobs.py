"""Jobs for tests/test_parallelize.py: run on every rank of a LocalPool (importable by name)."""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

import autopar
from conftest import build_own_gpt, build_tiny
from tp_helpers import TINY_COST

LR = 1e-3
#: LLaMA's published Adam epsilon; with torch's 1e-8, Adam magnifies reduction-order noise in
#: near-zero gradients past fp32 comparison tolerances (see tests/dp_harness.py).
EPS = 1e-5


def make_model(name: str):
    if name == "own_gpt":
        model, loss_fn = build_own_gpt()
        return model, loss_fn
    zm = build_tiny(name)
    return zm.model, zm.loss_fn


def batches(name: str, steps: int, batch: int = 8, seq: int = 16):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (batch, seq + 1), generator=gen)
        out.append(((tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)))
    return out


def reference(name: str, steps: int = 3):
    """Single-process losses and final parameters."""
    torch.manual_seed(0)
    model, loss_fn = make_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for inputs, targets in batches(name, steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), *targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(configs, steps: int = 3):
    """For each (model name, pins): parallelize, train ``steps`` steps, return losses and the
    full state dict (rank 0 only, to keep the results small)."""
    out = []
    for name, pins in configs:
        start = time.perf_counter()
        model, loss_fn = make_model(name)
        data = batches(name, steps)
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
        losses = [pm.train_step(inputs, targets) for inputs, targets in data]
        state = pm.state_dict()
        memory = pm.memory_bytes()
        pm.close()
        out.append(dict(losses=losses, state=state if dist.get_rank() == 0 else None,
                        memory=memory, seconds=time.perf_counter() - start))
    return out
