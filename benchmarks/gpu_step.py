"""autopar on one GPU (NCCL, world of one) against eager PyTorch: a bf16 GPT-2 training step.

    python benchmarks/gpu_step.py [--model gpt2-medium] [--batch 8] [--seq 1024] [--steps 20]
        [--rounds 5] [--json out.json]

What it runs, in one process on one CUDA device:

- **autopar**: ``autopar.parallelize(model, example_inputs=..., loss_fn=..., plan={"tp": 1,
  "pp": 1, "dp": 1, "num_micro_batches": 1}, mixed_precision=True)``: the process group is NCCL
  (a world of one), the model is captured with torch.export, turned into the generated
  per-rank program (``pm.generated_code()``), and trained with bf16 compute and fp32 master
  weights, gradients reduced in fp32, AdamW.
- **eager**: the same model (same weights, same batch), ``torch.autocast(bfloat16)`` around the
  forward and the loss, fp32 parameters and AdamW (foreach): torch's standard mixed precision.

Both do forward + backward + AdamW + zero_grad per step. Rounds of ``--steps`` steps alternate
between the two (order reversed every other round), each round timed with CUDA events after
warm-up; the figure is the median over rounds, and the ratio autopar / eager is the median of
the paired ratios. Forward-only time (``pm.eval_step`` against an eager forward and loss under
``torch.no_grad``) is timed the same way: it isolates the generated module.

MFU = model FLOPs per step / step time / the device's dense bf16 peak (the ``h100-80g`` or
``h200`` preset: 989 TFLOP/s), with model FLOPs = 3 x forward FLOPs, forward FLOPs from
autopar's analysis of the captured graph (every GEMM, attention included; the closed form
l (24 b s h^2 + 4 b s^2 h) + 2 b s h V agrees within 1% on GPT shapes, tests/test_analyze.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time


def _cuda_time(fn, steps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def _kind(kernel: str) -> str:
    k = kernel.lower()
    if any(w in k for w in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(w in k for w in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")):
        return "gemm"
    if any(w in k for w in ("nccl",)):
        return "collective"
    if any(w in k for w in ("elementwise", "vectorized", "reduce", "softmax", "norm",
                            "multi_tensor", "copy", "fill", "index", "gather", "scatter")):
        return "element-wise/reduce/copy"
    return "other"


def _profile(step, steps: int = 3) -> dict:
    """GPU kernel time per step of ``step`` by kind and the 12 longest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e6 / steps
        if t <= 0 or e.key.startswith(("ProfilerStep", "aten::", "autograd::", "Optimizer")):
            continue
        kernels[e.key] = kernels.get(e.key, 0.0) + t
        kind = _kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + t
    by_kind["total"] = sum(by_kind.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"by_kind": by_kind, "top": top}


def _host_profile(step, steps: int) -> dict:
    """The host's time per step of ``step`` (no synchronization inside the loop) and the
    functions that take it (cProfile, by own time): a host-bound step spends its time in
    Python and launches, a GPU-bound one waits in a synchronizing call."""
    import cProfile
    import io
    import pstats

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host_s = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    synced_s = (time.perf_counter() - t0) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]
    return {"host_s": host_s, "synced_s": synced_s, "top": lines[-32:]}


