"""Run every rank's action list of a pipeline schedule without processes.

``simulate(schedule, durations)`` executes the lowered lists (sends and receives included, see
:func:`autopar.runtime.schedules.add_communication`) with the executor's semantics:

- a compute action (F, B, I, W) starts when its rank is free and its inputs are there: the
  received tensor (RECV done) or, for a stage on the same rank, the producing action done;
- a send never blocks its rank (the executor posts ``isend`` and waits for it at the end of the
  step); the tensor arrives at the receiver ``p2p`` seconds after the send is posted;
- a receive blocks its rank until the matching send has been posted and the tensor has arrived.
  Sends and receives match by identity (the executor tags every message with its stage,
  direction and micro-batch); ``strict_order=True`` also demands that every pair of ranks posts
  its messages in the same order on both sides (what NCCL, which ignores tags, needs).

If at some point no rank can move, the schedule deadlocks: :class:`ScheduleError` names each
rank's blocked action and what it waits for. The result has the step time, each rank's busy,
communication and idle time, the bubble fraction and a timeline of (rank, action, start, end)
events for Chrome traces and Gantt charts.

One event engine runs every case, in time order: a rank moves when its previous action ends or
a message for it is posted, and the ranks computing at once progress at the rate a model of the
processors gives (``processors=``, a :class:`Processors`):

- :class:`Dedicated` (the default): every rank has processors of its own (a GPU each): rate 1,
  so a compute takes exactly its duration;
- :class:`SharedCores` (``cores=``): the ranks of a CPU host are processes that share its cores.
  With ``cores`` processors for this pipeline and ``replicas - 1`` identical copies of it
  running the same list at the same time (its data- and tensor-parallel peers on the host), a
  rank computing while k of the pipeline's ranks compute progresses at 1 while
  ``k replicas <= cores``, else at ``efficiency x cores / (k replicas)`` of its own speed
  (processor sharing: the kernel's scheduler gives runnable processes of one thread equal
  shares, and time-sliced processes run on colder caches, the measured ``efficiency``; a rank
  waiting on a receive, or on its peers inside a compute (``Durations.forward_wait``), sleeps
  and takes none). The durations are then times on a processor of one's own. On a host
  holding more processes than cores, a compute its rank begins after waiting (on a receive, on
  a compute it depends on, or at the start of the step) has ``resume_s`` more work: the
  process resumes on a core where others ran since, its caches cold.

A receive is posted when its rank reaches it and completes ``send_overhead`` later or when the
message arrives, whichever is last.

This is the cost model's schedule model: the plan search prices its finalists by simulating
``build_schedule(kind, p, m, v)`` with the cost model's per-stage forward, backward (input and
weight) and transfer times (``autopar/planner/schedule_model.py``), and ``autopar simulate``
draws that simulation. (The runtime does not import the planner; the planner imports this.)
"""

from __future__ import annotations

import gc
import heapq
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple, Protocol, Sequence

from autopar.cluster import processor_share
from autopar.errors import ScheduleError
from autopar.runtime.schedules import Action, ActionKind, PipelineSchedule, add_communication

__all__ = ["Durations", "TimelineEvent", "SimulationResult", "simulate", "simulate_nccl",
           "processor_share",
           "Processors", "Dedicated", "SharedCores"]


def _floats(name: str, values: Sequence[float], length: int) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if len(out) != length:
        raise ScheduleError(f"durations.{name} has {len(out)} entries",
                            expected=f"{length} (one per {'cut' if name.startswith('p2p') else 'stage'})")
    if any(v < 0 for v in out):
        raise ScheduleError(f"durations.{name} has a negative time", found=str(out))
    return out


