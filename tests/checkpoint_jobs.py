"""Jobs for tests/test_checkpoint.py: run on every rank of a LocalPool (importable by name)."""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist

import autopar
from parallelize_jobs import EPS, LR, batches, make_model, shared_captures
from tp_helpers import TINY_COST

#: Steps before the checkpoint, and in all (the resumed run does the rest).
SAVED_AT, TOTAL = 2, 4


def _parallelize(name: str, pins: dict, data, bucket_mb: float, checkpoint: str | None = None):
    # resuming from a checkpoint: built on meta, no weights anywhere but the checkpoint's
    device = "meta" if checkpoint else "cpu"
    model, loss_fn = make_model(name, device)
    with shared_captures(name, device):
        return autopar.parallelize(model, example_inputs=data[0][0],
                                   example_targets=data[0][1], loss_fn=loss_fn, plan=dict(pins),
                                   tp_cost=TINY_COST, bucket_mb=bucket_mb, checkpoint=checkpoint,
                                   optimizer=functools.partial(torch.optim.AdamW, lr=LR,
                                                               eps=EPS))


def train_and_save(configs, root: str):
    """For each (model, pins): SAVED_AT steps, then save to ``root/<model>``. Rank 0 returns
    the losses and the state dict at the save."""
    out = []
    for name, pins in configs:
        start = time.perf_counter()
        data = batches(name, TOTAL)
        pm = _parallelize(name, pins, data, bucket_mb=0.01)  # several buckets per stage
        losses = [pm.train_step(x, y) for x, y in data[:SAVED_AT]]
        pm.save(os.path.join(root, name))
        state = pm.state_dict()
        pm.close()
        out.append(dict(losses=losses, state=state if dist.get_rank() == 0 else None,
                        seconds=time.perf_counter() - start))
    return out


def load_and_continue(configs, root: str):
    """For each (model, pins[, meta]): load ``root/<model>`` under these pins (with ``meta``,
    a model built on meta parallelized with ``checkpoint=`` the directory), then train to TOTAL
    steps. Rank 0 returns the state dict right after loading, the resumed losses, the final
    state dict and the restored step count."""
    out = []
    for name, pins, *meta in configs:
        start = time.perf_counter()
        data = batches(name, TOTAL)
        path = os.path.join(root, name)
        if meta and meta[0]:
            pm = _parallelize(name, pins, data, bucket_mb=1.0, checkpoint=path)
        else:
            pm = _parallelize(name, pins, data, bucket_mb=1.0)
            pm.load(path)
        loaded = pm.state_dict()
        steps = pm.steps
        losses = [pm.train_step(x, y) for x, y in data[SAVED_AT:]]
        final = pm.state_dict()
        pm.close()
        rank0 = dist.get_rank() == 0
        out.append(dict(loaded=loaded if rank0 else None, final=final if rank0 else None,
                        losses=losses, steps=steps, seconds=time.perf_counter() - start))
    return out
