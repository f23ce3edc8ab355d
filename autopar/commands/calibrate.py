"""``autopar calibrate --out cluster.json``: measure this machine and write a cluster file."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="measure this machine's GEMM rate and collectives; write a cluster file",
        description="Start WORLD local gloo processes (one thread each), time torch.mm, memory "
                    "copies, a kernel's floor and fused attention on every rank at once, time "
                    "all-reduce / all-gather / reduce-scatter / send-recv from 4 KiB to 16 MiB "
                    "(back to back and after compute), fit the ring model's latency and "
                    "bandwidth for each, and write the result as a cluster file that "
                    "`autopar plan --cluster FILE` reads.")
    p.add_argument("--out", required=True, metavar="FILE", help="cluster file (.json or .yaml)")
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--name", help="cluster name (default calibrated-HOSTNAME)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--raw", metavar="FILE", help="also write every measurement as JSON")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: WORLD local gloo processes (default); cuda: this machine's first "
                        "GPU, with the links of --base")
    p.add_argument("--base", metavar="PRESET",
                   help="with --device cuda: the preset whose nodes and links the file keeps "
                        "(default: the one named after the GPU)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from autopar.errors import InvalidInputError
    from autopar.planner.calibration import calibrate_cluster
    from autopar.units import fmt_bytes, fmt_seconds

    if args.device == "cuda":
        return _run_cuda(args)
    if args.world < 2:
        raise InvalidInputError("calibration needs at least two processes",
                                expected="--world >= 2", found=str(args.world),
                                fix="pass --world 2 (or more)")
    cluster, raw = calibrate_cluster(args.world, quick=args.quick, name=args.name)
    d = cluster.device
    return _write_and_show(args, cluster, raw, f"{args.world} processes", [
        ("GEMM fp32", f"{d.peak_flops['fp32'] / 1e9:.2f} GFLOP/s"),
        ("GEMM bf16", f"{d.peak_flops['bf16'] / 1e9:.2f} GFLOP/s"),
        ("memory bandwidth", f"{fmt_bytes(d.memory_bandwidth)}/s"),
        ("kernel floor", fmt_seconds(d.kernel_floor_s)),
        ("attention / GEMM rate", f"{d.attention_efficiency:.2f}"),
        ("AdamW step per parameter", fmt_seconds(d.optimizer_s_per_param)),
        ("AdamW step per tensor", fmt_seconds(d.optimizer_s_per_tensor)),
        ("host per graph node, forward / backward",
         f"{fmt_seconds(d.node_overhead_s)} / {fmt_seconds(d.node_backward_overhead_s)}"),
        ("split backward per autograd node", fmt_seconds(d.split_backward_overhead_s)),
        ("full recompute's checkpoint per block / per saved tensor",
         f"{fmt_seconds(d.checkpoint_call_overhead_s)} / "
         f"{fmt_seconds(d.checkpoint_tensor_overhead_s)}"),
        *[(f"{name} latency / bus bandwidth", f"{fmt_seconds(raw[key]['latency_s'])} / "
                                              f"{fmt_bytes(raw[key]['bus_bandwidth'])}/s")
          for name, key in (("all-reduce", "all_reduce"), ("all-gather", "all_gather"),
                            ("reduce-scatter", "reduce_scatter"))],
        ("collective arrival after compute", fmt_seconds(raw["arrival"]["latency_s"])),
        ("p2p latency / bandwidth", f"{fmt_seconds(raw['p2p']['latency_s'])} / "
                                    f"{fmt_bytes(raw['p2p']['bandwidth'])}/s"),
        ("cores / oversubscribed efficiency",
         f"{cluster.cores_per_node} / {cluster.oversubscription_efficiency:.2f}")])


def _run_cuda(args: argparse.Namespace) -> int:
    import torch

    from autopar.errors import InvalidInputError
    from autopar.planner.calibration_cuda import calibrate_cuda_cluster
    from autopar.units import fmt_bytes, fmt_seconds

    if not torch.cuda.is_available():
        raise InvalidInputError("--device cuda needs a CUDA device", expected="a visible GPU",
                                found="torch.cuda.is_available() is False",
                                fix="run on a GPU machine, or calibrate the CPU (--device cpu)")
    cluster, raw = calibrate_cuda_cluster(args.base, quick=args.quick, name=args.name)
    d = cluster.device
    return _write_and_show(args, cluster, raw, raw["device_name"], [
        ("GEMM bf16 (best)", f"{d.peak_flops['bf16'] / 1e12:.1f} TFLOP/s"),
        ("GEMM fp32 (no TF32)", f"{d.peak_flops['fp32'] / 1e12:.1f} TFLOP/s"),
        ("copy bandwidth", f"{fmt_bytes(d.memory_bandwidth)}/s"),
        ("kernel floor", fmt_seconds(d.kernel_floor_s)),
        ("attention / GEMM rate", f"{d.attention_efficiency:.2f}"),
        ("launch per node (forward / backward)",
         f"{fmt_seconds(d.launch_overhead_s)} / {fmt_seconds(d.launch_backward_overhead_s)}"),
        ("recompute's checkpoint per block / saved tensor",
         f"{fmt_seconds(d.checkpoint_call_overhead_s)} / "
         f"{fmt_seconds(d.checkpoint_tensor_overhead_s)}"),
        ("host AdamW per parameter / per tensor",
         f"{cluster.host_optimizer_s_per_param * 1e9:.2f} ns / "
         f"{fmt_seconds(cluster.host_optimizer_s_per_tensor)}")])


def _write_and_show(args: argparse.Namespace, cluster, raw: dict, what: str,
                    rows: list[tuple[str, str]]) -> int:
    """Save the cluster file (and the raw measurements with --raw), print the headline table."""
    from rich.table import Table

    from autopar.units import console

    cluster.save(args.out)
    if args.raw:
        with open(args.raw, "w") as fh:
            json.dump(raw, fh, indent=1)
    table = Table(title=f"{cluster.name}: {what} -> {args.out}")
    table.add_column("quantity")
    table.add_column("measured", justify="right")
    for row in rows:
        table.add_row(*row)
    console().print(table)
    return 0