@dataclass(frozen=True, slots=True)
class Durations:
    """Seconds (or any unit) per action, per stage.

    ``backward`` is a full backward; ``backward_input`` and ``backward_weight`` are its two
    halves for split-backward schedules (default: half of ``backward`` each). ``p2p[s]`` is the
    time to move stage s's output to stage s + 1, ``p2p_grad[s]`` the gradient back (default the
    same). ``send_overhead`` is rank time spent posting one send or receive.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...] = ()
    backward_weight: tuple[float, ...] = ()
    p2p: tuple[float, ...] = ()
    p2p_grad: tuple[float, ...] = ()
    send_overhead: float = 0.0
    #: Of each stage's forward (and of its backward, or input-gradient half), the seconds its
    #: rank waits on peers without computing (its tensor-parallel collectives' arrival): with
    #: shared processors that part takes no core and is not slowed by sharing. Default 0.
    forward_wait: tuple[float, ...] = ()
    backward_wait: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n < 1:
            raise ScheduleError("durations need at least one stage")
        object.__setattr__(self, "forward", _floats("forward", self.forward, n))
        object.__setattr__(self, "backward", _floats("backward", self.backward, n))
        half = tuple(b / 2 for b in self.backward)
        object.__setattr__(self, "backward_input",
                           _floats("backward_input", self.backward_input or half, n))
        object.__setattr__(self, "backward_weight",
                           _floats("backward_weight", self.backward_weight or half, n))
        p2p = _floats("p2p", self.p2p or (0.0,) * (n - 1), n - 1)
        object.__setattr__(self, "p2p", p2p)
        object.__setattr__(self, "p2p_grad", _floats("p2p_grad", self.p2p_grad or p2p, n - 1))
        for name, total in (("forward_wait", self.forward), ("backward_wait", self.backward)):
            waits = _floats(name, getattr(self, name) or (0.0,) * n, n)
            if any(w > t * (1 + 1e-9) for w, t in zip(waits, total)):
                raise ScheduleError(f"durations.{name} exceeds the time it is part of",
                                    found=str(waits), expected=f"at most {total}")
            object.__setattr__(self, name, waits)
        if self.send_overhead < 0:
            raise ScheduleError("send_overhead is negative", found=str(self.send_overhead))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def compute_seconds(self) -> dict[ActionKind, tuple[float, ...]]:
        """Each compute kind's seconds per stage."""
        return {ActionKind.FORWARD: self.forward, ActionKind.BACKWARD: self.backward,
                ActionKind.BACKWARD_INPUT: self.backward_input,
                ActionKind.BACKWARD_WEIGHT: self.backward_weight}

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, *,
                weight: float | None = None, p2p: float = 0.0,
                send_overhead: float = 0.0) -> "Durations":
        """Every stage alike; ``weight`` is W's share of ``backward`` (default half)."""
        w = backward / 2 if weight is None else weight
        n = num_stages
        return cls((forward,) * n, (backward,) * n, (backward - w,) * n, (w,) * n,
                   (p2p,) * (n - 1), (), send_overhead)


