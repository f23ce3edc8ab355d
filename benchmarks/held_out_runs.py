"""autopar's predictions for published training runs that were never used to set a factor.

    .venv/bin/python benchmarks/held_out_runs.py          # prints the markdown table

Runs (the numbers the papers report):

- GPT-3 175B on 1024 A100 80GB, global batch 1536 x 2048: 140 TFLOP/s per GPU (44.9% of 312;
  hardware FLOPs, counting activation recomputation), tp=8, pp=16 (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1).
  Priced with that run's software (Megatron-LM 2021: scores materialized, data-parallel
  all-reduce after the backward, fp16), the same fields as benchmarks/published_runs.py.
- LLaMA-65B on 2048 A100 80GB, 4M-token batches of 2048-token sequences: about 380 tokens/s per
  GPU, 1.4T tokens in about 21 days (Touvron et al. 2023, section 2.4); the parallel layout is
  not published beyond "model and sequence parallelism" and selective activation checkpointing.

- ResNet-50 v1.5 on one A100 80GB and on eight (DGX A100), 256 images of 224 x 224 per GPU,
  mixed precision, SGD with momentum: 2470 img/s on one GPU, 16621 img/s on eight
  (NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
  "Training performance: NVIDIA DGX A100 (8x A100 80GB)", pytorch-21.03 NGC container; plain
  data parallelism). transformers' ResNetConfig() is that network (stride 2 in the 3 x 3
  convolutions). Convolutions priced as their implicit GEMMs (planner/kernels.py conv_times).

For each run: autopar's prediction for the published layout (where known) and for the plan its
own search picks.
"""

from __future__ import annotations

import sys

from autopar import Cluster
from autopar.plan_types import OptimizerKernel, OptimizerProfile, RecomputeKind, ScheduleKind
from autopar.planner.cost_model import Candidate, CostModel, TrainingSetup
from autopar.planner.planning import capture_model_costs
from autopar.planner.search import search

A100_PEAK = 312e12


def row(label, ev, n, tokens_total, published=None):
    p = ev.prediction
    tok_gpu = ev.extra["tokens_per_s_per_gpu"]
    days = tokens_total / p.tokens_per_s / 86400
    return (f"| {label} | {ev.candidate.label()} | {p.step_time_s:.2f} s | {p.mfu:.3f} | "
            f"{ev.extra['hfu']:.3f} | {ev.extra['hardware_tflops_per_gpu']:.0f} | "
            f"{tok_gpu:.0f} | {days:.1f} |" + (f" {published} |" if published else " |"))


def main() -> int:
    header = ("| run | plan | step | MFU | HFU | hw TFLOP/s per GPU | tokens/s per GPU | "
              "days | published |\n|---|---|---|---|---|---|---|---|---|")
    print(header)
    # GPT-3 175B, with the software of the run (Megatron-LM 2021, as benchmarks/published_runs.py
    # states it): attention written out, gradients all-reduced after the backward, fp16, apex's
    # fused Adam
    from published_runs import megatron_2021_cluster

    costs, _, _ = capture_model_costs("gpt3-175b", attention="eager")
    cm = CostModel(costs, megatron_2021_cluster(1024),
                   TrainingSetup(1536, 2048, "fp16",
                                 optimizer=OptimizerProfile(OptimizerKernel.FUSED)))
    for sched, v in ((ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.INTERLEAVED_1F1B, 2)):
        ev = cm.refine(cm.evaluate(Candidate(8, 8, 16, v, 1, sched, RecomputeKind.FULL, 0,
                                             False)))
        print(row("GPT-3 175B, Megatron layout", ev, 1024, 300e9,
                  "140 TFLOP/s (HFU 0.449)"))
    best = search(cm).best
    print(row("GPT-3 175B, autopar's plan", best, 1024, 300e9, "140 TFLOP/s (HFU 0.449)"))
    # LLaMA-65B
    costs, _, _ = capture_model_costs("llama-65b")
    cm = CostModel(costs, Cluster.load("a100-80g").with_devices(2048), TrainingSetup(2048, 2048))
    per_token = cm.model_flops_per_sequence / 2048
    implied = 380 * per_token / A100_PEAK
    label = f"380 tokens/s (MFU {implied:.3f})"
    for dp, tp, pp in ((64, 8, 4), (32, 8, 8)):
        ev = cm.refine(cm.evaluate(Candidate(dp, tp, pp, 1, 1, ScheduleKind.ONE_F_ONE_B,
                                             RecomputeKind.SELECTIVE, 0, True)))
        print(row(f"LLaMA-65B, Megatron-style tp={tp} pp={pp}", ev, 2048, 1.4e12, label))
    best = search(cm).best
    print(row("LLaMA-65B, autopar's plan", best, 2048, 1.4e12, label))
    resnet50()
    return 0


def resnet50() -> None:
    """ResNet-50 v1.5 on one and eight A100s at the published 256 images per GPU (fp16 mixed
    precision, SGD with momentum: 4 bytes of state a parameter)."""
    import tempfile

    from transformers import ResNetConfig

    print("\n| run | GPUs | step (256 images per GPU) | predicted img/s per GPU | published | "
          "error |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        ResNetConfig(architectures=["ResNetForImageClassification"]).save_pretrained(root)
        costs, _, _ = capture_model_costs(root)
    for gpus, published in ((1, 2470), (8, 16621 / 8)):
        cm = CostModel(costs, Cluster.load("a100-80g").with_devices(gpus),
                       TrainingSetup(256 * gpus, 1, "fp16",
                                     optimizer=OptimizerProfile(state_bytes=4.0)))
        ev = cm.refine(cm.evaluate(Candidate(gpus, 1, 1, 1, 256, ScheduleKind.ONE_F_ONE_B,
                                             RecomputeKind.NONE, 0, False)))
        rate = 256 / ev.prediction.step_time_s
        print(f"| ResNet-50 v1.5, data parallel | {gpus} | {ev.prediction.step_time_s * 1e3:.1f} "
              f"ms | {rate:.0f} | {published:.0f} | {rate / published - 1:+.0%} |")


if __name__ == "__main__":
    sys.exit(main())
