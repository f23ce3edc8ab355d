"""``autopar codegen MODEL --tp N [--rank R] --out DIR``: per-rank tensor-parallel source."""

from __future__ import annotations

import argparse

from autopar.commands._model_args import add_model_args, model_overrides


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codegen", help="write the per-rank tensor-parallel program of a model",
                       description="Capture MODEL on the meta device, choose every tensor's "
                                   "placement over N tensor-parallel ranks (ILP over "
                                   "communication and memory), insert the collectives and "
                                   "write each rank's module as Python source (rankR.py). The "
                                   "output is deterministic.")
    add_model_args(p)
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    p.add_argument("--rank", type=int, help="write only this rank (default: every rank)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--sequence-parallel", "--sp", dest="sequence_parallel", action="store_true",
                   help="shard the norm and dropout regions along the sequence")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: the program of one rank holding 1/cp of each "
                        "sequence (attention exchanges keys and values; the same source on "
                        "every cp rank)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch size costs are priced at")
    p.add_argument("--seq", type=int, help="sequence length costs are priced at "
                                           "(default: the model's maximum)")
    p.add_argument("--no-strict", dest="strict", action="store_false",
                   help="run heads / vocabulary tp does not divide replicated instead of failing")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from autopar.compiler import shard_program
    from autopar.frontend import capture
    from autopar.ir import SEQ
    from autopar.models.workload import load_workload
    from autopar.plan_types import Plan

    work = load_workload(args.model, overrides=model_overrides(args), shallow=False)
    captured = capture(work.model, work.example_inputs, work.loss_fn,
                       example_targets=work.example_targets)
    seq = args.seq or work.max_seq or captured.example_sizes.get(SEQ, 1)
    plan = Plan(tp=args.tp, sequence_parallel=args.sequence_parallel)  # the compiler's phase
    program = shard_program(captured, plan, cost=None, sizes={"b": args.batch, "s": seq},
                            strict=args.strict)
    ranks = None if args.rank is None else [args.rank]
    if args.rank is not None and not 0 <= args.rank < args.tp:
        from autopar.errors import InvalidInputError

        raise InvalidInputError("--rank is outside the tensor-parallel group",
                                expected=f"0 <= rank < {args.tp}", found=str(args.rank))
    if args.cp > 1:
        paths = _write_context_parallel(program, args.cp, args.out, ranks, work.name)
    else:
        paths = program.write(args.out, ranks)
    print(f"{work.name}: tp={args.tp}" + (f", cp={args.cp}" if args.cp > 1 else ""))
    for line in program.summary(timing=True):
        print(line)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _write_context_parallel(program, cp: int, out: str, ranks, name: str):
    """Each tp rank's module after the sequence-split transform (passes/context_parallel.py)."""
    from pathlib import Path

    from autopar.errors import InvalidInputError
    from autopar.passes.context_parallel import context_parallelize
    from autopar.passes.tp_codegen import emit_rank_source

    if cp < 1:
        raise InvalidInputError("--cp must be positive", found=str(cp))
    gm = context_parallelize(program.gm)
    summary = list(program.summary()) + [
        f"Context parallel: cp={cp}; each rank holds chunks r and {2 * cp - 1} - r of the "
        f"{2 * cp} chunks of every sequence; the cp group (forward's `cp`) carries the rank."]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in (range(program.tp) if ranks is None else ranks):
        path = folder / f"rank{r}.py"
        path.write_text(emit_rank_source(gm, tp=program.tp, rank=r, title=name, summary=summary))
        paths.append(path)
    return paths