class TimelineEvent(NamedTuple):
    """One action of one rank; for a receive, start is when the rank began to wait. (A named
    tuple: a simulated step has tens of thousands of them.)"""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class SimulationResult:
    step_time: float
    #: Per rank: compute time (F, B, I, W), time posting sends/receives, and idle time.
    busy: tuple[float, ...]
    comm: tuple[float, ...]
    idle: tuple[float, ...]
    #: (p * step_time - total busy) / total busy: the bubble relative to the ideal time
    #: (total compute spread evenly over the ranks): (p - 1) / m for GPipe and 1F1B.
    bubble_fraction: float
    #: Most micro-batches (summed over its stages) whose activations a rank holds at once.
    peak_in_flight: tuple[int, ...]
    events: tuple[TimelineEvent, ...] = field(repr=False)
    #: Per rank: the computes that paid the processors' ``resume_s`` (begun after a wait).
    resumed: tuple[int, ...] = ()

    @property
    def num_ranks(self) -> int:
        return len(self.busy)

    def rank_events(self, rank: int) -> list[TimelineEvent]:
        return [e for e in self.events if e.rank == rank]

    def to_chrome_trace(self, time_unit_s: float = 1.0) -> dict:
        """The timeline in the Chrome trace format (chrome://tracing, Perfetto): one row per
        rank, one complete event per action; times are multiplied by ``1e6 * time_unit_s`` to
        microseconds."""
        scale = 1e6 * time_unit_s
        events = [{"name": str(e.action), "cat": e.action.kind.name.lower(), "ph": "X",
                   "pid": 0, "tid": e.rank, "ts": e.start * scale,
                   "dur": max(e.end - e.start, 0.0) * scale,
                   "args": {"stage": e.action.stage, "microbatch": e.action.microbatch}}
                  for e in self.events]
        names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                  "args": {"name": f"pp rank {r}"}} for r in range(self.num_ranks)]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def _message_key(action: Action) -> tuple[int, str, int]:
    """The message a send posts or a receive takes: (sending stage, direction, micro-batch)."""
    s, mb = action.stage, action.microbatch
    if action.kind is ActionKind.SEND_F:
        return (s, "F", mb)
    if action.kind is ActionKind.RECV_F:
        return (s - 1, "F", mb)
    if action.kind is ActionKind.SEND_B:
        return (s, "B", mb)
    return (s + 1, "B", mb)  # RECV_B


class _Dependencies:
    """The executor's dependency rules, shared by both event loops: when an action's inputs
    are there, given what has finished (``done``: computes and receives by (stage, kind,
    micro-batch)) and what has been sent (``posted``: message -> (arrival, order))."""

    def __init__(self, schedule: PipelineSchedule) -> None:
        self.where = schedule.stage_to_rank
        self.last = schedule.num_stages - 1
        self.done: dict[tuple[int, ActionKind, int], float] = {}
        self.posted: dict[tuple[int, str, int], tuple[float, int]] = {}

    def backward_done(self, stage: int, mb: int) -> float | None:
        t = self.done.get((stage, ActionKind.BACKWARD, mb))
        return t if t is not None else self.done.get((stage, ActionKind.BACKWARD_INPUT, mb))

    def ready_time(self, rank: int, a: Action) -> float | None:
        """When ``a``'s inputs are there (None: not yet)."""
        s, mb, kind = a.stage, a.microbatch, a.kind
        done, where = self.done, self.where
        if kind is ActionKind.FORWARD:
            if s == 0:
                return 0.0
            if where[s - 1] == rank:
                return done.get((s - 1, ActionKind.FORWARD, mb))
            return done.get((s, ActionKind.RECV_F, mb))
        if kind is ActionKind.BACKWARD or kind is ActionKind.BACKWARD_INPUT:
            fwd = done.get((s, ActionKind.FORWARD, mb))
            if fwd is None or s == self.last:
                return fwd
            t = self.backward_done(s + 1, mb) if where[s + 1] == rank else done.get(
                (s, ActionKind.RECV_B, mb))
            return None if t is None else max(t, fwd)
        if kind is ActionKind.BACKWARD_WEIGHT:
            return done.get((s, ActionKind.BACKWARD_INPUT, mb))
        if kind is ActionKind.SEND_F:
            return done.get((s, ActionKind.FORWARD, mb))
        if kind is ActionKind.SEND_B:
            return self.backward_done(s, mb)
        arrival = self.posted.get(_message_key(a))  # a receive
        return None if arrival is None else arrival[0]

    def waits_for(self, rank: int, a: Action) -> str:
        """What a blocked action waits for (for the deadlock report)."""
        s, mb, where = a.stage, a.microbatch, self.where
        if a.kind is ActionKind.FORWARD:
            return f"{s - 1}F{mb}" if where[s - 1] == rank else f"{s}RECV_F{mb}"
        if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            if (s, ActionKind.FORWARD, mb) not in self.done:
                return f"{s}F{mb}"
            return f"{s + 1}B{mb} or {s + 1}I{mb}" if where[s + 1] == rank else f"{s}RECV_B{mb}"
        if a.kind is ActionKind.BACKWARD_WEIGHT:
            return f"{s}I{mb}"
        if a.kind is ActionKind.SEND_F:
            return f"{s}F{mb}"
        if a.kind is ActionKind.SEND_B:
            return f"{s}B{mb} or {s}I{mb}"
        key = _message_key(a)
        return f"the send of {key[0]}{'SEND_F' if key[1] == 'F' else 'SEND_B'}{mb} on rank " \
               f"{where[key[0]]}"


