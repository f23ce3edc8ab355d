"""``autopar simulate plan.json --trace out.json --png out.png``: the simulated step."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a plan's step: Chrome trace and Gantt chart",
                       description="Run the pipeline schedule of a plan document (the action "
                                   "lists the executor runs) through the runtime's simulator "
                                   "with the plan's per-stage costs; write a "
                                   "Chrome-trace timeline (open it in https://ui.perfetto.dev) "
                                   "and/or a Gantt picture of the schedule.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--trace", metavar="FILE", help="Chrome trace JSON to write")
    p.add_argument("--png", metavar="FILE", help="Gantt chart (PNG) to write")
    p.add_argument("--max-micro-batches", type=int, default=None,
                   help="draw only the first M micro-batches' worth of a long step in the PNG")
    p.set_defaults(run=run)


def simulate_document(doc):
    """(simulation, per-stage costs) of the plan document's pipeline: the runtime's simulator
    (``runtime/simulator.py``) over the action lists the executor runs
    (``runtime/schedules.py``), with the plan's per-stage costs, as the planner priced it."""
    from autopar.cluster import Cluster
    from autopar.plan_types import ScheduleKind
    from autopar.planner.host import Host
    from autopar.planner.cost_model import StageCost
    from autopar.planner.schedule_model import (PipelineWork, backward_whole_at_input,
                                                first_backward_in_weight, simulate_pipeline)

    plan = doc["plan"]
    stages = [StageCost.from_json(s) for s in doc["stage_costs"]]
    cores, efficiency, resume = Host(Cluster.from_json(doc["cluster"])).pipeline_cores()
    work = PipelineWork(ScheduleKind(plan["schedule"]), plan["pp"], plan["virtual_stages"],
                        plan["num_micro_batches"], tuple(s.forward_s for s in stages),
                        tuple(s.backward_s for s in stages), tuple(s.weight_s for s in stages),
                        tuple(s.p2p_s for s in stages[:-1]),
                        cores=cores, replicas=plan["dp"] * plan.get("cp", 1) * plan["tp"],
                        efficiency=efficiency, resume_s=resume,
                        # stage 0 holds a block under full recompute iff it prices a recompute
                        first_backward_in_weight=first_backward_in_weight(
                            plan.get("zero", 0), backward_whole_at_input(
                                ScheduleKind(plan["schedule"]).spec.splits_backward,
                                plan.get("recompute") == "full", stages[0].recompute_s > 0)))
    return simulate_pipeline(work), stages


#: Action kind (text spelling) -> trace category and Gantt colour.
_CATEGORY = {"F": ("forward", "#4C72B0"), "B": ("backward", "#55A868"),
             "I": ("backward", "#55A868"), "W": ("weight grad", "#DD8452"),
             "SEND_F": ("p2p", "#333333"), "SEND_B": ("p2p", "#333333"),
             "RECV_F": ("p2p wait", "#BBBBBB"), "RECV_B": ("p2p wait", "#BBBBBB")}


def chrome_trace(doc, sim, stages) -> dict:
    """Chrome trace-event JSON: one thread per pipeline rank for its compute, one for its sends
    and receives (a receive lasts from when the rank starts waiting to the tensor's arrival)."""
    plan, pred = doc["plan"], doc["prediction"]
    us = 1e6
    out = [{"name": "process_name", "ph": "M", "pid": 0,
            "args": {"name": f"{doc['model']['name']} dp={plan['dp']}"
                             + (f" cp={plan['cp']}" if plan.get("cp", 1) > 1 else "")
                             + f" tp={plan['tp']} "
                             f"pp={plan['pp']} {plan['schedule']}"}}]
    for r in range(plan["pp"]):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * r,
                    "args": {"name": f"pp rank {r}"}})
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * r + 1,
                    "args": {"name": f"pp rank {r} sends and receives"}})
    for e in sim.events:
        a = e.action
        cat = _CATEGORY[a.kind.value][0]
        comm = a.kind.is_comm
        if comm and e.end <= e.start:
            continue  # a send is posted in no time; its transfer is the receiver's wait
        tid = 2 * e.rank + (1 if comm else 0)
        out.append({"name": str(a), "cat": cat, "ph": "X", "pid": 0, "tid": tid,
                    "ts": e.start * us, "dur": (e.end - e.start) * us,
                    "args": {"stage": a.stage, "micro_batch": a.microbatch}})
        st = stages[a.stage]
        if a.kind.value in ("B", "I") and st.recompute_s > 0:
            out.append({"name": "recompute", "cat": "recompute", "ph": "X", "pid": 0, "tid": tid,
                        "ts": e.start * us, "dur": st.recompute_s * us})
    end = sim.step_time
    b = pred["breakdown"]
    for r in range(plan["pp"]):
        t = end
        for key, label in (("dp_comm_s", "data-parallel gradient sync (exposed)"),
                           ("optimizer_s", "optimizer step"),
                           ("loss_comm_s", "the loss all-reduce")):
            if b.get(key, 0) > 0:
                out.append({"name": label, "cat": key, "ph": "X", "pid": 0, "tid": 2 * r,
                            "ts": t * us, "dur": b[key] * us})
                t += b[key]
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"predicted_step_time_s": pred["step_time_s"],
                          "simulated_pipeline_s": end}}


