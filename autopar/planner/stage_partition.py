"""Cutting a model into pipeline stages: the problem from a captured model's profile, the
stage ILP's cut of a plan, and where a graph can be cut.

The problem and its pricing are :mod:`autopar.planner.stage_problem`; the integer linear program
that solves it, with its formulation as math, :mod:`autopar.planner.stage_ilp`. This module
builds problems from a captured graph (:func:`problem_from_profile`), cuts the stages of a plan
that has none (:func:`stages_for_plan`) and lists the cut points (:func:`cut_points`); it
re-exports the rest, so callers import stage partitioning from one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import networkx as nx

from autopar.errors import InvalidInputError
from autopar.plan_types import ScheduleKind, StagePlan
from autopar.planner.stage_ilp import TIE_BREAK_S, partition_stages
from autopar.planner.stage_problem import (LayerCosts, PartitionProblem, StagePartition,
                                           brute_force_partition, even_partition,
                                           in_flight_vectors, min_max_split, modeled_step_time,
                                           rank_memory)

__all__ = [
    "LayerCosts",
    "PartitionProblem",
    "StagePartition",
    "partition_stages",
    "brute_force_partition",
    "modeled_step_time",
    "rank_memory",
    "in_flight_vectors",
    "problem_from_profile",
    "CutPoint",
    "cut_points",
    "even_partition",
    "min_max_split",
    "stages_for_plan",
    "TIE_BREAK_S",
]


# ---------------------------------------------------------------------------------------------
# Inputs from a captured graph
# ---------------------------------------------------------------------------------------------

def problem_from_profile(captured: Any, profile: Any, *, num_ranks: int, num_microbatches: int,
                         micro_batch_size: int, seq: int, flops_per_s: float,
                         schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
                         stages_per_rank: int = 1, device_memory: float = math.inf,
                         state_bytes_per_param: float = 16.0, link_bandwidth: float = math.inf,
                         link_latency: float = 0.0, backward_factor: float = 2.0
                         ) -> PartitionProblem:
    """Per-layer costs from the analysis, with a simple time model.

    Forward time is the layer's FLOPs at the micro-batch's shape over ``flops_per_s`` (achieved
    FLOP/s); the backward takes ``backward_factor`` times that, half of it the weight gradient.
    Activations are the analysis' saved bytes; parameters include weights a layer reads but
    another layer owns (a tied LM head holds a copy of the embedding on its own stage). Only
    tensors the stage split really sends count at a cut: the masks and positions every stage
    recomputes do not (see :mod:`autopar.passes.split_stages`).
    """
    from autopar.ir import info
    from autopar.passes.split_stages import recomputable_nodes

    if flops_per_s <= 0:
        raise InvalidInputError("flops_per_s must be positive", found=str(flops_per_s))
    sizes = {"b": micro_batch_size, "s": seq}
    recomputed = {n.name for n in recomputable_nodes(captured.gm)}
    owned = {fqn: layer.index for layer in captured.layers for fqn in layer.params}
    numel = {p.fqn: int(p.spec.numel) for p in captured.params.values()}
    read_by: dict[int, set[str]] = {}
    for layer in captured.layers:
        fqns = set()
        for name in layer.nodes:
            fqns.update(info(captured.node(name)).reads)
        read_by[layer.index] = {f for f in fqns if f in numel and owned.get(f) != layer.index}
    layers = []
    for cost in profile.layers:
        values = cost.at(**sizes)
        forward = values["flops"] / flops_per_s
        backward = backward_factor * forward
        boundary = sum(_nbytes(info(captured.node(n)).spec, sizes)
                       for n in cost.boundary_tensors if n not in recomputed)
        params = cost.params + sum(numel[f] for f in read_by.get(cost.index, ()))
        layers.append(LayerCosts(cost.name, forward, backward, backward / 2, float(params),
                                 float(values["saved_bytes"]), float(boundary)))
    return PartitionProblem(tuple(layers), num_ranks, num_microbatches, ScheduleKind(schedule),
                            stages_per_rank, device_memory, state_bytes_per_param,
                            link_bandwidth, link_latency)


def stages_for_plan(captured: Any, plan: Any, *, profile: Any = None,
                    time_limit_s: float = 30.0) -> tuple[StagePlan, ...]:
    """The stages of ``plan`` (an :class:`autopar.plan_types.Plan` without stages) cut by the ILP, from
    the analysis of ``captured`` at the plan's micro-batch and the example's sequence length.

    Times are FLOP-proportional (backward twice the forward), transfers and memory left out:
    without a cluster this balances the schedule's step, embedding and LM head included. The
    plan search (:mod:`autopar.planner.search`) cuts with the cost model's times and memory."""
    from autopar.passes.analyze import analyze

    if plan.num_stages == 1:
        return (StagePlan(0, (0, len(captured.layers) - 1), 0, 0),)
    profile = profile if profile is not None else analyze(captured)
    seq = captured.example_size_kwargs().get("s", 1)
    problem = problem_from_profile(captured, profile, num_ranks=plan.pp,
                                   num_microbatches=plan.num_micro_batches,
                                   micro_batch_size=plan.micro_batch_size, seq=seq,
                                   flops_per_s=1e12, schedule=plan.schedule,
                                   stages_per_rank=plan.virtual_stages)
    return partition_stages(problem, time_limit_s=time_limit_s, lp_bound=False).stage_plans()


