"""Pipeline schedules as data: per-rank action lists with a short text form that round-trips.

An :class:`Action` is ``(stage, kind, micro-batch)`` and prints as ``1F0`` (stage 1 forward of
micro-batch 0), ``3I2`` (input gradient), ``3W2`` (weight gradient), ``2B5`` (full backward),
``0SEND_F4`` / ``1RECV_F4`` (activation to / from the next / previous stage) and ``1SEND_B4`` /
``0RECV_B4`` (gradient to / from the previous / next stage), the spelling of
``torch.distributed.pipelining``. A :class:`PipelineSchedule` is one action list per pipeline
rank; stage ``s`` lives on rank ``s % p`` (with ``v`` stages per rank: Megatron-LM's loop
placement, so rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p``).

The generators (:mod:`autopar.runtime.schedule_builders`, reached through
:func:`autopar.runtime.schedules.build_schedule`) produce compute-only lists;
:func:`add_communication` lowers them by putting a send right after the compute that produces a
tensor for another rank and a receive right before the compute that needs one. Consecutive
send/receive actions form one batch of ``isend/irecv`` in the executor (Megatron's ``send_forward_recv_backward``). The
simulator (:mod:`autopar.runtime.simulator`) runs the lowered lists of every rank without
processes and proves them deadlock-free.

That lowering suits a transport that matches messages by tag (gloo). NCCL matches the messages
between two ranks by their order, and a send of more than its buffers hold waits until the
receiver has posted its receive, behind whatever that rank posted before on its one stream.
``add_communication(schedule, match="order")`` lowers for it: the list above where it passes
both (GPipe, 1F1B, ZB-H1), else every receive posted when its send is, in a lockstep walk of all
ranks (``torch.distributed.pipelining``'s ``_add_send_recv`` does the same), so each link
carries its messages in one order on both ends and every rank's transfers form one global
order (interleaved 1F1B, ZB-V). :meth:`PipelineSchedule.link_order_mismatch` and
:meth:`PipelineSchedule.rendezvous_deadlock` check a lowered list under those semantics without
durations.

The text form, one line per rank::

    # autopar schedule kind=1f1b ranks=2 microbatches=2
    0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from autopar.errors import ScheduleError

if TYPE_CHECKING:
    from autopar.runtime.schedules import ScheduleSpec

__all__ = ["ScheduleKind", "ActionKind", "Action", "PipelineSchedule", "SCHEDULES", "StreamRun",
           "add_communication", "comm_batches", "COMPUTE_KINDS", "COMM_KINDS"]

#: The registry, one :class:`~autopar.runtime.schedules.ScheduleSpec` per schedule; its entries
#: are written by :mod:`autopar.runtime.schedules` (which imports this module, so the action
#: vocabulary and the generators need not import the registry).
SCHEDULES: dict["ScheduleKind", "ScheduleSpec"] = {}


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
        return SCHEDULES[self]  # filled by autopar.runtime.schedules

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
class StreamRun:
    """What :meth:`PipelineSchedule.on_nccl_streams` found: the step's end (None when the lists
    stop) and where each rank stopped, described (None when all finish)."""

    step_time: float | None
    stuck: str | None


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if type(self.kind) is not ActionKind:  # a kind's letter; Enum's lookup costs 1.5 us
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
    #: :attr:`stage_to_rank`, found on first use (a scan of every action: the planner asks it
    #: per rank of each schedule it prices, 176 million dictionary lookups for a 1T GPT's
    #: plan when it was not kept)
    _owners: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

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
        if not self._owners:
            owner: dict[int, int] = {}
            for rank, actions in enumerate(self.ranks):
                for a in actions:
                    owner.setdefault(a.stage, rank)
            object.__setattr__(self, "_owners", tuple(owner[s] for s in range(len(owner))))
        return self._owners

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

    def in_flight(self, rank: int, *, release_at_input: bool = False
                  ) -> list[tuple[int, ...]]:
        """Micro-batches whose activations rank ``rank`` holds after each of its actions, per
        local stage (in :meth:`stages_of` order): forward done, backward (B, or W when split)
        not yet. What the stage partitioner charges activation memory for.
        ``release_at_input``: a split backward's stages run their whole backward in I (full
        recompute: ``PipelineExecutor.runs_whole_at_input``), which frees them there."""
        local = {s: i for i, s in enumerate(self.stages_of(rank))}
        counts = [0] * len(local)
        out = []
        release = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) if release_at_input \
            else (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
        for a in self.ranks[rank]:
            if a.kind is ActionKind.FORWARD:
                counts[local[a.stage]] += 1
            elif a.kind in release:
                counts[local[a.stage]] -= 1
            out.append(tuple(counts))
        return out

    def peak_in_flight(self, rank: int, *, release_at_input: bool = False) -> int:
        return max((sum(c) for c in self.in_flight(rank, release_at_input=release_at_input)),
                   default=0)

    def peak_receives_ahead(self, rank: int) -> int:
        """On lowered lists: the most receives ``rank`` holds posted for a later compute while it
        runs a compute, when each receive is posted where its list puts it and taken by the
        compute that needs it (the executor under ``match="order"``). Each holds a boundary
        tensor (a stage input, or an output's gradient) on top of the activations: 0 where every
        receive comes right before its compute (the lowering for tags); up to p - 1 under
        interleaved 1F1B lowered in send order (:func:`add_communication`)."""
        held: set[Action] = set()
        peak = 0
        for a in self.ranks[rank]:
            if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                held.add(a)
            elif a.kind.is_compute:
                if a.kind is not ActionKind.BACKWARD_WEIGHT:  # W takes no transfer
                    held.discard(Action(a.stage, ActionKind.RECV_F if a.kind is
                                        ActionKind.FORWARD else ActionKind.RECV_B, a.microbatch))
                peak = max(peak, len(held))
        return peak

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
                if not a.kind.is_comm:
                    continue
                link, is_send = _link(a, rank, where)
                forward = a.kind in (ActionKind.SEND_F, ActionKind.RECV_F)
                # the message as (sending stage, direction, micro-batch)
                sender = a.stage if is_send else _sender(a).stage
                (sent if is_send else taken).setdefault(link, []).append(
                    (sender, "F" if forward else "B", a.microbatch))
        for link in sorted(sent):
            for i, (out, got) in enumerate(zip(sent[link], taken.get(link, []))):
                if out != got:
                    return (f"rank {link[0]} sends {out[0]}{out[1]}{out[2]} as message {i} to "
                            f"rank {link[1]}, which takes {got[0]}{got[1]}{got[2]} there")
        return None

    def rendezvous_deadlock(self) -> str | None:
        """Where the lowered lists stop under NCCL's semantics, described; None when every rank
        finishes: :meth:`on_nccl_streams` without durations, each transfer on its own on the
        stream of its pair of ranks (the executor's use of NCCL, ``match="order"``).

        Lists fit for gloo can stop here: under the lowering for tags (p = 2), 1F1B's rank 0
        posts ``0SEND_F1`` before ``0RECV_B0`` on the stream it shares with rank 1, and rank 1
        posts ``1SEND_B0`` before ``1RECV_F1``: each send waits for a receive queued behind the
        other (tests/test_schedules.py). The lowering in send order never stops."""
        return self.on_nccl_streams().stuck

    def on_nccl_streams(self, *, per_pair: bool = True,
                        compute_s: Callable[[Action], float] | None = None,
                        transfer_s: Callable[[Action], float] | None = None) -> "StreamRun":
        """Run the lowered lists under NCCL's semantics (a model; no durations: where they
        stop). ``compute_s(a)``: a compute's seconds; ``transfer_s(a)``: a send's (the time its
        message takes once both ends have started).

        - ``per_pair`` (the executor): each transfer is one operation on the stream of its
          pair of ranks (a two-rank process group per pipeline link, both directions on it).
          Else each run of transfers is one group (``batch_isend_irecv``) on the rank's one
          stream (a group over the pipeline column; also what point-to-point operations
          become on an eagerly initialized process group, which shares one communicator).
        - A stream runs its operations in issue order: one starts once the one before it is
          complete and the computes issued before it are done (NCCL's stream waits for the
          compute stream at issue); it completes once the operation holding each of its
          messages' other end has started, plus the transfer: a send may not complete before
          its receive is posted (a message larger than NCCL's buffers, as activations are), and
          the i-th send on a link matches the i-th receive.
        - The computes run in list order, each once its receive is complete.
        """
        lowered = add_communication(self)
        where = lowered.stage_to_rank
        compute_s = compute_s or (lambda a: 0.0)
        counted: dict[tuple[tuple[int, int], bool], int] = {}
        # per rank: its computes in order, each with the group of its receive and its seconds
        computes: list[list[tuple[Action, int | None, float]]] = []
        # per group: (rank, computes issued before it, its transfers)
        groups: list[tuple[int, int, list[tuple[tuple[tuple[int, int], int, bool], float,
                                                Action]]]] = []
        streams: dict[tuple, list[int]] = {}
        home: dict[tuple[tuple[int, int], int, bool], int] = {}  # message end -> its group
        for rank, actions in enumerate(lowered.ranks):
            mine: list[tuple[Action, int | None, float]] = []
            received: dict[Action, int] = {}
            for run in comm_batches(actions):
                if not run[0].kind.is_comm:
                    a = run[0]
                    needs, _ = _crossings(a, rank, where)
                    mine.append((a, received.get(needs) if needs is not None else None,
                                 compute_s(a)))
                    continue
                for part in ([[a] for a in run] if per_pair else [run]):
                    g = len(groups)
                    ends = []
                    for a in part:
                        link, is_send = _link(a, rank, where)
                        n = counted.get((link, is_send), 0)
                        counted[(link, is_send)] = n + 1
                        home[(link, n, is_send)] = g
                        if not is_send:
                            received[a] = g
                        seconds = transfer_s(a if is_send else _sender(a)) \
                            if transfer_s is not None else 0.0
                        ends.append(((link, n, is_send), seconds, a))
                    key = (rank, min(link), max(link)) if per_pair else (rank,)
                    streams.setdefault(key, []).append(g)
                    groups.append((rank, len(mine), ends))
            computes.append(mine)
        # Event-driven: a stream is tried again when its rank's computes advance, when the
        # group holding one of its head's messages' other end starts, and when its own head
        # completes; a rank's computes when one of its groups completes. Each try moves as far
        # as it can, so the work is linear in the actions (where rescanning every stream and
        # rank until nothing moved was not). The times are maxima over a fixed graph of waits:
        # the order of the tries does not change them.
        key_of: list[tuple] = [()] * len(groups)
        for key, queue in streams.items():
            for g in queue:
                key_of[g] = key
        rank_streams: dict[int, list[tuple]] = {}
        for key, queue in streams.items():
            rank_streams.setdefault(groups[queue[0]][0], []).append(key)
        ended: list[list[float]] = [[] for _ in computes]  # each rank's computes' end times
        start: dict[int, float] = {}
        complete: dict[int, float] = {}
        heads = {key: 0 for key in streams}
        todo: list[tuple] = [("stream", key) for key in streams] + \
            [("rank", r) for r in range(len(computes))]
        while todo:
            what, item = todo.pop()
            if what == "stream":
                key, queue = item, streams[item]
                free = complete[queue[heads[key] - 1]] if heads[key] else 0.0
                while heads[key] < len(queue):
                    g = queue[heads[key]]
                    rank, before, ends = groups[g]
                    if g not in start:
                        if len(ended[rank]) < before:
                            break
                        start[g] = max(free, ended[rank][before - 1] if before else 0.0)
                        for (link, n, is_send), _, _ in ends:  # their other ends may complete
                            other = home.get((link, n, not is_send))
                            if other is not None and key_of[other] != key:
                                todo.append(("stream", key_of[other]))
                    finish = start[g]
                    for (link, n, is_send), seconds, _ in ends:
                        began = start.get(home.get((link, n, not is_send), -1))
                        if began is None:
                            break
                        finish = max(finish, max(start[g], began) + seconds)
                    else:
                        free = complete[g] = finish
                        heads[key] += 1
                        todo.append(("rank", rank))
                        continue
                    break
            else:
                rank, mine, done = item, computes[item], ended[item]
                ran = False
                while len(done) < len(mine):
                    a, receive, seconds = mine[len(done)]
                    if receive is not None and receive not in complete:
                        break
                    begin = max(done[-1] if done else 0.0,
                                complete[receive] if receive is not None else 0.0)
                    done.append(begin + seconds)
                    ran = True
                if ran:
                    todo.extend(("stream", key) for key in rank_streams.get(rank, ()))
        stuck = []
        for rank, mine in enumerate(computes):
            waiting = [" ".join(str(a) for _, _, a in groups[q[heads[key]]][2])
                       for key, q in streams.items() if key[0] == rank and heads[key] < len(q)]
            if len(ended[rank]) < len(mine) or waiting:
                at = str(mine[len(ended[rank])][0]) if len(ended[rank]) < len(mine) else "the end"
                stuck.append(f"rank {rank} at {at}, transfers waiting: "
                             f"{' '.join(waiting) or 'none'}")
        step = max([t for done in ended for t in done] + list(complete.values()), default=0.0)
        return StreamRun(None if stuck else step, "; ".join(stuck) if stuck else None)

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
# Lowering: sends and receives
# ---------------------------------------------------------------------------------------------

def add_communication(schedule: PipelineSchedule, *, match: str = "tag") -> PipelineSchedule:
    """Insert SEND/RECV actions for every tensor that crosses ranks.

    A send goes right after the compute that produces the tensor (sends never block the sender).
    ``match="tag"`` (gloo, which matches the executor's tags): a receive right before the
    compute that needs it; between two computes the sends of the first come before the receives
    of the second, so the executor batches them into one ``batch_isend_irecv``.
    ``match="order"`` (NCCL, which pairs a link's messages by their order and lets a large send
    complete only once its receive is posted): each receive where its send is posted
    (:func:`_lower_in_send_order`), every link's messages in one order on both ends, which the
    executor runs one operation at a time on a stream per pair of ranks
    (:meth:`PipelineSchedule.rendezvous_deadlock`).
    Stages on the same rank hand tensors over locally. A schedule that has its transfers
    already is returned as it is (under ``"order"``, if it passes both checks).
    """
    if match not in ("tag", "order"):
        raise ScheduleError(f"unknown message matching {match!r}", expected="'tag' or 'order'")
    if match == "order":
        if schedule.has_communication and schedule.link_order_mismatch() is None \
                and schedule.rendezvous_deadlock() is None:
            return schedule
        return _lower_in_send_order(schedule.compute_only())
    if schedule.has_communication:
        return schedule
    where = schedule.stage_to_rank
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        out: list[Action] = []
        for a in actions:
            receive, send = _crossings(a, rank, where)
            out += [x for x in (receive, a, send) if x is not None]
        ranks.append(tuple(_sends_first(out)))
    return PipelineSchedule(tuple(ranks), schedule.num_microbatches, schedule.kind)


def _lower_in_send_order(schedule: PipelineSchedule) -> PipelineSchedule:
    """The lowering for transports that match by order: walk the ranks in lockstep, each taking
    its next compute once its input is posted; a compute's send is appended after it, and its
    receive to the receiving rank's list at the same moment. The compute order of every rank is
    the schedule's; each link's receives come in the order of its sends, and every rank's
    transfers follow one global order, so no cycle of waits can form under NCCL's semantics
    (:meth:`PipelineSchedule.rendezvous_deadlock`; checked for every generated schedule in
    tests/test_schedules.py). The receives come early: the executor waits for each when its
    compute needs it."""
    where = schedule.stage_to_rank
    todo = [list(actions) for actions in schedule.ranks]
    nxt = [0] * len(todo)
    out: list[list[Action]] = [[] for _ in todo]
    posted: set[Action] = set()  # the receives appended so far
    while any(n < len(actions) for n, actions in zip(nxt, todo)):
        moved = False
        for rank, actions in enumerate(todo):
            if nxt[rank] == len(actions):
                continue
            a = actions[nxt[rank]]
            needs, send = _crossings(a, rank, where)
            if needs is not None and needs not in posted:
                continue
            nxt[rank] += 1
            moved = True
            out[rank].append(a)
            if send is not None:
                out[rank].append(send)
                receive = _receiver(send)
                out[where[receive.stage]].append(receive)
                posted.add(receive)
        if not moved:
            stuck = [f"rank {r}: {todo[r][nxt[r]]}" for r in range(len(todo))
                     if nxt[r] < len(todo[r])]
            raise ScheduleError("the schedule deadlocks: no rank can take its next compute",
                                found="; ".join(stuck),
                                fix="every compute needs a tensor an earlier compute sends")
    return PipelineSchedule(tuple(map(tuple, out)), schedule.num_microbatches, schedule.kind)


def _crossings(a: Action, rank: int, where: Sequence[int]) -> tuple[Action | None, Action | None]:
    """The receive compute ``a`` on ``rank`` needs first and the send that follows it: its
    input from, or its output to, a stage on another rank (None where none crosses)."""
    s, mb, last = a.stage, a.microbatch, len(where) - 1
    if a.kind is ActionKind.FORWARD:
        return (Action(s, ActionKind.RECV_F, mb) if s > 0 and where[s - 1] != rank else None,
                Action(s, ActionKind.SEND_F, mb) if s < last and where[s + 1] != rank else None)
    if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
        return (Action(s, ActionKind.RECV_B, mb) if s < last and where[s + 1] != rank else None,
                Action(s, ActionKind.SEND_B, mb) if s > 0 and where[s - 1] != rank else None)
    return None, None


def _sender(receive: Action) -> Action:
    """The send whose message ``receive`` takes."""
    if receive.kind is ActionKind.RECV_F:
        return Action(receive.stage - 1, ActionKind.SEND_F, receive.microbatch)
    return Action(receive.stage + 1, ActionKind.SEND_B, receive.microbatch)


def _receiver(send: Action) -> Action:
    """The receive that takes ``send``'s message."""
    if send.kind is ActionKind.SEND_F:
        return Action(send.stage + 1, ActionKind.RECV_F, send.microbatch)
    return Action(send.stage - 1, ActionKind.RECV_B, send.microbatch)


def _link(a: Action, rank: int, where: Sequence[int]) -> tuple[tuple[int, int], bool]:
    """The link (sending rank, receiving rank) a transfer on ``rank`` uses, and whether it is
    the sending end."""
    if a.kind is ActionKind.SEND_F:
        return (rank, where[a.stage + 1]), True
    if a.kind is ActionKind.SEND_B:
        return (rank, where[a.stage - 1]), True
    if a.kind is ActionKind.RECV_F:
        return (where[a.stage - 1], rank), False
    return (where[a.stage + 1], rank), False


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
