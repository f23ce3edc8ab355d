r"""Pipeline stage partition as an integer linear program (pulp / CBC).

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
continuous) is solved too; its value bounds the optimum from below, so when CBC stops at its time
limit ``(step_time − lp_bound) / step_time`` bounds how far the answer can be from optimal. The
relaxation is loose (tens of percent below the optimum is common): it is reported, but it is the
certificate only when the search was cut short.

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

import bisect
import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import networkx as nx
import pulp

from autopar import solver
from autopar.errors import InfeasiblePlanError, InvalidInputError
from autopar.plan_types import ScheduleKind, StagePlan
from autopar.runtime.schedules import ScheduleSpec, StageILPForm, build_schedule

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
]


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """What one layer costs per micro-batch: seconds, parameter count, bytes."""

    name: str
    forward: float
    backward: float
    #: The weight-gradient part of ``backward`` (ZB-H1 defers it); default half.
    weight_grad: float | None = None
    params: float = 0.0
    activation_bytes: float = 0.0
    #: Bytes sent to the next stage when a cut falls right after this layer.
    boundary_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.weight_grad is None:
            object.__setattr__(self, "weight_grad", self.backward / 2)
        for name in ("forward", "backward", "weight_grad", "params", "activation_bytes",
                     "boundary_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
                raise ValueError(f"layer {self.name}: {name} must be a number >= 0, got {value!r}")
        if self.weight_grad > self.backward:
            raise ValueError(f"layer {self.name}: weight_grad ({self.weight_grad}) exceeds the "
                             f"backward time ({self.backward}) it is part of")

    def key(self) -> tuple[float, ...]:
        return (self.forward, self.backward, self.weight_grad, self.params,
                self.activation_bytes, self.boundary_bytes)


@dataclass(frozen=True, slots=True)
class PartitionProblem:
    """Inputs of the stage partition."""

    layers: tuple[LayerCosts, ...]
    num_ranks: int
    num_microbatches: int
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    stages_per_rank: int = 1
    #: Bytes per rank (inf: no memory limit).
    device_memory: float = math.inf
    #: Bytes of weights + gradients + optimizer state per parameter (16: mixed-precision Adam).
    state_bytes_per_param: float = 16.0
    #: Point-to-point link between neighbouring stages.
    link_bandwidth: float = math.inf
    link_latency: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        for name in ("num_ranks", "num_microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        problem = self.schedule.spec.shape_problem(self.num_ranks, self.stages_per_rank,
                                                   self.num_microbatches)
        if problem is not None and "divisible" not in problem[0]:
            raise ValueError(f"stages_per_rank={self.stages_per_rank} does not fit the "
                             f"{self.schedule.value} schedule: {problem[0]}")
        if not self.layers:
            raise ValueError("the problem has no layers")
        if self.device_memory <= 0 or self.link_bandwidth <= 0 or self.link_latency < 0 \
                or self.state_bytes_per_param < 0:
            raise ValueError("device_memory and link_bandwidth must be positive, link_latency and "
                             "state_bytes_per_param >= 0")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    @property
    def spec(self) -> ScheduleSpec:
        return self.schedule.spec

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in chunk order (the schedule's placement)."""
        return self.spec.stages_of_rank(rank, self.num_ranks, self.stages_per_rank)

    def transfer_time(self, layer: int) -> float:
        """Seconds to send what crosses a cut right after ``layer``."""
        return self.link_latency + self.layers[layer].boundary_bytes / self.link_bandwidth

    def segments(self) -> list[tuple[int, int]]:
        """Runs (start, length) of consecutive layers with equal costs."""
        out: list[tuple[int, int]] = []
        for i, layer in enumerate(self.layers):
            if out and self.layers[out[-1][0]].key() == layer.key():
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((i, 1))
        return out


