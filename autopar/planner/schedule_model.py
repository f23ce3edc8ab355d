"""Pipeline schedule models: how long m micro-batches take through p ranks of stages.

STAND-IN: the pipeline issue's schedules (``runtime/schedules.py``) and simulator
(``runtime/simulator.py``) will replace both classes here, through
:class:`autopar.planner.components.Components`.

Inputs (:class:`PipelineWork`): for each of the ``p * v`` stages (stage ``s`` on rank ``s % p``,
chunk ``s // p``) the time of one micro-batch's forward ``F``, input-gradient backward ``B`` and
weight-gradient backward ``W`` (``W`` is only separated by zero-bubble schedules; the others run
it inside ``B``), and the time ``c`` to send a boundary tensor to the next stage.

:class:`ClosedFormScheduleModel` (the formulas of Narayanan et al. 2021 and Qi et al. 2023,
generalised to unequal ranks). With ``T_r`` the per-micro-batch work of rank ``r`` (all its
chunks), ``T* = max_r T_r``:

- GPipe and 1F1B:   t = m T* + (sum_r T_r - T*)               (uniform: (m + p - 1) T)
- interleaved 1F1B: t = m T* + (sum_r T_r - T*) / v           (uniform: (m + (p - 1)/v) T)
- ZB-H1:            t = m T* + (sum_r X_r - X*),  X_r = F_r + B_r - W_r  (uniform: bubble
                    (p - 1)(F + B - W))
- plus point-to-point, when p > 1: 2 (v m + p - 2) c. Megatron-LM's send/recv is synchronous,
  so each of a rank's v m forward and v m backward transfers is on its critical path, and the
  fill and drain add p - 2 more each way. The event simulator sends asynchronously (a rank goes
  on once its send is posted), so it hides part of this: the closed form is the upper of the two.

:class:`EventPipelineSimulator` runs each rank's action list (the orders Megatron-LM, GPipe
and ZB-H1 use) against the dependencies (F after the previous stage's F plus c, B after the next
stage's B plus c, W after B), and returns the timeline. Tests hold the closed form to it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from autopar.errors import ScheduleError
from autopar.plan import ScheduleKind

__all__ = ["PipelineWork", "PipelineTime", "ScheduleModel", "ClosedFormScheduleModel",
           "EventPipelineSimulator", "Action", "TimelineEvent", "in_flight_micro_batches"]


@dataclass(frozen=True, slots=True)
class PipelineWork:
    """Per-micro-batch work of every stage, and the pipeline's shape."""

    schedule: ScheduleKind
    pp: int
    virtual_stages: int
    num_micro_batches: int
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # input gradients (and weight gradients unless zero-bubble)
    weight_s: tuple[float, ...]  # weight gradients (zero-bubble schedules only; else zeros)
    p2p_s: tuple[float, ...] = ()  # send of stage s's output to stage s + 1 (len p*v - 1)

    def __post_init__(self) -> None:
        n = self.pp * self.virtual_stages
        for name in ("forward_s", "backward_s", "weight_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries; expected "
                                 f"pp x virtual_stages = {n}")
        if self.p2p_s and len(self.p2p_s) != n - 1:
            raise ValueError(f"p2p_s has {len(self.p2p_s)} entries; expected {n - 1}")
        if self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")
        if self.schedule is ScheduleKind.INTERLEAVED_1F1B and self.num_micro_batches % self.pp:
            raise ValueError(f"interleaved 1F1B needs num_micro_batches "
                             f"({self.num_micro_batches}) divisible by pp ({self.pp})")

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_work(self, rank: int) -> float:
        return sum(self.forward_s[s] + self.backward_s[s] + self.weight_s[s]
                   for s in range(rank, self.num_stages, self.pp))

    @property
    def p2p_max(self) -> float:
        return max(self.p2p_s, default=0.0)


@dataclass(frozen=True, slots=True)
class PipelineTime:
    """Time of the pipelined part of a step, split the way the breakdown reports it."""

    total_s: float
    #: m x the bottleneck rank's per-micro-batch work (compute, recompute and TP comm).
    busy_s: float
    bubble_s: float
    p2p_s: float
    bottleneck_rank: int


class ScheduleModel(Protocol):
    name: str

    def pipeline_time(self, work: PipelineWork) -> PipelineTime: ...


