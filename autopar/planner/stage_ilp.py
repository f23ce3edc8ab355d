r"""Pipeline stage partition as an integer linear program (pulp; HiGHS in process, CBC the
fallback: autopar/solver.py).

The problem
-----------
Layers ``l = 0..L-1`` (``CapturedGraph.layers``: pre, blocks, post) cost, per micro-batch,
forward time ``f_l``, backward time ``b_l`` (of which ``w_l`` is the weight gradient), ``π_l``
parameters (each costing ``σ`` bytes of weights, gradients and optimizer state), ``a_l`` bytes of
saved activations, and ``τ_l`` seconds to send what crosses a cut right after ``l``. They are cut
into ``S = p v`` contiguous stages, stage ``s`` on pipeline rank ``s mod p`` (``v`` stages per rank
when interleaved; ZB-V places its two chunks in a V, stage ``s`` and ``2p - 1 - s`` on rank ``s``:
the schedule's ``ScheduleSpec.placement``), and ``m`` micro-batches run through them under a
schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V; each schedule's ``StageILPForm`` says which
constraint families below apply). Each rank has ``M`` bytes of device memory.

Repeated layers keep the program small: consecutive layers with equal costs form a segment
``g = [α_g, α_g + K_g)`` (GPT-3 175B: embedding, 96 equal blocks, LM head), and a
cut is placed by choosing its segment and an offset inside it, instead of one binary per layer and
stage. Stage sums are differences of prefix sums ``Q(c) = Σ_{l<c} q_l``, which are linear inside a
segment.

Variables, for cut ``s = 0..S-2`` (after stage ``s``) and segment ``g``:

    u[s,g] ∈ {0,1}       cut s falls right after a layer of segment g
    k[s,g] ∈ Z, ≥ 0      the offset of that layer in g
    Y ≥ 0                time per micro-batch in the steady state (GPipe: Y_F + Y_B, the
                         forward and backward phases)
    Z ≥ 0                ZB-H1 only: the largest weight-gradient time of a stage

Cut position and stage sums (:func:`_cut_expressions`)::

    c_s     = 1 + Σ_g (α_g u[s,g] + k[s,g])                      (layers in stages 0..s)
    Q(c_s)  = Σ_g ((Q(α_g) + q_g) u[s,g] + q_g k[s,g]),  Q(c_{-1}) = 0,  Q(c_{S-1}) = Q(L)
    q(s)    = Q(c_s) − Q(c_{s−1})                                 (stage s's total of q)
    τ(c_s)  = Σ_g τ_g u[s,g]                                     (transfer at cut s)

Constraints:

    (C1) one segment per cut      Σ_g u[s,g] = 1                              _add_cut_choice
    (C2) offset inside it         k[s,g] ≤ (K_g − 1 − [g = last]) u[s,g]       _add_cut_choice
    (C3) stages not empty         c_{s+1} ≥ c_s + 1                            _add_order
    (C4) bottleneck               Y ≥ t(s) per stage, t = f + b;               _add_bottleneck
                                  interleaved: Y ≥ v t(s) (a rank's chunks run in rounds
                                  paced by the slowest chunk; an upper bound of the
                                  simulator's steady state, exact for equal chunks), and
                                  Y_F ≥ Σ_{s on r} t(s), the busiest rank, minimised in a
                                  second solve among the optima (ties are common);
                                  GPipe: Y_F ≥ f(s), Y_B ≥ b(s); ZB-H1: Z ≥ w(s);
                                  ZB-V: Y ≥ Σ_{s on r} t(s) per rank (its two chunks
                                  alternate in the steady state)
    (C5) pipeline loops           1F1B: (p − i) Y ≥ Σ_{s≥i} t(s) + 2 Σ_{s≥i} τ(c_s)   _add_loops
                                  for every i (stage i keeps p − i micro-batches in flight,
                                  so a micro-batch's round trip from stage i is shared by
                                  p − i of them); ZB-H1 the same with f + b − w (W is off the
                                  loop); interleaved (2p − 1) Y ≥ Σ_s t(s) + 2 Σ_s τ(c_s);
                                  none for GPipe and ZB-V
    (C6) memory                   σ π(r) + Σ_j n_j a(s_j) ≤ M                  _add_memory
                                  for every rank r and every vector n of in-flight micro-batches
                                  per local stage s_j that r's action list reaches (from the
                                  schedule itself: stage i of 1F1B holds p − i, GPipe m)
    (C8) whole layers             Y ≥ B* (v B* interleaved), where B* = min over   _add_integral_bounds
                                  contiguous partitions of the busiest stage's f + b
                                  (:func:`min_max_split`, exact); GPipe Y_F ≥ B*_f,
                                  Y_B ≥ B*_b; ZB-H1 Z ≥ B*_w. Implied by (C4) at every
                                  integer point; it tightens the LP relaxation, which
                                  otherwise spreads blocks fractionally over the stages

Objective, the modelled step time (:func:`_objective`, :func:`modeled_step_time`)::

    GPipe        (m − 1)(Y_F + Y_B) + Σ_l t_l + 2 Σ_s τ(c_s)
    1F1B         (m − 1) Y + Σ_l t_l + 2 Σ_s τ(c_s)
    interleaved  (m − 1/v) Y + Σ_l t_l / v + 2 Σ_s τ(c_s)
    ZB-H1        (m − 1) Y + Σ_l (f_l + b_l − 2 w_l) + 2 Z + 2 Σ_s τ(c_s)
    ZB-V         m Y + (p − 1)/(2p) Σ_l (f_l + b_l − 2 w_l) + 2 Σ_s τ(c_s)

The first term is the steady state, the rest the fill and drain: one micro-batch's trip through
every stage and every cut (forward and back). Embedding and LM head costs are layers like any
other, so first and last stages take fewer blocks when that is better. On equal stages without
transfer costs these are the published closed forms: the bubble is (p − 1)/m of the ideal time
for GPipe and 1F1B, (p − 1)/(v m) interleaved, ZB-H1 saves (p − 1)(2w) against 1F1B, and ZB-V's
fill is (p − 1) stage-forwards when F = I = W (half of ZB-H1's, Qi et al. 2024 section 6); the
simulator (:mod:`autopar.runtime.simulator`) gives the same numbers. With transfers the loop
constraints reproduce the simulator's 1F1B steady state (F + B + 2(p − 1)τ/p on equal stages,
within 2%). For interleaved 1F1B with unequal chunks the model is conservative (C4 is above the
simulator's steady state to within 0.2% on random chunk times, which can run ~15% faster), and
its (C5) is fitted to the simulator
(2p − 1 micro-batch chunks share the loop), not derived. The simulator stays the reference for
a chosen partition.

Certificate, of the modelled step time above (not of the simulator's time, which runs the
executor's action lists and is reported beside it): CBC solves with ``gapRel = 0``, so a status
"optimal" proves no contiguous partition models faster (gap 0). The LP relaxation (u, k
continuous) is solved too; its value bounds the optimum from below, so when the solver stops at
its time limit ``(step_time − lp_bound) / step_time`` bounds how far the answer can be from
optimal. Without (C8) the relaxation sat tens of percent below the optimum (96 equal blocks on 80
stages: 1.2 fractional blocks per stage against 2 whole ones, 39% below) and 48- and 80-stage
interleaved programs ran to their time limit, once returning a cut 12% slower than the optimum;
with it the bound is usually the optimum itself, and those programs are proven optimal in about
a second (tests/test_stage_partition.py).

:func:`brute_force_partition` enumerates every partition (small instances, tests) and
:func:`modeled_step_time` evaluates one; :func:`problem_from_profile` builds the inputs from the
analysis of a captured graph with a flops/peak time model, and :func:`stages_for_plan` cuts a
plan's stages from it (what ``autopar.parallelize`` does for a plan given without stages);
:func:`cut_points` finds, with networkx, where the graph can be cut and which tensors cross.

:func:`min_max_split` is the plan search's fast first pass (thousands of candidates, no solver):
the contiguous split whose busiest stage is least busy. That stage's time bounds the ILP's
steady state from below ((C4): ``Y >= t(s)``, ``v t(s)`` interleaved, ``Y_F + Y_B >= t(s)``
GPipe), so the objective above at that steady state, without transfers, is a lower bound of the
ILP's (tested). The search re-cuts its finalists with the ILP.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import pulp

from autopar import solver
from autopar.errors import InfeasiblePlanError
from autopar.planner.stage_problem import (PartitionProblem, StagePartition, check_sizes,
                                           in_flight_vectors, infeasible_error, min_max_split,
                                           modeled_step_time, partition_result, rank_memory,
                                           stage_ranges)
from autopar.runtime.schedules import StageILPForm

__all__ = ["partition_stages", "TIE_BREAK_S"]


# ---------------------------------------------------------------------------------------------
# The ILP
# ---------------------------------------------------------------------------------------------

class _Model:
    """The program's variables and the expressions built from them."""

    def __init__(self, problem: PartitionProblem, relaxed: bool) -> None:
        self.problem = problem
        self.lp = pulp.LpProblem("stage_partition", pulp.LpMinimize)
        self.segments = problem.segments()
        L = len(problem.layers)
        cat_bin = pulp.LpContinuous if relaxed else pulp.LpBinary
        cat_int = pulp.LpContinuous if relaxed else pulp.LpInteger
        n_cuts = problem.num_stages - 1
        self.u = {(s, g): self.lp.add_variable(f"u_{s}_{g}", 0, 1, cat_bin)
                  for s in range(n_cuts) for g in range(len(self.segments))}
        self.k = {(s, g): self.lp.add_variable(f"k_{s}_{g}", 0, None, cat_int)
                  for s in range(n_cuts) for g in range(len(self.segments))}
        self.Y = self.lp.add_variable("Y", 0)
        self.Y_F = self.lp.add_variable("Y_F", 0)
        self.Y_B = self.lp.add_variable("Y_B", 0)
        self.Z = self.lp.add_variable("Z", 0)
        self.num_layers = L
        # prefix sums at segment starts
        self.prefix: dict[str, list[float]] = {}
        for attr in ("forward", "backward", "weight_grad", "params", "activation_bytes"):
            acc, out = 0.0, []
            for layer in problem.layers:
                out.append(acc)
                acc += getattr(layer, attr)
            out.append(acc)
            self.prefix[attr] = out

    def num_integer_vars(self) -> int:
        return len(self.u) + len(self.k)


