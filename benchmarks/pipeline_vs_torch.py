"""autopar's 1F1B executor against torch.distributed.pipelining's Schedule1F1B, in one run.

Same model (the plain PyTorch GPT of examples/gpt.py, LM head untied so that torch's stages need
no weight sharing), same two stages (embeddings + the first half of the blocks; the rest + final
norm + LM head), same micro-batches, same initial weights, gloo on CPU, 2 processes. Steps
alternate between the two implementations (A B A B ...) so that machine noise hits both alike;
the step time is the median over the timed steps of forward + backward (no optimizer), and the
losses of the two are checked equal (the same computation).

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--steps 10] [--layers 8] [--hidden 256]

Prints one Markdown table row for benchmarks/README.md.
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


class FirstStage(nn.Module):
    def __init__(self, model: GPT, blocks: int) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[:blocks])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, model: GPT, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[blocks:])
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq))
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())  # untie
    return model


def bench_job(model, split, tokens, targets, microbatches, steps, warmup):
    """Runs on both ranks: the two executors, alternating, timed."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from autopar.runtime.mesh import ParallelMesh
    from autopar.runtime.pipeline import PipelineExecutor
    from autopar.runtime.schedules import build_schedule

    mesh = ParallelMesh(1, 2, 1)
    rank = mesh.pp_rank
    half = len(model.blocks) // 2
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers()))
    ours = PipelineExecutor(split, build_schedule("1f1b", 2, microbatches), mesh, tensors=tensors)
    module = FirstStage(model, half) if rank == 0 else LastStage(model, half)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=mesh.pp_group)
    theirs = Schedule1F1B(stage, microbatches, loss_fn=gpt_loss)

    def run_ours():
        ours.zero_grad()
        loss = ours.step((tokens,), (targets,))
        return None if loss is None else float(loss)

    def run_theirs():
        module.zero_grad()
        if rank == 0:
            theirs.step(tokens)
            return None
        losses = []
        theirs.step(target=targets, losses=losses)
        return float(torch.stack([l.detach() for l in losses]).mean())

    times = {"autopar": [], "torch": []}
    losses = {}
    for i in range(warmup + steps):
        for name, fn in (("autopar", run_ours), ("torch", run_theirs)):
            dist.barrier(group=mesh.pp_group)
            start = time.perf_counter()
            loss = fn()
            dist.barrier(group=mesh.pp_group)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
            losses[name] = loss
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    from autopar import capture
    from autopar.passes.split_stages import split_into_stages
    from autopar.runtime.local_pool import LocalPool

    model = build_model(args.layers, args.hidden, args.heads, args.vocab, args.seq)
    batch = args.microbatches * args.microbatch_size
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (batch, args.seq + 1), generator=gen)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    captured = capture(model, (tokens,), gpt_loss, example_targets=(targets,))
    half = args.layers // 2
    # layers: pre, blocks..., post -> stage 0 = pre + first half, stage 1 = the rest + post
    split = split_into_stages(captured.gm, captured.layers,
                              [(0, half), (half + 1, len(captured.layers) - 1)],
                              constants=captured.constants)
    with LocalPool(2, timeout_s=600) as pool:
        results = pool.run(bench_job, model, split, tokens, targets, args.microbatches,
                           args.steps, args.warmup, timeout_s=600)
    times, losses = results[1]  # the last rank holds the loss; barriers align both ranks
    ours = statistics.median(times["autopar"])
    theirs = statistics.median(times["torch"])
    assert abs(losses["autopar"] - losses["torch"]) < 1e-4 * abs(losses["torch"]), losses
    params = sum(p.numel() for p in model.parameters())
    print(f"| GPT {args.layers}x{args.hidden}, vocab {args.vocab}, seq {args.seq} "
          f"({params / 1e6:.1f} M params) | pp=2, m={args.microbatches}, "
          f"micro-batch {args.microbatch_size} | {ours * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | "
          f"{ours / theirs:.2f} | loss {losses['autopar']:.5f} = {losses['torch']:.5f} |")


if __name__ == "__main__":
    main()
