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

Shared processors (``cores=``): the ranks of a CPU host are processes that share its cores.
With ``cores`` processors for this pipeline and ``replicas - 1`` identical copies of it running
the same list at the same time (its data- and tensor-parallel peers on the host), a rank
computing while k of the pipeline's ranks compute progresses at 1 while ``k replicas <= cores``,
else at ``efficiency x cores / (k replicas)`` of its own speed (processor sharing: the kernel's
scheduler gives runnable processes of one thread equal shares, and time-sliced processes run on
colder caches, the measured ``efficiency``; a rank waiting on a receive sleeps and takes none).
The durations are then times on a processor of one's own, and the simulation runs in time order,
rate changes included.

This is the cost model's schedule model: the plan search prices its finalists by simulating
``build_schedule(kind, p, m, v)`` with the cost model's per-stage forward, backward (input and
weight) and transfer times (``autopar/planner/schedule_model.py``), and ``autopar simulate``
draws that simulation. (The runtime does not import the planner; the planner imports this.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple, Sequence

from autopar.cluster import processor_share
from autopar.errors import ScheduleError
from autopar.runtime.schedules import Action, ActionKind, PipelineSchedule, add_communication

__all__ = ["Durations", "TimelineEvent", "SimulationResult", "simulate", "processor_share"]


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

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, *,
                weight: float | None = None, p2p: float = 0.0,
                send_overhead: float = 0.0) -> "Durations":
        """Every stage alike; ``weight`` is W's share of ``backward`` (default half)."""
        w = backward / 2 if weight is None else weight
        n = num_stages
        return cls((forward,) * n, (backward,) * n, (backward - w,) * n, (w,) * n,
                   (p2p,) * (n - 1), (), send_overhead)

    def compute(self, action: Action) -> float:
        s = action.stage
        return {ActionKind.FORWARD: self.forward, ActionKind.BACKWARD: self.backward,
                ActionKind.BACKWARD_INPUT: self.backward_input,
                ActionKind.BACKWARD_WEIGHT: self.backward_weight}[action.kind][s]

    def wait(self, action: Action) -> float:
        """The part of :meth:`compute` spent waiting on peers (no processor)."""
        kind = action.kind
        if kind is ActionKind.FORWARD:
            return self.forward_wait[action.stage]
        if kind is ActionKind.BACKWARD or kind is ActionKind.BACKWARD_INPUT:
            return self.backward_wait[action.stage]
        return 0.0


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


