"""``autopar explain plan.json``: why this plan, and what the alternatives would cost."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="why a plan was chosen and what the alternatives cost",
                       description="Read a plan document (autopar plan --out) and explain it: "
                                   "where the step time goes, how close memory is to the "
                                   "limit, how each alternative differs and what it costs, and "
                                   "why other candidates were rejected.")
    p.add_argument("plan", metavar="PLAN.json")
    p.set_defaults(run=run)


_DEFAULTS = {"cp": 1}
_AXES = ("dp", "cp", "tp", "pp", "virtual_stages", "micro_batch_size", "num_micro_batches",
         "schedule", "recompute", "zero", "sequence_parallel")


def explain_lines(doc) -> list[str]:
    """The explanation as plain lines (the CLI prints them with rich markup)."""
    from autopar.units import fmt_bytes, fmt_seconds

    plan, pred = doc["plan"], doc["prediction"]
    t = pred["step_time_s"]
    limit = doc["cluster"]["device"]["memory_bytes"] - doc["cluster"]["device"].get(
        "reserved_memory_bytes", 0)
    lines = [f"{doc['model']['name']} on {doc['cluster']['nodes'] * doc['cluster']['devices_per_node']}"
             f" x {doc['cluster']['device']['name']}: dp={plan['dp']} "
             + (f"cp={plan['cp']} ({plan.get('cp_attention', 'ring')} attention) "
                if plan.get("cp", 1) > 1 else "") + f"tp={plan['tp']} "
             f"pp={plan['pp']}" + (f" (v={plan['virtual_stages']})" if plan['virtual_stages'] > 1
                                  else "")
             + (f" ep={plan['ep']}" if plan.get("ep", 1) > 1 else "")
             + f", {plan['num_micro_batches']} micro-batches of {plan['micro_batch_size']}, "
               f"{plan['schedule']}, recompute {plan['recompute']}, ZeRO-{plan['zero']}"
             + (", sequence parallel" if plan["sequence_parallel"] else ""),
             f"predicted step {fmt_seconds(t)}, {pred['tokens_per_s']:,.0f} tokens/s, "
             f"MFU {pred['mfu']:.1%} (HFU {pred['hfu']:.1%})", "", "Where the time goes:"]
    for k, v in sorted(pred["breakdown"].items(), key=lambda kv: -kv[1]):
        if v > 0:
            lines.append(f"  {k.removesuffix('_s').replace('_', ' '):<10} {fmt_seconds(v):>10}"
                         f"  {v / t:6.1%}")
    mem = pred["memory"]
    lines += ["", f"Memory: peak {fmt_bytes(pred['peak_memory_bytes'])} of "
                  f"{fmt_bytes(limit)} usable ({1 - pred['peak_memory_bytes'] / limit:.0%} "
                  f"headroom): " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items()
                                             if v)]
    lines += ["", "Stages:"] + [f"  {line}" for line in stage_partition_lines(doc)]
    lines += ["", "Why this plan:"]
    reasons = _reasons(doc)
    lines += [f"  - {r}" for r in reasons]
    if doc["alternatives"]:
        lines += ["", "Alternatives (what changes, and what it costs):"]
        for alt in doc["alternatives"]:
            lines.append(f"  {alt['label']}: {fmt_seconds(alt['prediction']['step_time_s'])} "
                         f"(+{alt['slower_than_best']:.1%}); {_diff(plan, pred, alt)}")
    meshes = [m for m in doc["best_per_mesh"]
              if (m["plan"]["dp"], m["plan"].get("cp", 1), m["plan"]["tp"], m["plan"]["pp"],
                  m["plan"].get("ep", 1))
              != (plan["dp"], plan.get("cp", 1), plan["tp"], plan["pp"], plan.get("ep", 1))]
    if meshes:
        lines += ["", "Best plan of each other mesh that was priced (first-pass prices: min-max "
                      "stages, closed-form schedule):"]
        for alt in meshes[:8]:
            cp = f" cp={alt['plan']['cp']}" if alt["plan"].get("cp", 1) > 1 else ""
            cp += f" ep={alt['plan']['ep']}" if alt["plan"].get("ep", 1) > 1 else ""
            lines.append(f"  dp={alt['plan']['dp']}{cp} tp={alt['plan']['tp']} "
                         f"pp={alt['plan']['pp']}"
                         f": {fmt_seconds(alt['prediction']['step_time_s'])} "
                         f"(+{alt['slower_than_best']:.1%}); {_diff(plan, pred, alt)}")
    s = doc["search"]
    on = s.get("processes", 1)
    lines += ["", f"Search: {s['candidates']} candidates, {s['candidates_evaluated']} priced"
                  f"{f' on {on} processes' if on > 1 else ''}; "
                  f"rejected as malformed {s['pruned']['structure']}, not fitting memory "
                  f"{s['pruned']['memory']}, bounded out {s['pruned']['bound']} (their compute "
                  f"alone exceeds the best plans)."]
    for ex in s.get("infeasible_examples", [])[:6]:
        lines.append(f"  rejected {ex['candidate']}: {ex['reason']}")
    comps = s.get("components", {})
    if comps:
        lines += ["", "Models used: " + "; ".join(f"{k}: {v}" for k, v in comps.items())]
    return lines


def stage_partition_lines(doc) -> list[str]:
    """How the stages were cut and priced: the stage ILP's objective, its LP bound and gap, the
    first pass's cut under the same model, and the simulated pipeline."""
    from autopar.units import fmt_seconds

    sp = doc["prediction"].get("stage_partition") or {}
    plan = doc["plan"]
    cuts = ", ".join(f"{s['layers'][0]}-{s['layers'][1]}" for s in plan["stages"])
    method = sp.get("method")
    if method == "ilp":
        solve = doc["prediction"].get("stage_ilp_solve_s")
        took = f"{solve:.2f} s, " if solve is not None else ""
        solver = {"highs": "HiGHS", "cbc": "CBC"}.get(sp.get("solver", ""), "the solver")
        out = [f"the stage ILP ({solver}, {sp['integer_variables']} integer variables, {took}"
               f"{sp['status']}) cut the layers as {cuts}",
               (f"modelled pipeline {fmt_seconds(sp['objective_s'])}: proven optimal for the "
                f"stage model ({solver} closed the branch-and-bound gap; the LP relaxation, a looser "
                f"bound, is {fmt_seconds(sp['lp_bound_s'])})" if sp.get("proven_optimal") else
                f"modelled pipeline {fmt_seconds(sp['objective_s'])}; LP bound "
                f"{fmt_seconds(sp['lp_bound_s'])}: at most {sp['gap']:.1%} above the optimum of "
                f"the stage model ({solver} stopped at its time limit)"),
               f"the first pass's min-max cut models at {fmt_seconds(sp['first_pass_objective_s'])}"
               f" ({sp['first_pass_objective_s'] / sp['objective_s'] - 1:+.1%})"]
    elif method == "single stage":
        out = [f"one stage (pp=1): layers {cuts}"]
    else:
        return [f"stages {cuts} from the first pass ({method or 'unknown'}); not re-cut by the "
                f"stage ILP"]
    simulated = sp["simulated_pipeline_s"]
    differs = (f" ({simulated / sp['objective_s'] - 1:+.1%} from the stage model, which the "
               f"bound above is about)" if method == "ilp" and sp.get("objective_s") else "")
    out.append(f"simulated pipeline (runtime/simulator.py over the executor's action lists): "
               f"{fmt_seconds(simulated)}{differs}; the prediction uses this one")
    if sp.get("resumed_computes"):
        n, r = sp["resumed_computes"], sp["resume_s"]
        out.append(f"more processes than cores: {n} computes of the pipeline's ranks begin after "
                   f"a wait and resume on a core others ran on, each {fmt_seconds(r)} more work "
                   f"(the cluster's resume_s)")
    return out


