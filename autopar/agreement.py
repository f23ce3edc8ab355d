"""Deciding the plan of a ``parallelize`` call: the pins checked on every rank before any work,
rank 0 deciding (the search, the pins, or a given plan or plan file), every rank agreeing.

:func:`agree_on_plan` is the phase between capture and compile: it returns the
:class:`~autopar.compiler.Planned` every rank compiles, or raises on every rank the error rank 0
met (same class, same message), so that no rank waits for a peer that gave up.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from autopar.compiler import Planned
from autopar.errors import (
    InfeasiblePlanError,
    InvalidInputError,
    InvalidPlanError,
    PlanMismatchError,
    error_from_parts,
    error_parts,
)
from autopar.plan_types import (CP_ATTENTION_KINDS, OFFLOAD_KINDS, OptimizerProfile, Plan,
                                 Prediction, RecomputeKind, ScheduleKind)
from autopar.runtime.comm import agree_on_success, broadcast_bytes
from autopar.runtime.schedules import schedule_spec

__all__ = ["PINNABLE", "plan_argument", "validate_pins", "agree_on_plan", "check_plan",
           "check_ep", "agree_on_success"]

#: Plan fields that ``plan={...}`` may pin.
PINNABLE = ("dp", "tp", "pp", "cp", "virtual_stages", "micro_batch_size", "num_micro_batches",
            "schedule", "recompute", "zero", "sequence_parallel", "zero_shard_size",
            "cp_attention", "cp_innermost", "ep", "reshard_after_forward", "vocab_multiple",
            "offload")


def plan_argument(plan: Any, world: int) -> Plan | dict[str, Any] | str:
    """``"auto"``, validated pins, or a Plan (loaded when ``plan`` is a file path)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)) and str(plan) != "auto":
        path = os.fspath(plan)
        if os.path.exists(path) or path.endswith((".json", ".yaml", ".yml")):
            return Plan.load(path)
        raise InvalidInputError(f"unknown plan {str(plan)!r}",
                                expected="'auto', a dict of pins, an autopar.Plan, or the path "
                                         "of a plan file (.json, .yaml)",
                                found="neither 'auto' nor an existing file",
                                fix="check the spelling or the path")
    if isinstance(plan, str):
        return "auto"
    if isinstance(plan, Mapping):
        return validate_pins(plan, world)
    raise InvalidInputError("plan has an unexpected type",
                            expected="'auto', a dict of pins, an autopar.Plan, or a file path",
                            found=type(plan).__name__)


_INT_PINS = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch_size",
             "num_micro_batches")