def simulate(schedule: PipelineSchedule, durations: Durations, *,
             strict_order: bool = False, cores: float | None = None,
             replicas: int = 1, efficiency: float = 1.0) -> SimulationResult:
    """Execute ``schedule`` (lowered with sends and receives if it is not) under ``durations``.

    ``cores``: processors the ranks share (with ``replicas`` copies of the pipeline running at
    once, see the module docstring); None: every rank has its own. ``efficiency``: the cores'
    throughput while oversubscribed, relative to fair sharing."""
    if durations.num_stages != schedule.num_stages:
        raise ScheduleError("durations and schedule disagree on the number of stages",
                            expected=f"{schedule.num_stages} stages",
                            found=f"{durations.num_stages}")
    if cores is not None and not cores > 0:
        raise ScheduleError("cores must be positive", found=str(cores))
    if replicas < 1:
        raise ScheduleError("replicas must be >= 1", found=str(replicas))
    if cores is not None and cores < schedule.num_ranks * replicas:
        if strict_order:  # message order does not depend on the processors: check it apart
            simulate(schedule, durations, strict_order=True)
        return _simulate_shared(add_communication(schedule), durations, float(cores), replicas,
                                efficiency)
    schedule = add_communication(schedule)
    where = schedule.stage_to_rank
    p = schedule.num_ranks
    clock = [0.0] * p
    pos = [0] * p
    busy = [0.0] * p
    comm = [0.0] * p
    deps = _Dependencies(schedule)
    done, posted, ready_time, waits_for = deps.done, deps.posted, deps.ready_time, deps.waits_for
    channel_sent: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
    channel_taken: dict[tuple[int, int], int] = {}
    events: list[TimelineEvent] = []

    F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                  ActionKind.BACKWARD_WEIGHT)
    SEND_F, SEND_B = ActionKind.SEND_F, ActionKind.SEND_B

    compute_time = {F: durations.forward, B: durations.backward, I: durations.backward_input,
                    W: durations.backward_weight}
    in_flight = [0] * p
    peaks = [0] * p
    remaining = sum(len(r) for r in schedule.ranks)
    while remaining:
        progressed = False
        for rank in range(p):
            actions = schedule.ranks[rank]
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                ready = ready_time(rank, a)
                if ready is None:
                    break
                start = clock[rank]
                kind = a.kind
                if kind in compute_time:
                    begin = max(start, ready)
                    end = begin + compute_time[kind][a.stage]
                    busy[rank] += end - begin
                    done[(a.stage, kind, a.microbatch)] = end
                    events.append(TimelineEvent(rank, a, begin, end))
                    if kind is F:
                        in_flight[rank] += 1
                        peaks[rank] = max(peaks[rank], in_flight[rank])
                    elif kind is B or kind is W:
                        in_flight[rank] -= 1
                elif kind is SEND_F or kind is SEND_B:
                    begin = max(start, ready)
                    end = begin + durations.send_overhead
                    comm[rank] += durations.send_overhead
                    transfer = (durations.p2p[a.stage] if kind is SEND_F
                                else durations.p2p_grad[a.stage - 1])
                    key = _message_key(a)
                    dst = where[a.stage + 1] if kind is SEND_F else where[a.stage - 1]
                    sent = channel_sent.setdefault((rank, dst), [])
                    posted[key] = (end + transfer, len(sent))
                    sent.append(key)
                    events.append(TimelineEvent(rank, a, begin, end))
                else:  # receive
                    key = _message_key(a)
                    src = where[key[0]]
                    channel = (src, rank)
                    order = channel_taken.get(channel, 0)
                    if strict_order and posted[key][1] != order:
                        expected = channel_sent[channel][order] if order < len(
                            channel_sent[channel]) else None
                        raise ScheduleError(
                            f"rank {rank} receives {a} out of order from rank {src}",
                            expected=f"the message rank {src} sent next on that link "
                                     f"({expected})",
                            found=f"message {key} (sent as number {posted[key][1]})",
                            fix="post sends and receives between a pair of ranks in the same "
                                "order on both sides")
                    channel_taken[channel] = order + 1
                    end = max(start + durations.send_overhead, ready)
                    comm[rank] += durations.send_overhead
                    done[(a.stage, a.kind, a.microbatch)] = end
                    events.append(TimelineEvent(rank, a, start, end))
                clock[rank] = end
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = []
            for rank in range(p):
                if pos[rank] < len(schedule.ranks[rank]):
                    a = schedule.ranks[rank][pos[rank]]
                    blocked.append(f"rank {rank} at {a} waits for {waits_for(rank, a)}")
            raise ScheduleError("the pipeline schedule deadlocks",
                                expected="every rank's next action to become ready",
                                found="; ".join(blocked),
                                fix="reorder the action lists so that every receive's send and "
                                    "every backward's forward come earlier on their ranks")
    step = max(clock)
    total_busy = sum(busy)
    bubble = (p * step - total_busy) / total_busy if total_busy > 0 else 0.0
    idle = tuple(step - b - c for b, c in zip(busy, comm))
    events.sort(key=attrgetter("start", "rank"))
    return SimulationResult(step, tuple(busy), tuple(comm), idle, bubble, tuple(peaks),
                            tuple(events))


