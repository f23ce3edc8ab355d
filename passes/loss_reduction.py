"""How the loss reduces over the batch, so micro-batches add up to one process's loss.

The pipeline runs the captured step once per micro-batch and adds the micro-batches' losses
with weight ``1 / m`` (and data parallelism averages the replicas' gradients). That is one
process's loss only when the loss is a mean over equal parts. It is not:

- for a loss summed over the batch (``cross_entropy(..., reduction="sum")``): one process's loss
  is the sum over every micro-batch of every replica, ``R m`` times the average of the parts;
- for a mean over the targets a loss does not ignore (``ignore_index``: padding, a prompt's
  tokens), when micro-batches hold different numbers of them: one process divides the whole
  batch's sum by the whole batch's count ``N``, so micro-batch ``k`` of replica ``r``, of
  ``n_rk`` counted targets, weighs ``R n_rk / N`` (its mean times that is its share of the sum
  over ``N``), not ``1 / m``. A micro-batch whose targets are all ignored weighs 0 (its own
  mean is 0/0, NaN).

:func:`loss_reduction` finds the loss of the captured step that is a cross entropy (or NLL)
times constants, and the part of the graph that computes its targets from the step's inputs and
targets (``labels[:, 1:]``, a ``where`` that masks padding): :meth:`LossReduction.weights` runs
that part on every micro-batch of every replica, counts, and gives this replica's weights
(``runtime/pipeline.PipelineExecutor.loss_weights``). A loss that adds other terms (an
auxiliary loss), a weighted cross entropy (class weights), or targets that read the model's
state keep the ``1 / m`` weights, as does context parallelism (each rank holds a part of the
sequence; its count is the split's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autopar.captured import CapturedGraph
from autopar.ir import op_name
from autopar.passes.index_checks import index_program, row_wise

__all__ = ["LossReduction", "loss_reduction"]

#: ATen's reduction codes (``at::Reduction``).
_MEAN, _SUM = 1, 2

#: Ops through which the step's loss is its cross entropy times a constant (or a view of it).
_SCALES = frozenset({"mul", "div", "neg", "to", "_to_copy", "clone", "alias", "detach", "view",
                     "reshape", "squeeze", "unsqueeze", "float", "type_as"})


@dataclass(frozen=True, eq=False)
class LossReduction:
    """The step's loss is ``reduction`` ("mean" or "sum") of a cross entropy over the targets
    that ``program`` computes from the step's inputs and targets named by ``reads``, ``ignore``
    (its ignore_index) not counted."""

    reduction: str
    ignore: int | None
    program: torch.fx.GraphModule
    reads: tuple[str, ...]
    #: No op of ``program`` mixes the batch's rows: the whole batch runs at once, and its
    #: targets split as the micro-batches' would (passes/index_checks.row_wise).
    row_wise: bool = False

    def counts(self, whole: dict[str, Any], parts: list[dict[str, Any]]) -> list[int]:
        """The targets each micro-batch counts, in order (``whole``: the step's inputs and
        targets by placeholder name; ``parts``: the same split into the micro-batches, whose
        rows follow one another in ``whole``)."""
        if self.row_wise:  # the whole batch at once, its targets split as the parts'
            targets = self.program(*(whole[name] for name in self.reads))
            return [self._counted(t) for t in targets.tensor_split(len(parts))]
        return [self._counted(self.program(*(part[name] for name in self.reads)))
                for part in parts]

    def _counted(self, targets: torch.Tensor) -> int:
        return int((targets != self.ignore).sum()) if self.ignore is not None \
            else targets.numel()

    def weights(self, counts: list[list[int]], replica: int) -> list[float] | None:
        """Replica ``replica``'s micro-batch weights, from every replica's counts (``counts[r][k]``,
        see the module docstring); None where they are ``1 / m`` (a mean over equal counts) or no
        target is counted at all (one process's mean is NaN then, as the parts' is)."""
        replicas, total = len(counts), sum(sum(c) for c in counts)
        if self.reduction == "sum":
            return [float(replicas)] * len(counts[replica])
        if total == 0 or len({n for c in counts for n in c}) == 1:
            return None
        return [replicas * n / total for n in counts[replica]]


def loss_reduction(captured: CapturedGraph) -> LossReduction | None:
    """The step's :class:`LossReduction` when its loss is one cross entropy (or NLL loss) with
    reduction mean or sum and no class weights, times constants; else None."""
    if not captured.has_loss:
        return None
    output = next(n for n in captured.gm.graph.nodes if n.op == "output")
    node = output.args[0]
    while isinstance(node, (tuple, list)) and len(node) == 1:
        node = node[0]
    for _ in range(32):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
        name = op_name(node)
        if name == "getitem" and node.args[1] == 0:  # nll_loss_forward's (loss, total weight)
            node = node.args[0]
            continue
        if name in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss_nd"):
            break
        if name not in _SCALES:
            return None
        operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if len(operands) != 1 or operands[0] is not node.args[0]:
            return None  # a term added, or a scale the graph computes (a tensor)
        node = node.args[0]
    else:
        return None
    args = list(node.args) + [None] * 5
    weight = args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = args[3] if len(node.args) > 3 else node.kwargs.get("reduction", _MEAN)
    ignore = args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    if weight is not None or reduction not in (_MEAN, _SUM) or \
            not isinstance(node.args[1], torch.fx.Node):
        return None
    part = index_program(captured, node.args[1])
    if part is None:
        return None
    program, reads, needed = part
    return LossReduction("mean" if reduction == _MEAN else "sum",
                         None if ignore is None else int(ignore), program, reads,
                         row_wise(needed, node.args[1]))