def validate_pins(pins: Mapping[str, Any], world: int) -> dict[str, Any]:
    """The pins, checked on their own and against each other and the world size (before any
    capture or search); enum pins are normalised to their values."""
    pins = dict(pins)
    unknown = sorted(set(pins) - set(PINNABLE), key=str)
    if unknown:
        raise InvalidPlanError(f"unknown pin(s) {unknown}", expected=f"some of {list(PINNABLE)}",
                               found=str(unknown), fix="remove or rename them")
    for name in _INT_PINS:
        if name in pins:
            v = pins[name]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidPlanError(f"pin {name}={v!r} is not a positive integer",
                                       expected=f"{name} >= 1", found=repr(v),
                                       fix=f"pin {name} to a positive integer, or leave it out")
    for name, kind in (("schedule", ScheduleKind), ("recompute", RecomputeKind)):
        if name in pins:
            try:
                pins[name] = kind(pins[name]).value
            except ValueError:
                choices = [k.value for k in kind]
                raise InvalidPlanError(f"pin {name}={pins[name]!r} is not a valid {kind.__name__}",
                                       expected=f"one of {choices}", found=repr(pins[name]),
                                       fix=f"pin {name} to one of {choices}") from None
    if "zero" in pins and (isinstance(pins["zero"], bool) or pins["zero"] not in (0, 1, 2, 3)):
        raise InvalidPlanError(f"pin zero={pins['zero']!r} is not a ZeRO stage",
                               expected="0, 1, 2 or 3", found=repr(pins["zero"]),
                               fix="pin zero to 0 (none), 1, 2 or 3")
    k = pins.get("zero_shard_size")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 2):
        raise InvalidPlanError(f"pin zero_shard_size={k!r} is not a shard group size",
                               expected="an integer >= 2 dividing dp (or None: the whole dp group)",
                               found=repr(k), fix="pin zero_shard_size to the data-parallel ranks "
                                                  "of one node, or leave it out")
    if "cp_innermost" in pins and not isinstance(pins["cp_innermost"], bool):
        raise InvalidPlanError("pin cp_innermost must be True or False",
                               expected="a bool", found=repr(pins["cp_innermost"]),
                               fix="pin cp_innermost=True (cp peers adjacent) or False")
    if "sequence_parallel" in pins and not isinstance(pins["sequence_parallel"], bool):
        raise InvalidPlanError("pin sequence_parallel must be True or False",
                               expected="a bool", found=repr(pins["sequence_parallel"]),
                               fix="pin sequence_parallel=True or False")
    if "reshard_after_forward" in pins and not isinstance(pins["reshard_after_forward"], bool):
        raise InvalidPlanError("pin reshard_after_forward must be True or False",
                               expected="a bool", found=repr(pins["reshard_after_forward"]),
                               fix="pin reshard_after_forward=True (gather again for the "
                                   "backward) or False (keep the layers gathered)")
    if "offload" in pins and pins["offload"] not in OFFLOAD_KINDS:
        raise InvalidPlanError(f"pin offload={pins['offload']!r} is not a place for the "
                               "optimizer state", expected=f"one of {OFFLOAD_KINDS}",
                               found=repr(pins["offload"]),
                               fix="pin offload='none', 'optimizer' (host memory) or 'disk' "
                                   "(files under offload_dir)")
    vm = pins.get("vocab_multiple")
    if "vocab_multiple" in pins and (not isinstance(vm, int) or isinstance(vm, bool) or vm < 0):
        raise InvalidPlanError(f"pin vocab_multiple={vm!r} is not a padding multiple",
                               expected="an integer >= 0 (the vocabulary is padded to a multiple "
                                        "of vocab_multiple x tp; 0: only what tp needs)",
                               found=repr(vm), fix="pin vocab_multiple=128 (Megatron-LM's "
                                                   "default), or leave it out")
    schedule = pins.get("schedule")
    v = pins.get("virtual_stages")
    if schedule is not None and v is not None:  # the micro-batch count is checked with the plan
        problem = schedule_spec(schedule).shape_problem(pins.get("pp", 1), v, 0)
        if problem is not None:
            summary, expected, fix = problem
            raise InvalidPlanError(summary, expected=expected,
                                   found=f"virtual_stages={v}, schedule={schedule}", fix=fix)
    if "ep" in pins and "dp" in pins and pins["dp"] % pins["ep"]:
        raise InvalidPlanError("expert parallelism borrows its ranks from data parallelism",
                               expected=f"ep dividing dp={pins['dp']}", found=f"ep={pins['ep']}",
                               fix="pin ep to a divisor of dp, or raise dp")
    if pins.get("sequence_parallel") and pins.get("tp") == 1:
        raise InvalidPlanError("sequence_parallel needs tp > 1", expected="tp >= 2",
                               found="tp=1", fix="drop sequence_parallel or pin tp >= 2")
    if "cp_attention" in pins and pins["cp_attention"] not in CP_ATTENTION_KINDS:
        raise InvalidPlanError(f"pin cp_attention={pins['cp_attention']!r} is not an attention "
                               f"algorithm", expected=f"one of {CP_ATTENTION_KINDS}",
                               found=repr(pins["cp_attention"]),
                               fix="pin cp_attention='ring' (p2p, overlapped) or 'allgather'")
    axes = ("dp", "tp", "pp", "cp")
    mesh = [pins[k] for k in axes if k in pins]
    product = 1
    for size in mesh:
        product *= size
    if {"dp", "tp", "pp"} <= set(pins) and product != world:
        raise PlanMismatchError("the pinned mesh does not match the world size",
                                expected=f"dp x tp x pp x cp = {world} (this job's processes)",
                                found=" x ".join(f"{k}={pins.get(k, 1)}" for k in axes)
                                      + f" = {product}",
                                fix="change the pins or the number of processes")
    if mesh and world % product:
        raise PlanMismatchError("the pinned sizes do not divide the world size",
                                expected=f"a product of pinned dp, tp, pp, cp dividing {world}",
                                found=" x ".join(f"{k}={pins[k]}" for k in axes
                                                 if k in pins) + f" = {product}",
                                fix="change the pins or the number of processes")
    return pins


