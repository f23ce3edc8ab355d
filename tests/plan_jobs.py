"""Jobs for tests/test_plan_integration.py, run on every rank of a LocalPool (by name)."""

from __future__ import annotations

import functools

import torch

import autopar
from conftest import build_own_gpt


def searched_layout() -> dict:
    """parallelize the project's own tiny GPT with tp pinned and the rest searched; what was
    planned and what was built."""
    model, loss_fn = build_own_gpt()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (4, 17), generator=gen)
    inputs, targets = (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)
    pm = autopar.parallelize(model, example_inputs=inputs, example_targets=targets,
                             loss_fn=loss_fn, plan={"tp": 2, "dp": 1, "pp": 1},
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    out = {"planned": {k: v.value for k, v in pm.plan.gemm_sharding.items()},
           "built": {k: v.value for k, v in pm.tp_program.gemm_sharding.items()},
           "stage_method": pm.prediction.stage_partition.get("method")}
    pm.close()
    return out
