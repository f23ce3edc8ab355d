"""gloo collectives after compute, with a core per process and with more processes than cores.

    .venv/bin/python benchmarks/host_collectives.py                 # 2 and 4 processes, 3.2 MB
    .venv/bin/python benchmarks/host_collectives.py --worlds 2 4 8 --mib 1 3.1 --calls 30

Each process runs the calibration's pace (two GEMMs of 2048 x 256 -> 1024 on operands cycled
through 24 MiB, ``autopar.planner.calibration.pace_compute``) and then one collective, ``--calls``
times; the figure is the slowest rank's mean per call less the pace timed alone just before and
just after it (the median over ``--rounds``): what a training step pays for the collective. All-reduce, reduce-scatter, all-gather and the
last two back to back (ZeRO-1/2's pair). Beside each, the cost model's price
(:func:`autopar.planner.comm.collective_time`) on a cluster file when ``--cluster`` is given (an
``autopar calibrate`` file: calibrated with one process per core, priced at each world with the
node's processes sharing its cores as data parallelism's collectives are priced,
``Host.collective_share``, and as if each process had a core).

This is the measurement behind pricing a collective's bandwidth term at the processes' share of
the cores on a CPU host (docs/cost-model.md, "Local gloo runs").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OPS = ("all-reduce", "reduce-scatter", "all-gather", "reduce-scatter + all-gather")


def _worker(sizes: list[int], calls: int, rounds: int) -> dict[tuple[str, int], float]:
    """Per (op, bytes): this rank's mean seconds per paced call less the pace alone (timed
    before and after it), the median over ``rounds``."""
    import torch
    import torch.distributed as dist

    from autopar.planner.calibration import pace_compute

    torch.set_num_threads(1)
    n = dist.get_world_size()
    pace = pace_compute()

    def timed(fn) -> float:
        fn()
        fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls

    out = {}
    for size in sizes:
        x = torch.ones(size // 4)
        shard = torch.ones(size // 4 // n)
        full = torch.empty(shard.numel() * n)
        fns = {"all-reduce": lambda: dist.all_reduce(x),
               "reduce-scatter": lambda: dist.reduce_scatter_tensor(shard, full),
               "all-gather": lambda: dist.all_gather_into_tensor(full, shard)}
        fns["reduce-scatter + all-gather"] = lambda: (fns["reduce-scatter"](),
                                                      fns["all-gather"]())
        per_round: dict[str, list[float]] = {op: [] for op in OPS}
        for _ in range(rounds):  # the pace alone timed around every collective, every round
            for op in OPS:
                fn = fns[op]
                before = timed(pace)
                paced = timed(lambda: (pace(), fn()))
                after = timed(pace)
                per_round[op].append(paced - (before + after) / 2)
        for op in OPS:
            out[(op, size)] = statistics.median(per_round[op])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=float, nargs="+", default=[3.1])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cluster", help="an `autopar calibrate` file to price the same calls on")
    args = ap.parse_args(argv)

    from autopar.cluster import Cluster, GroupSpan
    from autopar.planner.comm import Collective, collective_time
    from autopar.planner.host import Host
    from autopar.runtime.local_pool import LocalPool

    every = math.lcm(*args.worlds)  # a whole number of fp32 elements per rank at every world
    sizes = [int(m * 2**20) // 4 // every * 4 * every for m in args.mib]
    base = Cluster.load(args.cluster) if args.cluster else None
    print("| processes | bytes | collective | measured | priced | priced as if a core each |")
    print("|---|---|---|---|---|---|")
    for world in args.worlds:
        with LocalPool(world, timeout_s=600) as pool:
            per_rank = pool.run(_worker, sizes, args.calls, args.rounds)
        cluster = base.with_devices(world, devices_per_node=world) if base else None
        for size in sizes:
            for op in OPS:
                measured = max(r[(op, size)] for r in per_rank)
                priced = own = "-"
                if cluster is not None:
                    span = GroupSpan(world, 1, world)
                    kinds = [Collective(k) for k in op.split(" + ")]

                    def price(cl: Cluster) -> str:  # as the cost model prices data parallelism's
                        share = Host(cl).collective_share()
                        t = sum(collective_time(cl, k, size, span, core_share=share).seconds
                                for k in kinds)
                        return f"{t * 1e3:.1f} ms"

                    priced = price(cluster)
                    own = price(dataclasses.replace(cluster, cores_per_node=0))
                print(f"| {world} | {size / 2**20:.2f} MiB | {op} | {measured * 1e3:.1f} ms | "
                      f"{priced} | {own} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
