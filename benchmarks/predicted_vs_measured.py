"""Predicted vs measured step time on local gloo processes, for every (dp, tp, pp) of world 2
and 4 on a small GPT, and whether the plan autopar picks is the measured fastest.

    .venv/bin/python benchmarks/predicted_vs_measured.py [--worlds 1 2 4] [--steps 5]
        [--cluster FILE]        # a cluster file from `autopar calibrate` (default: calibrate
                                # here once, one process per core, before measuring)

Predictions come from the cost model with the calibrated cluster (world sizes above the host's
cores are the same device shared: ``cores_per_node``); every plan is pinned to
ZeRO-0 and no recomputation (what every runner below implements) and the search picks the rest
(micro-batch size, schedule, sequence parallelism) for each mesh.

Runners:

- ``autopar`` (default): ``autopar.parallelize(model, plan=the searched Plan)`` on ``world``
  local gloo processes, the end-to-end runtime the prediction is about. All plans of a world
  run in one process group, interleaved: ``--rounds`` rounds, each running every plan for a
  warm-up step and ``--steps`` timed steps; a plan's figure is the median over rounds of its
  round medians, and the spread over rounds is reported.
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


def _autopar_worker(plans: list[dict], rounds: int, steps: int, cluster: dict, seed: int = 0
                    ) -> list[list[float]]:
    """One rank of the autopar runs of one world: ``autopar.parallelize`` every plan (all
    meshes of the world, in this one process group), then ``rounds`` rounds that each run every
    plan for one warm-up and ``steps`` timed steps, the plans' order rotating by round. Per plan,
    the median step of each round (each step bracketed by barriers, as ``_ddp_worker``).

    Interleaved, because the host drifts: on the 2-core VM the same plan measured 25% apart a
    few minutes apart; plans timed one after the other would be ranked by the drift. ``cluster``
    (the predictions' cluster, as JSON) goes to ``parallelize``: where a plan does not carry its
    per-GEMM layout, the runtime solves it with these numbers, as the prediction did."""
    import functools

    import torch

    import autopar
    from autopar import models

    zm = models.build("gpt", dropout=0.0, seed=seed, **MODEL)
    gen = torch.Generator().manual_seed(seed)
    inputs, targets = zm.example_inputs(batch=GLOBAL_BATCH, seq=MODEL["seq"], generator=gen)
    pms = [autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                               loss_fn=zm.loss_fn, plan=autopar.Plan.from_json(plan),
                               cluster=autopar.Cluster.from_json(cluster),
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
           for plan in plans]
    out = interleaved_step_times(pms, inputs, targets, rounds, steps)
    for pm in pms:
        pm.close()
    return out


def interleaved_step_times(pms: list, inputs: tuple, targets: tuple, rounds: int, steps: int
                           ) -> list[list[float]]:
    """Per model, this rank's median step of each of ``rounds`` rounds; each round runs every
    model for a warm-up and ``steps`` timed steps (each bracketed by barriers), the models'
    order rotating by round."""
    import torch.distributed as dist

    out: list[list[float]] = [[] for _ in pms]
    for r in range(rounds):
        for k in range(len(pms)):
            i = (k + r) % len(pms)
            times = []
            for step in range(steps + 1):
                dist.barrier()
                start = time.perf_counter()
                pms[i].train_step(inputs, targets)
                dist.barrier()
                if step >= 1:
                    times.append(time.perf_counter() - start)
            out[i].append(statistics.median(times))
    return out


def run_with_autopar(plans: list[dict], world: int, rounds: int, steps: int, cluster: dict
                     ) -> list[list[float]]:
    """Run every plan (a Plan's JSON) of one world with ``autopar.parallelize`` on ``world``
    local gloo processes, interleaved (:func:`_autopar_worker`): per plan, the per-round median
    step times, each the slowest rank's."""
    from autopar.runtime.local_pool import LocalPool

    with LocalPool(world, timeout_s=900) as pool:
        per_rank = pool.run(_autopar_worker, plans, rounds, steps, cluster, timeout_s=3600)
    return [[max(r[i][j] for r in per_rank) for j in range(rounds)] for i in range(len(plans))]


def measure_torch(plan: dict, world: int, steps: int) -> tuple[float | None, str]:
    """The torch runner: (median step seconds, runner used) or (None, why not)."""
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
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan and round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of the interleaved autopar runs (median over rounds)")
    ap.add_argument("--cluster", help="calibrated cluster file (default: calibrate now, with "
                                      "one process per core)")
    ap.add_argument("--runner", choices=["autopar", "torch"], default="autopar")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--mesh", action="append", default=[], metavar="DP,TP,PP",
                    help="measure only these meshes (repeatable; default: all)")
    args = ap.parse_args(argv)

    from autopar import Cluster
    from autopar.planner.calibration import calibrate_cluster
    from autopar.planner.calibration_host import host_cores
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
            rows.append({"world": world, "dp": dp, "tp": tp, "pp": pp,
                         "plan": best.candidate.label(), "plan_json": best.plan.to_json(),
                         "predicted_s": best.prediction.step_time_s,
                         "picked": best.candidate == picked,
                         "breakdown": best.prediction.breakdown,
                         "stages": [st.to_json() for st in best.stages]})
        todo = [r for r in rows if r["world"] == world and r["predicted_s"] is not None]
        if args.runner == "autopar" and todo:
            rounds = run_with_autopar([r["plan_json"] for r in todo], world, args.rounds,
                                      args.steps, cluster.to_json())
            for r, per_round in zip(todo, rounds):
                r.update(measured_s=statistics.median(per_round), rounds_s=per_round,
                         runner="autopar")
        else:
            for r in todo:
                r["measured_s"], r["runner"] = measure_torch(r["plan_json"], world, args.steps)
        for r in todo:
            print(json.dumps({k: v for k, v in r.items() if k not in ("plan_json", "stages")}),
                  flush=True)
    print()
    print("| world | dp | tp | pp | plan | predicted | measured | error | rounds (min-max) | "
          "runner |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["predicted_s"] is None:
            print(f"| {r['world']} | {r['dp']} | {r['tp']} | {r['pp']} | - | - | - | - | - | "
                  f"{r['note']} |")
            continue
        m = r["measured_s"]
        err = f"{r['predicted_s'] / m - 1:+.1%}" if m else "-"
        mark = " (picked)" if r["picked"] else ""
        spread = (f"{min(r['rounds_s']) * 1e3:.0f}-{max(r['rounds_s']) * 1e3:.0f} ms"
                  if r.get("rounds_s") else "-")
        print(f"| {r['world']} | {r['dp']} | {r['tp']} | {r['pp']} | {r['plan']}{mark} | "
              f"{r['predicted_s'] * 1e3:.0f} ms | {f'{m * 1e3:.0f} ms' if m else '-'} | {err} | "
              f"{spread} | {r['runner']} |")
    for world in args.worlds:
        done = [r for r in rows if r["world"] == world and r.get("measured_s")]
        if len(done) >= 2:
            by_pred = [(r["dp"], r["tp"], r["pp"]) for r in sorted(done,
                                                                     key=lambda r: r["predicted_s"])]
            by_meas = [(r["dp"], r["tp"], r["pp"]) for r in sorted(done,
                                                                    key=lambda r: r["measured_s"])]
            print(f"world {world}: predicted order {by_pred}, measured order {by_meas}")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "plan_json"}
                                               for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
