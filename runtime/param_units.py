"""ZeRO-3's units: the parameters of one module gathered for its forward and backward.

A :class:`ParamUnit` wraps a module whose parameters live in ZeRO-3 flat buckets
(:class:`autopar.runtime.zero.FlatBucket`): module hooks gather the buckets before the module
runs forward, free them after it (unless kept gathered between forward and backward, FSDP's
``reshard_after_forward=False``), gather them again when the first gradient reaches the
module's outputs and free them once every parameter's gradient is accumulated. A
:class:`UnitOrder` learns the order the units run in during the first step and from then on
launches the next unit's gather while the current one computes (the prefetch FSDP2 does), in the
forward and in the backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from autopar.runtime.zero import FlatBucket

__all__ = ["ParamUnit", "UnitOrder"]


def _flatten_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flatten_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flatten_tensors(v)]
    return []


class ParamUnit:
    """Stage 3: the parameters of one module, gathered for its forward and backward.

    Forward: gathered by a forward pre-hook, freed by the forward hook (unless
    ``reshard_after_forward`` is False, or this is a root unit whose output the backward starts
    from at once). Backward: gathered again when the first gradient reaches the module's outputs,
    freed when every parameter's gradient has been accumulated (the engine calls
    :meth:`on_param_grad`) or at the end of the backward.
    """

    def __init__(self, name: str, module: nn.Module, buckets: Sequence[FlatBucket], *,
                 reshard_after_forward: bool, is_root: bool,
                 on_backward_start: Callable[[], None],
                 order: "UnitOrder | None" = None,
                 shared: Sequence[FlatBucket] = (),
                 free_after_inputs: Callable[[], bool] | None = None,
                 shared_grads: int = 0) -> None:
        """``shared``: buckets another unit owns that this one also needs gathered (a weight
        two wrapped modules share); gathered and freed with this unit's own. ``shared_grads``:
        how many of those shared weights need a gradient; their accumulation calls
        :meth:`on_param_grad` too, and the unit's backward ends after its own parameters' and
        theirs (freeing a shared weight before autograd accumulated its gradient would fail).
        ``free_after_inputs`` (a graph layer under a split backward, whose input-gradient pass
        accumulates no weight gradient to count): free the unit once the gradients of every
        tensor entering it are computed, if the callable says so then; the layer's input side
        has run, and the weight-gradient pass gathers it again."""
        self._free_after_inputs = free_after_inputs
        self.name = name
        self.order = order
        self.module = module
        self.num_grad_params = sum(len(b.slots) for b in buckets if b.requires_grad) + \
            shared_grads
        self.buckets = list(buckets) + list(shared)
        self.reshard_after_forward = reshard_after_forward and not is_root
        self.fired = 0
        self.in_backward = False
        self._on_backward_start = on_backward_start
        if hasattr(module, "bind_unit"):  # a layer inside a graph calls us itself
            module.bind_unit(lambda tensors: self._enter(module, tensors),
                             lambda tensors: self._post_forward(module, (), tensors))
            self._handles = []
        else:
            self._handles = [module.register_forward_pre_hook(self._pre_forward),
                             module.register_forward_hook(self._post_forward)]

    def gather(self) -> None:
        for b in self.buckets:
            b.gather()

    def prefetch(self) -> None:
        """Launch this unit's gathers without waiting (the next unit's, during this one)."""
        for b in self.buckets:
            b.start_gather()

    def free(self) -> None:
        for b in self.buckets:
            b.free()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.gather()
        if self.order is not None and not self.in_backward:
            self.order.forward(self)

    def _enter(self, module: nn.Module, tensors: tuple[Any, ...]) -> None:
        self._pre_forward(module, ())
        if self._free_after_inputs is None or self.in_backward or not torch.is_grad_enabled():
            return
        # leaves (a stage's received activations) cannot carry an "all" hook under
        # autograd.grad; the stage's first layer is freed at the pass's end instead
        entering = [t for t in _flatten_tensors(tensors)
                    if t.requires_grad and t.grad_fn is not None]
        if entering:
            torch.autograd.graph.register_multi_grad_hook(entering, self._inputs_done, mode="all")

    def _inputs_done(self, grads: Any) -> None:
        if self._free_after_inputs is not None and self._free_after_inputs():
            self.end_backward()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.in_backward:  # a recomputation (activation checkpointing) inside backward
            return output
        tensors = [t for t in _flatten_tensors(output) if t.requires_grad]
        if tensors and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if self.reshard_after_forward or not (tensors and torch.is_grad_enabled()):
            self.free()
        return output

    def _pre_backward(self, grad: Any) -> None:
        self._on_backward_start()
        self.in_backward = True
        self.gather()
        if self.order is not None:
            self.order.backward(self)

    def on_param_grad(self) -> None:
        self.fired += 1
        if self.fired == self.num_grad_params:
            self.end_backward()

    def end_backward(self) -> None:
        self.fired = 0
        self.in_backward = False
        self.free()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if hasattr(self.module, "bind_unit"):
            self.module.bind_unit(None, None)


class UnitOrder:
    """The order a rank's ZeRO-3 units run in, learnt in the first forward and backward (the
    sequence of first entries, as FSDP2 records it), and the prefetch it drives: entering a unit
    launches the gather of the unit that ran after it last time, so that gather overlaps this
    unit's compute. At most two units are gathered at once. Every data-parallel rank runs the
    same modules in the same order, so their collectives stay in step."""

    def __init__(self) -> None:
        self._forward: list[ParamUnit] = []
        self._backward: list[ParamUnit] = []
        self.prefetched = 0  # gathers launched ahead of use (for tests and reports)

    def forward(self, unit: ParamUnit) -> None:
        self._next(self._forward, unit)

    def backward(self, unit: ParamUnit) -> None:
        self._next(self._backward, unit)

    def _next(self, order: list[ParamUnit], unit: ParamUnit) -> None:
        if unit not in order:  # still learning: the first pass runs without prefetch
            order.append(unit)
            return
        i = order.index(unit)
        if i + 1 < len(order):
            nxt = order[i + 1]
            if not all(b.gathered or b.prefetching for b in nxt.buckets):
                nxt.prefetch()
                self.prefetched += 1
