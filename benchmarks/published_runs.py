"""autopar's cost model against published training runs: step time and memory.

    .venv/bin/python benchmarks/published_runs.py            # prints the markdown tables
    .venv/bin/python benchmarks/published_runs.py --quick    # three rows (what the test runs)

Nothing here sets a factor: the runs are the test of the model, not its training data. Every
device and link number comes from the cluster preset (``autopar/data/clusters/a100-80g.yaml``,
datasheets and microbenchmarks, each with its source). What each run's software did is stated
per run and expressed as plan and cluster fields; what the papers do not state is an assumption,
named in the table.

Runs
----

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21), Table 1: GPT models of 1.7B to 1T parameters on 32 to 3072 A100-80GB
(Selene: DGX A100 nodes, 8 GPUs on NVSwitch, 8 x 200 Gb/s HDR InfiniBand), sequence 2048,
vocabulary 51,200, fp16 mixed precision, activation recomputation (the paper's FLOP count,
96 B s l h^2 (1 + s/6h + V/16lh), counts four forward passes), achieved teraFLOP/s per GPU.
The published step time is that FLOP count over (GPUs x teraFLOP/s).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023), Tables 3 and 5: 22B, 175B, 530B and 1T GPT on 8 to 512 A100-80GB, one pipeline
(no data parallelism), iteration time with full recomputation and with selective recomputation
plus sequence parallelism.

Software (both papers; Megatron-LM of 2021-2022):

- attention written out (scores materialized, fused scale-mask-softmax, attention dropout 0.1):
  the model is captured with ``attention="eager"`` (HF GPT-2's eager attention), not SDPA;
- tensor-parallel all-reduces not overlapped with compute (autopar's model never overlaps them);
- data-parallel gradients all-reduced after the whole backward (Megatron's local DDP; its
  ``--overlap-grad-reduce`` came in 2023): the cluster's ``overlap_grad_reduce: false``;
- plain data parallelism (no distributed optimizer): ZeRO 0;
- apex's FusedAdam (one multi-tensor kernel reading and writing each state once): the
  ``fused`` optimizer kernel;
- the 1F1B schedule without interleaving (PipeDream-Flush), assumed: the papers' tables do not
  say which runs interleaved;
- micro-batch 1 for Table 1, assumed (the table gives the global batch only); Korthikanti et al.
  give theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from autopar import Cluster
from autopar.plan_types import OptimizerKernel, OptimizerProfile, RecomputeKind, ScheduleKind
from autopar.planner.cost_model import Candidate, CostModel, TrainingSetup
from autopar.planner.planning import capture_model_costs

SEQ, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class Run:
    source: str
    label: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    recompute: RecomputeKind
    sequence_parallel: bool
    #: the published step time (seconds), or None when a throughput is given instead
    step_s: float | None = None
    #: achieved teraFLOP/s per GPU (Narayanan et al.'s hardware FLOPs, recomputation counted)
    tflops: float | None = None
    assumed: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def published_step_s(self) -> float:
        if self.step_s is not None:
            return self.step_s
        l, h = self.layers, self.hidden
        flops = 96 * self.batch * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))
        return flops / (self.gpus * self.tflops * 1e12)


N21 = "Narayanan et al. 2021, Table 1"
K22 = "Korthikanti et al. 2022, Table 5"
FULL, SELECTIVE = RecomputeKind.FULL, RecomputeKind.SELECTIVE
RUNS = [
    Run(N21, "1.7B", 24, 2304, 24, 1, 1, 32, 512, 1, FULL, False, tflops=137, assumed="mbs 1"),
    Run(N21, "3.6B", 32, 3072, 30, 2, 1, 64, 512, 1, FULL, False, tflops=138, assumed="mbs 1"),
    Run(N21, "7.5B", 32, 4096, 36, 4, 1, 128, 512, 1, FULL, False, tflops=142, assumed="mbs 1"),
    Run(N21, "18.4B", 48, 6144, 40, 8, 1, 256, 1024, 1, FULL, False, tflops=135,
        assumed="mbs 1"),
    Run(N21, "39.1B", 64, 8192, 48, 8, 2, 512, 1536, 1, FULL, False, tflops=138,
        assumed="mbs 1, 1F1B"),
    Run(N21, "76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 1, FULL, False, tflops=140,
        assumed="mbs 1, 1F1B"),
    Run(N21, "145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 1, FULL, False, tflops=148,
        assumed="mbs 1, 1F1B"),
    Run(N21, "310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, FULL, False, tflops=155,
        assumed="mbs 1, 1F1B"),
    Run(N21, "529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, FULL, False, tflops=163,
        assumed="mbs 1, 1F1B"),
    Run(N21, "1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, FULL, False, tflops=163,
        assumed="mbs 1, 1F1B"),
    Run(K22, "22B full", 64, 6144, 48, 8, 1, 8, 4, 4, FULL, False, step_s=1.42),
    Run(K22, "22B selective + SP", 64, 6144, 48, 8, 1, 8, 4, 4, SELECTIVE, True, step_s=1.10),
    Run(K22, "175B full", 96, 12288, 96, 8, 8, 64, 64, 1, FULL, False, step_s=18.13,
        assumed="1F1B"),
    Run(K22, "175B selective + SP", 96, 12288, 96, 8, 8, 64, 64, 1, SELECTIVE, True,
        step_s=13.75, assumed="1F1B"),
    Run(K22, "530B full", 128, 20480, 105, 8, 35, 280, 280, 1, FULL, False, step_s=49.05,
        assumed="1F1B"),
    Run(K22, "530B selective + SP", 128, 20480, 105, 8, 35, 280, 280, 1, SELECTIVE, True,
        step_s=37.83, assumed="1F1B"),
    Run(K22, "1T full", 160, 25600, 128, 8, 64, 512, 512, 1, FULL, False, step_s=94.42,
        assumed="1F1B"),
    Run(K22, "1T selective + SP", 160, 25600, 128, 8, 64, 512, 512, 1, SELECTIVE, True,
        step_s=71.49, assumed="1F1B"),
]
QUICK = ("1.7B", "145.6B", "22B selective + SP")


def megatron_2021_cluster(gpus: int) -> Cluster:
    """The a100-80g preset at ``gpus`` devices, with the software of the runs: gradients
    all-reduced after the backward."""
    return dataclasses.replace(Cluster.load("a100-80g").with_devices(gpus),
                               overlap_grad_reduce=False)


def predict(run: Run, _cache: dict = {}):  # noqa: B006 - one capture per model shape
    key = (run.heads, run.hidden, run.layers)
    if key not in _cache:
        _cache[key] = capture_model_costs("gpt", attention="eager", layers=run.layers,
                                          hidden=run.hidden, heads=run.heads, vocab=VOCAB,
                                          seq=SEQ)[0]
    cm = CostModel(_cache[key], megatron_2021_cluster(run.gpus),
                   TrainingSetup(run.batch, SEQ, "fp16",
                                 optimizer=OptimizerProfile(OptimizerKernel.FUSED)))
    c = Candidate(run.dp, run.tp, run.pp, 1, run.micro_batch, ScheduleKind.ONE_F_ONE_B,
                  run.recompute, 0, run.sequence_parallel)
    problem = cm.check(c)
    if problem:
        raise SystemExit(f"{run.label}: {problem}")
    ev = cm.evaluate(c)
    return cm.refine(ev) if ev.plan is not None and run.pp > 1 else ev


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.quick or r.label in QUICK]
    print("| source | run | tp x pp x dp | batch (mbs) | recompute | assumed | published | "
          "predicted | error | predicted peak memory |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for run in runs:
        ev = predict(run)
        published = run.published_step_s()
        predicted = ev.prediction.step_time_s
        error = predicted / published - 1
        errors.append(error)
        memory = ev.prediction.peak_memory_bytes / 2**30
        fits = "" if ev.feasible else f" (over: {ev.infeasible})"
        rec = run.recompute.value + (" + SP" if run.sequence_parallel else "")
        print(f"| {run.source} | {run.label} | {run.tp} x {run.pp} x {run.dp} | {run.batch} "
              f"({run.micro_batch}) | {rec} | {run.assumed or '-'} | {published:.2f} s | "
              f"{predicted:.2f} s | {error * 100:+.1f}% | {memory:.1f} GiB{fits} |")
    absolute = [abs(e) for e in errors]
    print(f"\nmean absolute error {statistics.mean(absolute) * 100:.1f}%, "
          f"max {max(absolute) * 100:.1f}% over {len(errors)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
