"""Predicted vs measured step time on local gloo processes, for every (dp, tp, pp) of world 2
and 4 on a small GPT, and whether the plan autopar picks is the measured fastest.

    .venv/bin/python benchmarks/predicted_vs_measured.py [--worlds 1 2 4] [--steps 5]
        [--cluster FILE]        # a cluster file from `autopar calibrate` (default: calibrate
                                # here once, one process per core, before measuring)

Predictions come from the cost model with the calibrated cluster (world sizes above the host's
cores are the same device shared: ``cores_per_node``); every plan is pinned to
ZeRO-0 and no recomputation (what every runner below implements) and the search picks the rest
(micro-batch size, schedule, sequence parallelism) for each mesh.

Measurements run the plan for ``--steps`` optimizer steps after two warm-up steps and report the
median. Runners:

- ``autopar`` (default): ``autopar.parallelize(model, plan=the searched Plan)`` on ``world``
  local gloo processes, the end-to-end runtime the prediction is about.
- ``torch``: PyTorch's own DistributedDataParallel (gloo) with gradient accumulation and AdamW,
  for the pure data-parallel plans (tp = pp = 1), and one process for world 1: a reference
  implementation of those plans, to see how far autopar's runtime is from torch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = dict(layers=4, hidden=256, heads=8, vocab=2048, seq=128)
GLOBAL_BATCH = 16


def meshes(world: int) -> list[tuple[int, int, int]]:
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0:
                out.append((world // (tp * pp), tp, pp))
    return sorted(out)


def _ddp_worker(plan: dict, steps: int, seed: int = 0) -> float:
    """One rank of a data-parallel run: DDP, m micro-batches per step, AdamW."""
    import torch
    import torch.distributed as dist

    from autopar import models

    torch.manual_seed(seed)
    zm = models.build("gpt", dropout=0.0, seed=seed, **MODEL)
    model = zm.model
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed + (dist.get_rank() if world > 1 else 0))
    batches = [zm.example_inputs(batch=plan["micro_batch_size"], seq=MODEL["seq"], generator=gen)
               for _ in range(plan["num_micro_batches"])]
    times = []
    for step in range(steps + 2):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        for i, (inputs, targets) in enumerate(batches):
            last = i == len(batches) - 1
            ctx = model.no_sync() if world > 1 and not last else _null()
            with ctx:
                loss = zm.loss_fn(model(*inputs), *targets) / len(batches)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _autopar_worker(plan: dict, steps: int, seed: int = 0) -> float:
    """One rank of an autopar run: ``autopar.parallelize`` with the plan, AdamW, the median
    step time (each step bracketed by barriers, as ``_ddp_worker``)."""
    import functools

    import torch
    import torch.distributed as dist

    import autopar
    from autopar import models

    zm = models.build("gpt", dropout=0.0, seed=seed, **MODEL)
    gen = torch.Generator().manual_seed(seed)
    inputs, targets = zm.example_inputs(batch=GLOBAL_BATCH, seq=MODEL["seq"], generator=gen)
    pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                             loss_fn=zm.loss_fn, plan=autopar.Plan.from_json(plan),
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    times = []
    for step in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        pm.train_step(inputs, targets)
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    pm.close()
    return statistics.median(times)


def run_with_autopar(plan: dict, world: int, steps: int) -> float:
    """Run ``plan`` (a Plan's JSON) with ``autopar.parallelize`` on ``world`` local gloo
    processes for ``steps`` timed steps of the MODEL above; the median step time (the slowest
    rank's)."""
    from autopar.runtime.local_pool import LocalPool

    with LocalPool(world, timeout_s=900) as pool:
        return max(pool.run(_autopar_worker, plan, steps, timeout_s=1800))


def measure(plan: dict, world: int, steps: int, runner: str) -> tuple[float | None, str]:
    """(median step seconds, runner used) or (None, why not)."""
    if runner == "autopar":
        return run_with_autopar(plan, world, steps), "autopar"
    if plan["tp"] == 1 and plan["pp"] == 1:
        if world == 1:
            import torch

            torch.set_num_threads(1)
            return _ddp_worker(plan, steps), "torch (1 process)"
        from autopar.runtime.local_pool import LocalPool

        with LocalPool(world, timeout_s=900) as pool:
            return max(pool.run(_ddp_worker, plan, steps)), "torch DDP"
    return None, "the torch runner covers pure data-parallel plans only"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cluster", help="calibrated cluster file (default: calibrate now, with "
                                      "one process per core)")
    ap.add_argument("--runner", choices=["autopar", "torch"], default="autopar")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--mesh", action="append", default=[], metavar="DP,TP,PP",
                    help="measure only these meshes (repeatable; default: all)")
    args = ap.parse_args(argv)

    from autopar import Cluster
    from autopar.planner.calibration import calibrate_cluster, host_cores
    from autopar.planner.cost_model import CostModel, TrainingSetup
    from autopar.planner.planning import capture_model_costs
    from autopar.planner.search import SearchSpace, search

    costs = capture_model_costs("gpt", **MODEL)[0]
    rows = []
    if args.cluster:
        base = Cluster.load(args.cluster)
    else:  # the device as it is, one process per core; more processes than cores are modelled
        procs = max(2, min(host_cores(), max(args.worlds)))
        base, _ = calibrate_cluster(procs, name=f"calibrated-{procs}")
    print(f"cluster {base.name}: {base.cores_per_node} cores per node", flush=True)
    for world in args.worlds:
        cluster = base.with_devices(world)
        cm = CostModel(costs, cluster, TrainingSetup(GLOBAL_BATCH, MODEL["seq"], "fp32"))
        picked = search(cm, SearchSpace(zero=0, recompute="none")).best.candidate
        only = {tuple(int(x) for x in m.split(",")) for m in args.mesh}
        for dp, tp, pp in meshes(world):
            if only and (dp, tp, pp) not in only:
                continue
            try:
                best = search(cm, SearchSpace(dp=dp, tp=tp, pp=pp, zero=0,
                                              recompute="none")).best
            except Exception as exc:  # noqa: BLE001 - a mesh the model cannot take
                rows.append({"world": world, "dp": dp, "tp": tp, "pp": pp,
                             "predicted_s": None, "measured_s": None, "note": str(exc)[:80]})
                continue
            plan = best.plan.to_json()
            measured, runner = measure(plan, world, args.steps, args.runner)
            rows.append({"world": world, "dp": dp, "tp": tp, "pp": pp,
                         "plan": best.candidate.label(),
                         "predicted_s": best.prediction.step_time_s, "measured_s": measured,
                         "runner": runner, "picked": best.candidate == picked,
                         "breakdown": best.prediction.breakdown,
                         "stages": [st.to_json() for st in best.stages]})
            print(json.dumps(rows[-1]), flush=True)
    print()
    print("| world | dp | tp | pp | plan | predicted | measured | error | runner |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["predicted_s"] is None:
            print(f"| {r['world']} | {r['dp']} | {r['tp']} | {r['pp']} | - | - | - | - | "
                  f"{r['note']} |")
            continue
        m = r["measured_s"]
        err = f"{r['predicted_s'] / m - 1:+.1%}" if m else "-"
        mark = " (picked)" if r["picked"] else ""
        print(f"| {r['world']} | {r['dp']} | {r['tp']} | {r['pp']} | {r['plan']}{mark} | "
              f"{r['predicted_s'] * 1e3:.0f} ms | {f'{m * 1e3:.0f} ms' if m else '-'} | {err} | "
              f"{r['runner']} |")
    for world in args.worlds:
        done = [r for r in rows if r["world"] == world and r.get("measured_s")]
        if len(done) >= 2:
            by_pred = [(r["dp"], r["tp"], r["pp"]) for r in sorted(done,
                                                                     key=lambda r: r["predicted_s"])]
            by_meas = [(r["dp"], r["tp"], r["pp"]) for r in sorted(done,
                                                                    key=lambda r: r["measured_s"])]
            print(f"world {world}: predicted order {by_pred}, measured order {by_meas}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
