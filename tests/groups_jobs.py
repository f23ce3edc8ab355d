"""Jobs for tests/test_shared_groups.py (run on every rank of a LocalPool)."""

from __future__ import annotations

import functools
import gc
import os

import torch
import torch.distributed as dist

import autopar
from autopar.errors import PlanMismatchError
import parallelize_jobs as jobs
from autopar.runtime.comm import note_failure
from autopar.runtime.groups import shared_keys
from tp_helpers import TINY_COST


def _threads() -> int:
    gc.collect()  # a dropped group's threads end with its last reference, often in a cycle
    return len(os.listdir("/proc/self/task"))


def _groups() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def _parallelize(name: str, pins: dict, data):
    model, loss_fn = jobs.make_model(name)
    with jobs.shared_captures(name, "cpu"):
        return autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                   loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                                   optimizer=functools.partial(torch.optim.AdamW, lr=jobs.LR,
                                                               eps=jobs.EPS))


def _state(pm):
    state = pm.state_dict()
    return state if dist.get_rank() == 0 else None


def models_in_turn(name: str, pins: dict, steps: int = 3) -> dict:
    """Threads and groups across models of one layout closed one after another; two models of
    that layout alive at once, stepped in turn (their groups are the same ones), then one of
    them failing; a failure counted on rank 0 alone, after which every rank creates its groups
    anew (else rank 0 would create groups its peers reuse, and all would hang)."""
    data = jobs.batches(name, steps)
    out: dict = {"threads": [_threads()], "groups": [_groups()]}
    for _ in range(2):
        pm = _parallelize(name, pins, data)
        pm.train_step(*data[0])
        pm.close()
        del pm
        out["threads"].append(_threads())
        out["groups"].append(_groups())
    keys = shared_keys()
    first, second = _parallelize(name, pins, data), _parallelize(name, pins, data)
    out["same_mesh"] = first.mesh.device_mesh is second.mesh.device_mesh
    out["keys_kept"] = shared_keys() == keys
    losses: dict[str, list[float]] = {"first": [], "second": []}
    for inputs, targets in data:
        losses["first"].append(first.train_step(inputs, targets))
        losses["second"].append(second.train_step(inputs, targets))
    out["two_alive"] = [dict(losses=losses[k], state=_state(pm))
                        for k, pm in (("first", first), ("second", second))]
    # the first fails (its executor shuts down, destroying the point-to-point group both use):
    # the second refuses its next step by name, not with torch's unregistered-group error
    first.executor._shut_down(RuntimeError("a failure for the test"))
    try:
        second.train_step(*data[0])
        out["second_after_failure"] = "trained"
    except PlanMismatchError as exc:
        out["second_after_failure"] = str(exc)
    mesh_before = first.mesh.device_mesh
    first.close()
    second.close()
    del first, second
    every = _parallelize(name, pins, data)  # every rank counted the failure: all create anew
    out["rebuilt_after_all"] = every.mesh.device_mesh is not mesh_before
    mesh_before = every.mesh.device_mesh
    every.close()
    del every
    if dist.get_rank() == 0:  # rank 0 alone: the agreement makes its peers create anew too
        note_failure()
    after = _parallelize(name, pins, data)
    out["rebuilt"] = after.mesh.device_mesh is not mesh_before
    out["after_failure"] = dict(losses=[after.train_step(i, t) for i, t in data],
                                state=_state(after))
    after.close()
    return out
