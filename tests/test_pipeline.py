"""The pipeline executor on real gloo processes against the single-process run.

One job per process pool loops over models x schedules x micro-batch counts: the own GPT, Hugging
Face GPT-2 and BERT (6 blocks, hidden 64), pp in {2, 4}, GPipe / 1F1B / interleaved 1F1B (v=2)
/ ZB-H1, m in {p, 2p}, two AdamW steps on a global batch of 8. Compared with the eager model on
the whole batch: the loss of both steps, the gradients of the first step and the parameters after
the second.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

from autopar import capture
from autopar.passes.split_stages import split_into_stages
from autopar.plan_types import ScheduleKind
from autopar.runtime.local_pool import LocalPool
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.pipeline import PipelineExecutor
from autopar.runtime.schedules import build_schedule
from conftest import build_own_gpt, build_tiny

pytestmark = pytest.mark.distributed

BATCH, SEQ, LR, BLOCKS = 8, 16, 1e-3, 6
SCHEDULES = [(ScheduleKind.GPIPE, 1), (ScheduleKind.ONE_F_ONE_B, 1),
             (ScheduleKind.INTERLEAVED_1F1B, 2), (ScheduleKind.ZB_H1, 1)]

# Tolerances (fp32). Loss: the pipeline sums the same per-token terms in m pieces, which moves
# the last bits only (rtol 1e-5). Gradients: accumulating m micro-batch gradients reorders fp32
# sums; the measured relative error is ~1e-6 of each tensor's largest entry (rtol 1e-4,
# atol 1e-6 leaves margin while any scaling or missing term, such as a tied weight's unsummed
# half, is off by far more). Parameters after two AdamW steps: Adam divides by sqrt(v) + 1e-8, so
# entries with near-zero gradients amplify rounding; the same single-process run differs by
# 3e-5 between whole-batch and 4-micro-batch accumulation, and by 6e-5 between fp32 and fp64,
# while each step moves a weight by up to lr = 1e-3: atol 1e-4.
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=0.0, atol=1e-4)


def even_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(num_stages)]


def _models():
    out = {}
    for family in ("gpt", "bert"):
        zm = build_tiny(family, layers=BLOCKS)
        out["hf-" + family] = (zm.model, zm.loss_fn, zm.example_inputs)
    model, loss_fn = build_own_gpt(layers=BLOCKS)

    def make_inputs(batch, seq, generator):  # token ids and next-token targets
        tokens = torch.randint(0, 128, (batch, seq + 1), generator=generator)
        return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)

    out["own-gpt"] = (model, loss_fn, make_inputs)
    return out


def _reference(model, loss_fn, batches):
    """The single-process run: eager model, whole batch, AdamW."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, grads = [], None
    for inputs, targets in batches:
        opt.zero_grad()
        loss = loss_fn(ref(*inputs), *targets)
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in ref.named_parameters(remove_duplicate=False)}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: p.detach().clone()
                           for k, p in ref.named_parameters(remove_duplicate=False)}


@pytest.fixture(scope="module")
def cases():
    """Per model: the stage splits for every (p, v), the initial tensors, the batches and the
    single-process reference."""
    out = {}
    gen = torch.Generator().manual_seed(7)
    for name, (model, loss_fn, make_inputs) in _models().items():
        batches = [make_inputs(batch=BATCH, seq=SEQ, generator=gen) for _ in range(2)]
        captured = capture(model, batches[0][0], loss_fn, example_targets=batches[0][1])
        n = len(captured.layers)
        splits = {(p, v): split_into_stages(captured.gm, captured.layers, even_ranges(n, p * v),
                                            constants=captured.constants)
                  for p in (2, 4) for v in (1, 2)}
        tensors = {k: t.detach() for k, t in model.named_parameters(remove_duplicate=False)}
        tensors.update(dict(model.named_buffers()))
        out[name] = dict(splits=splits, tensors=tensors, batches=batches,
                         reference=_reference(model, loss_fn, batches))
    return out


def train_pipelines(configs, dp=1, pp=None, tp=1, match=None):
    """Worker job: for each (name, split, tensors, batches, kind, v, m) run two AdamW steps.
    Every (dp, tp) column of the mesh runs its own copy of the pipeline on the same batch.
    ``match="order"``: messages paired by their order on each link, as NCCL pairs them."""
    mesh = ParallelMesh(dp, pp or dist.get_world_size() // (dp * tp), tp)
    results = []
    for name, split, tensors, batches, kind, v, m in configs:
        start = time.perf_counter()
        executor = PipelineExecutor(split, build_schedule(kind, mesh.pp, m, v), mesh,
                                    tensors=tensors, match=match)
        opt = torch.optim.AdamW(executor.parameters(), lr=LR)
        ahead = _count_receives_ahead(executor)
        losses, grads = [], None
        for inputs, targets in batches:
            opt.zero_grad()
            loss = executor.step(inputs, targets)
            if grads is None:
                grads = {k: p.grad.clone() for k, p in executor.named_parameters()}
            opt.step()
            losses.append(None if loss is None else loss.item())
        params = {k: p.detach().clone() for k, p in executor.named_parameters()}
        results.append(dict(losses=losses, grads=grads, params=params, receives_ahead=ahead[0],
                            peak_ahead=ahead[1], seconds=time.perf_counter() - start))
    return results


def _count_receives_ahead(executor):
    """Count the computes that start with a later compute's receive already posted (on gloo the
    executor posts each compute's receives one compute ahead, so the transfer overlaps it), and
    the most such receives held at once (what the memory model charges:
    ``ScheduleSpec.receives_ahead`` when paired by order, one on gloo)."""
    from autopar.runtime.schedules import Action, ActionKind

    count = [0, 0]
    compute = executor._compute

    def counted(a):
        own = Action(a.stage, ActionKind.RECV_F if a.kind is ActionKind.FORWARD
                     else ActionKind.RECV_B, a.microbatch)
        ahead = sum(k != own for k in executor._posted)
        count[0] += ahead > 0
        count[1] = max(count[1], ahead)
        compute(a)

    executor._compute = counted
    return count


def _check(cases, configs, per_rank, label):
    """Compare every rank's part of every configuration with the reference."""
    for i, (name, split, _, _, kind, v, m) in enumerate(configs):
        ref_losses, ref_grads, ref_params = cases[name]["reference"]
        what = f"{label} {name} {kind.value} v={v} m={m}"
        losses = [r[i]["losses"] for r in per_rank if r[i]["losses"][0] is not None]
        assert losses, what
        for got in losses:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), **LOSS_TOL,
                                       msg=lambda msg: f"{what} loss: {msg}")
        seen = set()
        for rank, result in enumerate(per_rank):
            for fqn, grad in result[i]["grads"].items():
                torch.testing.assert_close(grad, ref_grads[fqn], **GRAD_TOL,
                                           msg=lambda msg: f"{what} rank {rank} grad {fqn}: {msg}")
                torch.testing.assert_close(result[i]["params"][fqn], ref_params[fqn],
                                           **PARAM_TOL,
                                           msg=lambda msg: f"{what} rank {rank} {fqn}: {msg}")
                seen.add(fqn)
        want = set(split.param_stages)
        assert seen == want, f"{what}: parameters {sorted(want - seen)[:3]} held by no rank"


