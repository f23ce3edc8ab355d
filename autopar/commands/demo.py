"""``autopar demo``: plan and train a small GPT on local CPU ranks beside a single-process run."""

from __future__ import annotations

import argparse

from autopar.runtime.schedules import ScheduleKind


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="plan and train a small GPT on local CPU ranks",
                       description="Plans a small GPT for N local gloo ranks, trains it on the "
                                   "text corpus shipped with autopar, and compares the loss with "
                                   "the same training in one process.")
    p.add_argument("--nproc", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    for name in ("dp", "tp", "pp"):
        p.add_argument(f"--{name}", type=int, help=f"pin {name} (default: searched)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="pin the ZeRO stage")
    p.add_argument("--schedule", choices=[k.value for k in ScheduleKind])
    p.add_argument("--cluster", help="price the plan on this cluster file or preset (default: "
                                     "this machine, calibrated quickly on first use and "
                                     "cached; `cpu`: the committed preset)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from autopar.demo import DemoConfig, run_demo

    pins = {k: getattr(args, k) for k in ("dp", "tp", "pp", "zero", "schedule")
            if getattr(args, k) is not None}
    report = run_demo(DemoConfig(nproc=args.nproc, steps=args.steps, pins=pins,
                                 cluster=args.cluster))
    return 0 if report["agrees"] else 1