def _cut_expressions(model: _Model):
    """c_s, Q(c_s) for each per-layer quantity, and τ(c_s), as affine expressions."""
    problem = model.problem
    n_cuts = problem.num_stages - 1

    def position(s: int):
        return 1 + pulp.lpSum(start * model.u[s, g] + model.k[s, g]
                              for g, (start, _) in enumerate(model.segments))

    def prefix_at(attr: str, s: int):
        """Q(c_s) with c_{-1} = 0 and c_{S-1} = L."""
        if s < 0:
            return 0.0
        if s >= n_cuts:
            return model.prefix[attr][-1]
        terms = []
        for g, (start, _) in enumerate(model.segments):
            q = getattr(problem.layers[start], attr)
            terms.append((model.prefix[attr][start] + q) * model.u[s, g] + q * model.k[s, g])
        return pulp.lpSum(terms)

    def transfer(s: int):
        if s >= n_cuts:
            return 0.0
        return pulp.lpSum(problem.transfer_time(start) * model.u[s, g]
                          for g, (start, _) in enumerate(model.segments))

    def stage(attr: str, s: int):
        return prefix_at(attr, s) - prefix_at(attr, s - 1)

    return position, stage, transfer, prefix_at


def _add_cut_choice(model: _Model) -> None:
    """(C1) each cut in one segment; (C2) its offset inside that segment."""
    last = len(model.segments) - 1
    for s in range(model.problem.num_stages - 1):
        model.lp += pulp.lpSum(model.u[s, g] for g in range(len(model.segments))) == 1, f"C1_{s}"
        for g, (_, length) in enumerate(model.segments):
            room = length - 1 - (1 if g == last else 0)
            if room < 0:  # a one-layer last segment: no cut can follow it
                model.lp += model.u[s, g] == 0, f"C2u_{s}_{g}"
            model.lp += model.k[s, g] <= max(room, 0) * model.u[s, g], f"C2_{s}_{g}"


