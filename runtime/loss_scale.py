"""The step's loss as one process's: each part's terms scaled to their share of the whole batch.

A step runs the loss once per part of the global batch: per micro-batch (the pipeline adds them
with weight ``1 / m``), per data-parallel replica (gradients averaged over ``dp``) and per
context-parallel rank (its tokens of each sequence, gradients averaged over ``cp`` too). The
average of the parts' losses is one process's loss only for a term that is a mean over equal
parts. Two kinds of term are not (``passes/loss_reduction.py`` finds them in the graph):

- a **token mean**, ``cross_entropy(..., reduction="mean")`` over targets of which some are
  ignored (padding, a prompt): one process divides the whole batch's sum by the whole batch's
  count ``N``. A part holding ``n`` counted targets computes its sum ``S``; its share is
  ``S * P / N`` (``P`` the parts averaged), whatever ``n`` is. A part whose targets are all
  ignored adds 0 (its own mean would be 0/0);
- a **batch sum** (``reduction="sum"``, ``.sum()`` of a tensor with a batch dim): one process's
  sum over the whole batch is ``P`` times the parts' average, so each part's sum is scaled by
  ``P``.

``P`` is ``m x dp``, times ``cp`` for a term over tokens the cp ranks split. ``N`` is counted on
the step's whole batch before the step (:class:`LossScale.totals`, set by
``autopar.parallel_model``); where it is not known (targets the model computes from its state),
a token mean falls back to each part's own mean over its cp ranks
(``runtime/cp.CPGroup.token_mean``), which is one process's when the parts count alike.

References: the gradient-accumulation normalization by the global token count of torchtitan
and Hugging Face's ``num_items_in_batch`` (Transformers 4.46, 2024); Megatron-LM's
``--calculate-per-token-loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.runtime.cp import CPGroup

__all__ = ["LossScale", "token_mean", "batch_sum", "FUNCTIONS"]


@dataclass(eq=False)
class LossScale:
    """What a part's loss terms are scaled by: the parts a step averages (``micro_batches x
    replicas``; ``cp`` is the group's size) and, set before each step, every token mean's
    count of targets over the whole batch (``totals[term]``; None: not known)."""

    micro_batches: int = 1
    replicas: int = 1
    cp: CPGroup = field(default_factory=CPGroup)
    totals: list[int | None] = field(default_factory=list)

    def parts(self, split: bool) -> int:
        """The parts a step averages: micro-batches x replicas, x cp for a term over the
        tokens cp splits (each cp rank holds some of them)."""
        return self.micro_batches * self.replicas * (self.cp.size if split else 1)

    def token_mean(self, term: int, loss_sum: torch.Tensor, target: torch.Tensor,
                   ignore_index: int, split: bool) -> torch.Tensor:
        """This part's share of token mean ``term`` over the whole batch: its sum ``loss_sum``
        times ``P / N``. ``N`` = 0 (every target ignored) gives NaN, as one process's mean does;
        ``N`` unknown: the part's own mean over its cp ranks."""
        total = self.totals[term] if term < len(self.totals) else None
        if total is None:
            return self.cp.token_mean(loss_sum, target, ignore_index)
        return loss_sum * (self.parts(split) / total if total else float("nan"))

    def batch_sum(self, value: torch.Tensor, split: bool) -> torch.Tensor:
        """This part's share of a sum over the whole batch: its own sum times ``P``."""
        return value * self.parts(split)


# -- functional forms: the call_function targets of per-rank fx graphs ----------------------------

def token_mean(scale: LossScale, term: int, loss_sum: torch.Tensor, target: torch.Tensor,
               ignore_index: int = -100, split: bool = False) -> torch.Tensor:
    return scale.token_mean(term, loss_sum, target, ignore_index, split)


def batch_sum(scale: LossScale, value: torch.Tensor, split: bool = False) -> torch.Tensor:
    return scale.batch_sum(value, split)


FUNCTIONS = {"token_mean": token_mean, "batch_sum": batch_sum}