class Processors(Protocol):
    """How fast a computing rank progresses while ``computing`` of the pipeline's ranks
    compute (relative to a processor of its own): the simulator's one model of the hardware.

    A model may also give ``resume_s``: seconds of work a compute gains when its rank begins it
    after waiting (:class:`SharedCores`; 0 when absent).
    """

    def rate(self, computing: int) -> float: ...


@dataclass(frozen=True)
class Dedicated:
    """Every rank has processors of its own (a GPU per rank): always full speed."""

    def rate(self, computing: int) -> float:
        return 1.0


@dataclass(frozen=True)
class SharedCores:
    """The ranks are processes sharing ``cores`` processors with ``replicas - 1`` identical
    copies of the pipeline (see the module docstring): :func:`processor_share`."""

    cores: float
    replicas: int = 1
    efficiency: float = 1.0
    #: Seconds of work a compute gains when its rank resumes after waiting (a host holding more
    #: processes than cores: :attr:`autopar.cluster.Cluster.resume_s`); 0 with a core each.
    resume_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.cores > 0:
            raise ScheduleError("cores must be positive", found=str(self.cores))
        if self.replicas < 1:
            raise ScheduleError("replicas must be >= 1", found=str(self.replicas))
        if not self.resume_s >= 0:
            raise ScheduleError("resume_s must be >= 0", found=str(self.resume_s))

    def rate(self, computing: int) -> float:
        return processor_share(computing * self.replicas, self.cores, self.efficiency)


def simulate(schedule: PipelineSchedule, durations: Durations, *,
             strict_order: bool = False, cores: float | None = None,
             replicas: int = 1, efficiency: float = 1.0,
             processors: Processors | None = None) -> SimulationResult:
    """Execute ``schedule`` (lowered with sends and receives if it is not) under ``durations``.

    ``processors``: the model of processor sharing (default :class:`Dedicated`, or
    :class:`SharedCores` when ``cores`` is given: processors the ranks share, with ``replicas``
    copies of the pipeline running at once; ``efficiency``: the cores' throughput while
    oversubscribed, relative to fair sharing)."""
    if durations.num_stages != schedule.num_stages:
        raise ScheduleError("durations and schedule disagree on the number of stages",
                            expected=f"{schedule.num_stages} stages",
                            found=f"{durations.num_stages}")
    if processors is not None and (cores is not None or replicas != 1):
        raise ScheduleError("simulate takes a processor model or cores and replicas, not both",
                            fix="pass processors=SharedCores(cores, replicas, efficiency)")
    if processors is None:
        processors = Dedicated() if cores is None and replicas == 1 else SharedCores(
            float(cores if cores is not None else float("inf")), replicas, efficiency)
    engine = _Engine(add_communication(schedule), durations, processors, strict_order)
    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of short-lived tuples, none in a cycle: no collector pauses
    try:
        return engine.run()
    finally:
        if collecting:
            gc.enable()