def _add_order(model: _Model, position) -> None:
    """(C3) stages are not empty: c_{s+1} >= c_s + 1."""
    for s in range(model.problem.num_stages - 2):
        model.lp += position(s + 1) >= position(s) + 1, f"C3_{s}"


def _add_bottleneck(model: _Model, stage) -> None:
    """(C4) the steady state is no faster than the busiest stage (or rank, interleaved)."""
    problem = model.problem
    S, p = problem.num_stages, problem.num_ranks
    form = problem.spec.ilp_form
    if form is StageILPForm.V_SHAPE:  # a rank's two chunks alternate: its total paces it
        for r in range(p):
            model.lp += model.Y >= pulp.lpSum(stage("forward", s) + stage("backward", s)
                                              for s in problem.stages_of(r)), f"C4v_{r}"
        return
    for s in range(S):
        if form is StageILPForm.PHASED:
            model.lp += model.Y_F >= stage("forward", s), f"C4f_{s}"
            model.lp += model.Y_B >= stage("backward", s), f"C4b_{s}"
        else:  # interleaved: the v chunks of a rank run in rounds paced by the slowest one
            weight = problem.stages_per_rank
            model.lp += model.Y >= weight * (stage("forward", s) + stage("backward", s)), \
                f"C4_{s}"
        if problem.spec.splits_backward:
            model.lp += model.Z >= stage("weight_grad", s), f"C4w_{s}"
    if form is StageILPForm.INTERLEAVED:  # Y_F >= the busiest rank's total (tie-break)
        for r in range(p):
            model.lp += model.Y_F >= pulp.lpSum(stage("forward", s) + stage("backward", s)
                                                for s in problem.stages_of(r)), f"C4r_{r}"


