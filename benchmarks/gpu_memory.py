"""Predicted against measured peak memory on one GPU: recompute none / selective / full, micro-batch
sizes, bf16 and fp32, the optimizer state offloaded to the host.

    python benchmarks/gpu_memory.py [--model gpt2-medium] [--batch 8] [--seq 1024] [--layers N]
        [--only 0 3 4] [--json out.json]

Every configuration runs in this one process on one CUDA device (NCCL, a world of one):
``autopar.parallelize`` with the plan pinned (tp = pp = dp = 1, ZeRO-0, the micro-batch size and
the recompute setting of the row), two training steps (AdamW), then:

- **states, measured**: ``torch.cuda.memory_allocated()`` after step 1 (after step 1 the
  optimizer state exists): parameters, master weights, gradients and AdamW's moments;
- **peak, measured**: ``torch.cuda.max_memory_allocated()`` over steps 2-4, the peak
  statistics reset before them: the states plus what a step allocates on top (activations, the
  optimizer's temporaries); the mean wall time of those steps is printed beside the predicted
  step time (three steps: a rough figure; ``gpu_step.py`` times steps properly);
- **predicted**: the cost model's :class:`~autopar.plan_types.Prediction` for the same plan
  (``CostModel.evaluate`` of the pinned candidate on the device's preset): its
  weights + gradients + optimizer (states) and ``peak_memory_bytes``.

Allocated bytes, not reserved ones: the caching allocator's fragmentation, the CUDA context and
NCCL's buffers are the cluster's ``reserved_memory_bytes`` (docs/cost-model.md), so the table also
prints ``max_memory_reserved`` to show that headroom. Rows where the plan does not fit are
skipped with the error.

On a machine without CUDA the script runs the same code on the CPU (gloo) with a tiny model and
prints no memory figures: a check that it runs, nothing more.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time

from gpu_step import predict  # benchmarks/ is the script's directory

#: Steps timed (and whose peak is taken) after the first.
TIMED_STEPS = 3

#: (label, recompute, micro-batch divisor of the batch, mixed precision, offload)
CONFIGS = (
    ("bf16, no recompute, mbs = batch", "none", 1, True, "none"),
    ("bf16, no recompute, mbs = batch / 2", "none", 2, True, "none"),
    ("bf16, no recompute, mbs = batch / 4", "none", 4, True, "none"),
    ("bf16, selective recompute, mbs = batch", "selective", 1, True, "none"),
    ("bf16, full recompute, mbs = batch", "full", 1, True, "none"),
    ("bf16, full recompute, mbs = batch / 2", "full", 2, True, "none"),
    ("bf16, no recompute, optimizer offloaded", "none", 1, True, "optimizer"),
    ("fp32, no recompute, mbs = batch", "none", 1, False, "none"),
)


def run_config(zm_factory, inputs, targets, batch: int, seq: int, recompute: str, div: int,
               mixed: bool, offload: str, preset: str, cuda: bool) -> dict:
    import torch

    import autopar

    zm = zm_factory()
    mbs = max(batch // div, 1)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                             loss_fn=zm.loss_fn, mixed_precision=mixed,
                             plan={"tp": 1, "pp": 1, "dp": 1, "num_micro_batches": batch // mbs,
                                   "zero": 0, "recompute": recompute, "offload": offload},
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    setup_s = time.perf_counter() - t0
    pred = predict(pm.captured, preset, batch, seq, micro_batch_size=mbs, recompute=recompute,
                   dtype="bf16" if mixed else "fp32", offload=offload)
    row = {"recompute": recompute, "micro_batch_size": mbs, "mixed_precision": mixed,
           "offload": offload, "setup_s": setup_s,
           "predicted_states": sum(pred.memory.get(k, 0)
                                   for k in ("weights", "gradients", "optimizer")),
           "predicted_peak": pred.peak_memory_bytes, "predicted_memory": dict(pred.memory),
           "counted": pm.memory_bytes()}
    loss1 = pm.train_step(inputs, targets)
    if cuda:
        torch.cuda.synchronize()
        row["measured_states"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    later = [pm.train_step(inputs, targets) for _ in range(TIMED_STEPS)]
    if cuda:
        torch.cuda.synchronize()
        row["measured_peak"] = torch.cuda.max_memory_allocated()
        row["measured_reserved"] = torch.cuda.max_memory_reserved()
    row["measured_step_s"] = (time.perf_counter() - t0) / TIMED_STEPS
    row["predicted_step_s"] = pred.step_time_s
    row["losses"] = [loss1, *later]
    pm.close()
    del pm, zm
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, help="override the model's depth")
    ap.add_argument("--only", type=int, nargs="*", help="run these rows of CONFIGS (0-based)")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--cluster", help="price the step times with this cluster file (e.g. from "
                                      "`autopar calibrate --device cuda`) instead of the preset")
    args = ap.parse_args(argv)

    import torch

    from autopar import models
    from autopar.cluster import preset_for_device

    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        device_name = torch.cuda.get_device_name(0)
        model, batch, seq = args.model, args.batch, args.seq
    else:  # a check that the script runs: a tiny model, no memory figures
        device_name, model, batch, seq = "cpu", "gpt", 4, 32
    preset = args.cluster or preset_for_device(device_name)
    small = ({"layers": args.layers} if args.layers else {}) if cuda else \
        {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32}
    factory = functools.partial(models.build, model, dropout=0.0, seed=0, **small)
    zm = factory()
    gen = torch.Generator().manual_seed(0)
    inputs, targets = zm.example_inputs(batch=batch, seq=seq, generator=gen)
    del zm
    rows = []
    for i, (label, recompute, div, mixed, offload) in enumerate(CONFIGS):
        if args.only is not None and i not in args.only:
            continue
        if not cuda and mixed:
            continue  # bf16 on a CPU is not what this measures
        try:
            row = run_config(factory, inputs, targets, batch, seq, recompute, div, mixed,
                             offload, preset, cuda)
        except Exception as exc:  # a row that does not fit or fails: say so, go on
            row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        row["label"] = label
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"device": device_name, "torch": torch.__version__, "model": model, "batch": batch,
           "seq": seq, "preset": preset, "rows": rows}
    gib = 2.0 ** 30
    print(f"\n{device_name}, torch {torch.__version__}, {model}, batch {batch} x {seq}, "
          f"preset {preset}")
    print("| plan | states predicted | states measured | error | peak predicted | "
          "peak measured | error | reserved | step predicted | step measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r or "measured_peak" not in r:
            print(f"| {r['label']} | {r.get('error', 'no CUDA: not measured')} |")
            continue
        se = r["predicted_states"] / r["measured_states"] - 1
        pe = r["predicted_peak"] / r["measured_peak"] - 1
        print(f"| {r['label']} | {r['predicted_states'] / gib:.2f} GiB | "
              f"{r['measured_states'] / gib:.2f} GiB | {se:+.1%} | "
              f"{r['predicted_peak'] / gib:.2f} GiB | {r['measured_peak'] / gib:.2f} GiB | "
              f"{pe:+.1%} | {r['measured_reserved'] / gib:.2f} GiB | "
              f"{r['predicted_step_s'] * 1e3:.1f} ms | {r['measured_step_s'] * 1e3:.1f} ms |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
