"""How long m micro-batches take through p ranks of pipeline stages.

The schedule model of the cost model is the runtime's own: :func:`simulated_pipeline_time` runs
the action lists of :func:`autopar.runtime.schedules.build_schedule` (the lists
``runtime/pipeline.py`` executes, with their sends and receives) through
:func:`autopar.runtime.simulator.simulate`, with the cost model's per-stage durations. The search
prices its finalists this way, and ``autopar simulate`` draws the same timeline.

Inputs (:class:`PipelineWork`): for each of the ``p * v`` stages (stage ``s`` on rank ``s % p``,
chunk ``s // p``) the time of one micro-batch's forward ``F``, backward ``B`` (input gradients,
recomputation and TP communication; for zero-bubble schedules without the weight gradient) and
weight gradient ``W`` (separate for ZB-H1 only), and the time ``c_s`` to send stage ``s``'s output
to stage ``s + 1`` (its gradient comes back in the same time).

:func:`closed_form_pipeline_time` is the search's FAST FIRST PASS, used to rank thousands of
candidates before the finalists are simulated. With ``T_r`` rank r's per-micro-batch work (all its
chunks), ``T* = max_r T_r`` (Narayanan et al. 2021, Qi et al. 2023, generalised to unequal ranks;
each schedule's fill and drain is its ``ScheduleSpec.fill_drain`` in ``runtime/schedules.py``):

- GPipe and 1F1B:   t = m T* + (sum_r T_r - T*)               (uniform: (m + p - 1) T)
- interleaved 1F1B: t = m T* + (sum_r T_r - T*) / v           (uniform: (m + (p - 1)/v) T)
- ZB-H1:            t = m T* + (sum_r X_r - X*),  X_r = F_r + B_r - W_r
- plus point-to-point, when p > 1: 2 (v m + p - 2) max_s c_s (each of a rank's transfers on its
  critical path, as with Megatron-LM's synchronous send/recv);
- ranks sharing ``cores`` processors with ``replicas`` copies of the pipeline (CPU processes,
  :attr:`PipelineWork.cores`): at least ``m (replicas sum_r (T_r - w_r) / cores + max_r w_r)``,
  all the host's work spread over its cores, where ``w_r`` is the time rank r waits on its
  tensor-parallel peers (it takes no core, and is not shortened by more cores). The simulator
  shares the processors event by event instead (``runtime/simulator.py``).

It equals the simulator on equal stages without transfers (tests), is within 10% of it on stages
within +-10% of each other, and is above it with transfers (the executor's sends are
asynchronous). It is not a bound in general; the search's bound is
:func:`autopar.planner.cost_model.lower_bound_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autopar.plan_types import ScheduleKind

__all__ = ["PipelineWork", "PipelineTime", "closed_form_pipeline_time", "simulate_pipeline",
           "simulated_pipeline_time", "in_flight_micro_batches", "first_backward_in_weight",
           "backward_whole_at_input"]


def first_backward_in_weight(zero: int, whole_at_input: bool = False) -> bool:
    """Whether a zero-bubble schedule's first stage runs its whole backward in one call in its
    W (its I computing nothing): below ZeRO-3, whose layer-by-layer gathers need the per-layer
    weight groups instead (runtime/split_backward.py, ``by_layer``; the executor's
    ``layer_units``), unless the stage runs it whole in its I (``whole_at_input``:
    :func:`backward_whole_at_input`)."""
    return zero < 3 and not whole_at_input


def backward_whole_at_input(splits_backward: bool, full_recompute: bool, has_blocks: bool
                            ) -> bool:
    """Whether a stage runs its whole backward, weight gradients included, in its I and nothing
    in its W: under a split-backward schedule, a stage whose blocks full recompute checkpoints
    (``PipelineExecutor.runs_whole_at_input``: a checkpoint recomputes once per autograd call,
    and a split W makes one call per weight group). Such a stage steps as under 1F1B."""
    return splits_backward and full_recompute and has_blocks


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
    #: Processors the ranks share (CPU processes on one host), with ``replicas`` copies of the
    #: pipeline (its data- and tensor-parallel peers) computing at the same time; 0: every rank
    #: has its own. The stage times above are times on a processor of one's own.
    cores: float = 0.0
    replicas: int = 1
    #: Throughput of the shared cores while more ranks compute than there are cores, relative
    #: to fair sharing (:attr:`autopar.cluster.Cluster.oversubscription_efficiency`).
    efficiency: float = 1.0
    #: Seconds a compute gains when its rank begins it after waiting, on a host holding more
    #: processes than cores (:attr:`autopar.cluster.Cluster.resume_s`); else 0.
    resume_s: float = 0.0
    #: Of ``forward_s`` (``backward_s``), the seconds a stage's rank waits on its peers without
    #: computing (its tensor-parallel collectives' arrival): sharing the cores does not slow
    #: them. Empty: none.
    forward_wait_s: tuple[float, ...] = ()
    backward_wait_s: tuple[float, ...] = ()
    #: A zero-bubble schedule's first stage runs its whole backward in its W, none in its I
    #: (:func:`first_backward_in_weight`). The simulator places it so; the closed form keeps
    #: the halves (the paper's lists step the same either way).
    first_backward_in_weight: bool = False

    def __post_init__(self) -> None:
        n = self.pp * self.virtual_stages
        for name in ("forward_wait_s", "backward_wait_s"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries; expected {n}")
        for name in ("forward_s", "backward_s", "weight_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries; expected "
                                 f"pp x virtual_stages = {n}")
        if self.p2p_s and len(self.p2p_s) != n - 1:
            raise ValueError(f"p2p_s has {len(self.p2p_s)} entries; expected {n - 1}")
        if self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")
        problem = self.schedule.spec.shape_problem(self.pp, self.virtual_stages,
                                                   self.num_micro_batches)
        if problem is not None:
            raise ValueError(problem[0])
        if self.cores < 0 or self.replicas < 1:
            raise ValueError(f"cores ({self.cores}) must be >= 0 and replicas ({self.replicas}) "
                             f">= 1")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def shared(self) -> bool:
        """Whether the ranks (and their replicas) are more than the processors."""
        return 0 < self.cores < self.pp * self.replicas

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return self.schedule.spec.stages_of_rank(rank, self.pp, self.virtual_stages)

    def rank_work(self, rank: int) -> float:
        return sum(self.forward_s[s] + self.backward_s[s] + self.weight_s[s]
                   for s in self.stages_of(rank))

    def rank_wait(self, rank: int) -> float:
        """The part of :meth:`rank_work` spent waiting on peers."""
        return sum((self.forward_wait_s[s] if self.forward_wait_s else 0.0)
                   + (self.backward_wait_s[s] if self.backward_wait_s else 0.0)
                   for s in self.stages_of(rank))

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
    #: What the point-to-point transfers add to the step.
    p2p_s: float
    bottleneck_rank: int
    #: "simulated" (runtime/simulator.py) or "closed form" (the first pass).
    method: str = "closed form"


def closed_form_pipeline_time(work: PipelineWork) -> PipelineTime:
    """The fast first pass of the search (see the module docstring)."""
    p, v, m = work.pp, work.virtual_stages, work.num_micro_batches
    per_rank = [work.rank_work(r) for r in range(p)]
    bottleneck = max(range(p), key=per_rank.__getitem__)
    t_max = per_rank[bottleneck]
    busy = m * t_max
    bubble = work.schedule.spec.fill_drain(work.forward_s, work.backward_s, work.weight_s, p, v)
    p2p = 2 * (v * m + p - 2) * work.p2p_max if p > 1 else 0.0
    total = busy + bubble + p2p
    if work.shared and work.resume_s > 0 and p > 1:
        # every forward and input gradient follows a receive on some rank: counted as resumed
        # on the bottleneck (the simulator counts the computes that wait)
        resumed = 2 * v * m * work.resume_s
        busy, total = busy + resumed, total + resumed
    if work.shared:  # no faster than all the host's work spread over its cores
        waits = [work.rank_wait(r) for r in range(p)]
        cpu = sum(per_rank) - sum(waits)
        shared = max(total, m * (cpu * work.replicas / (work.cores * work.efficiency)
                                 + max(waits)))
        stretch = (shared - p2p) / (total - p2p) if total > p2p else 1.0
        busy, bubble, total = busy * stretch, bubble * stretch, shared
    return PipelineTime(total, busy, bubble, p2p, bottleneck)


@lru_cache(maxsize=64)
def _schedule(kind: ScheduleKind, p: int, m: int, v: int):
    from autopar.runtime.schedules import build_schedule

    return build_schedule(kind, p, m, v)


@lru_cache(maxsize=256)
def _compute_lists(kind: ScheduleKind, p: int, m: int, v: int):
    """The schedule's computes without their transfers: what counting activations reads (its
    lowering for the simulator took 2.5 s of a 1T GPT's plan when built for this too)."""
    from autopar.runtime.schedules import build_schedule

    return build_schedule(kind, p, m, v, communication=False)


