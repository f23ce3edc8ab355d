"""The generators of :mod:`autopar.runtime.schedules`: each returns a schedule's compute-only
action lists for p ranks and m micro-batches (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V); the
registry (``SCHEDULES``) names them and :func:`~autopar.runtime.schedules.build_schedule` lowers
them with sends and receives."""

from __future__ import annotations

from autopar.errors import ScheduleError
from autopar.runtime.pipeline_actions import Action, ActionKind, PipelineSchedule, ScheduleKind

__all__ = ["check_counts", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_v"]


def _F(stage: int, mb: int) -> Action:
    return Action(stage, ActionKind.FORWARD, mb)


def _B(stage: int, mb: int, kind: ActionKind = ActionKind.BACKWARD) -> Action:
    return Action(stage, kind, mb)


# ---------------------------------------------------------------------------------------------
# Generators (compute-only lists)
# ---------------------------------------------------------------------------------------------

def check_counts(p: int, m: int) -> None:
    """A pipeline of ``p`` ranks and ``m`` micro-batches: both positive integers."""
    if not isinstance(p, int) or p < 1:
        raise ScheduleError("a pipeline needs at least one rank", found=f"p={p!r}")
    if not isinstance(m, int) or m < 1:
        raise ScheduleError("a pipeline needs at least one micro-batch", found=f"m={m!r}")


def gpipe(p: int, m: int) -> PipelineSchedule:
    """GPipe: every forward, then every backward. Each stage holds all m micro-batches."""
    check_counts(p, m)
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
    check_counts(p, m)
    return PipelineSchedule(tuple(tuple(_one_f_one_b_rank(r, p, m, ActionKind.BACKWARD))
                                  for r in range(p)), m, ScheduleKind.ONE_F_ONE_B)


def interleaved_1f1b(p: int, v: int, m: int) -> PipelineSchedule:
    """Interleaved 1F1B (Narayanan et al. 2021): v stages per rank (stage c*p + r on rank r).

    Forwards go through the chunks in rounds of p micro-batches (chunk 0 for micro-batches 0..p-1,
    chunk 1 for the same, ...); backwards through the chunks in reverse. Rank r warms up with
    2 (p - r - 1) + (v - 1) p forwards, then alternates. Needs m divisible by p.
    """
    check_counts(p, m)
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
    check_counts(p, m)
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

    From m = 2p - 1 micro-batches on, the paper's hand-made lists (:func:`_zb_v_paper`), which
    need that many to fill the V; below, lists from list scheduling (:func:`_zb_v_listed`).
    Both are deadlock-free for any durations (topological orders of the dependencies; the
    simulator checks them). Where both exist, the paper's were never slower in the simulator
    (7 duration profiles, p = 2..8, m = 2p - 1..8p: up to 5% faster when the last stage or I
    is heavier) and measured 1-3% faster on gloo (benchmarks/README.md, "Pipeline")."""
    check_counts(p, m)
    return _zb_v_paper(p, m) if m >= 2 * p - 1 else _zb_v_listed(p, m)


def _zb_v_paper(p: int, m: int) -> PipelineSchedule:
    """The paper's ZB-V lists (Qi et al. 2024, section 6 and its figure of ZB-V), for
    m >= 2p - 1. Rank r, with chunk a = stage r (down the V) and chunk b = stage 2p - 1 - r (up):

    - warm-up: 2(p - r) - 1 forwards of a; r pairs (F of b, F of a); p - r triples (F, I, W of
      b), which start b's backwards as soon as its forwards reach the bottom of the V;
    - steady state: F of a (while a has forwards left), I and W of a, then F, I and W of b,
      until both chunks have run every forward;
    - cool-down: r pairs of input gradients (I of a, I of b), then p - r pairs (I of a, the
      oldest W of a), then the weight gradients left, b's before a's (the W's fill the drain).
    """
    stages = 2 * p
    F, I, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    ranks = []
    for r in range(p):
        a, b = r, stages - 1 - r
        done = {(s, kind): 0 for s in (a, b) for kind in ActionKind}  # next micro-batch
        out: list[Action] = []

        def run(s: int, kind: ActionKind) -> None:
            k = done[(s, kind)]
            done[(s, kind)] = k + 1
            out.append(Action(s, kind, k))

        for _ in range(2 * (p - r) - 1):
            run(a, F)
        for _ in range(r):
            run(b, F)
            run(a, F)
        for _ in range(p - r):
            for kind in (F, I, W):
                run(b, kind)
        while done[(a, F)] < m or done[(b, F)] < done[(a, F)]:
            if done[(a, F)] < m:
                run(a, F)
            for s, kind in ((a, I), (a, W), (b, F), (b, I), (b, W)):
                run(s, kind)
        for _ in range(r):
            run(a, I)
            run(b, I)
        for _ in range(p - r):
            run(a, I)
            run(a, W)
        for s in (b, a):
            while done[(s, W)] < m:
                run(s, W)
        assert all(done[(s, kind)] == m for s in (a, b) for kind in (F, I, W)), (p, m, r)
        ranks.append(tuple(out))
    return PipelineSchedule(tuple(ranks), m, ScheduleKind.ZB_V)


def _zb_v_listed(p: int, m: int) -> PipelineSchedule:
    """ZB-V lists from list scheduling at unit times (F = I = W = 1): every rank, when free,
    runs the first ready action of chunk 1's forward, chunk 0's input gradient, chunk 0's
    forward (at most 2p chunk-micro-batches in flight), chunk 1's input gradient, the oldest
    weight gradient; while forwards remain, an input gradient is followed by its weight gradient
    (the steady state F-I-W of the paper, which keeps the lists robust when I and W differ).
    For any m; :func:`zb_v` uses it below 2p - 1, where the paper's lists do not fill the V."""
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