def agree_on_plan(plan: Any, captured: Any, cluster: Any, world: int, global_batch: int,
                   seq: int, mixed_precision: bool, seed: int | None = None, *,
                   offload_choices: tuple[str, ...] = ("optimizer",),
                   optimizer: OptimizerProfile = OptimizerProfile()) -> Planned:
    """Rank 0 decides; every rank gets its plan, or raises its error (same class, same
    message), and the dropout seed. A search prices ``optimizer`` (the runtime's profile of
    the one the user gave)."""
    decided = None
    error = None
    search = None
    if dist.get_rank() == 0:
        try:
            decided, prediction, search = _decide(plan, captured, cluster, world, global_batch,
                                                  seq, mixed_precision, offload_choices,
                                                  optimizer)
            payload = {"plan": decided.to_json(),
                       "prediction": prediction.to_json() if prediction else None,
                       "seed": int(seed if seed is not None else torch.initial_seed())}
        except Exception as exc:  # noqa: BLE001 - every rank must learn that rank 0 failed
            error = exc
            payload = {"error": error_parts(exc)}
        data = json.dumps(payload).encode()
    else:
        data = b""
    data = broadcast_bytes(data, 0, "the broadcast of rank 0's plan")
    payload = json.loads(data.decode())
    if "error" in payload:
        if error is not None:
            raise error
        raise error_from_parts(**payload["error"])
    chosen = Plan.from_json(payload["plan"])
    prediction = Prediction.from_json(payload["prediction"]) if payload["prediction"] else None
    if chosen.world_size != world:
        raise PlanMismatchError("the plan does not match this job's world size",
                                expected=f"dp x pp x tp = {chosen.world_size} processes",
                                found=f"a world of {world}",
                                fix=f"launch {chosen.world_size} processes, or re-plan")
    return Planned(captured, chosen, prediction, int(payload["seed"]), search)




