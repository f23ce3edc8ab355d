"""Jobs for tests/test_loss_reduction.py (run on every rank of a LocalPool, importable by name),
and the one-process references they are compared with: a small language model whose losses
reduce over the batch in the ways one process's does and a micro-batched step must match."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from tp_helpers import TINY_COST

VOCAB = 32
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class TinyLM(nn.Module):
    """Embedding, a block (tensor-parallel GEMMs, a pipeline cut between the two), a head."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(),
                                                  nn.Linear(2 * hidden, hidden))
                                    for _ in range(2))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        h = self.tokens(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def summed(logits, labels):
    """A sum over the batch's tokens (divided by a constant: SGD's step stays small)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                       reduction="sum") / 64


def padded(logits, labels):
    """Next-token loss with padding (id 0) ignored: labels shifted inside, as training code
    does."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                       ignore_index=0)


def masked(logits, labels):
    """Targets masked by ``where`` (prompt tokens, here ids below 4) times a constant."""
    kept = torch.where(labels < 4, -100, labels)
    return 0.5 * nn.functional.cross_entropy(logits.flatten(0, 1), kept.flatten())


def aux(logits, labels):
    """A mean over the tokens that are not padding, plus a mean over every logit (the same
    number of elements in every part: left as each part's own)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=0) \
        + 1e-2 * logits.pow(2).mean()


def mixed(logits, labels):
    """An NLL loss (``nll_loss_nd``) over the tokens that are not padding, a sum of per-token
    losses, and an element-wise loss summed, each with its own factor."""
    flat, target = logits.flatten(0, 1), labels.flatten()
    per_token = nn.functional.cross_entropy(flat, target, reduction="none")
    return 0.7 * nn.functional.nll_loss(flat.log_softmax(-1), target, ignore_index=0) \
        + per_token.sum() / 256 - 1e-4 * nn.functional.mse_loss(
            logits, torch.zeros_like(logits), reduction="sum")


LOSSES: dict[str, Callable] = {"summed": summed, "padded": padded, "masked": masked, "aux": aux,
                               "mixed": mixed}
#: The losses that mix no tokens of a sequence (no shift): what context parallelism runs.
TOKEN_WISE = ("summed", "masked", "aux", "mixed")


def batch(rows: int = 8, seq: int = 8, *, seed: int = 1) -> torch.Tensor:
    """Token ids whose padding (0s at the end of a row) differs from row to row: rows 0-1 keep
    2 tokens, rows 2-3 one (the shifted labels all ignored: a whole micro-batch of 2 rows), the
    rest 3 to 8."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=gen)
    for row, kept in enumerate([2, 2, 1, 1] + [3 + (r % 6) for r in range(rows - 4)]):
        ids[row, kept:] = 0
    return ids


def reference(loss: str, steps: int = 2, rows: int = 8) -> dict[str, Any]:
    """One process: the losses and the state after ``steps`` SGD steps on the whole batch."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = SGD(model.parameters())
    losses = []
    for step in range(steps):
        ids = batch(rows, seed=step + 1)
        optimizer.zero_grad()
        value = LOSSES[loss](model(ids), ids)
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def train(configs: list[tuple], steps: int = 2, rows: int = 8) -> list[dict]:
    """Each (loss, plan pins[, local]): the losses and rank 0's full state after ``steps``
    steps; ``local``: each replica passes only its rows (``train_step(local=True)``)."""
    out = []
    for loss, pins, *local in configs:
        torch.manual_seed(0)
        model = TinyLM()
        ids = batch(rows, seed=1)
        pm = autopar.parallelize(model, example_inputs=(ids,), example_targets=(ids.clone(),),
                                 loss_fn=LOSSES[loss], optimizer=SGD, plan=dict(pins),
                                 tp_cost=TINY_COST)
        try:
            losses = []
            for step in range(steps):
                ids = batch(rows, seed=step + 1)
                if local and local[0]:
                    ids = pm.local_batch(ids)
                losses.append(pm.train_step((ids,), (ids,), local=bool(local and local[0])))
            state = pm.state_dict()
        finally:
            pm.close()
        out.append({"losses": losses, "state": state if dist.get_rank() == 0 else None})
    return out


class StaticLM(TinyLM):
    """TinyLM whose logits add a bias per row of a batch of 4: export cannot keep the batch
    symbolic, and the graph is captured at 4 rows (a part's)."""

    def __init__(self):
        super().__init__()
        self.row_bias = nn.Parameter(torch.zeros(4, 1, VOCAB))

    def forward(self, ids):
        return super().forward(ids) + self.row_bias


def row_mean(logits, labels):
    """A summed cross entropy divided by the rows: a mean per row, written out."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                       reduction="sum") / logits.shape[0]


def scaled_sum(logits, labels):
    """A summed cross entropy times 0.03 (1 / 33.3: no multiple of a part's rows)."""
    return 0.03 * nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                              reduction="sum")


STATIC_LOSSES: dict[str, Callable] = {"summed": scaled_sum, "row mean": row_mean}


def static_run(loss: str, steps: int = 2) -> dict[str, Any]:
    """StaticLM at one rank, 2 micro-batches of its 4 rows: losses and the state after
    ``steps`` SGD steps."""
    torch.manual_seed(0)
    ids = batch(8, seed=1)
    pm = autopar.parallelize(StaticLM(), example_inputs=(ids[:4],),
                             example_targets=(ids[:4].clone(),), loss_fn=STATIC_LOSSES[loss],
                             optimizer=SGD, global_batch=8, tp_cost=TINY_COST,
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2,
                                   "micro_batch_size": 4})
    try:
        losses = [pm.train_step((ids,), (ids,)) for ids in
                  (batch(8, seed=step + 1) for step in range(steps))]
        return {"losses": losses, "state": pm.state_dict()}
    finally:
        pm.close()


def static_reference(loss: str, steps: int = 2) -> dict[str, Any]:
    """One process, as the user means each loss over a batch of 8 that the model takes 4 rows
    at a time: a sum over the batch adds the halves' sums, a mean per row averages the halves'
    means."""
    torch.manual_seed(0)
    model = StaticLM()
    optimizer = SGD(model.parameters())
    weight = 1.0 if loss == "summed" else 0.5
    losses = []
    for step in range(steps):
        ids = batch(8, seed=step + 1)
        optimizer.zero_grad()
        value = sum(weight * STATIC_LOSSES[loss](model(half), half) for half in ids.split(4))
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}