@dataclass(frozen=True, slots=True)
class StagePartition:
    """The answer: layer ranges per stage, the modelled step time and its certificate."""

    ranges: tuple[tuple[int, int], ...]
    #: The modelled step time of this partition (seconds).
    step_time: float
    #: The LP relaxation's value: no partition can do better (None for brute force).
    lp_bound: float | None
    #: Per stage: forward + backward time of one micro-batch.
    stage_times: tuple[float, ...]
    #: Per rank: peak bytes (state of its parameters + in-flight activations).
    rank_memory: tuple[float, ...]
    solve_seconds: float
    status: str
    num_ranks: int = 1
    #: The schedule the partition was made for (its placement puts the stages on ranks).
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    #: Binary and integer variables of the program (0 for brute force).
    num_variables: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def proven_optimal(self) -> bool:
        """CBC closed the branch-and-bound gap (``gapRel=0``): no partition models faster."""
        return self.status in ("optimal", "trivial")

    @property
    def gap(self) -> float | None:
        """Upper bound on the relative distance of the modelled step time to the optimum of the
        same model: 0 when proven optimal, else the LP relaxation's gap (None: no bound)."""
        if self.proven_optimal:
            return 0.0
        if self.lp_bound is None:
            return None
        return max(0.0, (self.step_time - self.lp_bound) / self.step_time) if self.step_time else 0.0

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(last - first + 1 for first, last in self.ranges)

    def stage_plans(self) -> tuple[StagePlan, ...]:
        """As :class:`autopar.plan_types.StagePlan` s, on the ranks the schedule places them (stage
        s on rank s mod p, chunk s div p, for Megatron-LM's loop placement)."""
        p, spec = self.num_ranks, self.schedule.spec
        v = len(self.ranges) // p
        out = []
        for s, r in enumerate(self.ranges):
            rank = spec.stage_to_rank(s, p)
            out.append(StagePlan(index=s, layers=r, pp_rank=rank,
                                 chunk=spec.stages_of_rank(rank, p, v).index(s)))
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# The schedule's memory profile
# ---------------------------------------------------------------------------------------------

def in_flight_vectors(problem: PartitionProblem) -> list[list[tuple[int, ...]]]:
    """Per rank, the Pareto-maximal vectors of in-flight micro-batches per local stage that its
    action list reaches (the schedule generator's own lists, so memory follows the schedule)."""
    return [list(v) for v in _in_flight_vectors(problem.schedule, problem.num_ranks,
                                                problem.num_microbatches,
                                                problem.stages_per_rank)]


