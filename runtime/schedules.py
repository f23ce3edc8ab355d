"""The schedule registry: one :class:`ScheduleSpec` per pipeline schedule (how to build its
action lists, whether it splits the backward and takes virtual stages, how it places stages, its
closed-form bubble and in-flight micro-batches), which the planner, the simulator, the runtime
and the CLI read; and :func:`build_schedule`, a schedule's lowered lists.

The action vocabulary (:class:`Action`, :class:`PipelineSchedule`, their text form, the lowering
with sends and receives) is :mod:`autopar.runtime.pipeline_actions`; the generators are
:mod:`autopar.runtime.schedule_builders`. This module re-exports both, so
``autopar.runtime.schedules`` is the one import a caller needs. Adding a schedule is one
generator and one entry of ``SCHEDULES`` here, and its tests (docs/architecture.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from autopar.errors import ScheduleError
from autopar.runtime.pipeline_actions import (COMM_KINDS, COMPUTE_KINDS, SCHEDULES, Action,
                                              ActionKind, PipelineSchedule, ScheduleKind,
                                              add_communication, comm_batches)
from autopar.runtime.schedule_builders import (check_counts, gpipe, interleaved_1f1b,
                                               one_f_one_b, zb_h1, zb_v)

__all__ = [
    "ScheduleKind",
    "ScheduleSpec",
    "StageILPForm",
    "SCHEDULES",
    "schedule_spec",
    "ActionKind",
    "Action",
    "PipelineSchedule",
    "build_schedule",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "StagePlacement",
    "add_communication",
    "comm_batches",
    "COMPUTE_KINDS",
    "COMM_KINDS",
]


# ---------------------------------------------------------------------------------------------
# The registry: one spec per schedule
# ---------------------------------------------------------------------------------------------

class StageILPForm(enum.Enum):
    """How the stage-partition ILP (``autopar/planner/stage_partition.py``) models a schedule's
    steady state."""

    #: Every forward, then every backward (GPipe): a forward and a backward phase, each paced
    #: by its slowest stage.
    PHASED = "phased"
    #: One stage per rank, forwards and backwards alternating (1F1B and its zero-bubble
    #: variants): a micro-batch's round trip from stage i is shared by the micro-batches stage i
    #: keeps in flight.
    LOOPED = "looped"
    #: Several chunks per rank run in rounds paced by the slowest chunk.
    INTERLEAVED = "interleaved"
    #: Two chunks per rank in a V, split backward (ZB-V): the steady state is paced by the
    #: busiest rank's total, and the fill and drain is (p - 1) / (2p) of every stage's
    #: F + B - 2W (exact on equal stages with F = I = W).
    V_SHAPE = "v-shape"


class StagePlacement(enum.Enum):
    """Which pipeline rank runs stage s of p ranks (v stages per rank)."""

    #: Megatron-LM's loop: stage c p + r on rank r (one stage per rank, or interleaved chunks).
    LOOP = "loop"
    #: A V over two chunks: stage s on rank s for s < p, else on rank 2p - 1 - s (ZB-V), so the
    #: first rank runs the first and the last stage.
    V = "v"


def _rank_sums(values: Sequence[float], p: int, stages_of: Callable[[int], Sequence[int]]
               ) -> list[float]:
    return [sum(values[s] for s in stages_of(r)) for r in range(p)]


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """Everything autopar knows about one schedule: how to build its action lists, what shapes
    it takes, how it places stages, and its closed forms (what the planner's first pass and the
    stage ILP use; the simulator of the same lists is the reference, and tests hold them equal
    where the closed form is exact)."""

    kind: ScheduleKind
    #: ``build(p, m, v)``: compute-only action lists for p ranks, m micro-batches, v stages per
    #: rank (validated by :meth:`shape_problem` first).
    build: Callable[[int, int, int], "PipelineSchedule"]
    #: One line for help texts and docs, with its source.
    summary: str
    ilp_form: StageILPForm
    #: ``in_flight(p, v, m, rank)``: micro-batches whose activations rank ``rank`` holds at its
    #: peak, in units of its whole per-micro-batch activations (all its chunks); the closed form
    #: of ``PipelineSchedule.peak_in_flight`` (tests hold them equal).
    in_flight: Callable[[int, int, int, int], float]
    #: ``receives_ahead(p, v, m, rank)``: boundary tensors rank ``rank`` holds received ahead
    #: of their compute at its peak, when the lists are lowered for a transport that pairs
    #: messages by their order (NCCL: ``add_communication(match="order")``, each receive posted
    #: where its send is); the closed form of ``PipelineSchedule.peak_receives_ahead`` (tests
    #: hold them equal, or a bound where said). GPipe: none.
    receives_ahead: Callable[[int, int, int, int], int] = lambda p, v, m, rank: 0
    #: The backward is split into input gradients (I) and weight gradients (W).
    splits_backward: bool = False
    min_virtual_stages: int = 1
    #: None: no upper bound.
    max_virtual_stages: int | None = 1
    micro_batches_divisible_by_pp: bool = False
    placement: StagePlacement = StagePlacement.LOOP

    def stage_to_rank(self, stage: int, p: int) -> int:
        """The pipeline rank that runs ``stage`` (:class:`StagePlacement`)."""
        if self.placement is StagePlacement.V and stage >= p:
            return 2 * p - 1 - stage
        return stage % p

    def stages_of_rank(self, rank: int, p: int, v: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in chunk order (the inverse of :meth:`stage_to_rank`;
        called for every rank of every candidate the planner prices, so in closed form)."""
        if self.placement is StagePlacement.V:
            return (rank, 2 * p - 1 - rank) if v == 2 else tuple(
                s for s in range(p * v) if self.stage_to_rank(s, p) == rank)
        return tuple(range(rank, p * v, p))

    def virtual_stage_choices(self, top: int) -> range:
        """The stages per rank the planner tries when at most ``top`` fit (a schedule of a fixed
        count is always tried: the cost model says why it does not fit)."""
        if self.max_virtual_stages == self.min_virtual_stages:
            return range(self.min_virtual_stages, self.min_virtual_stages + 1)
        hi = top if self.max_virtual_stages is None else min(top, self.max_virtual_stages)
        return range(self.min_virtual_stages, hi + 1)

    def shape_problem(self, p: int, v: int, m: int) -> tuple[str, str, str] | None:
        """Why ``p`` ranks, ``v`` stages per rank and ``m`` micro-batches cannot run this
        schedule, as (summary, expected, fix); None when they can."""
        name = self.kind.value
        if v < self.min_virtual_stages:
            return (f"{name} needs virtual_stages >= {self.min_virtual_stages}",
                    f"virtual_stages >= {self.min_virtual_stages} with {name}",
                    "use 1f1b for one stage per rank, or raise virtual_stages")
        if self.max_virtual_stages is not None and v > self.max_virtual_stages:
            takers = [k.value for k, sp in SCHEDULES.items()
                      if sp.max_virtual_stages is None or sp.max_virtual_stages >= v]
            if self.max_virtual_stages == 1:
                return (f"virtual_stages={v} needs the " + " or the ".join(takers)
                        + f" schedule (got {name})",
                        f"virtual_stages=1 with {name}",
                        f"set schedule to one of {takers}, or virtual_stages=1")
            return (f"{name} runs {self.max_virtual_stages} stages per rank",
                    f"virtual_stages <= {self.max_virtual_stages}", f"use one of {takers}")
        if p == 1 and v > 1:  # as Megatron-LM refuses a virtual pipeline without a pipeline
            return (f"virtual_stages={v} needs a pipeline: with pp=1 the stages would run one "
                    "after another on the one rank, with nothing to interleave",
                    "virtual_stages=1 when pp=1",
                    "set virtual_stages=1 and a one-stage schedule (1f1b), or raise pp")
        if self.micro_batches_divisible_by_pp and m % p:
            return (f"{name} needs num_micro_batches ({m}) divisible by pp ({p})",
                    f"a multiple of pp={p} micro-batches",
                    "change the micro-batch count or the schedule")
        return None

    def fill_drain(self, forward: Sequence[float], backward: Sequence[float],
                   weight: Sequence[float], p: int, v: int) -> float:
        """The closed-form bubble of the planner's first pass: what m micro-batches take beyond
        m times the busiest rank's per-micro-batch work, from the stages' forward, backward
        (without W when split) and weight-gradient times (Narayanan et al. 2021, Qi et al. 2024,
        generalised to unequal ranks)."""
        stages_of = lambda r: self.stages_of_rank(r, p, v)  # noqa: E731
        work = _rank_sums([f + b + w for f, b, w in zip(forward, backward, weight)], p, stages_of)
        bottleneck = max(range(p), key=work.__getitem__)
        if self.splits_backward:  # W runs in the bubble; two chunks halve the fill (ZB-V)
            idle = [max(x, 0.0) for x in _rank_sums(
                [f + b - w for f, b, w in zip(forward, backward, weight)], p, stages_of)]
            return (sum(idle) - idle[bottleneck]) / v
        if self.ilp_form is StageILPForm.INTERLEAVED:
            return (sum(work) - work[bottleneck]) / v
        return sum(work) - work[bottleneck]