def _reasons(doc) -> list[str]:
    plan, pred = doc["plan"], doc["prediction"]
    b = pred["breakdown"]
    t = pred["step_time_s"]
    out = []
    comm = (b.get("tp_comm_s", 0) + b.get("cp_comm_s", 0) + b.get("pp_comm_s", 0)
            + b.get("dp_comm_s", 0) + b.get("loss_comm_s", 0))
    out.append(f"compute is {b['compute_s'] / t:.0%} of the step; communication "
               f"{comm / t:.0%}, pipeline bubble {b['bubble_s'] / t:.0%}, recompute "
               f"{b['recompute_s'] / t:.0%}")
    if plan["tp"] > 1:
        gemms = {}
        for row in doc.get("tp_placement", []):
            gemms[row["sharding"]] = gemms.get(row["sharding"], 0) + row["count"]
        layout = ", ".join(f"{n} {k}" for k, n in sorted(gemms.items()))
        out.append(f"tp={plan['tp']} splits each layer's GEMMs over NVLink peers as the sharding "
                   f"search chose ({layout or 'see tp_placement'}), costing "
                   f"{b['tp_comm_s'] / t:.0%} in collectives, so the weights and activations fit")
    cp = plan.get("cp", 1)
    if cp > 1:
        seq = doc["training"]["seq"]
        without = [m for m in doc["best_per_mesh"] if m["plan"].get("cp", 1) == 1]
        if without:
            best = min(without, key=lambda m: m["prediction"]["step_time_s"])
            versus = (f"the best plan without cp ({best['label']}) is "
                      f"{best['prediction']['step_time_s'] / t - 1:+.1%}")
        else:
            versus = "no plan without cp fits the devices' memory"
        placed = ("cp peers are adjacent ranks, tp peers stride by cp" if plan.get("cp_innermost")
                  else f"cp peers stride by tp={plan['tp']}")
        out.append(f"cp={cp} splits every {seq}-token sequence over {cp} ranks ({seq // cp} "
                   f"tokens each, two chunks from both ends so causal attention work is equal), "
                   f"dividing activations by {cp}; {plan.get('cp_attention', 'ring')} attention "
                   f"exchanges keys and values, {b.get('cp_comm_s', 0) / t:.1%} of the step "
                   f"exposed ({placed}); {versus}")
    experts = doc["model"].get("experts", 0)
    if experts:
        ep = plan.get("ep", 1)
        others = {}
        for m in (*doc["alternatives"], *doc["best_per_mesh"]):
            e = m["plan"].get("ep", 1)
            if e != ep and (e not in others or m["prediction"]["step_time_s"]
                            < others[e]["prediction"]["step_time_s"]):
                others[e] = m
        versus = "; ".join(f"the best plan at ep={e} ({m['label']}) is "
                           f"{m['prediction']['step_time_s'] / t - 1:+.1%}"
                           for e, m in sorted(others.items()))
        imbalance = doc["training"].get("moe_imbalance", 1.0)
        if ep > 1:
            out.append(f"ep={ep} splits each block's {experts} experts over {ep} of the dp ranks "
                       f"({experts // ep} each, their weights, gradients and optimizer state "
                       f"divided by {ep}; ZeRO shards them over the dp / ep = "
                       f"{plan['dp'] // ep} ranks holding the same experts); every token goes "
                       f"to its experts' ranks and back by all-to-all, "
                       f"{b.get('ep_comm_s', 0) / t:.1%} of the step exposed; routing assumed "
                       f"{'uniform' if imbalance == 1 else f'{imbalance}x the mean on the busiest rank'}"
                       + (f"; {versus}" if versus else ""))
        else:
            out.append(f"ep=1: every rank holds all {experts} experts of each block (no "
                       f"all-to-all)" + (f"; {versus}" if versus else ""))
    if plan["pp"] > 1:
        out.append(f"pp={plan['pp']} cuts the layers into {len(plan['stages'])} stages; "
                   f"{plan['num_micro_batches']} micro-batches keep the bubble at "
                   f"{b['bubble_s'] / t:.0%}")
    if plan["recompute"] != "none":
        out.append(f"recompute={plan['recompute']} trades {b['recompute_s'] / t:.0%} of the "
                   f"step for activation memory (no cheaper plan fits)")
    if plan["zero"]:
        out.append(f"ZeRO-{plan['zero']} shards optimizer state"
                   + (" and gradients" if plan["zero"] >= 2 else "")
                   + (" and weights" if plan["zero"] >= 3 else "")
                   + (f" over dp x cp = {plan['dp'] * cp}" if cp > 1 else
                      f" over dp={plan['dp']}"))
    alts = doc["alternatives"]
    if alts:
        out.append(f"the next best plan is {alts[0]['slower_than_best']:.1%} slower")
    return out