def gantt(doc, sim, path: str, max_micro_batches: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    plan = doc["plan"]
    p = plan["pp"]
    shown = [e for e in sim.events if e.action.kind.is_compute
             and (max_micro_batches is None or e.action.microbatch < max_micro_batches)]
    fig, ax = plt.subplots(figsize=(12, 1 + 0.5 * p))
    for kind in ("F", "B", "I", "W"):
        for r in range(p):
            bars = [(e.start, e.end - e.start) for e in shown
                    if e.rank == r and e.action.kind.value == kind]
            if bars:
                ax.broken_barh(bars, (p - 1 - r - 0.4, 0.8), facecolors=_CATEGORY[kind][1],
                               edgecolors="white", linewidth=0.3)
    end = max(e.end for e in shown)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"pp {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("seconds")
    ax.set_xlim(0, end * 1.01)
    cp = f"cp={plan['cp']} ({plan.get('cp_attention', 'ring')}), " if plan.get("cp", 1) > 1 else ""
    ax.set_title(f"{doc['model']['name']}: {cp}{plan['schedule']}, pp={p}, "
                 f"v={plan['virtual_stages']}, {plan['num_micro_batches']} micro-batches "
                 f"(pipeline {sim.step_time:.3g} s of a {doc['prediction']['step_time_s']:.3g} s "
                 f"step)")
    ax.legend(handles=[Patch(color=_CATEGORY[k][1], label=label) for k, label in
                       (("F", "forward"), ("B", "backward"), ("W", "weight grad"))],
              loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from autopar.errors import InvalidInputError
    from autopar.planner.planning import read_document
    from autopar.units import console, fmt_seconds

    if not args.trace and not args.png:
        raise InvalidInputError("nothing to write", expected="--trace FILE and/or --png FILE",
                                found="neither", fix="add --trace out.json or --png out.png")
    doc = read_document(args.plan)
    sim, stages = simulate_document(doc)
    if args.trace:
        with open(args.trace, "w") as fh:
            json.dump(chrome_trace(doc, sim, stages), fh)
    if args.png:
        gantt(doc, sim, args.png, args.max_micro_batches)
    end = sim.step_time
    pred = doc["prediction"]
    plan = doc["plan"]
    if plan.get("cp", 1) > 1:  # its exchange is inside each stage's forward and backward
        console().print(f"context parallel: cp={plan['cp']} ({plan.get('cp_attention', 'ring')} "
                        f"attention), exposed K/V exchange "
                        f"{fmt_seconds(pred['breakdown'].get('cp_comm_s', 0))} of the stages' "
                        f"time (bottleneck rank)", markup=False, highlight=False)
    console().print(f"simulated pipeline {fmt_seconds(end)} + data-parallel "
                    f"{fmt_seconds(pred['breakdown'].get('dp_comm_s', 0))} + optimizer "
                    f"{fmt_seconds(pred['breakdown'].get('optimizer_s', 0))} + loss all-reduce "
                    f"{fmt_seconds(pred['breakdown'].get('loss_comm_s', 0))}; predicted step "
                    f"{fmt_seconds(pred['step_time_s'])}; {len(sim.events)} events"
                    + (f"; trace -> {args.trace}" if args.trace else "")
                    + (f"; Gantt -> {args.png}" if args.png else ""), highlight=False)
    return 0
