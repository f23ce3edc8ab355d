"""Full recompute one block at a time (runtime/layer_recompute.py): the same numbers as no
recompute, one checkpointed call per block, and the memory it saves, measured.

The memory test runs each setting in a fresh process with glibc's malloc returning every
allocation of 64 KiB or more to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so that the
process's peak resident set over a training step (``VmHWM`` after ``clear_refs``) minus its
resident set before the step is the step's peak of live tensors. Measured on the development VM:
no recompute 202 MB (the cost model: 227), full recompute per block 52 MB (66); checkpointing
the stage whole, as the executor did before, 202 MB: no saving at all with one stage, which is
what an H200 measured too (benchmarks/gpu_memory.py).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import autopar
from autopar import models
from autopar.runtime.layer_recompute import checkpointed, draws_global_rng
from parallelize_jobs import counting_checkpoint_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(recompute, schedule="1f1b", steps=2, zero=0, runs=None):
    """``runs``: a list that gets, per step, how many times a checkpointed block ran (its
    forward and each recompute)."""
    zm = models.build("gpt", dropout=0.1, seed=0, layers=3, hidden=64, heads=4, vocab=128,
                      seq=32)
    inputs, targets = zm.example_inputs(batch=4, seq=32, generator=torch.Generator().manual_seed(3))
    pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                             loss_fn=zm.loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2,
                                   "recompute": recompute, "schedule": schedule,
                                   "zero": zero})
    try:
        module = pm.executor.stage_modules[0]
        calls = [n for n in module._graph.graph.nodes if n.target is checkpointed]
        # the blocks' dropouts are autopar's own (runtime/rng.py): no global RNG to restore
        assert not any(n.args[1] for n in calls)
        losses = []
        for _ in range(steps):
            with counting_checkpoint_runs() as count:
                losses.append(pm.train_step(inputs, targets))
            if runs is not None:
                runs.append(count[0])
        state = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    finally:
        pm.close()
    return losses, state, module.recomputes_layers, len(calls)


@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("zb-h1", 0), ("zb-h1", 3)])
def test_per_block_recompute_trains_like_no_recompute(schedule, zero):
    """GPT with dropout 0.1 (the recomputed blocks must redraw their micro-batch's masks), two
    micro-batches, two SGD steps: every loss and parameter bit-equal to no recompute; under
    ZB-H1 the weight gradients are taken in a separate pass. One checkpointed call per block,
    also inside ZeRO-3's per-layer gathers (one stage holding the tied embedding and LM head:
    its W is one call, runtime/split_backward.py; both settings failed under ZeRO-3 with a
    zero-bubble schedule before 2026-11-29)."""
    ref_losses, ref_state, per_layer, calls = _train("none", schedule, zero=zero)
    assert not per_layer and calls == 0
    if zero:  # and the same numbers as without ZeRO-3
        assert ref_losses == _train("none", schedule)[0]
    runs: list[int] = []
    losses, state, per_layer, calls = _train("full", schedule, zero=zero, runs=runs)
    assert per_layer and calls == 3
    # each block runs twice per micro-batch, forward and one recompute, also under ZB-H1 (whose
    # W made one autograd call per weight group, each recomputing the block again, before
    # 2026-11-29: the stage now runs its whole backward at I)
    assert runs == [3 * 2 * 2] * 2
    assert losses == ref_losses
    for name, value in ref_state.items():
        assert torch.equal(state[name], value), name


_MEASURE = r"""
import functools, gc, json, sys, torch
import autopar
from autopar import models
from autopar.cluster import Cluster
from autopar.plan_types import RecomputeKind, ScheduleKind
from autopar.planner.cost_model import Candidate, CostModel, ModelCosts, TrainingSetup

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

torch.set_num_threads(1)
recompute, zero = sys.argv[1], int(sys.argv[2])
zm = models.build("gpt", dropout=0.0, seed=0, layers=6, hidden=128, heads=4, vocab=128, seq=256)
inputs, targets = zm.example_inputs(batch=16, seq=256, generator=torch.Generator().manual_seed(3))
pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                         loss_fn=zm.loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                         plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1,
                               "recompute": recompute, "zero": zero})
pm.train_step(inputs, targets)
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
pm.train_step(inputs, targets)
measured = status("VmHWM") - before
cm = CostModel(ModelCosts(pm.captured), Cluster.load("cpu").with_devices(1),
               TrainingSetup(16, 256, "fp32"))
ev = cm.evaluate(Candidate(1, 1, 1, 1, 16, ScheduleKind.ONE_F_ONE_B, RecomputeKind(recompute),
                           0, False))
print(json.dumps({"measured": measured, "predicted": ev.ranks[0].activations}))
"""


def _peaks(*runs: tuple[str, int]) -> list[dict]:
    """Each (recompute, zero) measured in a process of its own, the processes at once: what is
    measured is each one's own peak resident set, which the others do not move."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", _MEASURE, recompute, str(zero)], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for recompute, zero in runs]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs")
def test_per_block_recompute_lowers_the_measured_peak_as_priced():
    """A step's peak of live tensors with full recompute is a quarter of no recompute's (six
    blocks, one re-materialized at a time), and each is within 35% of the cost model's
    activations (the model counts autograd's saved tensors; the allocator rounds and the
    backward's own temporaries come and go)."""
    none, full, zero3 = _peaks(("none", 0), ("full", 0), ("full", 3))
    print(none, full, zero3)
    assert full["measured"] < 0.4 * none["measured"], (none, full)
    # inside ZeRO-3's per-layer gathers too (it checkpointed the stage whole before 2026-11-29)
    assert zero3["measured"] < 0.4 * none["measured"], (none, zero3)
    for got in (none, full, zero3):
        assert got["measured"] == pytest.approx(got["predicted"], rel=0.35), got


def test_a_block_drawing_from_torchs_rng_keeps_its_state():
    """A block calling a random op of torch itself is recomputed with the global RNG state
    restored (``preserve_rng_state``); autopar's dropout, seeded per sample, needs none."""
    from autopar.runtime import tp as tp_runtime

    noisy = torch.fx.symbolic_trace(lambda x: x + torch.randn_like(x))
    drop = torch.fx.symbolic_trace(lambda x: torch.nn.functional.dropout(x, 0.1))
    assert draws_global_rng(noisy) and draws_global_rng(drop)
    assert not draws_global_rng(torch.fx.symbolic_trace(
        lambda x: torch.nn.functional.dropout(x, 0.0) + torch.nn.functional.dropout(
            x, 0.5, training=False)))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(tp_runtime.dropout, (None, x, 0.1), {"site": "s"}))
    assert not draws_global_rng(torch.fx.GraphModule({}, graph))