def _decide(plan: Any, captured: Any, cluster: Any, world: int, global_batch: int, seq: int,
            mixed_precision: bool, offload_choices: tuple[str, ...] = ("optimizer",),
            optimizer: OptimizerProfile = OptimizerProfile()
            ) -> tuple[Plan, Prediction | None, Any]:
    fingerprint = captured.fingerprint()
    if isinstance(plan, Plan):
        check_plan(plan, fingerprint, world, global_batch)
        return _with_stages(plan, captured).replace(model_fingerprint=fingerprint), None, None
    pins = validate_pins(plan, world) if isinstance(plan, Mapping) else {}
    full = {"dp", "tp", "pp"} <= set(pins) and (
        "micro_batch_size" in pins or "num_micro_batches" in pins)
    if pins.get("ep", 1) > 1:
        check_ep(pins["ep"], captured)
    if full:  # everything that shapes the mesh is pinned: no search needed
        ep = pins.pop("ep", 1)
        decided = _plan_from_pins(pins, captured, world, global_batch)
        if decided.dp % ep:
            raise InvalidPlanError("expert parallelism borrows its ranks from data parallelism",
                                   expected=f"ep dividing dp (dp={decided.dp})",
                                   found=f"ep={ep}", fix="pin dp to a multiple of ep too")
        return decided.replace(ep=ep, model_fingerprint=fingerprint), None, None
    shard_size = pins.pop("zero_shard_size", None)  # not a search dimension: applied after
    vocab_multiple = pins.pop("vocab_multiple", None)  # nor is this (any value makes tp divide)
    decided, prediction, search = _search(pins, captured, cluster, global_batch, seq,
                                          mixed_precision, offload_choices, optimizer)
    if vocab_multiple is not None:
        decided = decided.replace(vocab_multiple=vocab_multiple)
    if shard_size is not None:
        try:
            decided = decided.replace(zero_shard_size=shard_size)
        except ValueError as exc:
            raise InvalidInputError("zero_shard_size does not fit the searched plan",
                                    found=f"{exc} (searched dp={decided.dp}, zero={decided.zero})",
                                    fix="pin dp (a multiple of zero_shard_size) and zero >= 1 "
                                        "too") from exc
    return decided.replace(model_fingerprint=fingerprint), prediction, search


def check_ep(ep: int, captured: Any) -> None:
    """A pinned ep must split the model's experts."""
    from autopar.passes.expert_parallel import expert_weights

    if not expert_weights(captured.gm, ep):  # raises when ep does not divide the experts
        raise InvalidPlanError("ep > 1 but the model has no mixture-of-experts block",
                               expected="experts autopar captures as one operation "
                                        "(autopar/moe.py: transformers' experts layout)",
                               found=f"ep={ep} and no experts", fix="drop the ep pin")


def check_plan(plan: Plan, fingerprint: str, world: int, global_batch: int) -> None:
    """A given plan must be made for this model (fingerprint), world and global batch."""
    if plan.model_fingerprint is not None and plan.model_fingerprint != fingerprint:
        raise PlanMismatchError("the plan was made for another model (or autopar version)",
                                expected=f"model fingerprint {fingerprint} (this model, "
                                         f"autopar.plan_fingerprint)",
                                found=f"model fingerprint {plan.model_fingerprint} in the plan",
                                fix="re-plan for this model (plan='auto', pins, or autopar plan "
                                    "... --out), or clear the plan's model_fingerprint to apply "
                                    "it anyway")
    if plan.world_size != world:
        raise PlanMismatchError("the plan does not match this job's world size",
                                expected=f"dp x pp x tp = {plan.world_size} processes",
                                found=f"a world of {world}",
                                fix=f"launch {plan.world_size} processes, or re-plan")
    if plan.global_batch != global_batch:
        raise InvalidInputError("the plan was made for another global batch",
                                expected=f"global batch micro_batch_size x num_micro_batches x dp"
                                         f" = {plan.micro_batch_size} x "
                                         f"{plan.num_micro_batches} x {plan.dp} = "
                                         f"{plan.global_batch}",
                                found=f"global batch {global_batch} (example inputs or "
                                      f"global_batch=)",
                                fix="pass example inputs of the plan's batch (or global_batch=), "
                                    "or re-plan")