def _least_busiest(problem: PartitionProblem, *attrs: str) -> float:
    """min over contiguous partitions of the busiest stage's total of ``attrs`` (exact:
    :func:`min_max_split`)."""
    times = [sum(getattr(layer, a) for a in attrs) for layer in problem.layers]
    return max(sum(times[a:b + 1]) for a, b in min_max_split(times, problem.num_stages))


def _add_integral_bounds(model: _Model) -> None:
    """(C8) what (C4) implies for whole layers, stated outright: every contiguous partition has
    a stage at least as busy as the least-busy partition's busiest, ``B* = min max_s t(s)``
    (:func:`min_max_split`, exact), so ``Y >= B*`` (``v B*`` interleaved; GPipe ``Y_F >= B*_f``,
    ``Y_B >= B*_b``, ``Y_F + Y_B >= B*``; ZB-H1 also ``Z >= B*_w``). Valid for every integer
    point, so the optimum is unchanged; the LP relaxation is what changes. Without it, fractional
    cuts spread 96 equal blocks over 80 stages at 1.2 blocks each while any real partition has a
    stage with 2: the relaxation sat ~40% below the optimum, the solver could not close the gap
    in its time limit (GPT-3 175B, pp 10 x v 8), and the bound it certified was that loose."""
    problem = model.problem
    form = problem.spec.ilp_form
    busiest = _least_busiest(problem, "forward", "backward")
    if form is StageILPForm.PHASED:
        model.lp += model.Y_F >= _least_busiest(problem, "forward"), "C8f"
        model.lp += model.Y_B >= _least_busiest(problem, "backward"), "C8b"
        model.lp += model.Y_F + model.Y_B >= busiest, "C8"
    elif form is StageILPForm.INTERLEAVED:
        model.lp += model.Y >= problem.stages_per_rank * busiest, "C8"
        model.lp += model.Y_F >= busiest, "C8r"
    else:  # 1F1B, ZB-H1 (Y >= t(s)); ZB-V (Y >= a rank's two stages >= either one)
        model.lp += model.Y >= busiest, "C8"
    if problem.spec.splits_backward and form is not StageILPForm.V_SHAPE:
        model.lp += model.Z >= _least_busiest(problem, "weight_grad"), "C8w"


def _add_loops(model: _Model, stage, transfer, prefix_at) -> None:
    """(C5) a micro-batch's round trip from stage i is shared by the micro-batches in flight.

    Stage sums telescope (Σ_{s>=i} q(s) = Q(L) - Q(c_{i-1})) and the transfers after cut i are
    a running sum R_i = τ(c_i) + R_{i+1}, so the family has O(S) terms, not O(S^2)."""
    problem = model.problem
    S, p = problem.num_stages, problem.num_ranks
    form = problem.spec.ilp_form
    total = model.prefix["forward"][-1] + model.prefix["backward"][-1]
    if form in (StageILPForm.PHASED, StageILPForm.V_SHAPE):
        return
    if form is StageILPForm.INTERLEAVED:
        model.lp += (2 * p - 1) * model.Y >= total + 2 * pulp.lpSum(
            transfer(s) for s in range(S - 1)), "C5"
        return
    tail = {S - 1: 0.0}
    for i in range(S - 2, -1, -1):
        var = model.lp.add_variable(f"R_{i}", 0)
        model.lp += var == transfer(i) + tail[i + 1], f"R_{i}"
        tail[i] = var
    total_w = model.prefix["weight_grad"][-1]
    for i in range(p):
        work = total - prefix_at("forward", i - 1) - prefix_at("backward", i - 1)
        if problem.spec.splits_backward:
            work = work - (total_w - prefix_at("weight_grad", i - 1))
        model.lp += (p - i) * model.Y >= work + 2 * tail[i], f"C5_{i}"


