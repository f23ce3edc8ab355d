"""``autopar plan MODEL --cluster C --gpus N --global-batch B``: the fastest plan that fits."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from autopar.commands._model_args import add_model_args, model_overrides
from autopar.runtime.schedules import ScheduleKind

if TYPE_CHECKING:
    from autopar.plan_types import OptimizerProfile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="search the fastest parallel plan for a model on a cluster",
        description="Capture MODEL on the meta device, price every plan (dp, tp, pp, virtual "
                    "stages, micro-batch, schedule, recompute, ZeRO, sequence parallel) with "
                    "the hardware cost model, and print the fastest one that fits in memory. "
                    "Pinned flags fix that choice; the rest is searched.")
    add_model_args(p)
    p.add_argument("--cluster", required=True, metavar="PRESET|FILE",
                   help="a100-80g, h100-80g, h200, cpu, or a JSON/YAML cluster file")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="devices in all")
    p.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, metavar="G",
                   help="devices per node (default: the preset's node)")
    p.add_argument("--global-batch", dest="global_batch", type=int, required=True, metavar="B",
                   help="sequences per optimizer step")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's maximum)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="training precision (default: the cluster's, bf16 on GPUs)")
    pins = p.add_argument_group("pinned choices (searched when absent)")
    pins.add_argument("--tp", type=int)
    pins.add_argument("--pp", type=int)
    pins.add_argument("--dp", type=int)
    pins.add_argument("--virtual-stages", dest="virtual_stages", type=int)
    pins.add_argument("--micro-batch", dest="micro_batch", type=int)
    pins.add_argument("--schedule", choices=[k.value for k in ScheduleKind])
    pins.add_argument("--recompute", choices=["none", "selective", "full"])
    pins.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    pins.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true",
                      default=None)
    pins.add_argument("--ep", type=int, help="expert parallelism (mixture-of-experts models)")
    pins.add_argument("--reshard-after-forward", dest="reshard_after_forward",
                      choices=["yes", "no"],
                      help="ZeRO-3: free each layer's weights after its forward (yes) or keep "
                           "them gathered until its backward (no)")
    pins.add_argument("--offload", choices=["none", "optimizer", "disk"],
                      help="where the optimizer state lives: with the weights (none), in host "
                           "memory (optimizer) or in files (disk); default: none, offloaded "
                           "only where memory requires it")
    p.add_argument("--moe-imbalance", dest="moe_imbalance", type=float, default=1.0,
                   metavar="F", help="mixture-of-experts: rows of the busiest expert rank over "
                                     "the mean (default 1: uniform routing)")
    p.add_argument("--optimizer", default=None, metavar="CLASS",
                   help="the torch.optim class training will use (SGD, AdamW, Adagrad, ...), "
                        "profiled on probes as parallelize profiles it: its state, and what its "
                        "step moves, calls and holds (default: AdamW's)")
    p.add_argument("--optimizer-options", dest="optimizer_options", default=None,
                   metavar="JSON", help='its keyword arguments, e.g. \'{"momentum": 0.9}\'')
    p.add_argument("--optimizer-kernel", dest="optimizer_kernel", default=None,
                   choices=["fused", "foreach", "for-loop"],
                   help="how the optimizer runs (AdamW(fused=True), foreach=True, foreach=False;"
                        " default: torch's default on the device, foreach on GPUs)")
    p.add_argument("--optimizer-state-bytes", dest="optimizer_state_bytes", type=float,
                   default=None, metavar="B",
                   help="bytes per parameter of the optimizer's own state (default: the "
                        "optimizer's, 8 for Adam's two fp32 moments; SGD with momentum 4, plain "
                        "SGD 0)")
    p.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa",
                   help="attention kernel the model is captured with (default sdpa; eager for a "
                        "transformers class without sdpa)")
    p.add_argument("--top", type=int, default=5, help="alternatives kept (default 5)")
    p.add_argument("--json", action="store_true", help="print the plan document as JSON")
    p.add_argument("--out", metavar="FILE", help="also write the plan document to FILE")
    p.set_defaults(run=run)


def space_from_args(args: argparse.Namespace):
    from autopar.planner.search import SearchSpace

    try:
        return SearchSpace(dp=args.dp, tp=args.tp, pp=args.pp, virtual_stages=args.virtual_stages,
                           micro_batch_size=args.micro_batch, schedule=args.schedule,
                           recompute=args.recompute, zero=args.zero,
                           sequence_parallel=args.sequence_parallel,
                           ep=getattr(args, "ep", None),
                           reshard_after_forward={"yes": True, "no": False, None: None}[
                               getattr(args, "reshard_after_forward", None)],
                           offload=getattr(args, "offload", None))
    except ValueError as exc:
        from autopar.errors import InvalidInputError

        raise InvalidInputError(f"bad pinned choice: {exc}", fix="see autopar plan --help") \
            from None


def run(args: argparse.Namespace) -> int:
    from autopar.cluster import Cluster
    from autopar.planner.planning import plan_model

    cluster = Cluster.load(args.cluster).with_devices(args.gpus, args.gpus_per_node)
    report = plan_model(args.model, cluster, global_batch=args.global_batch, seq=args.seq,
                        dtype=args.dtype, space=space_from_args(args), top_k=args.top + 1,
                        attention=args.attention, overrides=model_overrides(args),
                        moe_imbalance=args.moe_imbalance,
                        optimizer=optimizer_from_args(args, gpu=cluster.gpu))
    doc = report.document()  # with the model's fingerprint: parallelize refuses another model
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print_plan(doc)
    return 0


def optimizer_from_args(args: argparse.Namespace, *, gpu: bool) -> "OptimizerProfile":
    """What ``--optimizer`` and its options name, profiled on probes for the device
    (``OptimizerFactory.profile``; AdamW's without one); ``--optimizer-kernel`` and
    ``--optimizer-state-bytes`` given override what the profile found."""
    import dataclasses

    import torch

    from autopar.errors import InvalidInputError
    from autopar.plan_types import OptimizerKernel, OptimizerProfile
    from autopar.runtime.optim import OptimizerFactory

    profile = OptimizerProfile()
    if args.optimizer is not None or args.optimizer_options is not None:
        name = args.optimizer or "AdamW"
        classes = {c.__name__.lower(): c for c in vars(torch.optim).values()
                   if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
                   and c is not torch.optim.Optimizer}
        cls = classes.get(name.lower())
        if cls is None:
            raise InvalidInputError("unknown optimizer", expected="a torch.optim class: " +
                                    ", ".join(sorted(c.__name__ for c in classes.values())),
                                    found=name, fix="pass --optimizer SGD, AdamW, ...")
        try:
            options = json.loads(args.optimizer_options or "{}")
        except json.JSONDecodeError:
            options = None
        if not isinstance(options, dict):
            raise InvalidInputError("--optimizer-options is not a JSON object",
                                    expected='keyword arguments, e.g. \'{"momentum": 0.9}\'',
                                    found=str(args.optimizer_options)[:80],
                                    fix="quote a JSON object of the optimizer's keyword "
                                        "arguments")
        kernel = args.optimizer_kernel  # into the options torch reads it from
        if kernel == "fused":
            options = {**options, "fused": True}
        elif kernel is not None:
            options = {**options, "foreach": kernel == "foreach"}
        factory = OptimizerFactory(cls, options)
        factory.build([("probe", torch.zeros(2, requires_grad=True))])  # its options' errors
        profile = factory.profile(gpu=gpu)
    elif args.optimizer_kernel is not None:
        profile = OptimizerProfile(OptimizerKernel(args.optimizer_kernel))
    if args.optimizer_state_bytes is not None:
        profile = dataclasses.replace(profile, state_bytes=args.optimizer_state_bytes)
    return profile


def print_plan(doc) -> None:
    from rich.table import Table

    from autopar.units import console, fmt_bytes, fmt_seconds

    out = console()
    plan, pred, model, cl = doc["plan"], doc["prediction"], doc["model"], doc["cluster"]
    train = doc["training"]
    mesh = Table(title=f"{model['name']} on {cl['nodes']} x {cl['devices_per_node']} "
                       f"{cl['device']['name']}  (global batch {train['global_batch']} x "
                       f"{train['seq']} tokens, {train['dtype']})")
    cp = plan.get("cp", 1)
    experts = doc["model"].get("experts", 0)
    for col in ("dp", "tp", "pp", "virtual", "micro-batch", "micro-batches", "schedule",
                "recompute", "ZeRO", "seq. parallel") + (("cp",) if cp > 1 else ()) + (
                ("ep",) if experts else ()):
        mesh.add_column(col, justify="right")
    mesh.add_row(*(str(plan[k]) for k in ("dp", "tp", "pp", "virtual_stages", "micro_batch_size",
                                          "num_micro_batches", "schedule", "recompute")),
                 str(plan["zero"]),
                 "yes" if plan["sequence_parallel"] else "no",
                 *((f"{cp} ({plan.get('cp_attention', 'ring')}"
                     f"{', innermost' if plan.get('cp_innermost') else ''})",) if cp > 1 else ()),
                 *((f"{plan.get('ep', 1)} ({experts // plan.get('ep', 1)}/{experts} experts)",)
                   if experts else ()))
    out.print(mesh)
    if plan["zero"] == 3 and not plan.get("reshard_after_forward", True):
        out.print("ZeRO-3 keeps each layer's weights gathered from its forward to its backward "
                  "(reshard_after_forward=False)")
    priced = train.get("optimizer")
    if priced:  # not AdamW on torch's default kernel
        step = priced.get("step")
        out.print("optimizer priced as profiled: " + ", ".join(
            ([f"{priced['kernel']} kernel"] if "kernel" in priced else [])
            + [f"state {priced.get('state_bytes', 8.0):g} bytes a parameter"]
            + ([f"step {step['bytes_per_param']:g} bytes a parameter and "
                f"{step['ops_per_tensor']:g} calls a tensor, temporaries "
                f"{step.get('temporary_bytes') or 0:g} bytes a stepped parameter + "
                f"{step.get('tensor_temporary_bytes') or 0:g} of its largest tensor"]
               if step else [])))
    where = {"optimizer": "host memory (the step runs on the host)",
             "disk": "files under parallelize(offload_dir=...), paged per bucket"}
    if plan.get("offload", "none") != "none":
        out.print(f"optimizer state offloaded to {where[plan['offload']]}")
    vocab = model.get("vocab_padded_from", model.get("vocab"))
    if vocab:
        from autopar.passes.pad_vocab import padded_size

        multiple = plan.get("vocab_multiple", 128)
        padded = padded_size(int(vocab), multiple, plan["tp"])
        if padded != vocab:
            out.print(f"vocabulary {vocab} padded to {padded} (a multiple of {multiple} x tp "
                      f"{plan['tp']}; the padded classes are masked out of the loss)")

    stages = Table(title="pipeline stages (per micro-batch, one tensor-parallel rank)")
    for col in ("stage", "pp rank", "chunk", "layers", "from", "to", "forward", "backward",
                "rank memory"):
        stages.add_column(col, justify="right" if col not in ("from", "to") else "left")
    for s in plan["stages"]:
        stages.add_row(str(s["index"]), str(s["pp_rank"]), str(s["chunk"]),
                       f"{s['layers'][0]}-{s['layers'][1]}", s["names"][0], s["names"][1],
                       fmt_seconds(s["forward_s"]), fmt_seconds(s["backward_s"]),
                       fmt_bytes(s["rank_memory_bytes"]))
    out.print(stages)
    from autopar.commands.explain import stage_partition_lines

    for line in stage_partition_lines(doc):
        out.print(f"stages: {line}", markup=False, highlight=False)

    if doc["tp_placement"]:
        sp = " with sequence parallelism" if plan["sequence_parallel"] else ""
        tp = Table(title=f"tensor-parallel placement (tp={plan['tp']}{sp}: the sharding "
                         f"search's layout)")
        for col in ("layers", "GEMM", "split"):
            tp.add_column(col)
        for row in doc["tp_placement"]:
            first, last = row["layers"]
            where = f"{first}" if first == last else f"{first}-{last} (x{row['count']})"
            tp.add_row(where, row["module"] or "(root)", row["sharding"])
        out.print(tp)

    t = pred["step_time_s"]
    summary = Table(title="predicted step")
    for col in ("step time", "tokens/s", "TFLOP/s per device", "MFU", "HFU", "peak memory"):
        summary.add_column(col, justify="right")
    summary.add_row(fmt_seconds(t), f"{pred['tokens_per_s']:,.0f}", f"{pred['tflops_per_gpu']:.1f}",
                    f"{pred['mfu']:.1%}", f"{pred['hfu']:.1%}",
                    fmt_bytes(pred["peak_memory_bytes"]))
    out.print(summary)
    parts = Table(title="step time breakdown (bottleneck pipeline rank)")
    parts.add_column("part")
    parts.add_column("time", justify="right")
    parts.add_column("share", justify="right")
    for k, v in pred["breakdown"].items():
        parts.add_row(k.removesuffix("_s").replace("_", " "), fmt_seconds(v), f"{v / t:.1%}")
    out.print(parts)
    if doc["alternatives"]:
        alt = Table(title="next best plans")
        for col in ("plan", "step time", "MFU", "peak memory", "vs best"):
            alt.add_column(col, justify="right" if col != "plan" else "left")
        for a in doc["alternatives"]:
            p = a["prediction"]
            alt.add_row(a["label"], fmt_seconds(p["step_time_s"]), f"{p['mfu']:.1%}",
                        fmt_bytes(p["peak_memory_bytes"]), f"+{a['slower_than_best']:.1%}")
        out.print(alt)
    s = doc["search"]
    on = s.get("processes", 1)
    out.print(f"searched {s['candidates']} candidates ({s['candidates_evaluated']} priced"
              f"{f' on {on} processes' if on > 1 else ''}; "
              f"pruned: {s['pruned']}) in {s['search_s']:.1f} s; total {s['time_s']:.1f} s "
              f"(capture {s['capture_s']:.1f} s)")
