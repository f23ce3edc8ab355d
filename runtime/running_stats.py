"""Running statistics: buffers a training forward updates in place (BatchNorm's).

A captured training graph updates BatchNorm's ``running_mean`` / ``running_var`` inside
``aten.batch_norm(..., training=True, momentum, ...)`` and its ``num_batches_tracked`` with an
``add_``. Run as captured, three things go wrong that one process gets right:

- **evaluation**: ``eval_step`` ran the training graph, so BatchNorm normalized by the batch's
  statistics (not the running ones) and updated them: a wrong loss and drifting buffers;
- **recompute**: a checkpointed block runs its forward again in the backward, updating the
  statistics a second time (torch's own ``checkpoint`` has the same flaw), and the first
  forward's in-place update of a block input made the recompute fail
  (``modified by an inplace operation``);
- **data parallelism**: each replica updated its copy from its own rows, so replicas drifted
  apart and ``state_dict`` returned one of them.

The generated program calls :func:`batch_norm` and :func:`update_buffer` instead
(passes/tp_transform.py): in evaluation they normalize by the running statistics and update
nothing; in a recompute they use the batch's statistics and update nothing (:func:`replaying`
marks the checkpoint's second run); otherwise they update through ``.data``, which leaves the
buffers' autograd version counters alone (a checkpoint checks its inputs' versions).

Across data-parallel replicas :class:`RunningStats` makes the buffers those of one process that
runs the step's micro-batches one after another, in the order of the global batch (replica r's m
micro-batches are chunks ``r m .. r m + m - 1``). Each update is ``x <- a x + (1 - a) u`` with
``a = 1 - momentum``; after K = dp x m updates from ``x0``, one process holds
``a^K x0 + sum_k a^(K-1-k) (1 - a) u_k``. Replica r ran its own m updates from ``x0`` and holds
``x_r = a^m x0 + sum_(j<m) a^(m-1-j) (1 - a) u_(rm+j)``, so

    x_K = a^K x0 + sum_r a^((dp-1-r) m) (x_r - a^m x0)

one all-reduce (sum) per step of the statistics a rank holds. The mean's and the unbiased
variance's updates are both of this form, so both equal one process's to rounding.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx

from autopar.runtime.comm import collective

__all__ = ["batch_norm", "update_buffer", "affine_as_statistics", "replaying", "is_replaying",
           "RunningStats", "Statistic", "running_statistics", "eager_in_compiled_code"]

#: True while a checkpointed region runs its forward again in the backward.
_REPLAYING: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_replaying",
                                                                  default=False)


def is_replaying() -> bool:
    return _REPLAYING.get()


def replaying(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for ``torch.utils.checkpoint``: its first call is the forward, every later call
    a recompute, run with :func:`is_replaying` true."""
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        token = _REPLAYING.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _REPLAYING.reset(token)

    return run


def batch_norm(tp: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               training: bool, momentum: float, eps: float,
               cudnn_enabled: bool = True) -> torch.Tensor:
    """``aten.batch_norm`` of a training graph: in evaluation (``tp.rng.training`` false) by the
    running statistics, unchanged; in a recompute by the batch's, updating nothing; otherwise
    by the batch's, updating the running ones once."""
    weight, bias = affine_as_statistics(weight, bias, running_mean)
    if training and not tp.rng.training:
        training = False
    elif training and is_replaying():  # copies take the second update (and are saved, as
        # the first run saved the buffers: a recompute must save as many tensors)
        running_mean = running_mean.detach().clone() if running_mean is not None else None
        running_var = running_var.detach().clone() if running_var is not None else None
    elif training:
        running_mean = running_mean.data if running_mean is not None else None
        running_var = running_var.data if running_var is not None else None
    return torch.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
                            cudnn_enabled)


def affine_as_statistics(weight: torch.Tensor | None, bias: torch.Tensor | None,
                         running_mean: torch.Tensor | None) -> tuple[Any, Any]:
    """Under mixed precision a batch norm's weight and bias are bf16 copies while its running
    statistics stay fp32 buffers, a combination torch's kernel refuses; it takes a bf16 input
    with an fp32 weight, bias and statistics (what torch.autocast runs, whose modules keep fp32
    weights), so the affine parameters are cast up (their gradients flow back through the
    cast)."""
    if running_mean is not None and weight is not None and weight.dtype != running_mean.dtype:
        weight = weight.to(running_mean.dtype)
        bias = bias.to(running_mean.dtype) if bias is not None else None
    return weight, bias


@torch.fx.node.has_side_effect  # kept by dead-code elimination, though nothing reads its result
def update_buffer(tp: Any, buffer: torch.Tensor, *args: Any, op: str,
                  **kwargs: Any) -> torch.Tensor:
    """An in-place ATen op ``op`` (``"aten::add_.Tensor"``) on a buffer: run in a training
    forward, once (not in evaluation, not in a recompute)."""
    if not tp.rng.training or is_replaying():
        return buffer
    return _overload(op)(buffer.data, *args, **kwargs)