def _add_memory(model: _Model, stage, vectors) -> None:
    """(C6) parameter state + in-flight activations fit every rank, at every point of its list;
    (C7) so do parameter state + the optimizer step's temporary, after the backward."""
    problem = model.problem
    if math.isinf(problem.device_memory):
        return
    S, p = problem.num_stages, problem.num_ranks
    scale = 1.0 / problem.device_memory  # keep coefficients near 1
    acts_of = [stage("activation_bytes", s) for s in range(S)]  # built once per stage
    for r in range(p):
        stages = problem.stages_of(r)
        static = pulp.lpSum(problem.state_bytes_per_param * scale * stage("params", s)
                            for s in stages)
        for i, vec in enumerate(vectors[r]):
            acts = pulp.lpSum(n * scale * acts_of[s] for n, s in zip(vec, stages) if n)
            model.lp += static + acts <= 1.0, f"C6_{r}_{i}"
        if problem.step_bytes_per_param > 0:
            model.lp += static + pulp.lpSum(problem.step_bytes_per_param * scale
                                            * stage("params", s) for s in stages) <= 1.0, \
                f"C7_{r}"


def _objective(model: _Model, transfer):
    problem = model.problem
    m, v, S = problem.num_microbatches, problem.stages_per_rank, problem.num_stages
    total_f = model.prefix["forward"][-1]
    total_b = model.prefix["backward"][-1]
    total_w = model.prefix["weight_grad"][-1]
    comm = 2 * pulp.lpSum(transfer(s) for s in range(S - 1))
    form = problem.spec.ilp_form
    if form is StageILPForm.PHASED:
        return (m - 1) * (model.Y_F + model.Y_B) + total_f + total_b + comm
    if form is StageILPForm.V_SHAPE:
        p = problem.num_ranks
        return m * model.Y + (p - 1) / (2 * p) * (total_f + total_b - 2 * total_w) + comm
    if form is StageILPForm.INTERLEAVED:
        return (m - 1 / v) * model.Y + (total_f + total_b) / v + comm
    if problem.spec.splits_backward:
        return (m - 1) * model.Y + total_f + total_b - 2 * total_w + 2 * model.Z + comm
    return (m - 1) * model.Y + total_f + total_b + comm


def _build(problem: PartitionProblem, relaxed: bool, vectors) -> _Model:
    model = _Model(problem, relaxed)
    position, stage, transfer, prefix_at = _cut_expressions(model)
    model.lp += _objective(model, transfer)
    _add_cut_choice(model)
    _add_order(model, position)
    _add_bottleneck(model, stage)
    _add_integral_bounds(model)
    _add_loops(model, stage, transfer, prefix_at)
    _add_memory(model, stage, vectors)
    model.position = position
    model.transfer = transfer
    model.stage = stage
    return model


#: Seconds for the interleaved schedule's tie-breaking second solve (see partition_stages).
TIE_BREAK_S = 1.0


def _objective_value(expr: Any) -> float:
    """The solved value of an objective. pulp gives None when a variable is in no constraint
    and CBC leaves it unset, which happens to a variable whose coefficient is zero (one
    micro-batch: the steady-state term (m - 1) Y vanishes); such a term adds nothing."""
    total = float(expr.constant)
    for var, coef in expr.items():
        if coef:
            assert var.varValue is not None, f"the solver left {var.name} unset"
            total += coef * var.varValue
    return total