def _diff(plan, pred, alt) -> str:
    from autopar.units import fmt_bytes, fmt_seconds

    changes = [f"{k} {plan.get(k, _DEFAULTS.get(k))}->{alt['plan'].get(k, _DEFAULTS.get(k))}"
               for k in _AXES if alt["plan"].get(k, _DEFAULTS.get(k))
               != plan.get(k, _DEFAULTS.get(k))]
    deltas = []
    for k, v in alt["prediction"]["breakdown"].items():
        d = v - pred["breakdown"].get(k, 0.0)
        if abs(d) > 0.005 * pred["step_time_s"]:
            deltas.append((abs(d), f"{k.removesuffix('_s').replace('_', ' ')} "
                                   f"{'+' if d > 0 else '-'}{fmt_seconds(abs(d))}"))
    deltas = [s for _, s in sorted(deltas, reverse=True)[:3]]
    mem = alt["prediction"]["peak_memory_bytes"] - pred["peak_memory_bytes"]
    return (", ".join(changes) or "same shape") + ("; " + ", ".join(deltas) if deltas else "") \
        + f"; memory {'+' if mem >= 0 else '-'}{fmt_bytes(abs(mem))}"


def run(args: argparse.Namespace) -> int:
    from autopar.planner.planning import read_document
    from autopar.units import console

    doc = read_document(args.plan)
    out = console()
    for line in explain_lines(doc):
        out.print(line, markup=False, highlight=False)
    return 0