def simulate_pipeline(work: PipelineWork, *, p2p: bool = True):
    """:func:`autopar.runtime.simulator.simulate` of the executor's action lists for ``work``
    (a :class:`autopar.runtime.simulator.SimulationResult`, with its timeline)."""
    from autopar.runtime.simulator import Dedicated, Durations, SharedCores, simulate

    n = work.num_stages
    zero_bubble = work.schedule.spec.splits_backward
    full = tuple(b + w for b, w in zip(work.backward_s, work.weight_s))
    transfers = work.p2p_s if p2p and work.p2p_s else (0.0,) * (n - 1)
    waits = dict(forward_wait=work.forward_wait_s, backward_wait=work.backward_wait_s)
    if zero_bubble and work.first_backward_in_weight:
        # stage 0's I computes nothing; its tensor-parallel collectives run in its W, whose
        # time the simulator counts as the core's
        inputs, weights = (0.0, *work.backward_s[1:]), (full[0], *work.weight_s[1:])
        if work.backward_wait_s:
            waits["backward_wait"] = (0.0, *work.backward_wait_s[1:])
        durations = Durations(work.forward_s, full, inputs, weights, transfers, **waits)
    elif zero_bubble:
        durations = Durations(work.forward_s, full, work.backward_s, work.weight_s, transfers,
                              **waits)
    else:
        durations = Durations(work.forward_s, full, full, (0.0,) * n, transfers, **waits)
    schedule = _schedule(work.schedule, work.pp, work.num_micro_batches, work.virtual_stages)
    processors = SharedCores(work.cores, work.replicas, work.efficiency, work.resume_s) \
        if work.shared \
        else Dedicated()
    return simulate(schedule, durations, processors=processors)


