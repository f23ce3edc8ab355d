"""Resident memory and step time of one process training with its optimizer state on disk
(``Plan.offload = "disk"``) against the same training with the state in memory, one run.

Each mode runs in a fresh process (peak RSS only grows), alternating rounds so that machine noise
hits both alike: a GPT (examples/gpt.py, fp32, AdamW) is parallelized on one gloo process, trained
``--steps`` steps, and measured: the process's resident set after the last step (``VmRSS``) and its
peak (``VmHWM``), the median step time, and what ``ParallelModel.memory_bytes`` counts (parameters,
gradients, optimizer state in memory, optimizer state in files). Adam's two fp32 moments are 8
bytes per parameter; with ``disk`` they live in files and at most three buckets' worth are in
memory during the step. The file pages the kernel caches are not the process's (they are not in
its RSS, and the kernel drops them under memory pressure).

    .venv/bin/python benchmarks/offload_memory.py                 # ~70M parameters, 3 rounds
    .venv/bin/python benchmarks/offload_memory.py --hidden 1024 --layers 8 --json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # examples/ is not installed
    sys.path.insert(0, ROOT)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run_one(offload: str, layers: int, hidden: int, vocab: int, seq: int, batch: int,
            steps: int, bucket_mb: float) -> dict:
    """One process: parallelize, train, measure (called in a fresh interpreter)."""
    import torch

    import autopar
    from examples.gpt import GPT, GPTConfig, gpt_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, hidden=hidden, heads=max(1, hidden // 64), vocab=vocab,
                          seq=seq))
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with tempfile.TemporaryDirectory() as directory:
        pm = autopar.parallelize(
            model, example_inputs=(x,), example_targets=(y,), loss_fn=gpt_loss,
            plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1, "offload": offload},
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), bucket_mb=bucket_mb,
            offload_dir=directory)
        del model
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            pm.train_step((x,), (y,))
            times.append(time.perf_counter() - start)
        gc.collect()  # the last step's cyclic garbage, in both modes alike
        out = {"offload": offload, "params": params, "rss": _status_bytes("VmRSS"),
               "peak_rss": _status_bytes("VmHWM"), "step_s": statistics.median(times[1:]),
               "first_step_s": times[0], "memory": pm.memory_bytes()}
        pm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = dict(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq,
                 batch=args.batch, steps=args.steps, bucket_mb=args.bucket_mb)
    if args.child:
        print(json.dumps(run_one(args.child, **shape)))
        return
    runs: dict[str, list[dict]] = {"none": [], "disk": []}
    for _ in range(args.rounds):
        for mode in runs:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode,
                   *[f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]]
            env = {**os.environ, "MASTER_PORT": str(29500 + len(runs[mode]) * 2
                                                    + (mode == "disk"))}
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {
            "params": rs[0]["params"],
            "rss_mib": statistics.median(r["rss"] for r in rs) / 2**20,
            "peak_rss_mib": statistics.median(r["peak_rss"] for r in rs) / 2**20,
            "step_s": statistics.median(r["step_s"] for r in rs),
            "optimizer_in_memory_mib": rs[0]["memory"]["optimizer"] / 2**20,
            "optimizer_on_disk_mib": rs[0]["memory"].get("disk", 0) / 2**20}
    ratio = {k: summary["disk"][k] / summary["none"][k]
             for k in ("rss_mib", "peak_rss_mib", "step_s")}
    result = {"shape": shape, "rounds": args.rounds, "modes": summary, "disk_over_none": ratio}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    from rich.table import Table

    from autopar.units import console

    table = Table(title=f"one process, {summary['none']['params'] / 1e6:.0f}M parameters (fp32 "
                        f"AdamW), median of {args.rounds} rounds")
    for col in ("offload", "RSS", "peak RSS", "optimizer state in memory", "on disk", "step"):
        table.add_column(col, justify="right")
    for mode, s in summary.items():
        table.add_row(mode, f"{s['rss_mib']:.0f} MiB", f"{s['peak_rss_mib']:.0f} MiB",
                      f"{s['optimizer_in_memory_mib']:.0f} MiB",
                      f"{s['optimizer_on_disk_mib']:.0f} MiB", f"{s['step_s'] * 1e3:.0f} ms")
    table.add_row("disk / none", f"{ratio['rss_mib']:.2f}", f"{ratio['peak_rss_mib']:.2f}", "",
                  "", f"{ratio['step_s']:.2f}")
    console().print(table)


if __name__ == "__main__":
    main()
