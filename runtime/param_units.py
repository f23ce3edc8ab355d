"""ZeRO-3's units: the parameters of one module gathered for its forward and backward.

A :class:`ParamUnit` wraps a module whose parameters live in ZeRO-3 flat buckets
(:class:`autopar.runtime.zero.FlatBucket`): module hooks gather the buckets before the module
runs forward, free them after it (unless kept gathered between forward and backward, FSDP's
``reshard_after_forward=False``), gather them again when the first gradient reaches the
module's outputs and free them once every parameter's gradient is accumulated (and, for a
module holding frozen parameters, once the gradients of its inputs are computed too: the
backward still reads a frozen weight after the last trainable one's gradient). A
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

#: What a unit holding frozen parameters waits for in backward, besides its gradients.
_INPUTS = "the gradients of the tensors entering it"
_PASS_END = "the end of the backward (an entering tensor is a leaf)"


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

    Frozen parameters (``requires_grad=False``: a frozen norm, a LoRA base weight) have no
    gradient to count, yet the backward reads them to pass gradients on (a frozen norm's weight
    scales its input's gradient), possibly after the unit's last trainable gradient. A unit
    holding some is freed when that count is done *and* the gradients of the tensors entering
    it are computed (a multi-grad hook registered in forward): every backward op of the unit
    leads to one or the other. Where an entering tensor is a leaf (a stage's received
    activations), the end of the backward frees it, as the stage's last unit it is by then.
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
        self._holds_frozen = any(not b.requires_grad for b in self.buckets)
        #: Frozen parameters: what the unit's backward waits for besides its gradients (None:
        #: nothing; _INPUTS: its entering tensors' gradients; _PASS_END: the backward's end),
        #: learnt in forward; and whether the current backward still waits for its inputs.
        self._inputs_wait: object | None = None
        self._inputs_pending = False
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
        self._watch_inputs(args)

    def _watch_inputs(self, args: Any) -> None:
        """A unit holding frozen parameters: learn what its backward must wait for (class
        docstring), hooking the gradients of the tensors entering it."""
        if not self._holds_frozen or self.in_backward or not torch.is_grad_enabled():
            return
        entering = [t for t in _flatten_tensors(args) if t.requires_grad]
        if any(t.grad_fn is None for t in entering):
            self._inputs_wait = _PASS_END
        elif entering:
            self._inputs_wait = _INPUTS
            torch.autograd.graph.register_multi_grad_hook(entering, self._frozen_inputs_done,
                                                          mode="all")
        else:
            self._inputs_wait = None

    def _frozen_inputs_done(self, grads: Any) -> None:
        self._inputs_pending = False
        if self.in_backward and self.fired >= self.num_grad_params:
            self.end_backward()

    def _enter(self, module: nn.Module, tensors: tuple[Any, ...]) -> None:
        self._pre_forward(module, tensors)
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
        if not self.in_backward:
            self._inputs_pending = self._inputs_wait is not None
        self.in_backward = True
        self.gather()
        if self.order is not None:
            self.order.backward(self)

    def on_param_grad(self) -> None:
        self.fired += 1
        if self.fired == self.num_grad_params and not self._inputs_pending:
            self.end_backward()

    def end_backward(self) -> None:
        self.fired = 0
        self.in_backward = False
        self._inputs_pending = False
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
