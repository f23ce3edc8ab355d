"""Jobs for tests/test_offload.py: run on every rank of a LocalPool (importable by name)."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

import autopar
from parallelize_jobs import EPS, LR, batches, make_model
from tp_helpers import TINY_COST


def train(configs, root: str, steps: int = 3):
    """For each ``(model, pins, mixed_precision)``: parallelize (``offload_dir`` a folder of
    ``root``), train ``steps`` steps and return the losses, rank 0's state dict, the memory
    report after the last step, the files the offload directory held then, and whether they
    were gone after ``close``."""
    out = []
    for k, (name, pins, mixed) in enumerate(configs):
        model, loss_fn = make_model(name)
        data = batches(name, steps)
        directory = os.path.join(root, f"run{k}")
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS),
                                 mixed_precision=mixed, offload_dir=directory, bucket_mb=0.05)
        losses = [pm.train_step(x, y) for x, y in data]
        memory = pm.memory_bytes()
        pager = pm.data_parallel.pager
        files = sorted(p.name for p in pager.root.glob("*.bin")) if pager is not None else []
        state = pm.state_dict()
        dp = pm.data_parallel
        masters = sum(b.master.numel() * b.master.element_size() for b in dp.buckets
                      if b.requires_grad)
        separate = all(b.separate_master for b in dp.buckets if b.requires_grad)
        pm.close()
        gone = pager is None or not pager.root.exists()
        out.append(dict(losses=losses, state=state if dist.get_rank() == 0 else None,
                        memory=memory, files=files, gone=gone, masters=masters,
                        separate=separate,
                        buckets=sum(1 for b in dp.buckets if b.requires_grad and b.pieces)))
    return out