def eager_in_compiled_code(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, about to go through ``torch.compile``, with its :func:`batch_norm` and
    :func:`update_buffer` calls run eagerly (a graph break each): what they do depends on the
    evaluation flag and on being a recompute, which a compiled graph would fix at its first
    trace, and their updates through ``.data`` must stay invisible to autograd. (Wrapped here,
    not where they are defined: ``torch.compiler.disable`` imports torch._dynamo, half a second
    of every CLI start.)"""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (batch_norm, update_buffer):
            eager = _EAGER.get(node.target)
            if eager is None:
                eager = torch.fx.node.has_side_effect(torch.compiler.disable(node.target))
                _EAGER[node.target] = eager
            node.target = eager
            changed = True
    if changed:
        gm.recompile()
    return gm


_EAGER: dict[Any, Any] = {}
_OVERLOADS: dict[str, Any] = {}


def _overload(name: str) -> Any:
    found = _OVERLOADS.get(name)
    if found is None:
        namespace, rest = name.split("::")
        op, _, overload = rest.partition(".")
        found = getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
        _OVERLOADS[name] = found
    return found


# ---------------------------------------------------------------------------------------------
# Data-parallel replicas
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Statistic:
    """A buffer a training forward updates: as ``x <- (1 - momentum) x + momentum u`` (a batch
    norm's mean and variance), or, with ``momentum`` None, by adding to it (its counter)."""

    fqn: str
    momentum: float | None


def running_statistics(gm: torch.fx.GraphModule) -> list[Statistic]:
    """The running statistics the program's batch norms update (:func:`batch_norm` calls
    whose mean and variance are buffers), each once."""
    from autopar.ir import NodeKind, has_info, info

    out: dict[str, Statistic] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        first = node.args[1] if len(node.args) > 1 else None
        if node.target is update_buffer and node.kwargs.get("op", "").startswith("aten::add_") \
                and isinstance(first, torch.fx.Node) and has_info(first) and info(first).fqn:
            out.setdefault(info(first).fqn, Statistic(info(first).fqn, None))
        if node.target is not batch_norm:
            continue
        args = list(node.args) + [None] * 10
        training, momentum = args[6], args[7]
        if training is False or not isinstance(momentum, (int, float)):
            continue
        for stat in (args[4], args[5]):
            if isinstance(stat, torch.fx.Node) and has_info(stat) \
                    and info(stat).kind is NodeKind.BUFFER and info(stat).fqn:
                out.setdefault(info(stat).fqn, Statistic(info(stat).fqn, float(momentum)))
    return list(out.values())


class RunningStats:
    """The running statistics this rank holds, made one process's after each step (module
    docstring). ``group``: the data-parallel group, ``rank``/``size`` this rank's place in it,
    ``micro_batches``: the updates each replica makes per step."""

    def __init__(self, stats: Sequence[Statistic], buffers: Mapping[str, torch.Tensor],
                 group: Any, rank: int, size: int, micro_batches: int) -> None:
        self.stats = [s for s in stats if s.fqn in buffers]
        self.buffers = buffers
        self.group, self.rank, self.size, self.m = group, rank, size, micro_batches
        self._before: list[torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.size > 1 and bool(self.stats)

    def begin_step(self) -> None:
        if self.active:
            self._before = [self.buffers[s.fqn].detach().clone() for s in self.stats]

    def end_step(self) -> None:
        """Combine the replicas' updates (collective over the data-parallel group)."""
        if not self.active or self._before is None:
            return
        before, self._before = self._before, None
        parts = []  # in float64: a counter's integers exactly, the averages' sums to rounding
        for s, x0 in zip(self.stats, before):
            a = 1.0 - s.momentum if s.momentum is not None else 1.0
            x = self.buffers[s.fqn]
            parts.append(((x.double() - a ** self.m * x0.double())
                          * a ** ((self.size - 1 - self.rank) * self.m)).reshape(-1))
        flat = torch.cat(parts)
        collective(dist.all_reduce, flat, group=self.group,
                   what="the all-reduce of the running statistics")
        offset = 0
        with torch.no_grad():
            for s, x0 in zip(self.stats, before):
                x = self.buffers[s.fqn]
                n = x.numel()
                a = 1.0 - s.momentum if s.momentum is not None else 1.0
                total = x0.double() * a ** (self.size * self.m) + flat[offset:offset + n].view_as(x)
                x.data.copy_(total.to(x.dtype))
                offset += n

    def discard(self) -> None:
        """A failed step: forget the snapshot (the buffers hold what the step left)."""
        self._before = None