def simulated_pipeline_time(work: PipelineWork, sim: Any = None):
    """(:class:`PipelineTime`, the simulation) of ``work``: the step is the simulator's; the
    point-to-point share is what the transfers add (a second run without them), the bubble the
    rest of the bottleneck rank's idle time. ``sim``: ``simulate_pipeline(work)`` when the
    caller has run it already."""
    sim = sim if sim is not None else simulate_pipeline(work)
    rank = max(range(work.pp), key=lambda r: (sim.busy[r], -r))
    busy = sim.busy[rank]
    if work.p2p_max > 0 and work.pp > 1:
        without = simulate_pipeline(work, p2p=False).step_time
    else:
        without = sim.step_time
    p2p = max(sim.step_time - without, 0.0)
    bubble = max(sim.step_time - busy - p2p, 0.0)
    return PipelineTime(sim.step_time, busy, bubble, p2p, rank, "simulated"), sim


def in_flight_micro_batches(schedule: ScheduleKind, pp: int, virtual_stages: int,
                            num_micro_batches: int, rank: int, *,
                            release_at_input: bool = False) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak, in units of the rank's
    whole per-micro-batch activations (all its chunks): the schedule's closed form
    (:attr:`autopar.runtime.schedules.ScheduleSpec.in_flight`), equal to the peak of
    ``PipelineSchedule.peak_in_flight`` of the runtime's action lists (tests hold them equal).
    One rank keeps one (all m under GPipe). ``release_at_input``: a split backward's stages
    each run their whole backward in I (:func:`backward_whole_at_input`) and free their
    activations there, not at W: the lists' peak counted so (ZB-H1's is then 1F1B's p - r)."""
    if release_at_input and schedule.spec.splits_backward:
        lists = _compute_lists(schedule, pp, num_micro_batches, virtual_stages)
        return lists.peak_in_flight(rank, release_at_input=True) / virtual_stages
    return schedule.spec.in_flight(pp, virtual_stages, num_micro_batches, rank)
