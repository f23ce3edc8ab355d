"""Pipeline schedules as data: per-rank action lists with a short text form that round-trips.

An :class:`Action` is ``(stage, kind, micro-batch)`` and prints as ``1F0`` (stage 1 forward of
micro-batch 0), ``3I2`` (input gradient), ``3W2`` (weight gradient), ``2B5`` (full backward),
``0SEND_F4`` / ``1RECV_F4`` (activation to / from the next / previous stage) and ``1SEND_B4`` /
``0RECV_B4`` (gradient to / from the previous / next stage), the spelling of
``torch.distributed.pipelining``. A :class:`PipelineSchedule` is one action list per pipeline
rank; stage ``s`` lives on rank ``s % p`` (with ``v`` stages per rank: Megatron-LM's loop
placement, so rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p``).

Generators (:func:`build_schedule`) produce compute-only lists; :func:`add_communication`
lowers them by putting a send right after the compute that produces a tensor for another rank and
a receive right before the compute that needs one. Consecutive send/receive actions form one
batch of ``isend/irecv`` in the executor (Megatron's ``send_forward_recv_backward``). The
simulator (:mod:`autopar.runtime.simulator`) runs the lowered lists of every rank without
processes and proves them deadlock-free.

The text form, one line per rank::

    # autopar schedule kind=1f1b ranks=2 microbatches=2
    0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from autopar.errors import ScheduleError

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


class ScheduleKind(str, enum.Enum):
    """Pipeline schedules (the value is the CLI spelling). Each has one :class:`ScheduleSpec`
    in :data:`SCHEDULES`, which everything else reads."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"

    @property
    def spec(self) -> "ScheduleSpec":
        return SCHEDULES[self]

    @property
    def interleaved(self) -> bool:
        """Whether the schedule runs several stages (chunks) per rank."""
        return SCHEDULES[self].min_virtual_stages > 1