@functools.lru_cache(maxsize=64)
def _in_flight_vectors(kind: ScheduleKind, p: int, m: int, v: int
                       ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    schedule = build_schedule(kind, p, m, v, communication=False)
    out = []
    for r in range(p):
        vectors = set(schedule.in_flight(r))
        maximal = [vec for vec in vectors
                   if not any(o != vec and all(a <= b for a, b in zip(vec, o)) for o in vectors)]
        out.append(tuple(sorted(maximal)))
    return tuple(out)


def _stage_ranges(cuts: Sequence[int], num_layers: int) -> tuple[tuple[int, int], ...]:
    bounds = [0, *cuts, num_layers]
    return tuple((bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1))


def _stage_sum(problem: PartitionProblem, ranges, attr: str) -> list[float]:
    return [sum(getattr(problem.layers[l], attr) for l in range(a, b + 1)) for a, b in ranges]


def rank_memory(problem: PartitionProblem, ranges: Sequence[tuple[int, int]],
                vectors: list[list[tuple[int, ...]]] | None = None) -> list[float]:
    """Peak bytes per rank: parameter state plus in-flight activations (constraint C6)."""
    vectors = vectors if vectors is not None else in_flight_vectors(problem)
    p = problem.num_ranks
    params = _stage_sum(problem, ranges, "params")
    acts = _stage_sum(problem, ranges, "activation_bytes")
    out = []
    for r in range(p):
        stages = problem.stages_of(r)
        static = problem.state_bytes_per_param * sum(params[s] for s in stages)
        peak = max((sum(n * acts[s] for n, s in zip(vec, stages)) for vec in vectors[r]),
                   default=0.0)
        out.append(static + peak)
    return out


def modeled_step_time(problem: PartitionProblem, ranges: Sequence[tuple[int, int]]) -> float:
    """The ILP's objective for a given partition (closed form, no solver)."""
    p, v, m = problem.num_ranks, problem.stages_per_rank, problem.num_microbatches
    f = _stage_sum(problem, ranges, "forward")
    b = _stage_sum(problem, ranges, "backward")
    w = _stage_sum(problem, ranges, "weight_grad")
    t = [x + y for x, y in zip(f, b)]
    tau = [problem.transfer_time(last) for _, last in ranges[:-1]] + [0.0]
    comm = 2 * sum(tau)
    form, split = problem.spec.ilp_form, problem.spec.splits_backward
    if form is StageILPForm.PHASED:
        return (m - 1) * (max(f) + max(b)) + sum(t) + comm
    if form is StageILPForm.V_SHAPE:
        y = max(sum(t[s] for s in problem.stages_of(r)) for r in range(p))
        return m * y + (p - 1) / (2 * p) * sum(x - 2 * wi for x, wi in zip(t, w)) + comm
    if form is StageILPForm.INTERLEAVED:
        y = max(v * max(t), (sum(t) + comm) / (2 * p - 1))
        return (m - 1 / v) * y + sum(t) / v + comm
    loop = [x - (wi if split else 0.0) for x, wi in zip(t, w)]
    y = max(max(t), max((sum(loop[i:]) + 2 * sum(tau[i:])) / (p - i) for i in range(p)))
    if split:
        return (m - 1) * y + sum(x - 2 * wi for x, wi in zip(t, w)) + 2 * max(w) + comm
    return (m - 1) * y + sum(t) + comm


def _check_sizes(problem: PartitionProblem) -> None:
    L, S = len(problem.layers), problem.num_stages
    if S > L:
        raise InfeasiblePlanError(
            f"{S} pipeline stages for {L} layers: each stage needs at least one layer",
            expected=f"at most {L} stages (pp x virtual stages)",
            found=f"pp={problem.num_ranks} x v={problem.stages_per_rank} = {S}",
            fix="reduce pp or the virtual stages, or use a model with more layers")


def _infeasible(problem: PartitionProblem, vectors) -> InfeasiblePlanError:
    biggest = max(problem.layers, key=lambda l: l.params * problem.state_bytes_per_param
                  + l.activation_bytes)
    return InfeasiblePlanError(
        f"no cut of the {len(problem.layers)} layers into {problem.num_stages} stages fits "
        f"{problem.device_memory / 2**30:.2f} GiB per rank under {problem.schedule.value}",
        expected=f"every rank's parameter state ({problem.state_bytes_per_param:g} B/param) and "
                 f"in-flight activations within the device memory",
        found=f"the largest layer ({biggest.name}) alone needs "
              f"{(biggest.params * problem.state_bytes_per_param + biggest.activation_bytes) / 2**30:.2f}"
              f" GiB for one micro-batch; "
              f"1F1B's first stage keeps {max(sum(v) for v in vectors[0])} micro-batches",
        fix="use more pipeline stages, tensor parallelism, ZeRO, activation recompute or a "
            "smaller micro-batch")


# ---------------------------------------------------------------------------------------------
# Brute force (the reference for small instances)
# ---------------------------------------------------------------------------------------------

def brute_force_partition(problem: PartitionProblem) -> StagePartition:
    """Every way to cut L layers into S stages: C(L-1, S-1) partitions."""
    _check_sizes(problem)
    start = time.perf_counter()
    L, S = len(problem.layers), problem.num_stages
    vectors = in_flight_vectors(problem)
    best: tuple[float, tuple] | None = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        ranges = _stage_ranges(cuts, L)
        if max(rank_memory(problem, ranges, vectors)) > problem.device_memory:
            continue
        value = modeled_step_time(problem, ranges)
        if best is None or value < best[0] - 1e-12:
            best = (value, ranges)
    if best is None:
        raise _infeasible(problem, vectors)
    return _result(problem, best[1], None, time.perf_counter() - start, "brute force", vectors, 0)


def _result(problem, ranges, lp_bound, seconds, status, vectors, num_vars) -> StagePartition:
    f = _stage_sum(problem, ranges, "forward")
    b = _stage_sum(problem, ranges, "backward")
    return StagePartition(
        ranges=tuple(ranges), step_time=modeled_step_time(problem, ranges), lp_bound=lp_bound,
        stage_times=tuple(x + y for x, y in zip(f, b)),
        rank_memory=tuple(rank_memory(problem, ranges, vectors)), solve_seconds=seconds,
        status=status, num_ranks=problem.num_ranks, schedule=problem.schedule,
        num_variables=num_vars)


def min_max_split(layer_times: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous non-empty stages minimising the largest stage sum of ``layer_times``.

    Bisection on the answer X with the greedy feasibility test (pack layers left to right while
    the stage stays within X: feasible iff at most ``num_stages`` stages), snapped to the values
    where the test can change: a feasible X moves the upper end down to the largest stage sum
    the greedy packing made (that packing stays feasible there), an infeasible X moves the
    lower end up to the smallest sum a closed stage would have with its next layer (below it
    every stage closes where it did, so the packing and its count are the same). The ends meet
    at the optimum exactly; the greedy packing there is refined to exactly ``num_stages`` stages
    by splitting the widest ones (which never raises the maximum)."""
    n = len(layer_times)
    if not 1 <= num_stages <= n:
        raise InfeasiblePlanError(f"cannot cut {n} layers into {num_stages} non-empty stages",
                                  expected=f"at most {n} stages", found=f"{num_stages}",
                                  fix="reduce pp or the virtual stages")
    costs = [max(float(c), 0.0) for c in layer_times]
    prefix = [0.0, *itertools.accumulate(costs)]
    # the optimum X* lies in [max(largest, total / S), that + largest]: at the upper end every
    # greedy stage but the last closes above X - largest >= total / S, so at most S stages
    lo = max(max(costs), prefix[-1] / num_stages)
    hi = min(prefix[-1], lo + max(costs))
    hi = max(prefix[b + 1] - prefix[a] for a, b in _greedy(prefix, hi))
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:  # the greedy test's own tolerance
            break
        mid = max((lo + hi) / 2, lo)
        stages = _greedy(prefix, mid, num_stages)
        if len(stages) <= num_stages:
            hi = max(prefix[b + 1] - prefix[a] for a, b in stages)
        else:  # the next limit at which some closed stage takes one more layer
            lo = max(mid, min(prefix[b + 2] - prefix[a] for a, b in stages[:-1]))
    stages = _greedy(prefix, hi)
    while len(stages) < num_stages:  # split the widest splittable stage
        i = max((j for j, (a, b) in enumerate(stages) if b > a),
                key=lambda j: (stages[j][1] - stages[j][0], -j))
        a, b = stages[i]
        stages[i:i + 1] = [(a, b - 1), (b, b)]
    return tuple(stages)


def _greedy(prefix: list[float], limit: float, most: int | None = None
            ) -> list[tuple[int, int]]:
    """Pack layers left to right into stages of at most ``limit`` (a layer above it alone);
    stops after ``most + 1`` stages (enough to know the limit is infeasible)."""
    n = len(prefix) - 1
    stages: list[tuple[int, int]] = []
    start = 0
    eps = 1e-12 * max(limit, 1e-300)
    while start < n:
        end = max(bisect.bisect_right(prefix, prefix[start] + limit + eps, start + 1) - 1,
                  start + 1)
        stages.append((start, end - 1))
        start = end
        if most is not None and len(stages) > most:
            break
    return stages


def even_partition(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Equal layer counts (the baseline the ILP is compared with)."""
    if num_stages > num_layers:
        raise InfeasiblePlanError(f"{num_stages} stages for {num_layers} layers",
                                  fix="reduce the number of stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return tuple((bounds[i], bounds[i + 1] - 1) for i in range(num_stages))


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
        self.u = {(s, g): pulp.LpVariable(f"u_{s}_{g}", 0, 1, cat_bin)
                  for s in range(n_cuts) for g in range(len(self.segments))}
        self.k = {(s, g): pulp.LpVariable(f"k_{s}_{g}", 0, None, cat_int)
                  for s in range(n_cuts) for g in range(len(self.segments))}
        self.Y = pulp.LpVariable("Y", 0)
        self.Y_F = pulp.LpVariable("Y_F", 0)
        self.Y_B = pulp.LpVariable("Y_B", 0)
        self.Z = pulp.LpVariable("Z", 0)
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
        var = pulp.LpVariable(f"R_{i}", 0)
        model.lp += var == transfer(i) + tail[i + 1], f"R_{i}"
        tail[i] = var
    total_w = model.prefix["weight_grad"][-1]
    for i in range(p):
        work = total - prefix_at("forward", i - 1) - prefix_at("backward", i - 1)
        if problem.spec.splits_backward:
            work = work - (total_w - prefix_at("weight_grad", i - 1))
        model.lp += (p - i) * model.Y >= work + 2 * tail[i], f"C5_{i}"


def _add_memory(model: _Model, stage, vectors) -> None:
    """(C6) parameter state + in-flight activations fit every rank, at every point of its list."""
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
    _check_sizes(problem)
    start = time.perf_counter()
    vectors = in_flight_vectors(problem)
    L, S = len(problem.layers), problem.num_stages
    if S == 1:
        ranges = ((0, L - 1),)
        if max(rank_memory(problem, ranges, vectors)) > problem.device_memory:
            raise _infeasible(problem, vectors)
        value = modeled_step_time(problem, ranges)
        return _result(problem, ranges, value, time.perf_counter() - start, "trivial", vectors, 0)
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
        raise _infeasible(problem, vectors)
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
            if modeled_step_time(problem, _stage_ranges(second, L)) <= \
                    modeled_step_time(problem, _stage_ranges(cuts, L)) * (1 + 1e-9):
                cuts = second
    ranges = _stage_ranges(cuts, L)
    if bound is not None:
        step = modeled_step_time(problem, ranges)
        if step < bound <= step * (1 + 1e-6):  # the LP solver's tolerance
            bound = step
    result = _result(problem, ranges, bound, time.perf_counter() - start,
                     "optimal" if optimal else "time limit (feasible)", vectors,
                     model.num_integer_vars())
    result.extra["ilp_objective"] = objective
    result.extra["segments"] = len(model.segments)
    result.extra["solver"] = answer.backend
    result.extra["initial_fits"] = first is not None
    if tie_break is not None:
        result.extra["tie_break"] = tie_break
    return result


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
