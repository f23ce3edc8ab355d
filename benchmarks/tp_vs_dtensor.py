"""autopar's tensor parallelism against DTensor's Megatron plan, same model, one run.

Both train the same decoder (separate q / k / v projections, heads read from the local shape, as
torchtitan writes its models so that DTensor's plans apply) on the same gloo processes, data and
optimizer (AdamW), in paired rounds (both back to back, order alternating) so that machine noise
hits both alike:

- ``autopar``: ``autopar.parallelize(model, plan={"tp": world, ...})``, its sharding search's
  layout (Megatron's column / row pairs, vocabulary-parallel embedding, LM head and loss);
- ``dtensor``: ``torch.distributed.tensor.parallel.parallelize_module`` with torchtitan's plan:
  q, k, v and the MLP's first GEMM ``ColwiseParallel``, the attention output and the MLP's second
  GEMM ``RowwiseParallel``, the embedding ``RowwiseParallel`` (vocabulary-split table, replicated
  output), the LM head ``ColwiseParallel`` with ``loss_parallel`` (the cross-entropy on
  vocabulary-split logits).

One step is forward, backward, optimizer step, zero_grad on the whole batch (every tp rank sees
it). The ratio is the median over rounds of (autopar / DTensor) step time.

    .venv/bin/python benchmarks/tp_vs_dtensor.py                 # world 2, gloo, CPU
    .venv/bin/python benchmarks/tp_vs_dtensor.py --world 4 --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden) for _ in range(3))
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _dtensor(model: nn.Module, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel, parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
        })
    return loss_parallel


def _bench(config: dict, steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    import autopar

    world = dist.get_world_size()
    torch.manual_seed(0)
    base = Decoder(**config)
    g = torch.Generator().manual_seed(0)  # every tp rank sees the same batch
    data = [torch.randint(0, config["vocab"], (config["batch"] if "batch" in config else 8,
                                               config["seq"] + 1), generator=g) for _ in range(4)]
    options = {"lr": 1e-4, "weight_decay": 0.1}
    runners = {}

    pm = autopar.parallelize(copy.deepcopy(base), example_inputs=(data[0][:, :-1],),
                             example_targets=(data[0][:, 1:],), loss_fn=lm_loss,
                             plan={"dp": 1, "tp": world, "pp": 1, "num_micro_batches": 1},
                             optimizer=functools.partial(torch.optim.AdamW, **options))
    runners["autopar"] = lambda x, y: pm.train_step((x,), (y,))

    dt_model = copy.deepcopy(base)
    loss_parallel = _dtensor(dt_model, world)
    dt_opt = torch.optim.AdamW(dt_model.parameters(), **options)

    def dtensor_step(x, y):
        with loss_parallel():
            lm_loss(dt_model(x), y).backward()
        dt_opt.step()
        dt_opt.zero_grad(set_to_none=True)

    runners["dtensor"] = dtensor_step
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for name in names:  # warm-up
        for i in range(2):
            runners[name](data[i][:, :-1].contiguous(), data[i][:, 1:].contiguous())
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                tokens = data[i % len(data)]
                runners[name](tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    counts: dict[str, int] = {}
    for kind in pm.tp_program.gemm_sharding.values():
        counts[kind.value] = counts.get(kind.value, 0) + 1
    layout = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    pm.close()
    return {"times": times, "params": sum(p.numel() for p in base.parameters()),
            "autopar_layout": layout}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="steps per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from autopar.runtime.local_pool import LocalPool

    config = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                  seq=args.seq)
    with LocalPool(args.world, timeout_s=1800) as pool:
        out = pool.run(_bench, config, args.steps, args.rounds, timeout_s=3600)[0]
    t = out["times"]
    ratios = [a / b for a, b in zip(t["autopar"], t["dtensor"])]
    result = {"config": vars(args), "params": out["params"], "torch": torch.__version__,
              "median_step_s": {k: statistics.median(v) for k, v in t.items()},
              "ratio_autopar_vs_dtensor": statistics.median(ratios), "per_round_ratio": ratios}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"decoder {out['params'] / 1e6:.2f}M params, tp {args.world} (gloo, 1 thread/rank), "
              f"batch 8x{args.seq}, {args.rounds} rounds x {args.steps} steps")
        for name, v in result["median_step_s"].items():
            print(f"  {name:8s} {v * 1e3:8.1f} ms/step")
        print(f"ratio autopar / DTensor: {result['ratio_autopar_vs_dtensor']:.3f} (per round: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}); autopar's GEMM shardings: "
              f"{out['autopar_layout']}")
    return result


if __name__ == "__main__":
    main()