class ClosedFormScheduleModel:
    """STAND-IN schedule model: the closed-form step time (see the module docstring)."""

    name = "closed-form (stand-in)"

    def pipeline_time(self, work: PipelineWork) -> PipelineTime:
        p, v, m = work.pp, work.virtual_stages, work.num_micro_batches
        per_rank = [work.rank_work(r) for r in range(p)]
        bottleneck = max(range(p), key=per_rank.__getitem__)
        t_max = per_rank[bottleneck]
        busy = m * t_max
        if work.schedule is ScheduleKind.ZB_H1:
            idle = [max(sum(work.forward_s[s] + work.backward_s[s] - work.weight_s[s]
                            for s in range(r, work.num_stages, p)), 0.0) for r in range(p)]
            bubble = sum(idle) - idle[bottleneck]
        else:
            bubble = (sum(per_rank) - t_max) / v
        p2p = 2 * (v * m + p - 2) * work.p2p_max if p > 1 else 0.0
        return PipelineTime(busy + bubble + p2p, busy, bubble, p2p, bottleneck)


# ---------------------------------------------------------------------------------------------
# Event simulator
# ---------------------------------------------------------------------------------------------

class Pass(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of a rank's schedule: ``pass`` of ``stage`` for ``micro_batch`` ("1F0")."""

    kind: Pass
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro_batch}"


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    rank: int
    name: str
    category: str  # "F", "B", "W" or "p2p"
    start_s: float
    end_s: float
    stage: int = -1
    micro_batch: int = -1


