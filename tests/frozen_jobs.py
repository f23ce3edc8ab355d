"""Jobs for tests/test_frozen_params.py (run on every rank of a LocalPool, importable by name),
and the one-process reference: fine-tuning with frozen parameters, the way users freeze them.

- ``"lora"``: the GPT of examples/gpt.py with every weight frozen and low-rank adapters
  (Hu et al. 2021, LoRA) added to the attention's ``qkv`` and the MLP's ``fc``;
- ``"norms"``: the same GPT with its embeddings and every LayerNorm frozen (a frozen norm's
  weight still scales its input's gradient in the backward, after the block's last trainable
  gradient);
- ``"first"``: the same GPT with its embeddings and first block frozen (fine-tuning the top).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from conftest import train_one_process
from tp_helpers import TINY_COST

LR = 1e-2
EPS = 1e-5  # see parallelize_jobs.EPS: Adam's epsilon vs reordered fp32 sums


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T``: a frozen linear layer and a trainable rank-``r`` update."""

    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, r) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def build(kind: str) -> tuple[nn.Module, Any]:
    """The model (seeded: every call gives the same weights) and its loss."""
    from examples.gpt import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32))
    torch.manual_seed(1)
    if kind == "lora":
        model.requires_grad_(False)
        for block in model.blocks:
            block.attn.qkv = LoRALinear(block.attn.qkv)
            block.mlp.fc = LoRALinear(block.mlp.fc)
    elif kind == "norms":
        for name, p in model.named_parameters():
            if "emb" in name or "ln" in name:
                p.requires_grad_(False)
    elif kind == "first":
        for name, p in model.named_parameters():
            if "emb" in name or name.startswith("blocks.0."):
                p.requires_grad_(False)
    else:
        raise KeyError(kind)
    return model, gpt_loss


def frozen_names(kind: str) -> set[str]:
    model, _ = build(kind)
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def batches(steps: int = 2) -> list[tuple[tuple, tuple]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (8, 17), generator=gen)
        out.append(((tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)))
    return out


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, AdamW over the trainable parameters: losses and the final state."""
    model, loss_fn = build(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    return train_one_process(model, loss_fn, opt, batches())


def reference_mixed(kind: str, micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process in bf16 mixed precision (tests/dp_harness.py's SingleProcess: bf16 compute
    copies, fp32 masters of the trainable parameters stepped by AdamW, micro-batch gradients
    summed in fp32; frozen weights held in bf16 alone) on the parallel run's micro-batches."""
    from dp_harness import SingleProcess
    from autopar.runtime.optim import OptimizerFactory

    model, loss_fn = build(kind)
    run = SingleProcess(model, loss_fn, OptimizerFactory(torch.optim.AdamW, {"lr": LR, "eps": EPS}),
                        mp=True)
    for (x,), (y,) in batches():
        run.step(x, y, micro_batches=micro_batches)
    return run.losses, run.parameters()


def train(configs: list[tuple[str, dict]]) -> list[tuple[list[float], dict | None]]:
    """Each ``(kind, pins)``: parallelize, train on :func:`batches` (AdamW over every
    parameter: frozen ones get no gradient and are skipped, as torch's optimizers skip them);
    the losses and rank 0's final state. ``pins["mixed_precision"]`` is passed to
    ``parallelize`` rather than planned."""
    out = []
    data = batches()
    for kind, pins in configs:
        model, loss_fn = build(kind)
        pins = dict(pins)
        mixed = pins.pop("mixed_precision", False)
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=pins, tp_cost=TINY_COST,
                                 mixed_precision=mixed,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
        losses = [pm.train_step(*d) for d in data]
        state = pm.state_dict()
        pm.close()
        out.append((losses, state if dist.get_rank() == 0 else None))
    return out


def state_bytes(configs: list[tuple[str, dict, bool]]) -> list[dict[str, int]]:
    """Each ``(kind, pins, mixed_precision)``: parallelize, one step (the optimizer's state
    exists from its first step), and the bytes this rank holds (``pm.memory_bytes()``)."""
    out = []
    data = batches(1)
    for kind, pins, mixed in configs:
        model, loss_fn = build(kind)
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                                 mixed_precision=mixed,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
        pm.train_step(*data[0])
        out.append(pm.memory_bytes())
        pm.close()
    return out
