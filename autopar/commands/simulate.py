"""``autopar simulate plan.json --trace out.json --png out.png``: the simulated step."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a plan's step: Chrome trace and Gantt chart",
                       description="Run the pipeline schedule of a plan document through the "
                                   "schedule simulator with the plan's per-stage costs; write a "
                                   "Chrome-trace timeline (open it in https://ui.perfetto.dev) "
                                   "and/or a Gantt picture of the schedule.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--trace", metavar="FILE", help="Chrome trace JSON to write")
    p.add_argument("--png", metavar="FILE", help="Gantt chart (PNG) to write")
    p.add_argument("--max-micro-batches", type=int, default=None,
                   help="draw only the first M micro-batches' worth of a long step in the PNG")
    p.set_defaults(run=run)


def simulate_document(doc):
    """(events, pipeline end, step end) of the plan document's step, simulated."""
    from autopar.plan import ScheduleKind
    from autopar.planner.components import default_components
    from autopar.planner.cost_model import StageCost
    from autopar.planner.schedule_model import PipelineWork

    plan = doc["plan"]
    stages = [StageCost.from_json(s) for s in doc["stage_costs"]]
    work = PipelineWork(ScheduleKind(plan["schedule"]), plan["pp"], plan["virtual_stages"],
                        plan["num_micro_batches"], tuple(s.forward_s for s in stages),
                        tuple(s.backward_s for s in stages), tuple(s.weight_s for s in stages),
                        tuple(s.p2p_s for s in stages[:-1]))
    events = default_components().simulator.simulate(work)
    return events, stages


def chrome_trace(doc, events, stages) -> dict:
    """Chrome trace-event JSON: one thread per pipeline rank, one per rank's sends."""
    plan, pred = doc["plan"], doc["prediction"]
    us = 1e6
    out = [{"name": "process_name", "ph": "M", "pid": 0,
            "args": {"name": f"{doc['model']['name']} dp={plan['dp']} tp={plan['tp']} "
                             f"pp={plan['pp']} {plan['schedule']}"}}]
    for r in range(plan["pp"]):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * r,
                    "args": {"name": f"pp rank {r}"}})
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * r + 1,
                    "args": {"name": f"pp rank {r} sends"}})
    names = {"F": "forward", "B": "backward", "W": "weight grad", "p2p": "p2p"}
    for e in events:
        tid = 2 * e.rank + (1 if e.category == "p2p" else 0)
        out.append({"name": e.name, "cat": names[e.category], "ph": "X", "pid": 0, "tid": tid,
                    "ts": e.start_s * us, "dur": (e.end_s - e.start_s) * us,
                    "args": {"stage": e.stage, "micro_batch": e.micro_batch}})
        st = stages[e.stage] if e.stage >= 0 else None
        if st is not None and e.category == "B" and st.recompute_s > 0:
            out.append({"name": "recompute", "cat": "recompute", "ph": "X", "pid": 0, "tid": tid,
                        "ts": e.start_s * us, "dur": st.recompute_s * us})
    end = max(e.end_s for e in events)
    b = pred["breakdown"]
    for r in range(plan["pp"]):
        t = end
        for key, label in (("dp_comm_s", "data-parallel gradient sync (exposed)"),
                           ("optimizer_s", "optimizer step")):
            if b.get(key, 0) > 0:
                out.append({"name": label, "cat": key, "ph": "X", "pid": 0, "tid": 2 * r,
                            "ts": t * us, "dur": b[key] * us})
                t += b[key]
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"predicted_step_time_s": pred["step_time_s"],
                          "simulated_pipeline_s": end}}


def gantt(doc, events, path: str, max_micro_batches: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    plan = doc["plan"]
    p = plan["pp"]
    colors = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452", "p2p": "#333333"}
    shown = [e for e in events if max_micro_batches is None or e.micro_batch < max_micro_batches]
    fig, ax = plt.subplots(figsize=(12, 1 + 0.5 * p))
    for cat in ("F", "B", "W"):
        for r in range(p):
            bars = [(e.start_s, e.end_s - e.start_s) for e in shown
                    if e.rank == r and e.category == cat]
            if bars:
                ax.broken_barh(bars, (p - 1 - r - 0.4, 0.8), facecolors=colors[cat],
                               edgecolors="white", linewidth=0.3)
    end = max(e.end_s for e in shown)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"pp {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("seconds")
    ax.set_xlim(0, end * 1.01)
    ax.set_title(f"{doc['model']['name']}: {plan['schedule']}, pp={p}, "
                 f"v={plan['virtual_stages']}, {plan['num_micro_batches']} micro-batches "
                 f"(pipeline {end:.3g} s of a {doc['prediction']['step_time_s']:.3g} s step)")
    ax.legend(handles=[Patch(color=colors[k], label=label) for k, label in
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
    events, stages = simulate_document(doc)
    if args.trace:
        with open(args.trace, "w") as fh:
            json.dump(chrome_trace(doc, events, stages), fh)
    if args.png:
        gantt(doc, events, args.png, args.max_micro_batches)
    end = max(e.end_s for e in events)
    pred = doc["prediction"]
    console().print(f"simulated pipeline {fmt_seconds(end)} + data-parallel "
                    f"{fmt_seconds(pred['breakdown'].get('dp_comm_s', 0))} + optimizer "
                    f"{fmt_seconds(pred['breakdown'].get('optimizer_s', 0))}; predicted step "
                    f"{fmt_seconds(pred['step_time_s'])}; {len(events)} events"
                    + (f"; trace -> {args.trace}" if args.trace else "")
                    + (f"; Gantt -> {args.png}" if args.png else ""), highlight=False)
    return 0