def _orders(schedule: ScheduleKind, p: int, v: int, m: int) -> list[list[Action]]:
    """Each rank's action list (without W actions: those are placed by the simulator)."""
    orders: list[list[Action]] = []
    for r in range(p):
        if schedule is ScheduleKind.GPIPE:
            order = [Action(Pass.F, r, i) for i in range(m)] + \
                [Action(Pass.B, r, i) for i in range(m)]
        elif schedule is ScheduleKind.INTERLEAVED_1F1B:
            total = m * v

            def fwd(k: int) -> Action:
                chunk = (k // p) % v
                return Action(Pass.F, chunk * p + r, (k // (p * v)) * p + k % p)

            def bwd(k: int) -> Action:
                chunk = v - 1 - (k // p) % v
                return Action(Pass.B, chunk * p + r, (k // (p * v)) * p + k % p)

            warm = min((p - r - 1) * 2 + (v - 1) * p, total)
            order = [fwd(k) for k in range(warm)]
            for i in range(total - warm):
                order += [fwd(warm + i), bwd(i)]
            order += [bwd(k) for k in range(total - warm, total)]
        else:  # 1F1B and ZB-H1 share the F/B order
            warm = min(p - r - 1, m)
            order = [Action(Pass.F, r, i) for i in range(warm)]
            for i in range(m - warm):
                order += [Action(Pass.F, r, warm + i), Action(Pass.B, r, i)]
            order += [Action(Pass.B, r, i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


class EventPipelineSimulator:
    """STAND-IN for runtime/simulator.py: list-schedules every rank's actions against the
    pipeline dependencies. ZB-H1 defers W passes and runs one when it fits in the wait for the next
    F/B, keeping
    at most p micro-batches between their F and W on any rank (1F1B's peak)."""

    name = "event simulator (stand-in)"

    def pipeline_time(self, work: PipelineWork) -> PipelineTime:
        events = self.simulate(work)
        total = max(e.end_s for e in events)
        closed = ClosedFormScheduleModel().pipeline_time(work)
        r = closed.bottleneck_rank
        busy = work.num_micro_batches * work.rank_work(r)
        p2p = sum(e.end_s - e.start_s for e in events if e.category == "p2p" and e.rank == r)
        return PipelineTime(total, busy, max(total - busy - p2p, 0.0), p2p, r)

    def simulate(self, work: PipelineWork) -> list[TimelineEvent]:
        p, v, m = work.pp, work.virtual_stages, work.num_micro_batches
        n = work.num_stages
        zero_bubble = work.schedule is ScheduleKind.ZB_H1
        orders = _orders(work.schedule, p, v, m)
        c = list(work.p2p_s) or [0.0] * max(n - 1, 0)
        done: dict[tuple[Pass, int, int], float] = {}
        clock = [0.0] * p
        pos = [0] * p
        pending_w: list[list[Action]] = [[] for _ in range(p)]
        in_flight = [0] * p
        events: list[TimelineEvent] = []
        duration = {Pass.F: work.forward_s, Pass.B: work.backward_s, Pass.W: work.weight_s}

        def ready(a: Action) -> float | None:
            if a.kind is Pass.F:
                if a.stage == 0:
                    return 0.0
                end = done.get((Pass.F, a.stage - 1, a.micro_batch))
                return None if end is None else end + c[a.stage - 1]
            if a.kind is Pass.B:
                if a.stage == n - 1:
                    return done.get((Pass.F, a.stage, a.micro_batch))
                end = done.get((Pass.B, a.stage + 1, a.micro_batch))
                return None if end is None else end + c[a.stage]
            return done.get((Pass.B, a.stage, a.micro_batch))

        def run(rank: int, a: Action, start: float) -> None:
            end = start + duration[a.kind][a.stage]
            done[(a.kind, a.stage, a.micro_batch)] = end
            clock[rank] = end
            events.append(TimelineEvent(rank, str(a), a.kind.value, start, end, a.stage,
                                        a.micro_batch))
            sends_to = a.stage + 1 if a.kind is Pass.F else a.stage - 1
            if a.kind is not Pass.W and 0 <= sends_to < n:
                cost = c[min(a.stage, sends_to)]
                if cost > 0:
                    events.append(TimelineEvent(rank, f"send {a}", "p2p", end, end + cost,
                                                a.stage, a.micro_batch))

        remaining = sum(len(o) for o in orders) + (n * m if zero_bubble else 0)
        while remaining:
            best: tuple[float, int, Action] | None = None
            for r in range(p):
                candidates: list[tuple[float, Action]] = []
                if pos[r] < len(orders[r]):
                    a = orders[r][pos[r]]
                    t = ready(a)
                    # ZB-H1 keeps at most p micro-batches between F and W on any rank: the
                    # 1F1B peak of rank 0 (Qi et al. 2023, section 3.2)
                    full = a.kind is Pass.F and in_flight[r] >= p
                    gap = float("inf") if t is None else t - clock[r]
                    fits = pending_w[r] and gap >= work.weight_s[pending_w[r][0].stage]
                    if zero_bubble and pending_w[r] and (full or fits):
                        candidates.append((clock[r], pending_w[r][0]))
                    elif t is not None:
                        candidates.append((max(t, clock[r]), a))
                elif pending_w[r]:
                    candidates.append((clock[r], pending_w[r][0]))
                for start, a in candidates:
                    if best is None or (start, r) < (best[0], best[1]):
                        best = (start, r, a)
            if best is None:
                raise ScheduleError("the pipeline schedule deadlocks",
                                    expected="every rank's next action to become ready",
                                    found=f"ranks stuck at {[o[i] if i < len(o) else None for o, i in zip(orders, pos)]}",
                                    fix="report this schedule as a bug")
            start, r, a = best
            if a.kind is Pass.W:
                pending_w[r].pop(0)
                in_flight[r] -= 1
            else:
                pos[r] += 1
                if a.kind is Pass.F:
                    in_flight[r] += 1
                elif not zero_bubble:
                    in_flight[r] -= 1
                if zero_bubble and a.kind is Pass.B:
                    pending_w[r].append(Action(Pass.W, a.stage, a.micro_batch))
            run(r, a, start)
            remaining -= 1
        return events


def in_flight_micro_batches(schedule: ScheduleKind, pp: int, virtual_stages: int,
                            num_micro_batches: int, rank: int) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak, in units of the rank's
    whole per-micro-batch activations (all its chunks).

    GPipe keeps all m; 1F1B and ZB-H1 keep p - r (Narayanan et al. 2021, section 2.2.1);
    interleaved 1F1B keeps (v - 1) p + 2 (p - r - 1) + 1 chunk-micro-batches, each 1/v of the
    rank's activations (Megatron-LM's warm-up count; Korthikanti et al. 2022, section 4.2.3).
    """
    m, p, v = num_micro_batches, pp, virtual_stages
    if p == 1:
        return 1.0 if schedule is not ScheduleKind.GPIPE else float(m)
    if schedule is ScheduleKind.GPIPE:
        return float(m)
    if schedule is ScheduleKind.INTERLEAVED_1F1B:
        chunks = min((v - 1) * p + 2 * (p - rank - 1) + 1, m * v)
        return chunks / v
    return float(min(p - rank, m))