def simulate_nccl(schedule: PipelineSchedule, durations: Durations, *,
                  per_pair: bool = True, match: str = "order") -> float:
    """The step time of ``schedule`` lowered for NCCL (``add_communication(match="order")``;
    ``match="tag"``: the lowering for gloo) under NCCL's stream semantics
    (:meth:`PipelineSchedule.on_nccl_streams`; a GPU per rank): each transfer on the stream of
    its pair of ranks, as the executor issues them, or with ``per_pair=False`` each run of
    transfers batched on the rank's one stream. A :class:`ScheduleError` where the lists
    stop."""
    if durations.num_stages != schedule.num_stages:
        raise ScheduleError("durations and schedule disagree on the number of stages",
                            expected=f"{schedule.num_stages} stages",
                            found=f"{durations.num_stages}")
    d = durations
    seconds = d.compute_seconds()

    def transfer(a: Action) -> float:  # a send
        return d.p2p[a.stage] if a.kind is ActionKind.SEND_F else d.p2p_grad[a.stage - 1]

    run = add_communication(schedule, match=match).on_nccl_streams(
        per_pair=per_pair, compute_s=lambda a: seconds[a.kind][a.stage], transfer_s=transfer)
    if run.step_time is None:
        raise ScheduleError("the pipeline schedule stops on NCCL's streams", found=run.stuck,
                            fix="lower it with add_communication(match='order')")
    return run.step_time


class _Running:
    """A compute action holding a processor: its work left (seconds on a processor of its own)
    as of ``since``."""

    __slots__ = ("action", "begin", "left", "since", "shared", "total", "wait")

    def __init__(self, action: Action, begin: float, total: float, wait: float) -> None:
        self.action, self.begin, self.since = action, begin, begin
        self.total, self.wait = total, wait  # its duration, and of it the wait on peers
        self.left = max(total - wait, 0.0)
        self.shared = False  # whether it ever ran at a rate other than 1