def _gpipe_in_flight(p: int, v: int, m: int, rank: int) -> float:
    """GPipe keeps all m."""
    return float(m)


def _one_f_one_b_in_flight(p: int, v: int, m: int, rank: int) -> float:
    """1F1B keeps p - r (Narayanan et al. 2021, section 2.2.1)."""
    return float(min(p - rank, m))


def _interleaved_in_flight(p: int, v: int, m: int, rank: int) -> float:
    """(v - 1) p + 2 (p - r - 1) + 1 chunk-micro-batches, each 1/v of the rank's activations
    (Megatron-LM's warm-up count; Korthikanti et al. 2022, section 4.2.3); with m = p every
    forward comes first: all m v."""
    if p == 1:
        return 1.0
    if m == p:
        return float(m)
    return min((v - 1) * p + 2 * (p - rank - 1) + 1, m * v) / v


def _zb_v_in_flight(p: int, v: int, m: int, rank: int) -> float:
    """min(2p, 2m, m + 1 + r) chunk-micro-batches, each half the rank's activations: 2p (1F1B's
    first rank's p micro-batches) once m >= 2p - 1 - r; tests hold it equal to the lists'
    peak for p <= 16, m <= 4p."""
    return min(2 * p, 2 * m, m + 1 + rank) / 2


