"""Context parallelism on local gloo processes: one long sequence split over cp = 1, 2, 4 ranks.

    .venv/bin/python benchmarks/cp_long_seq.py [--seq 4096] [--steps 3] [--cps 1 2 4]

For each cp, ``cp`` processes train LLaMA-style blocks (rotary, causal, fused attention) on a
global batch of one sequence of ``--seq`` tokens under ``plan={"cp": cp, ...}`` (ring
attention, and the all-gather variant), and report, per rank:

- the activation bytes autograd saves in one step (``torch.autograd.graph.saved_tensors_hooks``:
  every tensor saved for backward that is not a parameter, counted once per storage), against
  the cost model's ``activations`` for the same pinned plan on the ``cpu`` preset;
- the step time (median of ``--steps`` after a warm-up), against the cost model's prediction.

torch's own ``torch.distributed.tensor.experimental.context_parallel`` is tried on the same
model, data and sequence split; on a CPU build its ring dispatches only CUDA attention kernels
(flash, efficient, cuDNN), so the run reports why it cannot run here.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

MODEL = dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn_hidden=256, vocab=256)


def _data(seq: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab"], (1, seq + 1), generator=gen)
    return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)


def _saved_bytes(pm, inputs, targets, params) -> int:
    import torch

    seen: set[int] = set()
    total = [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.train_step(inputs, targets)
    return total[0]


def worker(seq: int, cp: int, steps: int, kinds: list[str]) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar import models

    out = []
    for kind in kinds:
        torch.manual_seed(0)
        zm = models.build("llama", dropout=0.0, seed=0, seq=seq, **MODEL)
        inputs, targets = _data(seq)
        pins = dict(dp=1, tp=1, pp=1, cp=cp, micro_batch_size=1, zero=0, recompute="none",
                    **({"cp_attention": kind} if cp > 1 else {}))
        pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                                 loss_fn=zm.loss_fn, plan=pins,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
        params = {p.untyped_storage().data_ptr() for p in pm.executor.params.values()}
        saved = _saved_bytes(pm, inputs, targets, params)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            loss = pm.train_step(inputs, targets)
            times.append(time.perf_counter() - start)
        pm.close()
        out.append(dict(kind=kind, saved_bytes=saved, step_s=statistics.median(times), loss=loss))
        if cp == 1:
            break
    return out


def torch_context_parallel(seq: int) -> str:
    """torch's context_parallel on the same model and sequence split: 'ok' or why not."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import models

    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as exc:
        return f"not available: {exc}"
    zm = models.build("llama", dropout=0.0, seed=0, seq=seq, **MODEL)
    inputs, targets = _data(seq)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    buffers = [inputs[0], targets[0]]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1]):
            loss = zm.loss_fn(zm.model(buffers[0]), buffers[1])
            loss.backward()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def predict(seq: int, cp: int, kind: str) -> dict:
    from autopar import models
    from autopar.cluster import Cluster
    from autopar.planner.cost_model import CostModel, ModelCosts, TrainingSetup
    from autopar.planner.search import SearchSpace, search
    from autopar.frontend import capture

    zm = models.build("llama", dropout=0.0, seed=0, seq=seq, device="meta", **MODEL)
    inputs, targets = _data(64)
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    cluster = Cluster.load("cpu").with_devices(cp)
    cm = CostModel(ModelCosts(captured), cluster, TrainingSetup(1, seq, "fp32"))
    result = search(cm, SearchSpace(dp=1, tp=1, pp=1, cp=cp, micro_batch_size=1, zero=0,
                                    recompute="none"), top_k=1)
    pred = result.best.prediction
    return dict(step_s=pred.step_time_s, activations=pred.memory.get("activations", 0),
                cp_attention=result.best.plan.cp_attention if result.best.plan else None)


def main(argv: list[str] | None = None) -> int:
    from autopar.runtime.local_pool import LocalPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    torch_status = None
    for cp in args.cps:
        with LocalPool(cp, timeout_s=900) as pool:
            per_rank = pool.run(worker, args.seq, cp, args.steps, ["ring", "allgather"],
                                timeout_s=1800)
            if cp > 1 and torch_status is None:
                torch_status = pool.run(torch_context_parallel, args.seq, timeout_s=600)[0]
        for i, kind_result in enumerate(per_rank[0]):
            kind = kind_result["kind"] if cp > 1 else "-"
            pred = predict(args.seq, cp, kind)
            saved = max(r[i]["saved_bytes"] for r in per_rank)
            step = max(r[i]["step_s"] for r in per_rank)
            rows.append(dict(cp=cp, attention=kind, saved_mib=saved / 2**20,
                             predicted_activations_mib=pred["activations"] / 2**20,
                             step_s=step, predicted_step_s=pred["step_s"],
                             planner_picks=pred["cp_attention"] if cp > 1 else "-",
                             loss=kind_result["loss"]))
    print(f"one sequence of {args.seq} tokens, LLaMA blocks {MODEL}, gloo on this host")
    print(f"{'cp':>3} {'attention':>10} {'saved MiB':>10} {'pred. MiB':>10} {'step s':>8} "
          f"{'pred. s':>8} {'err':>6} {'loss':>8}")
    for r in rows:
        err = r["predicted_step_s"] / r["step_s"] - 1
        print(f"{r['cp']:>3} {r['attention']:>10} {r['saved_mib']:>10.1f} "
              f"{r['predicted_activations_mib']:>10.1f} {r['step_s']:>8.3f} "
              f"{r['predicted_step_s']:>8.3f} {err:>+6.0%} {r['loss']:>8.4f}")
    print(f"torch context_parallel on this host: {torch_status}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "torch": torch_status}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