class _Engine:
    """The one event loop: in time order, every rank takes its next actions as soon as it is
    free and their inputs are there (:class:`_Dependencies`); computing ranks progress at the
    processors' common rate, recomputed whenever the number computing changes.

    A rank is woken only by what can unblock it (its own previous action ending, a message for
    it being posted), so a step costs O(actions log actions) whatever the number of ranks."""

    def __init__(self, schedule: PipelineSchedule, durations: Durations,
                 processors: Processors, strict_order: bool) -> None:
        self.schedule, self.durations, self.processors = schedule, durations, processors
        self.strict_order = strict_order
        p = schedule.num_ranks
        self.deps = _Dependencies(schedule)
        self.where = self.deps.where
        self.clock = [0.0] * p  # when each rank is free of its posting or receiving
        self.pos = [0] * p
        self.busy = [0.0] * p
        self.comm = [0.0] * p
        self.in_flight = [0] * p
        self.peaks = [0] * p
        self.running: dict[int, _Running] = {}
        self.waiting: dict[int, tuple[Action, float, float]] = {}  # on peers: (a, begin, end)
        self.wakes: list[tuple[float, int]] = []  # (time, rank): when a rank may move
        self.finishes: list[tuple[float, int, int]] = []  # (time, rank, version)
        self.version = 0  # finish times of an older version are stale (the rate changed)
        self.rate = processors.rate(0)
        self.resume_s = float(getattr(processors, "resume_s", 0.0))
        self.resumes = [True] * p  # whether the rank's next compute begins after a wait
        self.resumed = [0] * p  # computes that paid resume_s
        self.channel_sent: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
        self.channel_taken: dict[tuple[int, int], int] = {}
        self.events: list[TimelineEvent] = []
        self.now = 0.0
        d = durations
        self.compute_time = d.compute_seconds()
        zeros = (0.0,) * d.num_stages  # the peer waits per kind: the loop's hottest lookup
        self.wait_time = {ActionKind.FORWARD: d.forward_wait, ActionKind.BACKWARD: d.backward_wait,
                          ActionKind.BACKWARD_INPUT: d.backward_wait,
                          ActionKind.BACKWARD_WEIGHT: zeros}

    def wake(self, rank: int, time: float) -> None:
        heapq.heappush(self.wakes, (time, rank))

    # -- one rank's moves -------------------------------------------------------------------

    def advance(self, rank: int) -> list[int]:
        """Take the rank's actions that can happen now; the ranks a posted message may wake."""
        now, actions, deps = self.now, self.schedule.ranks[rank], self.deps
        woken: list[int] = []
        waiting = self.waiting.get(rank)
        if waiting is not None and waiting[2] <= now:
            del self.waiting[rank]
            self.finish(rank, waiting[0], waiting[1], waiting[2])
        while rank not in self.running and rank not in self.waiting \
                and self.pos[rank] < len(actions) and self.clock[rank] <= now:
            a = actions[self.pos[rank]]
            kind = a.kind
            if kind is ActionKind.RECV_F or kind is ActionKind.RECV_B:
                if not self.receive(rank, a):
                    break
            else:
                ready = deps.ready_time(rank, a)
                if ready is None or ready > now:
                    self.resumes[rank] = True
                    break
                if kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
                    woken.append(self.send(rank, a))
                else:
                    self.start(rank, a)
            self.pos[rank] += 1
        return woken

    def start(self, rank: int, a: Action) -> None:
        kind = a.kind  # a str enum hashes in Python: look it up once
        total, wait = self.compute_time[kind][a.stage], self.wait_time[kind][a.stage]
        if self.resumes[rank]:
            if self.resume_s > 0:
                total += self.resume_s
                self.resumed[rank] += 1
            self.resumes[rank] = False
        self.running[rank] = _Running(a, self.now, total, wait)
        if a.kind is ActionKind.FORWARD:
            self.in_flight[rank] += 1
            self.peaks[rank] = max(self.peaks[rank], self.in_flight[rank])

    def send(self, rank: int, a: Action) -> int:
        d, now = self.durations, self.now
        end = now + d.send_overhead
        self.comm[rank] += d.send_overhead
        transfer = d.p2p[a.stage] if a.kind is ActionKind.SEND_F else d.p2p_grad[a.stage - 1]
        key = _message_key(a)
        dst = self.where[a.stage + 1 if a.kind is ActionKind.SEND_F else a.stage - 1]
        sent = self.channel_sent.setdefault((rank, dst), [])
        self.deps.posted[key] = (end + transfer, len(sent))
        sent.append(key)
        self.events.append(TimelineEvent(rank, a, now, end))
        self.clock[rank] = end
        self.wake(rank, end)
        return dst

    def receive(self, rank: int, a: Action) -> bool:
        """A posted receive completes once its message has arrived and the rank has spent
        ``send_overhead`` posting it (False: the message was not sent yet)."""
        key = _message_key(a)
        arrival = self.deps.posted.get(key)
        if arrival is None:
            self.resumes[rank] = True
            return False
        src = self.where[key[0]]
        channel = (src, rank)
        order = self.channel_taken.get(channel, 0)
        if self.strict_order and arrival[1] != order:
            expected = self.channel_sent[channel][order] if order < len(
                self.channel_sent[channel]) else None
            raise ScheduleError(
                f"rank {rank} receives {a} out of order from rank {src}",
                expected=f"the message rank {src} sent next on that link ({expected})",
                found=f"message {key} (sent as number {arrival[1]})",
                fix="post sends and receives between a pair of ranks in the same order on both "
                    "sides")
        self.channel_taken[channel] = order + 1
        start = self.clock[rank]
        end = max(start + self.durations.send_overhead, arrival[0])
        if arrival[0] > start + self.durations.send_overhead:
            self.resumes[rank] = True  # it waited for the message
        self.comm[rank] += self.durations.send_overhead
        self.deps.done[(a.stage, a.kind, a.microbatch)] = end
        self.events.append(TimelineEvent(rank, a, start, end))
        self.clock[rank] = end
        self.wake(rank, end)
        return True

    def finish(self, rank: int, a: Action, begin: float, end: float) -> None:
        self.deps.done[(a.stage, a.kind, a.microbatch)] = end
        self.busy[rank] += end - begin
        self.events.append(TimelineEvent(rank, a, begin, end))
        if a.kind is ActionKind.BACKWARD or a.kind is ActionKind.BACKWARD_WEIGHT:
            self.in_flight[rank] -= 1
        self.clock[rank] = end
        self.wake(rank, end)

    # -- the processors ---------------------------------------------------------------------

    def finish_time(self, r: _Running) -> float:
        return r.since + r.left / self.rate if r.left > 0 else r.since

    def set_rate(self, started: list[int]) -> None:
        """After the moves at ``now``: the common rate for the ranks computing now; the finish
        times of those that started now, or of all of them when the rate changed."""
        rate = self.processors.rate(len(self.running))
        if rate != self.rate:
            for r in self.running.values():  # the work done at the old rate until now
                r.left = max(r.left - (self.now - r.since) * self.rate, 0.0)
                r.since = self.now
                r.shared = True
            self.rate, self.version = rate, self.version + 1
            started = list(self.running)
        elif rate != 1.0:
            for rank in started:
                self.running[rank].shared = True
        for rank in started:
            heapq.heappush(self.finishes,
                           (self.finish_time(self.running[rank]), rank, self.version))

    def end_computes(self) -> None:
        """Complete the computes whose processor work ends now (then their wait on peers)."""
        while self.finishes and self.finishes[0][0] <= self.now:
            _, rank, version = heapq.heappop(self.finishes)
            if version != self.version or rank not in self.running:
                continue
            r = self.running.pop(rank)
            a = r.action
            if not r.shared:  # at full speed throughout: exactly begin + duration
                end = r.begin + r.total
            else:
                end = self.now + r.wait
            if end > self.now:  # its peers' arrival: no processor taken
                self.waiting[rank] = (a, r.begin, end)
                self.wake(rank, end)
            else:
                self.finish(rank, a, r.begin, end)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> SimulationResult:
        schedule = self.schedule
        p = schedule.num_ranks
        for rank in range(p):
            self.wake(rank, 0.0)
        while True:
            self.end_computes()
            started: list[int] = []
            while self.wakes and self.wakes[0][0] <= self.now:
                rank = heapq.heappop(self.wakes)[1]
                was_running = rank in self.running
                for dst in self.advance(rank):
                    self.wake(dst, self.now)
                if not was_running and rank in self.running:
                    started.append(rank)
            self.set_rate(started)
            finishes = self.finishes
            while finishes and (finishes[0][2] != self.version
                                or finishes[0][1] not in self.running):
                heapq.heappop(finishes)  # stale: the rate changed since, or already ended
            upcoming = [h[0][0] for h in (self.wakes, self.finishes) if h]
            if not upcoming:
                break
            self.now = min(upcoming)
        if any(self.pos[r] < len(schedule.ranks[r]) for r in range(p)) or self.running \
                or self.waiting:
            blocked = []
            for rank in range(p):
                if self.pos[rank] < len(schedule.ranks[rank]):
                    a = schedule.ranks[rank][self.pos[rank]]
                    blocked.append(f"rank {rank} at {a} waits for "
                                   f"{self.deps.waits_for(rank, a)}")
            raise ScheduleError("the pipeline schedule deadlocks",
                                expected="every rank's next action to become ready",
                                found="; ".join(blocked),
                                fix="reorder the action lists so that every receive's send and "
                                    "every backward's forward come earlier on their ranks")
        step = max(self.clock)
        total_busy = sum(self.busy)
        bubble = (p * step - total_busy) / total_busy if total_busy > 0 else 0.0
        idle = tuple(step - b - c for b, c in zip(self.busy, self.comm))
        self.events.sort(key=attrgetter("start", "rank"))
        return SimulationResult(step, tuple(self.busy), tuple(self.comm), idle, bubble,
                                tuple(self.peaks), tuple(self.events), tuple(self.resumed))
