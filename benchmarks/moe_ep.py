"""Expert parallelism on local gloo processes: step time, memory and the share spent in
all-to-all at ep 1, 2 and 4, beside the cost model's prediction for each.

    .venv/bin/python benchmarks/moe_ep.py [--world 4] [--rounds 5] [--steps 3]
        [--cluster FILE]        # a cluster file from `autopar calibrate` (default: calibrate
                                # here once, one process per core, before measuring)

The model is examples/moe.py's (a plain PyTorch mixture-of-experts language model: 4 blocks of
8 SwiGLU experts, top-2, hidden 256) with a global batch of 16 sequences of 128 tokens, on
``world`` processes as dp = world, ZeRO-0, one micro-batch, no recomputation; ep takes every
divisor of dp that divides the 8 experts. All plans run in one process group, interleaved:
``--rounds`` rounds, each running every plan for a warm-up step and ``--steps`` timed steps; a
plan's figure is the median over rounds of its round medians (paired rounds: the host's load
hits every plan alike).

Measured per plan: the step (rank 0's wall clock, the slowest rank's is the same: the all-reduce
ends the step), the seconds inside expert-parallel exchanges (the row counts and the rows, both
directions, timed around ``runtime/moe.py``'s collectives on rank 0), and the parameter,
gradient and optimizer bytes each rank holds (``ParallelModel.memory_bytes``) against the cost
model's model state.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = dict(vocab=2048, hidden=256, heads=8, inner=512, layers=4, num_experts=8, top_k=2,
             seq=128)
GLOBAL_BATCH = 16


def _model():
    import torch

    from examples.moe import MoELM

    torch.manual_seed(0)
    return MoELM(**MODEL)


def _batch(seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL["vocab"], (GLOBAL_BATCH, MODEL["seq"] + 1), generator=gen)
    return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)


def _worker(plans: list[dict], rounds: int, steps: int, cluster: dict) -> dict:
    """One rank: every plan parallelized once, then ``rounds`` interleaved rounds."""
    import torch

    import autopar
    from autopar.runtime import moe
    from examples.moe import loss_fn

    spent = [0.0]
    original = moe._all_to_all

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    moe._all_to_all = timed
    original_collective = moe.collective

    def timed_collective(*args, **kwargs):  # the row-count exchange
        start = time.perf_counter()
        try:
            return original_collective(*args, **kwargs)
        finally:
            if "expert-parallel" in kwargs.get("what", "") and "counts" in kwargs["what"]:
                spent[0] += time.perf_counter() - start

    moe.collective = timed_collective
    inputs, targets = _batch(0)
    models = []
    for plan in plans:
        pm = autopar.parallelize(_model(), cluster=autopar.Cluster.from_json(cluster),
                                 example_inputs=inputs, example_targets=targets, loss_fn=loss_fn,
                                 plan=autopar.Plan.from_json(plan),
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
        models.append(pm)
    out = {"step_s": [[] for _ in plans], "a2a_s": [[] for _ in plans], "memory": []}
    for r in range(rounds):
        for k, pm in enumerate(models):
            pm.train_step(*_batch(r + 1))  # warm-up
            if r == 0:  # after a step: the optimizer's state exists
                out["memory"].append(pm.memory_bytes())
            times, a2a = [], []
            for s in range(steps):
                spent[0] = 0.0
                start = time.perf_counter()
                pm.train_step(*_batch(100 * r + s))
                times.append(time.perf_counter() - start)
                a2a.append(spent[0])
            out["step_s"][k].append(statistics.median(times))
            out["a2a_s"][k].append(statistics.median(a2a))
    for pm in models:
        pm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cluster", help="calibrated cluster file (default: calibrate now)")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--save-cluster", dest="save_cluster",
                    help="write the calibrated cluster to this file (reuse it with --cluster)")
    args = ap.parse_args(argv)

    import autopar
    from autopar import Cluster
    from autopar.plan_types import RecomputeKind, ScheduleKind
    from autopar.planner.calibration import calibrate_cluster
    from autopar.planner.calibration_host import host_cores
    from autopar.planner.candidates import Candidate
    from autopar.planner.cost_model import CostModel, ModelCosts, TrainingSetup
    from autopar.runtime.local_pool import LocalPool
    from examples.moe import loss_fn

    if args.cluster:
        base = Cluster.load(args.cluster)
    else:
        procs = max(2, min(host_cores(), args.world))
        base, _ = calibrate_cluster(procs, name=f"calibrated-{procs}")
        if args.save_cluster:
            base.save(args.save_cluster)
    cluster = base.with_devices(args.world)
    inputs, targets = _batch(0)
    model = _model()
    captured = autopar.capture(model, inputs, loss_fn, example_targets=targets)
    cm = CostModel(ModelCosts(captured), cluster,
                   TrainingSetup(GLOBAL_BATCH, MODEL["seq"], "fp32"))
    dp = args.world
    rows, plans = [], []
    for ep in (e for e in (1, 2, 4, 8) if dp % e == 0 and MODEL["num_experts"] % e == 0):
        c = Candidate(dp, 1, 1, 1, GLOBAL_BATCH // dp, ScheduleKind.ONE_F_ONE_B,
                      RecomputeKind.NONE, 0, False, ep=ep)
        ev = cm.evaluate(c)
        mem = ev.ranks[0]
        rows.append({"ep": ep, "predicted_s": ev.prediction.step_time_s,
                     "breakdown": ev.prediction.breakdown,
                     "predicted_a2a_s": ev.prediction.breakdown.get("ep_comm_s", 0.0),
                     "predicted_state_bytes": mem.weights + mem.gradients + mem.optimizer})
        plans.append(ev.plan.to_json())
    with LocalPool(args.world, timeout_s=600) as pool:
        per_rank = pool.run(_worker, plans, args.rounds, args.steps, cluster.to_json(),
                            timeout_s=3600)
    got = per_rank[0]
    for k, row in enumerate(rows):
        mem = got["memory"][k]
        row.update(measured_s=statistics.median(got["step_s"][k]),
                   rounds_s=got["step_s"][k],
                   measured_a2a_s=statistics.median(got["a2a_s"][k]),
                   measured_state_bytes=mem["params"] + mem["grads"] + mem["optimizer"])
        print(json.dumps(row), flush=True)
    print()
    print(f"examples/moe.py {MODEL}, global batch {GLOBAL_BATCH}, {args.world} gloo processes "
          f"(dp {dp}), cluster {base.name}")
    print("| ep | predicted step | measured step | error | all-to-all predicted | "
          "all-to-all measured (share) | state predicted | state measured |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["measured_s"]
        print(f"| {r['ep']} | {r['predicted_s'] * 1e3:.0f} ms | {m * 1e3:.0f} ms | "
              f"{r['predicted_s'] / m - 1:+.1%} | {r['predicted_a2a_s'] * 1e3:.1f} ms | "
              f"{r['measured_a2a_s'] * 1e3:.1f} ms ({r['measured_a2a_s'] / m:.1%}) | "
              f"{r['predicted_state_bytes'] / 2**20:.1f} MiB | "
              f"{r['measured_state_bytes'] / 2**20:.1f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
