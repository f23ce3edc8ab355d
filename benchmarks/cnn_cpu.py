"""Predicted vs measured step time of small CNNs on local gloo processes: a ResNet (3 x 3 and
1 x 1 convolutions, batch norm, max pooling) and a ConvNeXt (7 x 7 depthwise convolutions, layer
norm, GEMMs), each on one process and data parallel on two.

    .venv/bin/python benchmarks/cnn_cpu.py [--cluster cpu] [--rounds 5] [--steps 3]

Predictions: ``autopar.plan`` of the same model, batch and plan (pinned: ZeRO-0, no
recomputation, one micro-batch per rank) on ``--cluster`` (a preset or a file from ``autopar
calibrate``). Measured: ``autopar.parallelize`` with that plan, SGD with momentum; the two
models' plans of one world run in one process group, interleaved over ``--rounds`` rounds of a
warm-up and ``--steps`` timed steps (each bracketed by barriers); a plan's figure is the median
over rounds of its round medians, the slowest rank's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BATCH = 16  # images per step (global)
SIDE = 64
CLASSES = 10


def build(name: str):
    """(model, loss) of one of the benchmark's CNNs, random weights (seed 0)."""
    import torch
    from transformers import (ConvNextConfig, ConvNextForImageClassification, ResNetConfig,
                              ResNetForImageClassification)

    torch.manual_seed(0)
    if name == "resnet":
        net = ResNetForImageClassification(ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
            num_labels=CLASSES))
    else:
        net = ConvNextForImageClassification(ConvNextConfig(
            hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_labels=CLASSES))

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            return self.inner(pixel_values=pixel_values).logits

    return Logits(net), torch.nn.functional.cross_entropy


MODELS = ("resnet", "convnext")


def _inputs(batch: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    return ((torch.randn(batch, 3, SIDE, SIDE, generator=gen),),
            (torch.randint(0, CLASSES, (batch,), generator=gen),))


def _optimizer():
    import functools

    import torch

    return functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


def _worker(cluster: str, rounds: int, steps: int) -> list[list[float]]:
    import torch.distributed as dist

    import autopar
    from benchmarks.predicted_vs_measured import interleaved_step_times

    world = dist.get_world_size()
    pms = []
    for name in MODELS:
        model, loss = build(name)
        inputs, targets = _inputs(BATCH)
        pms.append(autopar.parallelize(
            model, cluster, example_inputs=inputs, example_targets=targets, loss_fn=loss,
            plan={"dp": world, "tp": 1, "pp": 1, "num_micro_batches": 1},
            optimizer=_optimizer()))
    out = interleaved_step_times(pms, *_inputs(BATCH), rounds, steps)
    for pm in pms:
        pm.close()
    return out


def predict(name: str, cluster: str, world: int) -> float:
    """The predicted step, the optimizer's state and step measured as parallelize measures
    them (``OptimizerFactory``)."""
    import torch

    import autopar
    from autopar.runtime.optim import OptimizerFactory

    model, loss = build(name)
    inputs, targets = _inputs(BATCH)
    factory = OptimizerFactory(torch.optim.SGD, dict(_optimizer().keywords))
    report = autopar.plan(model, cluster, example_inputs=inputs, example_targets=targets,
                          loss_fn=loss, global_batch=BATCH, devices=world, dp=world, tp=1, pp=1,
                          micro_batch_size=BATCH // world, recompute="none", zero=0,
                          optimizer=factory)
    return report.prediction.step_time_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    from autopar.runtime.local_pool import LocalPool

    print("| model | processes | predicted | measured (spread over rounds) | error |\n"
          "|---|---|---|---|---|")
    for world in args.worlds:
        with LocalPool(world, timeout_s=900) as pool:
            per_rank = pool.run(_worker, args.cluster, args.rounds, args.steps, timeout_s=3600)
        for i, name in enumerate(MODELS):
            rounds = [max(r[i][j] for r in per_rank) for j in range(args.rounds)]
            measured = statistics.median(rounds)
            predicted = predict(name, args.cluster, world)
            print(f"| {name} | {world} | {predicted * 1e3:.1f} ms | {measured * 1e3:.1f} ms "
                  f"({min(rounds) * 1e3:.1f}-{max(rounds) * 1e3:.1f}) | "
                  f"{predicted / measured - 1:+.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
