"""autopar's pipeline executor against torch.distributed.pipelining, schedule by schedule, in one run.

Three pairs, each the same schedule in both implementations:

| autopar (`runtime/schedules.py`) | torch.distributed.pipelining |
| --- | --- |
| `1f1b`: one stage per rank | `Schedule1F1B` |
| `interleaved-1f1b`: two stages per rank, stage c*p + r on rank r | `ScheduleInterleaved1F1B` |
| `zb-v`: two stages per rank in a V, backward split into input and weight gradients | `ScheduleZBVZeroBubble` |

Same model (the plain PyTorch GPT of examples/gpt.py, LM head untied so that torch's stages need
no weight sharing), the same stages (the blocks divided evenly; embeddings with the first stage,
final norm and LM head with the last), the same micro-batches and initial weights, gloo on CPU.
Steps alternate between the two implementations (A B A B ...) so that machine noise hits both
alike; the step time is the median over the timed steps of forward + backward (no optimizer).
The CPU ratio compares the CPU seconds all ranks spent per step (summed step by step, median):
the work done, which the sharing of the cores moves far less than the wall time (gloo waits
sleep).
The losses and every parameter's gradient of the two are checked equal (the same computation).

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--ranks 2] [--schedule all] [--steps 10]

Prints one Markdown table row per schedule for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

#: autopar's schedule -> (torch's schedule class name, stages per rank).
PAIRS = {
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zb-v": ("ScheduleZBVZeroBubble", 2),
}


class Stage(nn.Module):
    """Blocks ``lo:hi`` of ``model``, with the embeddings if ``first`` and the head if ``last``:
    the model's own submodules, so both implementations start from the same tensors."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def build_model(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq))
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())  # untie
    return model


def bench_job(model, split, kind, tokens, targets, microbatches, steps, warmup):
    """Runs on every rank: the two executors of one schedule, alternating, timed."""
    import torch.distributed.pipelining as pipelining

    from autopar.runtime.mesh import ParallelMesh
    from autopar.runtime.pipeline import PipelineExecutor
    from autopar.runtime.schedules import build_schedule

    p = dist.get_world_size()
    torch_class, v = PAIRS[kind]
    mesh = ParallelMesh(1, p, 1)
    rank = mesh.pp_rank
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers()))
    schedule = build_schedule(kind, p, microbatches, v)
    ours = PipelineExecutor(split, schedule, mesh, tensors=tensors)

    num_stages = p * v
    per_stage = len(model.blocks) // num_stages
    mine = schedule.stages_of(rank)  # the same placement torch uses for this schedule
    modules = {s: Stage(model, s * per_stage, (s + 1) * per_stage, s == 0, s == num_stages - 1)
               for s in mine}
    stages = [pipelining.PipelineStage(modules[s], s, num_stages, torch.device("cpu"),
                                       group=mesh.pp_group) for s in mine]
    cls = getattr(pipelining, torch_class)
    theirs = cls(stages[0] if v == 1 else stages, microbatches, loss_fn=gpt_loss)
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine

    def run_ours():
        ours.zero_grad()
        loss = ours.step((tokens,), (targets,))
        return None if loss is None else float(loss)

    def run_theirs():
        for module in modules.values():
            module.zero_grad()
        losses: list[torch.Tensor] = []
        args = (tokens,) if holds_first else ()
        if holds_last:
            theirs.step(*args, target=targets, losses=losses)
            return float(torch.stack([l.detach() for l in losses]).mean())
        theirs.step(*args)
        return None

    times: dict[str, list[float]] = {"autopar": [], "torch": []}
    cpu: dict[str, list[float]] = {"autopar": [], "torch": []}
    losses: dict[str, float | None] = {}
    for i in range(warmup + steps):
        for name, fn in (("autopar", run_ours), ("torch", run_theirs)):
            dist.barrier(group=mesh.pp_group)
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = fn()
            spent = time.process_time() - start_cpu
            dist.barrier(group=mesh.pp_group)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(spent)
            losses[name] = loss
    # The last torch step left its gradients on the model's own parameters; run ours once more
    # and compare every local parameter's gradient.
    run_ours()
    names = {id(param): name for name, param in model.named_parameters()}
    worst = 0.0
    for module in modules.values():
        for param in module.parameters():
            mine_grad = ours.params[names[id(param)]].grad
            worst = max(worst, float((mine_grad - param.grad).abs().max()))
    return times, losses, worst, cpu


def run(kind: str, args: argparse.Namespace) -> str:
    from autopar import capture
    from autopar.passes.split_stages import split_into_stages
    from autopar.runtime.local_pool import LocalPool

    v = PAIRS[kind][1]
    num_stages = args.ranks * v
    if args.layers % num_stages:
        raise SystemExit(f"--layers {args.layers} must divide into {num_stages} stages")
    model = build_model(args.layers, args.hidden, args.heads, args.vocab, args.seq)
    batch = args.microbatches * args.microbatch_size
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (batch, args.seq + 1), generator=gen)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    captured = capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    # Captured layers: pre, the blocks, post. Stage s holds blocks [s*k, (s+1)*k); the first
    # also holds pre (layer 0), the last also post.
    k = args.layers // num_stages
    last_layer = len(captured.layers) - 1
    ranges = [(0 if s == 0 else 1 + s * k, last_layer if s == num_stages - 1 else (s + 1) * k)
              for s in range(num_stages)]
    split = split_into_stages(captured.gm, captured.layers, ranges, constants=captured.constants)
    with LocalPool(args.ranks, timeout_s=900) as pool:
        results = pool.run(bench_job, model, split, kind, tokens, targets, args.microbatches,
                           args.steps, args.warmup, timeout_s=900)
    # Barriers align the ranks, so every rank's times agree; the loss is on the last stage's rank.
    times = results[0][0]
    loss = next(r[1] for r in results if r[1]["autopar"] is not None)
    worst_grad = max(r[2] for r in results)
    ours = statistics.median(times["autopar"])
    theirs = statistics.median(times["torch"])
    # CPU seconds of all ranks per step (their sum, step by step; median over the steps): the
    # work each implementation does, which the cores' sharing hardly moves (wall time does)
    cpu_ours, cpu_theirs = (statistics.median(map(sum, zip(*(r[3][name] for r in results))))
                            for name in ("autopar", "torch"))
    assert abs(loss["autopar"] - loss["torch"]) < 1e-4 * abs(loss["torch"]), loss
    assert worst_grad < 1e-4, f"gradients differ by {worst_grad}"
    params = sum(p.numel() for p in model.parameters())
    return (f"| GPT {args.layers}x{args.hidden}, vocab {args.vocab}, seq {args.seq} "
            f"({params / 1e6:.1f} M params) | {kind} vs {PAIRS[kind][0]}, pp={args.ranks}, "
            f"{num_stages} stages, m={args.microbatches} x {args.microbatch_size} | "
            f"{ours * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | **{ours / theirs:.2f}** | "
            f"{cpu_ours / cpu_theirs:.2f} | "
            f"loss {loss['autopar']:.5f} = {loss['torch']:.5f}, gradients within "
            f"{worst_grad:.0e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=[*PAIRS, "all"], default="all")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=2)
    args = parser.parse_args()
    print("| model | schedule | autopar step | torch step | ratio autopar / torch | CPU ratio "
          "| check |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in PAIRS if args.schedule == "all" else [args.schedule]:
        print(run(kind, args), flush=True)


if __name__ == "__main__":
    main()