def _start_point(model: _Model, ranges: Sequence[tuple[int, int]]) -> dict[Any, float]:
    """The cut variables (u, k) of a given partition: cut s after its stage's last layer l,
    in the segment holding l at offset l - α_g."""
    out: dict[Any, float] = {}
    for s, (_, last) in enumerate(ranges[:-1]):
        for g, (first, length) in enumerate(model.segments):
            inside = first <= last < first + length
            out[model.u[s, g]] = 1.0 if inside else 0.0
            out[model.k[s, g]] = float(last - first) if inside else 0.0
    return out


def partition_stages(problem: PartitionProblem, *, time_limit_s: float = 60.0,
                     lp_bound: bool = True,
                     initial: Sequence[tuple[int, int]] | None = None) -> StagePartition:
    """Solve the ILP (HiGHS, or CBC: :mod:`autopar.solver`); also the LP relaxation for a lower
    bound on the optimum. ``initial``: a partition (layer ranges per stage) to begin from, used
    when it fits the memory (the plan search's first-pass cut)."""
    check_sizes(problem)
    start = time.perf_counter()
    vectors = in_flight_vectors(problem)
    L, S = len(problem.layers), problem.num_stages
    if S == 1:
        ranges = ((0, L - 1),)
        if max(rank_memory(problem, ranges, vectors)) > problem.device_memory:
            raise infeasible_error(problem, vectors)
        value = modeled_step_time(problem, ranges)
        return partition_result(problem, ranges, value, time.perf_counter() - start, "trivial", vectors, 0)
    model = _build(problem, relaxed=False, vectors=vectors)
    bound = None
    if lp_bound:  # the LP relaxation of the same program (no integrality)
        if solver.solve(model.lp, time_limit_s=time_limit_s, mip=False).status == "optimal":
            bound = _objective_value(model.lp.objective)
    first = None
    if initial is not None and len(initial) == S and \
            max(rank_memory(problem, initial, vectors)) <= problem.device_memory:
        first = _start_point(model, initial)
    answer = solver.solve(model.lp, time_limit_s=time_limit_s, gap_rel=0.0, start=first)
    if answer.status == "infeasible":
        raise infeasible_error(problem, vectors)
    if not answer.has_solution:
        raise InfeasiblePlanError(
            f"the stage partition solver found no solution ({answer.status})",
            found=f"{answer.backend} stopped after {time_limit_s:.0f} s without a partition",
            fix="raise time_limit_s or use fewer stages")
    cuts = [int(round(pulp.value(model.position(s)))) for s in range(S - 1)]
    optimal = answer.status == "optimal"
    objective = _objective_value(model.lp.objective)
    tie_break = None
    form = problem.spec.ilp_form
    secondary = None
    if form is StageILPForm.INTERLEAVED:  # the busiest rank least busy
        secondary = model.Y_F
    if secondary is not None and optimal:
        # among the optima (the objective has ties: it sees only the bottleneck), the one the
        # secondary criterion prefers; a heuristic refinement with its own short time limit,
        # started from the first answer: it only picks among optima
        here = {var: var.varValue for var in model.lp.variables() if var.varValue is not None}
        model.lp += _objective(model, model.transfer) <= objective * (1 + 1e-7), "optimum"
        model.lp.setObjective(secondary)
        second_answer = solver.solve(model.lp, time_limit_s=min(TIE_BREAK_S, time_limit_s),
                                     gap_rel=0.0, start=here)
        tie_break = "optimal" if second_answer.status == "optimal" else "time limit"
        if second_answer.has_solution:
            second = [int(round(pulp.value(model.position(s)))) for s in range(S - 1)]
            if modeled_step_time(problem, stage_ranges(second, L)) <= \
                    modeled_step_time(problem, stage_ranges(cuts, L)) * (1 + 1e-9):
                cuts = second
    ranges = stage_ranges(cuts, L)
    if bound is not None:
        step = modeled_step_time(problem, ranges)
        if step < bound <= step * (1 + 1e-6):  # the LP solver's tolerance
            bound = step
    result = partition_result(problem, ranges, bound, time.perf_counter() - start,
                     "optimal" if optimal else "time limit (feasible)", vectors,
                     model.num_integer_vars())
    result.extra["ilp_objective"] = objective
    result.extra["segments"] = len(model.segments)
    result.extra["solver"] = answer.backend
    result.extra["initial_fits"] = first is not None
    if tie_break is not None:
        result.extra["tie_break"] = tie_break
    return result
