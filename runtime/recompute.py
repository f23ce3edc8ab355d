"""Selective activation recompute at run time: a region of a stage graph recomputed in backward.

:class:`RecomputedRegion` is what ``passes/recompute.py`` puts in a stage graph in place of each
attention core (``call_module`` on it). Its forward runs the region's graph under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: autograd keeps none of the
tensors the region's ops save (scores, probabilities, dropout masks: the ``s^2`` tensors), only
the region's inputs stay referenced (Q, K, V and small index tensors), and the first time a
backward pass needs one of the dropped tensors the region runs again and hands them over.

Why non-reentrant checkpointing: it works with ``torch.autograd.grad`` and ``inputs=`` (the
zero-bubble schedule's separate input- and weight-gradient passes), recomputes once per
backward pass that reaches the region (each graph task recomputes for itself, so a ``W`` that
reached it after its ``I`` would recompute again rather than find the tensors freed; a W's calls
start at the weights' nodes and do not reach an attention core), stops recomputing as soon as
the tensors the backward asked for exist, and checks that the recomputed tensors have the
shapes and dtypes of the first run.

Dropout inside the region (the attention-probability dropout) must draw the same masks when
recomputed. autopar's masks are a function of (seed, step, site, rows of the micro-batch)
(:mod:`autopar.runtime.rng`); the rows change with every micro-batch the executor runs, and a
recompute can happen long after the region's forward (ZB-H1 defers ``W`` by up to ``p - 1``
micro-batches). So, as ``torch.utils.checkpoint`` stashes torch's RNG state
(``preserve_rng_state``), a region stashes the dropout state of the tensor-parallel
communicators it reads (``TPGroup.rng``: step, rows, training) at forward time and runs its
recomputation under that state, putting the current one back afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.utils.checkpoint

from autopar.runtime.rng import DropoutRNG
from autopar.runtime.running_stats import replaying

__all__ = ["RecomputedRegion"]


class RecomputedRegion(nn.Module):
    """A graph region whose saved tensors are dropped after forward and recomputed in backward.

    ``body`` takes the region's inputs (tensors, the tensor-parallel communicator, sizes) and
    returns its outputs; it owns no parameters (weights it reads are inputs)."""

    def __init__(self, body: torch.fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return self.body(*args)
        rngs = [a.rng for a in args if isinstance(getattr(a, "rng", None), DropoutRNG)]
        at_forward = [_dropout_state(rng) for rng in rngs]

        def run(*inputs: Any) -> Any:
            current = [_dropout_state(rng) for rng in rngs]
            for rng, state in zip(rngs, at_forward):
                _set_dropout_state(rng, state)
            try:
                return self.body(*inputs)
            finally:
                for rng, state in zip(rngs, current):
                    _set_dropout_state(rng, state)

        return torch.utils.checkpoint.checkpoint(replaying(run), *args, use_reentrant=False)


def _dropout_state(rng: DropoutRNG) -> tuple[int, int, Any, bool]:
    return rng.seed, rng.step, rng.rows, rng.training


def _set_dropout_state(rng: DropoutRNG, state: tuple[int, int, Any, bool]) -> None:
    rng.seed, rng.step, rng.rows, rng.training = state