def predict(captured, preset: str, batch: int, seq: int, *, micro_batch_size: int | None = None,
            recompute: str = "none", dtype: str = "bf16", offload: str = "none",
            optimizer_kernel: str | None = None):
    """The cost model's prediction for a pinned one-device plan (ZeRO-0, 1F1B; by default one
    micro-batch of the whole batch, no recompute, bf16) on the ``preset`` cluster (a name or
    file)."""
    from autopar.cluster import Cluster
    from autopar.plan_types import OptimizerProfile, RecomputeKind, ScheduleKind
    from autopar.planner.cost_model import Candidate, CostModel, ModelCosts, TrainingSetup

    cm = CostModel(ModelCosts(captured), Cluster.load(preset).with_devices(1),
                   TrainingSetup(batch, seq, dtype,
                                 optimizer=OptimizerProfile(kernel=optimizer_kernel)))
    ev = cm.refine(cm.evaluate(Candidate(1, 1, 1, 1, micro_batch_size or batch,
                                         ScheduleKind.ONE_F_ONE_B, RecomputeKind(recompute), 0,
                                         False, offload=offload)))
    if ev.prediction is None:
        raise RuntimeError(f"the cost model rejects the plan: {ev.infeasible}")
    return ev.prediction


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the figures as JSON to this file")
    ap.add_argument("--cluster", help="also predict with this cluster file (e.g. from "
                                      "`autopar calibrate --device cuda`)")
    ap.add_argument("--unpadded", action="store_true",
                    help="also run autopar with the vocabulary unpadded (vocab_multiple=0)")
    ap.add_argument("--compile", nargs="?", const="both", choices=("both", "autopar"),
                    help="also run autopar with compile=True and (both, the default) eager "
                         "under torch.compile (inductor; compiled before the timed rounds)")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                    help="autopar's activation recompute; with full, eager checkpoints each "
                         "block too (Hugging Face's gradient_checkpointing_enable, torch's "
                         "non-reentrant checkpoint)")
    ap.add_argument("--offload", default="none", choices=("none", "optimizer"),
                    help="autopar's optimizer offload (eager keeps its optimizer on the GPU)")
    ap.add_argument("--fused", action="store_true",
                    help="AdamW(fused=True) for autopar (on the host too, when offloaded) and "
                         "eager, priced as the fused kernel; default: torch's default (foreach "
                         "on the GPU, the for-loop on host tensors)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also run N steps of each autopar variant under cProfile and print "
                         "where the host's time goes (a step the host cannot keep ahead of the "
                         "GPU shows its Python above the kernels' time)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 3 steps of each with torch.profiler: GPU kernel time by "
                         "kind (GEMM, attention, element-wise and the rest) and the top kernels")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("gpu_step.py needs a CUDA device", file=sys.stderr)
        return 2
    import autopar
    from autopar import models
    from autopar.cluster import Cluster, preset_for_device

    device = torch.device("cuda", 0)
    kernel = {"fused": True} if args.fused else {}
    torch.backends.cuda.matmul.allow_tf32 = True
    zm = models.build(args.model, dropout=0.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    inputs, targets = zm.example_inputs(batch=args.batch, seq=args.seq, generator=gen)
    params = sum(p.numel() for p in zm.model.parameters())
    x, y = inputs[0].to(device), targets[0].to(device)

    def parallelized(vocab_multiple: int, compile: bool):
        model = models.build(args.model, dropout=0.0, seed=0).model
        t0 = time.perf_counter()
        pm = autopar.parallelize(model, example_inputs=inputs, example_targets=targets,
                                 loss_fn=zm.loss_fn, mixed_precision=True, compile=compile,
                                 plan={"tp": 1, "pp": 1, "dp": 1, "num_micro_batches": 1,
                                       "zero": 0, "recompute": args.recompute,
                                       "offload": args.offload,
                                       "vocab_multiple": vocab_multiple},
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4,
                                                             **kernel))
        setup = time.perf_counter() - t0
        return pm, setup, (lambda: pm.train_step(inputs, targets)), \
            (lambda: pm.eval_step(inputs, targets))

    def eager(compile: bool):
        model = models.build(args.model, dropout=0.0, seed=0).model.to(device)
        if args.recompute == "full":  # torch's checkpoint per block, as Hugging Face runs it
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **(kernel or {"foreach": True}))
        run = torch.compile(model) if compile else model

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = zm.loss_fn(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def forward() -> float:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                return float(zm.loss_fn(run(x), y))
        return step, forward

    variants: dict[str, tuple] = {}
    setup_s: dict[str, float] = {}
    # the first losses, same weights and batch: a sanity check of the bf16 path
    first: dict[str, float] = {}
    pm, setup_s["autopar"], *fns = parallelized(128, False)
    variants["autopar"] = tuple(fns)
    variants["eager"] = eager(False)
    closing = [pm]
    if args.unpadded:
        pm0, setup_s["autopar, vocabulary unpadded"], *fns = parallelized(0, False)
        variants["autopar, vocabulary unpadded"] = tuple(fns)
        closing.append(pm0)
    if args.compile == "both":
        t0 = time.perf_counter()
        variants["eager, torch.compile"] = eager(True)
        # compiled outside the rounds: the no_grad forward, then forward + backward
        first["eager, torch.compile"] = variants["eager, torch.compile"][1]()
        for _ in range(2):
            variants["eager, torch.compile"][0]()
        setup_s["eager, torch.compile"] = time.perf_counter() - t0
    if args.compile:
        pmc, setup_s["autopar, compile=True"], *fns = parallelized(128, True)
        t0 = time.perf_counter()
        first["autopar, compile=True"] = fns[1]()
        for _ in range(2):
            fns[0]()
        setup_s["autopar, compile=True"] += time.perf_counter() - t0
        variants["autopar, compile=True"] = tuple(fns)
        closing.append(pmc)
    backend = dist.get_backend()
    from autopar.passes.analyze import analyze

    fwd_flops = float(analyze(pm.captured).forward_flops(b=args.batch, s=args.seq))
    preset = preset_for_device(torch.cuda.get_device_name(0))
    peak = Cluster.load(preset).peak_flops("bf16")

    planned = dict(recompute=args.recompute, offload=args.offload,
                   optimizer_kernel="fused" if args.fused else None)
    predicted = predict(pm.captured, preset, args.batch, args.seq, **planned)
    calibrated = (predict(pm.captured, args.cluster, args.batch, args.seq, **planned)
                  if args.cluster else None)

    first = {name: float(first[name]) if name in first else float(fwd())
             for name, (_, fwd) in variants.items()}
    for step, fwd in variants.values():  # warm-up
        for _ in range(3):
            step()
            fwd()
    names = list(variants)
    rows: dict[str, list[float]] = {f"{n}|{k}": [] for n in names for k in ("step", "forward")}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # the order rotates by round
            step, fwd = variants[name]
            rows[f"{name}|step"].append(_cuda_time(step, args.steps))
            rows[f"{name}|forward"].append(_cuda_time(fwd, args.steps))
    med = {k: statistics.median(v) for k, v in rows.items()}

    def ratio(name: str, kind: str) -> float:
        return statistics.median(a / e for a, e in zip(rows[f"{name}|{kind}"],
                                                       rows[f"eager|{kind}"]))

    tokens = args.batch * args.seq
    out = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backend": backend,
        "model": args.model, "params": params, "batch": args.batch, "seq": args.seq,
        "recompute": args.recompute, "offload": args.offload,
        "setup_s": setup_s, "forward_flops": fwd_flops, "peak_bf16": peak,
        "first_loss": first, "median_s": med,
        "step_ratio": {n: ratio(n, "step") for n in names},
        "forward_ratio": {n: ratio(n, "forward") for n in names},
        "tokens_per_s": {n: tokens / med[f"{n}|step"] for n in names},
        "mfu": {n: 3 * fwd_flops / med[f"{n}|step"] / peak for n in names},
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "rounds": rows,
        # the cost model's prediction for this plan on the preset (h100-80g / h200), for the
        # cost model's measured-error table (docs/cost-model.md)
        "predicted_step_s": predicted.step_time_s,
        "predicted_breakdown": dict(predicted.breakdown),
        "calibrated_step_s": calibrated.step_time_s if calibrated else None,
        "calibrated_breakdown": dict(calibrated.breakdown) if calibrated else None,
    }
    print(json.dumps(out, indent=1))
    print()
    print(f"{out['device']}, torch {out['torch']}, backend {backend}, {args.model} "
          f"({params / 1e6:.0f}M params), batch {args.batch} x {args.seq} tokens, bf16, "
          f"autopar's recompute {args.recompute}, offload {args.offload}")
    print("| | step ms (median) | x eager | forward ms | x eager | tokens/s | MFU | first loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        print(f"| {name} | {med[f'{name}|step'] * 1e3:.1f} | {out['step_ratio'][name]:.3f} | "
              f"{med[f'{name}|forward'] * 1e3:.1f} | {out['forward_ratio'][name]:.3f} | "
              f"{out['tokens_per_s'][name]:,.0f} | {out['mfu'][name]:.3f} | "
              f"{first[name]:.5f} |")
    for label, p in ((preset, predicted), (args.cluster, calibrated)):
        if p is not None:
            print(f"autopar's prediction for this plan ({label}): {p.step_time_s * 1e3:.1f} "
                  f"ms/step ({p.step_time_s / med['autopar|step'] - 1:+.0%} vs measured); "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.breakdown.items() if v))
    if args.profile:
        out["profile"] = {name: _profile(variants[name][0]) for name in names}
        for name, prof in out["profile"].items():
            print(f"{name}: GPU kernel ms per step by kind: "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in prof["by_kind"].items()))
            for kernel, t in prof["top"]:
                print(f"    {t * 1e3:7.2f} ms  {kernel[:110]}")
    if args.host_profile:
        out["host_profile"] = {name: _host_profile(variants[name][0], args.host_profile)
                               for name in names if name.startswith("autopar")}
        for name, prof in out["host_profile"].items():
            print(f"{name}: host seconds per step {prof['host_s']:.4f} "
                  f"(GPU-synchronized {prof['synced_s']:.4f}); top functions by own time:")
            for line in prof["top"]:
                print("    " + line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    for p in closing:
        p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
