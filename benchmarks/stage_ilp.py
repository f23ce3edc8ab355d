"""The stage ILP on GPT-3 175B (docs/pipeline.md's table): for each schedule and p x v, the
solve's CPU time, status, modelled step, LP bound, gap, and the equal-layer-count cut's step.

    .venv/bin/python benchmarks/stage_ilp.py

The layer costs are the tests' (tests/test_stage_partition.py ``gpt3_175b_layers``: per rank of
a tp=8 group of A100s at 50% of peak, selective recompute, micro-batch 1), 80 GiB per rank,
m = 2p (GPipe m = p), no starting point, a 60 s limit."""

from __future__ import annotations

import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_stage_partition import gpt3_175b_layers  # noqa: E402

from autopar.planner.stage_ilp import partition_stages  # noqa: E402
from autopar.planner.stage_problem import (PartitionProblem, even_partition,  # noqa: E402
                                           modeled_step_time, rank_memory)
from autopar.runtime.schedules import ScheduleKind  # noqa: E402

CASES = [(ScheduleKind.ONE_F_ONE_B, p, 1) for p in (8, 16, 32, 64)] + [
    (ScheduleKind.ZB_H1, 64, 1), (ScheduleKind.GPIPE, 64, 1),
    (ScheduleKind.INTERLEAVED_1F1B, 8, 2), (ScheduleKind.INTERLEAVED_1F1B, 32, 2),
    (ScheduleKind.INTERLEAVED_1F1B, 8, 6), (ScheduleKind.INTERLEAVED_1F1B, 10, 8)]


def _cpu() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    layers = gpt3_175b_layers()
    print("| schedule | p x v | solve (s) | status | step (s) | LP bound | gap | even split (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, p, v in CASES:
        m = p if kind is ScheduleKind.GPIPE else 2 * p
        problem = PartitionProblem(layers, p, m, kind, v, 80 * 2**30, 16.0, 100e9 / 8, 5e-6)
        start = _cpu()
        r = partition_stages(problem, time_limit_s=60.0)
        took = _cpu() - start
        even = even_partition(len(layers), p * v)
        even_s = (f"{modeled_step_time(problem, even):.3f}"
                  if max(rank_memory(problem, even)) <= 80 * 2**30 else "does not fit")
        gap = (r.step_time - r.lp_bound) / r.step_time
        print(f"| {kind.value} | {p}{f' x {v}' if v > 1 else ''} | {took:.2f} | {r.status} | "
              f"{r.step_time:.3f} | {r.lp_bound:.3f} | {gap:.1%} | {even_s} |")


if __name__ == "__main__":
    main()