def _check_receives_ahead(configs, per_rank, ordered):
    """The receives each rank held posted ahead of their compute at once, at most: what the
    memory model charges (``ScheduleSpec.receives_ahead`` when paired by order, as on NCCL;
    one on gloo, which posts each compute's receives one compute ahead)."""
    from autopar.runtime.schedules import schedule_spec

    p = len(per_rank)
    for i, (name, _, _, _, kind, v, m) in enumerate(configs):
        held = [r[i]["peak_ahead"] for r in per_rank]
        want = [schedule_spec(kind).receives_ahead(p, v, m, r) if ordered else 1
                for r in range(p)]
        assert held == want, (name, kind.value, v, m, held, want)


def _configs(cases, p):
    return [(name, case["splits"][(p, v)], case["tensors"], case["batches"], kind, v, m)
            for name, case in cases.items() for kind, v in SCHEDULES for m in (p, 2 * p)]


def _in_order_configs(cases, p):
    """Every schedule, ZB-V included, on the own GPT (tied embedding and head), m = 2p."""
    case = cases["own-gpt"]
    return [("own-gpt", case["splits"][(p, v)], case["tensors"], case["batches"], kind, v, 2 * p)
            for kind, v in (*SCHEDULES, (ScheduleKind.ZB_V, 2))]


@pytest.mark.timeout(300)
def test_pipeline_matches_single_process_pp2(cases):
    configs = _configs(cases, 2)
    with LocalPool(2, timeout_s=240, collective_timeout_s=60) as pool:
        per_rank = pool.run(train_pipelines, configs)
        # every schedule with its messages paired by order on each link (tag 0 on gloo,
        # which then pairs as NCCL does), lowered in send order; a message taken out of order
        # would land in the wrong buffer (a shape error, or wrong numbers)
        ordered = _in_order_configs(cases, 2)
        per_rank_ordered = pool.run(train_pipelines, ordered, match="order")
    _check(cases, ordered, per_rank_ordered, "pp=2 paired by order")
    _check(cases, configs, per_rank, "pp=2")
    _check_receives_ahead(ordered, per_rank_ordered, ordered=True)
    _check_receives_ahead(configs, per_rank, ordered=False)
    # every configuration overlapped some receive with the compute before it (gloo)
    for i, config in enumerate(configs):
        assert sum(r[i]["receives_ahead"] for r in per_rank) > 0, config[0]
    # tied weights: the embedding (first stage) and the LM head (last stage) are one tensor
    own = cases["own-gpt"]["splits"][(2, 1)]
    assert own.shared_params() == {"lm_head.weight": (0, 1)}  # export names it after the head
    assert "lm_head.weight" in per_rank[0][0]["params"] and \
        "lm_head.weight" in per_rank[1][0]["params"]


@pytest.mark.timeout(400)
def test_pipeline_matches_single_process_pp4(cases):
    configs = _configs(cases, 4)
    with LocalPool(4, timeout_s=360, collective_timeout_s=60) as pool:
        per_rank = pool.run(train_pipelines, configs)
        _check(cases, configs, per_rank, "pp=4")
        # a 2 x 2 mesh (pp=2, tp=2): pipeline peers stride by tp; each tp column runs the
        # (unsharded) stages, so both columns must reproduce the reference
        mesh_configs = [c for c in _configs(cases, 2) if c[0] == "own-gpt" and c[6] == 2]
        per_rank = pool.run(train_pipelines, mesh_configs, dp=1, pp=2, tp=2)
        ordered = _in_order_configs(cases, 4)
        per_rank_ordered = pool.run(train_pipelines, ordered, match="order")
    _check(cases, ordered, per_rank_ordered, "pp=4 paired by order")
    _check_receives_ahead(ordered, per_rank_ordered, ordered=True)
    for column in ((0, 2), (1, 3)):
        _check(cases, mesh_configs, [per_rank[r] for r in column], f"tp column {column}")
    split8 = cases["hf-gpt"]["splits"][(4, 2)]
    assert split8.num_stages == 8 and split8.shared_params() == {"lm_head.weight": (0, 7)}
