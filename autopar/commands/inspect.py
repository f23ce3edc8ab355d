"""``autopar inspect MODEL``: per-layer parameters, forward FLOPs and activation memory."""

from __future__ import annotations

import argparse
import json

from autopar.commands._model_args import add_model_args, model_overrides


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="capture a model and show its per-layer costs",
                       description="Capture MODEL (on the meta device: no weights are allocated) "
                                   "and print parameters, forward FLOPs and activation bytes per "
                                   "layer at the given batch and sequence length.")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's maximum)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="parameter/activation dtype (default fp32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--full", action="store_true",
                   help="capture every block (default: a model deeper than two blocks is "
                        "captured two deep and its last block repeated, as the planner does)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from autopar.report import inspect_model

    report = inspect_model(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype,
                           full=args.full, **model_overrides(args))
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
        return 0
    _print_table(report)
    return 0


def _print_table(report) -> None:
    from rich.table import Table

    from autopar.report import collapse_repeated
    from autopar.units import console, fmt_bytes, fmt_count, fmt_flops

    table = Table(title=f"{report.model}  batch={report.batch} seq={report.seq} {report.dtype}",
                  caption=f"captured with {report.capture_method} in {report.capture_s:.1f} s"
                          + (f" ({report.blocks_captured} blocks, the last repeated)"
                             if report.blocks_captured is not None else "") + ", "
                          f"analyzed in {report.analyze_s:.2f} s; activation bytes = tensors "
                          f"saved for backward")
    table.add_column("layer", no_wrap=True)
    for column in ("x", "params", "fwd FLOPs", "activations"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("holds", max_width=28, overflow="ellipsis", no_wrap=True)
    for row, count, name in collapse_repeated(report.layers):
        holds = "repeated block" if count > 1 or row["kind"] == "block" else \
            ", ".join(m.rsplit(".", 1)[-1] for m in row["modules"][:4])
        table.add_row(name, str(count), fmt_count(row["params"]), fmt_flops(row["forward_flops"]),
                      fmt_bytes(row["activation_bytes"]), holds)
    table.add_section()
    table.add_row("total", str(len(report.layers)), fmt_count(report.params),
                  fmt_flops(report.forward_flops), fmt_bytes(report.activation_bytes), "")
    console().print(table)