def _one_f_one_b_receives_ahead(p: int, v: int, m: int, rank: int) -> int:
    """Lowered in send order: every rank but the first posts the receive of its next forward's
    input while it runs a backward, once m > p - r (its warm-up has room for one more
    forward); the first rank receives only gradients, each right when its backward comes.
    Tests hold it equal to the lists for p <= 12."""
    return 1 if rank > 0 and m > p - rank else 0


def _zb_h1_receives_ahead(p: int, v: int, m: int, rank: int) -> int:
    """As 1F1B, and the first rank too once m > p (a deferred W then stands between a
    gradient's arrival and its I). Tests hold it equal to the lists for p <= 12."""
    return 1 if p > 1 and m > p - rank else 0


def _interleaved_receives_ahead(p: int, v: int, m: int, rank: int) -> int:
    """Lowered in send order (the lowering for tags stalls under NCCL), with m >= 2p: rank 0
    posts the receives of its second chunk's inputs as the last rank sends them, p - 1 of them
    during its warm-up; the last rank holds p // 3 + 1 (at least 2), the others 2. With m = p
    every forward comes first and nothing is received ahead, but for one tensor on each rank
    at p = 2. Counted on the lists: tests hold it equal for p <= 12, at p = 13, 16 and 32
    (found equal up to p = 64 by hand)."""
    if p == 1:
        return 0
    if m < 2 * p:
        return 1 if p == 2 else 0
    if rank == 0:
        return p - 1
    return max(2, p // 3 + 1) if rank == p - 1 else 2


def _zb_v_receives_ahead(p: int, v: int, m: int, rank: int) -> int:
    """Lowered in send order (ZB-V's lists take a link's messages in another order than they
    are sent): with m >= 2p, 1 on rank 0 and 2 on the others; with fewer micro-batches at most
    3 (a bound: the exact count wanders between 0 and 3). Tests hold both for p <= 10 and at
    p = 16 (found so up to p = 32 by hand)."""
    if p == 1:
        return 0
    if m >= 2 * p:
        return 1 if rank == 0 else 2
    return 3


def _zb_h1_in_flight(p: int, v: int, m: int, rank: int) -> float:
    """p on every rank: rank r defers its weight gradients by r micro-batches, and the executor
    holds a micro-batch's activations until its W (Qi et al. 2024: 1F1B's peak)."""
    return float(min(p, m)) if p > 1 else 1.0


#: Every schedule autopar plans, simulates and runs. Adding one is one entry here and its tests.
SCHEDULES.update({spec.kind: spec for spec in (
    ScheduleSpec(ScheduleKind.GPIPE, lambda p, m, v: gpipe(p, m),
                 "every forward, then every backward (Huang et al. 2019)",
                 StageILPForm.PHASED, _gpipe_in_flight),
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, lambda p, m, v: one_f_one_b(p, m),
                 "one forward, one backward after a warm-up (PipeDream-Flush, Narayanan et al. "
                 "2021)", StageILPForm.LOOPED, _one_f_one_b_in_flight,
                 receives_ahead=_one_f_one_b_receives_ahead),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, lambda p, m, v: interleaved_1f1b(p, v, m),
                 "1F1B over v chunks per rank (Narayanan et al. 2021)",
                 StageILPForm.INTERLEAVED, _interleaved_in_flight,
                 receives_ahead=_interleaved_receives_ahead, min_virtual_stages=2,
                 max_virtual_stages=None, micro_batches_divisible_by_pp=True),
    ScheduleSpec(ScheduleKind.ZB_H1, lambda p, m, v: zb_h1(p, m),
                 "1F1B with the weight gradient deferred into the bubble (Qi et al. 2024)",
                 StageILPForm.LOOPED, _zb_h1_in_flight, receives_ahead=_zb_h1_receives_ahead,
                 splits_backward=True),
    ScheduleSpec(ScheduleKind.ZB_V, lambda p, m, v: zb_v(p, m),
                 "two chunks per rank in a V, the weight gradient in the bubble (Qi et al. 2024, "
                 "section 6)", StageILPForm.V_SHAPE, _zb_v_in_flight,
                 receives_ahead=_zb_v_receives_ahead, splits_backward=True,
                 min_virtual_stages=2, max_virtual_stages=2, placement=StagePlacement.V),
)})


def schedule_spec(kind: ScheduleKind | str) -> ScheduleSpec:
    """The spec of schedule ``kind`` (a :class:`ScheduleKind` or its spelling)."""
    try:
        return SCHEDULES[ScheduleKind(kind)]
    except ValueError:
        raise ScheduleError(f"unknown schedule {kind!r}",
                            expected=", ".join(k.value for k in ScheduleKind)) from None


def build_schedule(kind: ScheduleKind | str, num_ranks: int, num_microbatches: int,
                   stages_per_rank: int = 1, *, communication: bool = True) -> PipelineSchedule:
    """The schedule ``kind`` for p ranks and m micro-batches (lowered with sends and receives
    unless ``communication=False``)."""
    spec = schedule_spec(kind)
    check_counts(num_ranks, num_microbatches)
    if spec.max_virtual_stages == 1 and stages_per_rank != 1:
        raise ScheduleError(f"{spec.kind.value} runs one stage per rank",
                            found=f"stages_per_rank={stages_per_rank}",
                            fix="use interleaved-1f1b for several stages per rank")
    schedule = spec.build(num_ranks, num_microbatches, stages_per_rank)
    return add_communication(schedule) if communication else schedule