def _simulate_shared(schedule: PipelineSchedule, durations: Durations, cores: float,
                     replicas: int, efficiency: float = 1.0) -> SimulationResult:
    """:func:`simulate` with the ranks sharing ``cores`` processors (processor sharing), in
    time order: at each event (a compute ends, a message arrives, a rank's posting ends) every
    rank that can move does, then all computing ranks progress at the common rate: 1 while
    ``computing x replicas <= cores``, else ``efficiency x cores / (computing x replicas)``, to
    the next event."""
    import heapq

    p = schedule.num_ranks
    F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                  ActionKind.BACKWARD_WEIGHT)
    compute_time = {F: durations.forward, B: durations.backward, I: durations.backward_input,
                    W: durations.backward_weight}
    clock = [0.0] * p  # when each rank is free (after posting a send or receive)
    pos = [0] * p
    busy = [0.0] * p
    comm = [0.0] * p
    in_flight = [0] * p
    peaks = [0] * p
    deps = _Dependencies(schedule)
    done, posted, ready_time = deps.done, deps.posted, deps.ready_time
    running: dict[int, list] = {}  # rank -> [action, work left, start, work] (own-processor s)
    waiting: dict[int, tuple[Action, float, float]] = {}  # rank -> (action, start, end)
    future: list[float] = []  # event times ahead (arrivals, ends of postings)
    events: list[TimelineEvent] = []
    now = 0.0

    def advance(rank: int) -> bool:
        """Take the rank's actions that can happen at ``now``; True if it moved."""
        actions = schedule.ranks[rank]
        moved = False
        while rank not in running and rank not in waiting and pos[rank] < len(actions) \
                and clock[rank] <= now:
            a = actions[pos[rank]]
            ready = ready_time(rank, a)
            if ready is None or ready > now:
                break
            kind = a.kind
            if kind in compute_time:
                work = max(compute_time[kind][a.stage] - durations.wait(a), 0.0)
                running[rank] = [a, work, now, max(work, 1e-300)]
                if kind is F:
                    in_flight[rank] += 1
                    peaks[rank] = max(peaks[rank], in_flight[rank])
            elif kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
                end = now + durations.send_overhead
                comm[rank] += durations.send_overhead
                transfer = (durations.p2p[a.stage] if kind is ActionKind.SEND_F
                            else durations.p2p_grad[a.stage - 1])
                key = _message_key(a)
                posted[key] = (end + transfer, 0)
                heapq.heappush(future, end + transfer)
                events.append(TimelineEvent(rank, a, now, end))
                clock[rank] = end
            else:  # a receive whose message has arrived
                end = now + durations.send_overhead
                comm[rank] += durations.send_overhead
                done[(a.stage, kind, a.microbatch)] = end
                events.append(TimelineEvent(rank, a, clock[rank], end))
                clock[rank] = end
            if clock[rank] > now:
                heapq.heappush(future, clock[rank])
            pos[rank] += 1
            moved = True
        return moved

    def finish_action(rank: int, a: Action, begin: float) -> None:
        done[(a.stage, a.kind, a.microbatch)] = now
        busy[rank] += now - begin
        events.append(TimelineEvent(rank, a, begin, now))
        if a.kind is B or a.kind is W:
            in_flight[rank] -= 1
        clock[rank] = now

    total = sum(len(r) for r in schedule.ranks)
    while True:
        while any([advance(rank) for rank in range(p)]):
            pass
        if not running and not waiting and all(pos[r] == len(schedule.ranks[r])
                                               for r in range(p)):
            break
        while future and future[0] <= now:
            heapq.heappop(future)
        rate = processor_share(len(running) * replicas, cores, efficiency)
        finish = min((e[1] / rate for e in running.values()), default=float("inf"))
        step = min(finish, (future[0] - now) if future else float("inf"))
        if step == float("inf"):
            blocked = [f"rank {r} at {schedule.ranks[r][pos[r]]}" for r in range(p)
                       if pos[r] < len(schedule.ranks[r])]
            raise ScheduleError("the pipeline schedule deadlocks",
                                expected="every rank's next action to become ready",
                                found="; ".join(blocked),
                                fix="reorder the action lists so that every receive's send and "
                                    "every backward's forward come earlier on their ranks")
        now += step
        for rank in list(waiting):  # waits on peers that are over
            a, begin, end = waiting[rank]
            if end <= now + 1e-12 * max(now, 1e-9):
                del waiting[rank]
                finish_action(rank, a, begin)
        for rank in list(running):
            entry = running[rank]
            entry[1] -= rate * step
            if entry[1] <= 1e-9 * entry[3]:
                a, _, begin, _ = entry
                del running[rank]
                wait = durations.wait(a)
                if wait > 0:  # its peers' arrival: no processor taken
                    waiting[rank] = (a, begin, now + wait)
                    heapq.heappush(future, now + wait)
                else:
                    finish_action(rank, a, begin)
    assert len(events) == total
    step_time = max(max(clock), now)
    total_busy = sum(busy)
    bubble = (p * step_time - total_busy) / total_busy if total_busy > 0 else 0.0
    idle = tuple(step_time - b - c for b, c in zip(busy, comm))
    events.sort(key=attrgetter("start", "rank"))
    return SimulationResult(step_time, tuple(busy), tuple(comm), idle, bubble, tuple(peaks),
                            tuple(events))
