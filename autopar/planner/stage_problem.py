"""The stage partition problem and how a cut is priced: what the stage ILP
(:mod:`autopar.planner.stage_ilp`) solves, and the references it is tested against.

A :class:`PartitionProblem` is the layers' per-micro-batch costs (:class:`LayerCosts`), the
number of pipeline ranks and micro-batches, the schedule (its ``StageILPForm`` and placement),
each rank's memory and the bytes a parameter costs. A cut into stages is priced by
:func:`modeled_step_time` (the objective the ILP encodes) and :func:`rank_memory` (the schedule's
in-flight micro-batches, :func:`in_flight_vectors`); :func:`brute_force_partition` tries every
cut (small problems: the tests' reference), :func:`min_max_split` is the search's first pass
(the cut minimising the largest stage), :func:`even_partition` splits by layer count.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from autopar.errors import InfeasiblePlanError
from autopar.plan_types import ScheduleKind, StagePlan
from autopar.runtime.schedules import ScheduleSpec, StageILPForm, build_schedule

__all__ = ["LayerCosts", "PartitionProblem", "StagePartition", "in_flight_vectors",
           "stage_ranges", "rank_memory", "modeled_step_time", "check_sizes", "infeasible_error",
           "brute_force_partition", "partition_result", "min_max_split", "even_partition"]


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
    #: Bytes per parameter the optimizer step allocates after the backward, when the
    #: activations are freed (autopar.planner.memory.optimizer_step_bytes: 4 on a GPU, over the
    #: rank's stepped share of its parameters; 0 where it is bounded by a bucket).
    step_bytes_per_param: float = 0.0
    #: A split backward's stages free a micro-batch's activations at its I, not its W: each
    #: runs its whole backward there (full recompute; ``schedule_model.backward_whole_at_input``,
    #: assumed of every stage here: one without a block, which keeps them to W, is rare).
    release_at_input: bool = False

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
                or self.state_bytes_per_param < 0 or self.step_bytes_per_param < 0:
            raise ValueError("device_memory and link_bandwidth must be positive, link_latency, "
                             "state_bytes_per_param and step_bytes_per_param >= 0")

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
        """The solver closed the branch-and-bound gap (``gapRel=0``): no partition models faster."""
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
                                                problem.stages_per_rank,
                                                problem.release_at_input)]


@functools.lru_cache(maxsize=64)
def _in_flight_vectors(kind: ScheduleKind, p: int, m: int, v: int, release_at_input: bool
                       ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    schedule = build_schedule(kind, p, m, v, communication=False)
    out = []
    for r in range(p):
        vectors = set(schedule.in_flight(r, release_at_input=release_at_input))
        maximal = [vec for vec in vectors
                   if not any(o != vec and all(a <= b for a, b in zip(vec, o)) for o in vectors)]
        out.append(tuple(sorted(maximal)))
    return tuple(out)


def stage_ranges(cuts: Sequence[int], num_layers: int) -> tuple[tuple[int, int], ...]:
    bounds = [0, *cuts, num_layers]
    return tuple((bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1))


def _stage_sum(problem: PartitionProblem, ranges, attr: str) -> list[float]:
    return [sum(getattr(problem.layers[l], attr) for l in range(a, b + 1)) for a, b in ranges]


def rank_memory(problem: PartitionProblem, ranges: Sequence[tuple[int, int]],
                vectors: list[list[tuple[int, ...]]] | None = None) -> list[float]:
    """Peak bytes per rank: parameter state plus the larger of the in-flight activations
    (constraint C6) and the optimizer step's temporary (C7)."""
    vectors = vectors if vectors is not None else in_flight_vectors(problem)
    p = problem.num_ranks
    params = _stage_sum(problem, ranges, "params")
    acts = _stage_sum(problem, ranges, "activation_bytes")
    out = []
    for r in range(p):
        stages = problem.stages_of(r)
        held = sum(params[s] for s in stages)
        peak = max((sum(n * acts[s] for n, s in zip(vec, stages)) for vec in vectors[r]),
                   default=0.0)
        out.append(problem.state_bytes_per_param * held
                   + max(peak, problem.step_bytes_per_param * held))
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


def check_sizes(problem: PartitionProblem) -> None:
    L, S = len(problem.layers), problem.num_stages
    if S > L:
        raise InfeasiblePlanError(
            f"{S} pipeline stages for {L} layers: each stage needs at least one layer",
            expected=f"at most {L} stages (pp x virtual stages)",
            found=f"pp={problem.num_ranks} x v={problem.stages_per_rank} = {S}",
            fix="reduce pp or the virtual stages, or use a model with more layers")


def infeasible_error(problem: PartitionProblem, vectors) -> InfeasiblePlanError:
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
    check_sizes(problem)
    start = time.perf_counter()
    L, S = len(problem.layers), problem.num_stages
    vectors = in_flight_vectors(problem)
    best: tuple[float, tuple] | None = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        ranges = stage_ranges(cuts, L)
        if max(rank_memory(problem, ranges, vectors)) > problem.device_memory:
            continue
        value = modeled_step_time(problem, ranges)
        if best is None or value < best[0] - 1e-12:
            best = (value, ranges)
    if best is None:
        raise infeasible_error(problem, vectors)
    return partition_result(problem, best[1], None, time.perf_counter() - start, "brute force", vectors, 0)


def partition_result(problem, ranges, lp_bound, seconds, status, vectors, num_vars) -> StagePartition:
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