class ActionKind(str, enum.Enum):
    """What one action does (the value is its text spelling)."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # gradient of the stage's inputs only (zero-bubble)
    BACKWARD_WEIGHT = "W"  # gradient of the stage's weights (zero-bubble, deferred)
    SEND_F = "SEND_F"  # stage s sends its output to stage s + 1
    RECV_F = "RECV_F"  # stage s receives its input from stage s - 1
    SEND_B = "SEND_B"  # stage s sends its input gradient to stage s - 1
    RECV_B = "RECV_B"  # stage s receives its output gradient from stage s + 1

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self in COMM_KINDS


COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                           ActionKind.BACKWARD_WEIGHT})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B,
                        ActionKind.RECV_B})

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"action {self.stage}{self.kind.value}{self.microbatch} has a "
                                f"negative index", expected="stage >= 0 and micro-batch >= 0")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot read action {text!r}",
                                expected="STAGE KIND MICROBATCH, e.g. 1F0, 3I2, 0SEND_F4",
                                found=repr(text))
        return cls(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


def _F(stage: int, mb: int) -> Action:
    return Action(stage, ActionKind.FORWARD, mb)


def _B(stage: int, mb: int, kind: ActionKind = ActionKind.BACKWARD) -> Action:
    return Action(stage, kind, mb)


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """One action list per pipeline rank. Validated on construction.

    ``kind`` is the generator that made it (None for a hand-written or parsed custom schedule).
    Stages must be numbered 0..S-1, each on exactly one rank; every (stage, micro-batch) has one
    forward and either one full backward or one input- and one weight-gradient action, in a valid
    order on its rank.
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    kind: ScheduleKind | None = None

    def __post_init__(self) -> None:
        ranks = tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in actions)
                      for actions in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if self.kind is not None:
            object.__setattr__(self, "kind", ScheduleKind(self.kind))
        if not ranks:
            raise ScheduleError("a schedule needs at least one rank", found="no action lists")
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ScheduleError("a schedule needs at least one micro-batch",
                                found=f"num_microbatches={self.num_microbatches!r}")
        self._validate()

    # -- derived ----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        owner: dict[int, int] = {}
        for rank, actions in enumerate(self.ranks):
            for a in actions:
                owner.setdefault(a.stage, rank)
        return tuple(owner[s] for s in range(len(owner)))

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @property
    def has_communication(self) -> bool:
        return any(a.kind.is_comm for actions in self.ranks for a in actions)

    @property
    def splits_backward(self) -> bool:
        return any(a.kind is ActionKind.BACKWARD_WEIGHT for actions in self.ranks for a in actions)

    def in_flight(self, rank: int) -> list[tuple[int, ...]]:
        """Micro-batches whose activations rank ``rank`` holds after each of its actions, per
        local stage (in :meth:`stages_of` order): forward done, backward (B, or W when split)
        not yet. What the stage partitioner charges activation memory for."""
        local = {s: i for i, s in enumerate(self.stages_of(rank))}
        counts = [0] * len(local)
        out = []
        for a in self.ranks[rank]:
            if a.kind is ActionKind.FORWARD:
                counts[local[a.stage]] += 1
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                counts[local[a.stage]] -= 1
            out.append(tuple(counts))
        return out

    def peak_in_flight(self, rank: int) -> int:
        return max((sum(c) for c in self.in_flight(rank)), default=0)

    def link_order_mismatch(self) -> str | None:
        """The first link (sending rank -> receiving rank) whose receiver takes its messages in
        another order than the sender sends them, described; None when every link agrees.
        NCCL matches point-to-point messages between two ranks by their order (it ignores
        tags), so a schedule run over NCCL needs None; gloo matches the executor's tags."""
        lowered = add_communication(self)
        where = lowered.stage_to_rank
        sent: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
        taken: dict[tuple[int, int], list[tuple[int, str, int]]] = {}
        for rank, actions in enumerate(lowered.ranks):
            for a in actions:
                s, mb = a.stage, a.microbatch
                if a.kind is ActionKind.SEND_F:
                    sent.setdefault((rank, where[s + 1]), []).append((s, "F", mb))
                elif a.kind is ActionKind.SEND_B:
                    sent.setdefault((rank, where[s - 1]), []).append((s, "B", mb))
                elif a.kind is ActionKind.RECV_F:
                    taken.setdefault((where[s - 1], rank), []).append((s - 1, "F", mb))
                elif a.kind is ActionKind.RECV_B:
                    taken.setdefault((where[s + 1], rank), []).append((s + 1, "B", mb))
        for link in sorted(sent):
            for i, (out, got) in enumerate(zip(sent[link], taken.get(link, []))):
                if out != got:
                    return (f"rank {link[0]} sends {out[0]}{out[1]}{out[2]} as message {i} to "
                            f"rank {link[1]}, which takes {got[0]}{got[1]}{got[2]} there")
        return None

    def compute_only(self) -> "PipelineSchedule":
        return PipelineSchedule(tuple(tuple(a for a in actions if a.kind.is_compute)
                                      for actions in self.ranks), self.num_microbatches, self.kind)

    # -- text form ------------------------------------------------------------------------
    def to_text(self) -> str:
        kind = self.kind.value if self.kind is not None else "custom"
        lines = [f"# autopar schedule kind={kind} ranks={self.num_ranks} "
                 f"microbatches={self.num_microbatches}"]
        lines += [f"{rank}: " + " ".join(str(a) for a in actions)
                  for rank, actions in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "PipelineSchedule":
        header: dict[str, str] = {}
        rows: dict[int, tuple[Action, ...]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                header.update(dict(re.findall(r"(\w+)=(\S+)", line)))
                continue
            rank_text, sep, body = line.partition(":")
            if not sep or not rank_text.strip().isdigit():
                raise ScheduleError(f"line {lineno} of a schedule has no rank",
                                    expected="RANK: ACTION ACTION ...", found=repr(raw))
            rows[int(rank_text)] = tuple(Action.parse(tok) for tok in body.split())
        if sorted(rows) != list(range(len(rows))):
            raise ScheduleError("schedule ranks are not numbered 0..p-1", found=str(sorted(rows)))
        written = header.get("microbatches")
        mbs = int(written) if written is not None else 1 + max(
            (a.microbatch for r in rows.values() for a in r), default=0)
        kind = header.get("kind", "custom")
        return cls(tuple(rows[r] for r in range(len(rows))), mbs,
                   None if kind == "custom" else ScheduleKind(kind))

    def __str__(self) -> str:
        return self.to_text()

    # -- validation ---------------------------------------------------------------------------
    def _validate(self) -> None:
        owner: dict[int, int] = {}
        for rank, actions in enumerate(self.ranks):
            for a in actions:
                if owner.setdefault(a.stage, rank) != rank:
                    raise ScheduleError(f"stage {a.stage} has actions on ranks {owner[a.stage]} "
                                        f"and {rank}", expected="each stage on exactly one rank",
                                        found=f"action {a} on rank {rank}")
        num_stages = len(owner)
        if sorted(owner) != list(range(num_stages)):
            raise ScheduleError("stages are not numbered 0..S-1", found=str(sorted(owner)))
        if num_stages % len(self.ranks):
            raise ScheduleError("every rank must hold the same number of stages",
                                found=f"{num_stages} stages on {len(self.ranks)} ranks")
        m = self.num_microbatches
        last = num_stages - 1
        for rank, actions in enumerate(self.ranks):
            counts = Counter((a.stage, a.kind, a.microbatch) for a in actions)
            dup = [k for k, c in counts.items() if c > 1]
            if dup:
                s, k, mb = dup[0]
                raise ScheduleError(f"action {s}{k.value}{mb} appears {counts[dup[0]]} times on "
                                    f"rank {rank}", expected="each action once")
            seen: set[tuple[int, ActionKind, int]] = set()
            for a in actions:
                if a.microbatch >= m:
                    raise ScheduleError(f"action {a} on rank {rank} names micro-batch "
                                        f"{a.microbatch}", expected=f"micro-batches 0..{m - 1}")
                if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
                    if (a.stage, ActionKind.FORWARD, a.microbatch) not in seen:
                        raise ScheduleError(f"backward {a} on rank {rank} comes before its "
                                            f"forward", expected=f"{a.stage}F{a.microbatch} first")
                if a.kind is ActionKind.BACKWARD_WEIGHT:
                    if (a.stage, ActionKind.BACKWARD_INPUT, a.microbatch) not in seen:
                        raise ScheduleError(f"weight gradient {a} on rank {rank} comes before its "
                                            f"input gradient",
                                            expected=f"{a.stage}I{a.microbatch} first")
                if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) and a.stage == last:
                    raise ScheduleError(f"{a}: the last stage has no next stage")
                if a.kind in (ActionKind.RECV_F, ActionKind.SEND_B) and a.stage == 0:
                    raise ScheduleError(f"{a}: the first stage has no previous stage")
                seen.add((a.stage, a.kind, a.microbatch))
            for stage in (s for s, r in owner.items() if r == rank):
                for mb in range(m):
                    f = counts[(stage, ActionKind.FORWARD, mb)]
                    full = counts[(stage, ActionKind.BACKWARD, mb)]
                    i = counts[(stage, ActionKind.BACKWARD_INPUT, mb)]
                    w = counts[(stage, ActionKind.BACKWARD_WEIGHT, mb)]
                    if f != 1 or not ((full, i, w) == (1, 0, 0) or (full, i, w) == (0, 1, 1)):
                        raise ScheduleError(
                            f"stage {stage} micro-batch {mb} on rank {rank} is incomplete",
                            expected="one F and either one B or one I and one W",
                            found=f"F x{f}, B x{full}, I x{i}, W x{w}",
                            fix="every micro-batch must go forward and backward once per stage")


# ---------------------------------------------------------------------------------------------
# Generators (compute-only lists)
# ---------------------------------------------------------------------------------------------

def _check(p: int, m: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ScheduleError("a pipeline needs at least one rank", found=f"p={p!r}")
    if not isinstance(m, int) or m < 1:
        raise ScheduleError("a pipeline needs at least one micro-batch", found=f"m={m!r}")


def gpipe(p: int, m: int) -> PipelineSchedule:
    """GPipe: every forward, then every backward. Each stage holds all m micro-batches."""
    _check(p, m)
    ranks = tuple(tuple(_F(r, mb) for mb in range(m)) + tuple(_B(r, mb) for mb in range(m))
                  for r in range(p))
    return PipelineSchedule(ranks, m, ScheduleKind.GPIPE)


def _one_f_one_b_rank(r: int, p: int, m: int, kind: ActionKind) -> list[Action]:
    warmup = min(p - 1 - r, m)
    out = [_F(r, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        out += [_F(r, warmup + i), _B(r, i, kind)]
    out += [_B(r, mb, kind) for mb in range(m - warmup, m)]
    return out


def one_f_one_b(p: int, m: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): rank r runs p - 1 - r warm-up forwards, then alternates one
    forward and one backward, so stage r keeps at most p - r micro-batches in flight."""
    _check(p, m)
    return PipelineSchedule(tuple(tuple(_one_f_one_b_rank(r, p, m, ActionKind.BACKWARD))
                                  for r in range(p)), m, ScheduleKind.ONE_F_ONE_B)


def interleaved_1f1b(p: int, v: int, m: int) -> PipelineSchedule:
    """Interleaved 1F1B (Narayanan et al. 2021): v stages per rank (stage c*p + r on rank r).

    Forwards go through the chunks in rounds of p micro-batches (chunk 0 for micro-batches 0..p-1,
    chunk 1 for the same, ...); backwards through the chunks in reverse. Rank r warms up with
    2 (p - r - 1) + (v - 1) p forwards, then alternates. Needs m divisible by p.
    """
    _check(p, m)
    if not isinstance(v, int) or v < 2:
        raise ScheduleError("interleaved 1F1B needs at least two stages per rank",
                            found=f"v={v!r}", fix="use v >= 2, or the 1f1b schedule")
    if m % p:
        raise ScheduleError("interleaved 1F1B needs the micro-batch count divisible by the "
                            "pipeline size", expected=f"m a multiple of p={p}", found=f"m={m}",
                            fix=f"use m={p * max(1, round(m / p))}")
    total = m * v

    def mb_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    ranks = []
    for r in range(p):
        def fwd(k: int) -> Action:
            return _F(((k // p) % v) * p + r, mb_of(k))

        def bwd(k: int) -> Action:
            return _B((v - 1 - (k // p) % v) * p + r, mb_of(k))

        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        out = [fwd(k) for k in range(warmup)]
        for i in range(total - warmup):
            out += [fwd(warmup + i), bwd(i)]
        out += [bwd(k) for k in range(total - warmup, total)]
        ranks.append(tuple(out))
    return PipelineSchedule(tuple(ranks), m, ScheduleKind.INTERLEAVED_1F1B)


def zb_h1(p: int, m: int) -> PipelineSchedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split
    into the input gradient I (on the critical path) and the weight gradient W (not). Rank r
    defers its W by r micro-batches, so the W's fill the cool-down bubble; in-flight activations
    stay at most p on every rank (1F1B's peak). Bubble (p-1)(F + I - W) instead of
    (p-1)(F + I + W)."""
    _check(p, m)
    ranks = []
    for r in range(p):
        compute = _one_f_one_b_rank(r, p, m, ActionKind.BACKWARD_INPUT)
        out: list[Action] = []
        done_inputs = 0
        next_weight = 0
        for a in compute:
            out.append(a)
            if a.kind is ActionKind.BACKWARD_INPUT:
                done_inputs += 1
                if done_inputs > r:
                    out.append(_B(r, next_weight, ActionKind.BACKWARD_WEIGHT))
                    next_weight += 1
        out += [_B(r, mb, ActionKind.BACKWARD_WEIGHT) for mb in range(next_weight, m)]
        ranks.append(tuple(out))
    return PipelineSchedule(tuple(ranks), m, ScheduleKind.ZB_H1)


def zb_v(p: int, m: int) -> PipelineSchedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): two stages per rank
    placed in a V (rank r runs stage r and stage 2p - 1 - r, so the first rank also runs the last
    stage and the loss), the backward split into I and W. With F = I = W per stage the bubble is
    (p - 1) F, half of ZB-H1's at the same peak memory: 2p stage-micro-batches in flight, 1F1B's
    first rank's p micro-batches.

    The lists come from list scheduling at unit times (F = I = W = 1, the case the paper's
    hand-made schedule is built for): every rank, when free, runs the first ready action of
    chunk 1's forward, chunk 0's input gradient, chunk 0's forward (at most 2p chunk-micro-batches
    in flight), chunk 1's input gradient, the oldest weight gradient; while forwards remain, an
    input gradient is followed by its weight gradient (the steady state F-I-W of the paper, which
    keeps the lists robust when I and W differ). The resulting order is deadlock-free for any
    durations (it is a topological order of the dependencies); the simulator checks it."""
    _check(p, m)
    stages = 2 * p
    cap = 2 * p
    forward_done: dict[tuple[int, int], int] = {}
    input_done: dict[tuple[int, int], int] = {}
    next_f = [0] * stages
    next_i = [0] * stages
    next_w = [0] * stages
    in_flight = [0] * p
    owed: list[Action | None] = [None] * p
    busy_until = [0] * p
    lists: list[list[Action]] = [[] for _ in range(p)]
    never = 1 << 62

    def ready(t: int, r: int) -> Action | None:
        first, second = r, stages - 1 - r
        for kind, s in ((ActionKind.FORWARD, second), (ActionKind.BACKWARD_INPUT, first),
                        (ActionKind.FORWARD, first), (ActionKind.BACKWARD_INPUT, second)):
            if kind is ActionKind.FORWARD:
                k = next_f[s]
                if k < m and in_flight[r] < cap and (
                        s == 0 or forward_done.get((s - 1, k), never) <= t):
                    return Action(s, kind, k)
            else:
                k = next_i[s]
                if k < m and forward_done.get((s, k), never) <= t and (
                        s == stages - 1 or input_done.get((s + 1, k), never) <= t):
                    return Action(s, kind, k)
        pending = [(input_done[(s, next_w[s])], s) for s in (second, first)
                   if next_w[s] < next_i[s]]
        if pending:
            _, s = min(pending)
            return Action(s, ActionKind.BACKWARD_WEIGHT, next_w[s])
        return None

    t, remaining = 0, 3 * m * stages
    while remaining:
        for r in range(p):
            if busy_until[r] > t:
                continue
            a, owed[r] = owed[r] or ready(t, r), None
            if a is None:
                continue
            lists[r].append(a)
            busy_until[r] = t + 1
            remaining -= 1
            s, k = a.stage, a.microbatch
            if a.kind is ActionKind.FORWARD:
                forward_done[(s, k)] = t + 1
                next_f[s] += 1
                in_flight[r] += 1
            elif a.kind is ActionKind.BACKWARD_INPUT:
                input_done[(s, k)] = t + 1
                next_i[s] += 1
                forwards_left = next_f[r] < m or next_f[stages - 1 - r] < m
                if forwards_left and next_w[s] == k:
                    owed[r] = Action(s, ActionKind.BACKWARD_WEIGHT, k)
            else:
                next_w[s] += 1
                in_flight[r] -= 1
        t += 1
        assert t <= 8 * m * stages + 4 * p, "ZB-V list scheduling made no progress"
    return PipelineSchedule(tuple(tuple(actions) for actions in lists), m, ScheduleKind.ZB_V)


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


def _zb_h1_in_flight(p: int, v: int, m: int, rank: int) -> float:
    """p on every rank: rank r defers its weight gradients by r micro-batches, and the executor
    holds a micro-batch's activations until its W (Qi et al. 2024: 1F1B's peak)."""
    return float(min(p, m)) if p > 1 else 1.0


#: Every schedule autopar plans, simulates and runs. Adding one is one entry here and its tests.
SCHEDULES: dict[ScheduleKind, ScheduleSpec] = {spec.kind: spec for spec in (
    ScheduleSpec(ScheduleKind.GPIPE, lambda p, m, v: gpipe(p, m),
                 "every forward, then every backward (Huang et al. 2019)",
                 StageILPForm.PHASED, _gpipe_in_flight),
    ScheduleSpec(ScheduleKind.ONE_F_ONE_B, lambda p, m, v: one_f_one_b(p, m),
                 "one forward, one backward after a warm-up (PipeDream-Flush, Narayanan et al. "
                 "2021)", StageILPForm.LOOPED, _one_f_one_b_in_flight),
    ScheduleSpec(ScheduleKind.INTERLEAVED_1F1B, lambda p, m, v: interleaved_1f1b(p, v, m),
                 "1F1B over v chunks per rank (Narayanan et al. 2021)",
                 StageILPForm.INTERLEAVED, _interleaved_in_flight, min_virtual_stages=2,
                 max_virtual_stages=None, micro_batches_divisible_by_pp=True),
    ScheduleSpec(ScheduleKind.ZB_H1, lambda p, m, v: zb_h1(p, m),
                 "1F1B with the weight gradient deferred into the bubble (Qi et al. 2024)",
                 StageILPForm.LOOPED, _zb_h1_in_flight, splits_backward=True),
    ScheduleSpec(ScheduleKind.ZB_V, lambda p, m, v: zb_v(p, m),
                 "two chunks per rank in a V, the weight gradient in the bubble (Qi et al. 2024, "
                 "section 6)", StageILPForm.V_SHAPE, _zb_v_in_flight, splits_backward=True,
                 min_virtual_stages=2, max_virtual_stages=2, placement=StagePlacement.V),
)}


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
    _check(num_ranks, num_microbatches)
    if spec.max_virtual_stages == 1 and stages_per_rank != 1:
        raise ScheduleError(f"{spec.kind.value} runs one stage per rank",
                            found=f"stages_per_rank={stages_per_rank}",
                            fix="use interleaved-1f1b for several stages per rank")
    schedule = spec.build(num_ranks, num_microbatches, stages_per_rank)
    return add_communication(schedule) if communication else schedule


# ---------------------------------------------------------------------------------------------
# Lowering: sends and receives
# ---------------------------------------------------------------------------------------------

def add_communication(schedule: PipelineSchedule) -> PipelineSchedule:
    """Insert SEND/RECV actions for every tensor that crosses ranks.

    A send goes right after the compute that produces the tensor (sends never block the sender);
    a receive right before the compute that needs it. Between two computes the sends of the first
    come before the receives of the second, so the executor batches them into one
    ``batch_isend_irecv``. Stages on the same rank hand tensors over locally.
    """
    if schedule.has_communication:
        return schedule
    where = schedule.stage_to_rank
    last = len(where) - 1
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        out: list[Action] = []
        for a in actions:
            s, mb = a.stage, a.microbatch
            if a.kind is ActionKind.FORWARD and s > 0 and where[s - 1] != rank:
                out.append(Action(s, ActionKind.RECV_F, mb))
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s < last \
                    and where[s + 1] != rank:
                out.append(Action(s, ActionKind.RECV_B, mb))
            out.append(a)
            if a.kind is ActionKind.FORWARD and s < last and where[s + 1] != rank:
                out.append(Action(s, ActionKind.SEND_F, mb))
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s > 0 \
                    and where[s - 1] != rank:
                out.append(Action(s, ActionKind.SEND_B, mb))
        ranks.append(tuple(_sends_first(out)))
    return PipelineSchedule(tuple(ranks), schedule.num_microbatches, schedule.kind)


def _sends_first(actions: Sequence[Action]) -> list[Action]:
    """Within each run of consecutive communication actions, sends before receives."""
    out: list[Action] = []
    run: list[Action] = []
    for a in list(actions) + [None]:  # type: ignore[list-item]
        if a is not None and a.kind.is_comm:
            run.append(a)
            continue
        out += [x for x in run if x.kind in (ActionKind.SEND_F, ActionKind.SEND_B)]
        out += [x for x in run if x.kind in (ActionKind.RECV_F, ActionKind.RECV_B)]
        run = []
        if a is not None:
            out.append(a)
    return out


def comm_batches(actions: Iterable[Action]) -> list[list[Action]]:
    """Group a rank's list into runs: each compute alone, each run of comm actions together."""
    out: list[list[Action]] = []
    for a in actions:
        if a.kind.is_comm and out and out[-1][0].kind.is_comm:
            out[-1].append(a)
        else:
            out.append([a])
    return out
