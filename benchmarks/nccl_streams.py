"""How a pipeline's transfers behave on NCCL's streams: a model, not a measurement.

NCCL runs a communicator's operations on one CUDA stream in issue order, and a receive (or a
send larger than its buffers) holds that stream until the other end has posted its half. So
where a rank's transfers share one stream, a receive posted ahead of its data blocks the sends
queued behind it, which other ranks may be waiting for. The executor issues each transfer on
its own, on a two-rank process group per pair of pipeline ranks (a stream per pair), with the
lists lowered so that each receive is posted where its send is
(``add_communication(match="order")``). Before 2026-11-29 it batched each run of transfers on
one group over the pipeline column (one stream per rank), with the lowering for tags where that
passed a deadlock check (GPipe, 1F1B, ZB-H1) and the lowering in send order elsewhere.

For uniform stages (forward 1, backward 2, under zero-bubble schedules input and weight
gradients 1 each) and a transfer of ``t`` forward-times, this prints the step under:

- gloo's semantics (sends never wait; ``runtime/simulator.py``, what the planner prices);
- NCCL, a stream per pair of ranks, lists in send order (the executor now);
- NCCL, one stream per rank, runs of transfers batched (the executor before).

Run: ``.venv/bin/python benchmarks/nccl_streams.py``. Nothing here ran on GPUs: the model is
:meth:`autopar.runtime.schedules.PipelineSchedule.on_nccl_streams` (tests/test_schedules.py
holds it equal to the simulator where transfers are instant and streams are per pair).
"""

from __future__ import annotations

import argparse

from autopar.plan_types import ScheduleKind
from autopar.runtime.schedules import build_schedule
from autopar.runtime.simulator import Durations, simulate, simulate_nccl

KINDS = [(ScheduleKind.GPIPE, 1), (ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.ZB_H1, 1),
         (ScheduleKind.INTERLEAVED_1F1B, 2), (ScheduleKind.ZB_V, 2)]


def random_draws(draws: int, seed: int) -> None:
    """The executor's step on NCCL's streams against gloo's semantics on random stage times
    (forward 0.5-2, backward 1-4) and transfers (0-0.3), p 2-8, m p to 4p: mean and largest
    excess per schedule."""
    import random
    import statistics

    rng = random.Random(seed)
    print("| schedule | cases | mean excess | largest |")
    print("|---|---|---|---|")
    for kind, v in KINDS:
        excess = []
        for p in (2, 3, 4, 6, 8):
            for m in sorted({p, 2 * p, 4 * p}):
                schedule = build_schedule(kind, p, m, v)
                n = p * v
                for _ in range(draws):
                    d = Durations([rng.uniform(0.5, 2) for _ in range(n)],
                                  [rng.uniform(1, 4) for _ in range(n)],
                                  p2p=[rng.uniform(0, 0.3) for _ in range(n - 1)])
                    excess.append(simulate_nccl(schedule, d) / simulate(schedule, d).step_time
                                  - 1)
        print(f"| {kind.value} | {len(excess)} | {100 * statistics.mean(excess):+.1f}% | "
              f"{100 * max(excess):+.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--transfer", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--micro-batches-per-rank", type=int, default=4)
    parser.add_argument("--random", type=int, default=0, metavar="DRAWS",
                        help="instead: DRAWS random stage and transfer times per shape")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.random:
        random_draws(args.random, args.seed)
        return
    print("| schedule | p | m | t | gloo semantics | NCCL, stream per pair (now) | x | "
          "NCCL, one stream, batched (before) | x |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, v in KINDS:
        before_match = "order" if kind in (ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.ZB_V) \
            else "tag"
        for p in args.ranks:
            m = args.micro_batches_per_rank * p
            schedule = build_schedule(kind, p, m, v)
            n = p * v
            for t in args.transfer:
                d = Durations.uniform(n, 1.0, 2.0, p2p=t)
                if not kind.spec.splits_backward:
                    d = Durations(d.forward, d.backward, d.backward, (0.0,) * n, d.p2p)
                gloo = simulate(schedule, d).step_time
                now = simulate_nccl(schedule, d)
                before = simulate_nccl(schedule, d, per_pair=False, match=before_match)
                print(f"| {kind.value} | {p} | {m} | {t:g} | {gloo:.1f} | {now:.1f} | "
                      f"{now / gloo:.3f} | {before:.1f} | {before / gloo:.3f} |")


if __name__ == "__main__":
    main()
