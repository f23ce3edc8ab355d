"""Loading a ~1B-parameter model into 4 CPU ranks from a safetensors directory, against
transformers' ``from_pretrained`` in one process.

Writes a GPT-2-style checkpoint (``save_pretrained``, fp32) once, then, each in fresh processes:

* ``from_pretrained`` in one process: wall time and peak resident memory (VmHWM);
* ``autopar.parallelize(model_on_meta, checkpoint=dir)`` on 4 gloo ranks under each plan given
  (default: pp 4, tp 2 x pp 2, dp 4 with ZeRO-3): wall time of the call (the slowest rank) and
  every rank's peak resident memory, with what the rank keeps (parameters, gradients).

    .venv/bin/python benchmarks/load_large.py                 # ~1.1B parameters, 4.4 GB on disk
    .venv/bin/python benchmarks/load_large.py --layers 4 --hidden 512 --json   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = {"pp4": dict(dp=1, pp=4, tp=1, num_micro_batches=4, zero=0),
         "tp2pp2": dict(dp=1, pp=2, tp=2, num_micro_batches=2, zero=0),
         "dp4-zero3": dict(dp=4, pp=1, tp=1, num_micro_batches=1, zero=3)}


def _config(args):
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                      vocab_size=args.vocab, n_positions=args.seq, tie_word_embeddings=True,
                      use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def from_pretrained(path: str) -> dict:
    """Run in a fresh process: transformers' own load of the whole model."""
    from transformers import GPT2LMHeadModel

    before = _rss()
    start = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32)
    seconds = time.perf_counter() - start
    lazy = dict(seconds=seconds, peak=_hwm(), growth=_hwm() - before)
    # the weights may still be pages of the mapped file: read every one, as training will
    with torch.no_grad():
        total = sum(float(p.double().sum()) for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    return dict(seconds=time.perf_counter() - start, peak=_hwm(), growth=_hwm() - before,
                params=params, lazy=lazy, checksum=total)


def load_rank(path: str, plan: dict, seq: int) -> dict:
    """One rank of a LocalPool job: build on meta, parallelize from the checkpoint."""
    import functools

    import torch.distributed as dist
    from transformers import AutoConfig, GPT2LMHeadModel

    import autopar

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (plan["num_micro_batches"] * plan["dp"], seq + 1))

    def loss_fn(out, targets):
        logits = out.logits if hasattr(out, "logits") else out
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark starts now
        f.write("5")
    before = _rss()
    dist.barrier()
    start = time.perf_counter()
    pm = autopar.parallelize(model, example_inputs=(tokens[:, :-1],),
                             example_targets=(tokens[:, 1:],), loss_fn=loss_fn, plan=dict(plan),
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                             checkpoint=path)
    seconds = time.perf_counter() - start
    memory = pm.memory_bytes()
    out = dict(seconds=seconds, peak=_hwm(), growth=_hwm() - before,
               kept=memory["params"], grads=memory["grads"],
               coordinates=(pm.mesh.dp_rank, pm.mesh.pp_rank, pm.mesh.tp_rank))
    pm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--plans", nargs="*", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--dir", default=None, help="where the checkpoint goes (default: a "
                                                     "temporary directory, removed after)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from autopar.runtime.local_pool import LocalPool

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "model")
        from transformers import GPT2LMHeadModel

        start = time.perf_counter()
        torch.manual_seed(0)
        model = GPT2LMHeadModel(_config(args))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(path, max_shard_size="2GB")
        del model
        written = time.perf_counter() - start
        code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); "
                f"from benchmarks.load_large import from_pretrained; "
                f"print(json.dumps(from_pretrained({path!r})))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True)
        reference = json.loads(done.stdout.strip().splitlines()[-1])
        results = {}
        for name in args.plans:
            with LocalPool(4, timeout_s=1800) as pool:
                results[name] = pool.run(load_rank, path, PLANS[name], args.seq, timeout_s=1800)
    report = dict(params=params, file_bytes=params * 4, write_seconds=written,
                  from_pretrained=reference, autopar=results)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    gib = 2 ** 30
    print(f"{params / 1e9:.2f}B parameters, {params * 4 / gib:.2f} GiB fp32 "
          f"(written in {written:.0f} s)")
    lazy = reference["lazy"]
    print(f"from_pretrained, 1 process: {lazy['seconds']:.1f} s mapped (+"
          f"{lazy['growth'] / gib:.2f} GiB), {reference['seconds']:.1f} s with every weight "
          f"read: peak RSS {reference['peak'] / gib:.2f} GiB (+{reference['growth'] / gib:.2f})")
    for name, per_rank in results.items():
        slowest = max(r["seconds"] for r in per_rank)
        print(f"autopar {name}, 4 ranks: {slowest:.1f} s (slowest rank)")
        for r in per_rank:
            print(f"  rank {r['coordinates']}: peak RSS {r['peak'] / gib:.2f} GiB "
                  f"(+{r['growth'] / gib:.2f}), keeps {r['kept'] / gib:.2f} GiB parameters + "
                  f"{r['grads'] / gib:.2f} GiB gradients")


if __name__ == "__main__":
    main()