def _plan_from_pins(pins: Mapping[str, Any], captured: Any, world: int, global_batch: int) -> Plan:
    dp, tp, pp, cp = pins["dp"], pins["tp"], pins["pp"], pins.get("cp", 1)
    if dp * tp * pp * cp != world:
        raise PlanMismatchError("the pinned mesh does not match the world size",
                                expected=f"dp x tp x pp x cp = {world}",
                                found=f"{dp} x {tp} x {pp} x {cp} = {dp * tp * pp * cp}",
                                fix="change the pins or the number of processes")
    m = pins.get("num_micro_batches")
    mbs = pins.get("micro_batch_size")
    if m is None:
        m, rest = divmod(global_batch, dp * mbs)
        if rest or m < 1:
            raise InvalidInputError("the global batch does not split as pinned",
                                    expected=f"a multiple of dp x micro_batch_size = {dp * mbs}",
                                    found=f"global batch {global_batch}")
    elif mbs is None:
        mbs, rest = divmod(global_batch, dp * m)
        if rest or mbs < 1:
            raise InvalidInputError("the global batch does not split as pinned",
                                    expected=f"a multiple of dp x num_micro_batches = {dp * m}",
                                    found=f"global batch {global_batch}")
    assert mbs is not None and m is not None  # the caller pins one of them at least
    fields = {k: v for k, v in pins.items() if k not in ("micro_batch_size", "num_micro_batches")}
    plan = Plan(micro_batch_size=mbs, num_micro_batches=m, **fields)
    if plan.global_batch != global_batch:
        raise InvalidInputError("pins disagree with the global batch",
                                expected=f"micro_batch_size x num_micro_batches x dp = {global_batch}",
                                found=f"{mbs} x {m} x {dp} = {plan.global_batch}")
    return _with_stages(plan, captured)


def _search(pins: Mapping[str, Any], captured: Any, cluster: Any, global_batch: int, seq: int,
            mixed_precision: bool, offload_choices: tuple[str, ...] = ("optimizer",),
            optimizer: OptimizerProfile = OptimizerProfile()
            ) -> tuple[Plan, Prediction | None, Any]:
    from autopar.planner.cost_model import CostModel, ModelCosts, TrainingSetup
    from autopar.planner.search import SearchSpace, search

    space_pins = {k: v for k, v in pins.items() if k != "num_micro_batches"}
    if "num_micro_batches" in pins:
        if "dp" not in pins:
            raise InvalidInputError("num_micro_batches can only be pinned together with dp",
                                    fix="pin dp too, or pin micro_batch_size instead")
        mbs, rest = divmod(global_batch, pins["dp"] * pins["num_micro_batches"])
        if rest or mbs < 1:
            raise InvalidInputError("the global batch does not split as pinned",
                                    expected="a multiple of dp x num_micro_batches")
        space_pins["micro_batch_size"] = mbs
    dtype = "bf16" if mixed_precision else "fp32"
    costs = ModelCosts(captured, name=type(captured.model).__name__)
    cost_model = CostModel(costs, cluster, TrainingSetup(global_batch, seq, dtype,
                                                         optimizer=optimizer))
    result = search(cost_model, SearchSpace(**space_pins, offload_choices=offload_choices),
                    top_k=5, progress=False)
    for ev in (result.best, *result.alternatives):
        if ev.plan is not None:
            return _with_stages(ev.plan, captured), ev.prediction, result
    raise InfeasiblePlanError("the search found no plan", found=f"best: {result.best}",
                              fix="relax the pins, or add devices or memory")


def _with_stages(plan: Plan, captured: Any) -> Plan:
    """Cut the stages with the planner's stage ILP when the plan has none, and check them."""
    n = len(captured.layers)
    k = plan.num_stages
    if k > n:
        raise InfeasiblePlanError(
            f"each stage would get less than one layer: {k} stages for {n} layers",
            expected=f"pp x virtual_stages <= {n} (the captured layers: pre, blocks, post)",
            found=f"pp={plan.pp} x virtual_stages={plan.virtual_stages} = {k}",
            fix="reduce pp or virtual_stages, or use a deeper model")
    if plan.stages:
        if plan.stages[0].layers[0] != 0 or plan.stages[-1].layers[1] != n - 1:
            raise PlanMismatchError("the plan's stages do not cover this model's layers",
                                    expected=f"layers 0..{n - 1}",
                                    found=f"{plan.stages[0].layers[0]}..{plan.stages[-1].layers[1]}",
                                    fix="re-plan for this model")
        return plan
    from autopar.planner.stage_partition import stages_for_plan

    return plan.replace(stages=stages_for_plan(captured, plan))