def _nbytes(spec: Any, sizes: dict[str, int]) -> int:
    from autopar.ir import evaluate

    return int(evaluate(spec.nbytes, **sizes))


# ---------------------------------------------------------------------------------------------
# Where the graph can be cut (networkx)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CutPoint:
    """A place in the graph's node order where a pipeline cut could go."""

    #: The last node before the cut.
    after: str
    #: Its layer, and whether the cut is a layer boundary.
    layer: str
    layer_boundary: bool
    #: Tensors (node names) that would cross, and their bytes at the given sizes.
    crossing: tuple[str, ...]
    nbytes: int


def cut_points(captured: Any, *, max_crossing: int = 1, **sizes: int) -> list[CutPoint]:
    """Positions in the op order where at most ``max_crossing`` tensors would cross.

    The activation dataflow (op nodes, without what every stage recomputes) is a networkx
    DiGraph; a cut after position i is crossed by every edge from a node at or before i to one
    after it. With ``max_crossing=1`` these are the single-tensor cuts: every layer boundary of
    a transformer (the residual stream) and points inside blocks (after the attention residual).
    """
    from autopar.ir import evaluate, info
    from autopar.passes.split_stages import recomputable_nodes

    sizes = sizes or captured.example_size_kwargs()
    gm = captured.gm
    skip = recomputable_nodes(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n not in skip]
    order = {n: i for i, n in enumerate(ops)}
    graph = nx.DiGraph()
    graph.add_nodes_from(n.name for n in ops)
    graph.add_edges_from((a.name, n.name) for n in ops for a in n.all_input_nodes if a in order)
    if not nx.is_directed_acyclic_graph(graph):
        raise InvalidInputError("the captured graph has a cycle")
    last_use = {name: max((order[captured.node(s)] for s in graph.successors(name)), default=-1)
                for name in graph.nodes}
    out = []
    live: dict[str, int] = {}
    for i, n in enumerate(ops[:-1]):
        if last_use[n.name] > i:
            live[n.name] = last_use[n.name]
        for name in [k for k, end in live.items() if end <= i]:
            del live[name]
        crossing = tuple(live)
        if len(crossing) <= max_crossing and crossing:
            nbytes = sum(int(evaluate(info(captured.node(c)).spec.nbytes, **sizes))
                         for c in crossing if info(captured.node(c)).spec is not None)
            layer_end = info(ops[i + 1]).layer != info(n).layer
            out.append(CutPoint(n.name, info(n).layer, layer_end, crossing, nbytes))
    return out
