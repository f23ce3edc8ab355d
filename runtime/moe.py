"""Mixture-of-experts experts: the captured operation, its math, and expert parallelism.

A mixture-of-experts block routes each token to ``k`` of ``E`` experts (feed-forward networks)
and adds their outputs, weighted by the router. How many tokens an expert receives depends on the
router's values, so the loop over experts cannot be traced with symbolic shapes. autopar captures
the router as an ordinary graph (a linear layer, a softmax, a top-k: every op traceable) and the
experts as one operation, ``torch.ops.autopar.moe_experts``::

    moe_experts(x [T, H], index [T, k] int, weights [T, k], gate_up [E, 2I or I, H],
                down [E, H, I], act, gated) -> [T, H]

    out[t] = sum_j weights[t, j] * down[e] @ f(gate_up[e] @ x[t]),   e = index[t, j]
    f(h) = act(h[:I]) * h[I:]   (gated: SwiGLU / GeGLU)      f(h) = act(h)   (not gated)

Entries of ``index`` outside ``[0, E)`` contribute nothing (transformers' padding sentinel E).
This is the layout of transformers' experts modules (``gate_up_proj``, ``down_proj``: Mixtral,
Qwen-MoE, OLMoE, DeepSeek) and of the plain example in ``examples/moe.py``. The computation is
dropless: every token reaches its k experts (no capacity factor), so a parallel run equals one
process.

Expert parallelism (:class:`EPGroup`, ``ep`` ranks borrowed from the data-parallel ones as in
Megatron-LM and DeepSpeed): each rank holds ``E / ep`` consecutive experts and its own tokens.
:meth:`EPGroup.experts` sorts this rank's (token, expert) pairs by expert, exchanges the number
of rows per expert (one all-to-all of ``E`` integers), sends each row to its expert's rank
(all-to-all with those split sizes), runs its experts on what arrived, grouped by expert, and
sends the results back the same way (the backward runs the two exchanges reversed). An expert's
gradient then holds the contributions of every token of the ``ep`` ranks; the data-parallel
engine averages it over the ``dp / ep`` ranks holding the same experts, so the weights' gradients
are scaled by ``1 / ep`` here to make the whole an average over all ``dp`` ranks, as the dense
parameters' is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import InvalidInputError
from autopar.runtime.comm import collective

__all__ = ["ACTIVATIONS", "EPGroup", "experts", "experts_reference", "moe_experts"]

#: The activations the operation knows, by the name the capture records.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def _check(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor, act: str, gated: bool) -> None:
    if act not in ACTIVATIONS:
        raise InvalidInputError(f"unknown expert activation {act!r}",
                                expected=f"one of {sorted(ACTIVATIONS)}", found=act)
    if x.dim() != 2 or index.dim() != 2 or weights.shape != index.shape:
        raise InvalidInputError("moe_experts takes tokens [T, H], index and weights [T, k]",
                                found=f"x {list(x.shape)}, index {list(index.shape)}, weights "
                                      f"{list(weights.shape)}")
    inner = down.shape[-1] * (2 if gated else 1)
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
            or gate_up.shape[1] != inner or gate_up.shape[2] != x.shape[1] \
            or down.shape[1] != x.shape[1]:
        raise InvalidInputError("expert weights do not fit the tokens",
                                expected=f"gate_up [E, {'2I' if gated else 'I'}, H={x.shape[1]}] "
                                         f"and down [E, H, I]",
                                found=f"gate_up {list(gate_up.shape)}, down {list(down.shape)}")


def _run_experts(rows: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor,
                 down: torch.Tensor, act: str, gated: bool) -> torch.Tensor:
    """Expert ``e`` applied to the ``counts[e]`` consecutive rows of ``rows`` (grouped by expert,
    in expert order). Every expert runs, an empty one on zero rows, so every expert weight gets a
    gradient (zero where no token came) and the backward is the same graph on every rank."""
    fn = ACTIVATIONS[act]
    outs = []
    for e, part in enumerate(torch.split(rows, list(counts))):
        h = F.linear(part, gate_up[e])
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = fn(gate) * up
        else:
            h = fn(h)
        outs.append(F.linear(h, down[e]))
    return torch.cat(outs) if outs else rows.new_zeros((0, down.shape[1]))


def _routes(index: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token, counts): the kept (token, slot) pairs sorted by expert (stable), the token
    of each, and the rows per expert."""
    k = index.shape[1]
    flat = index.reshape(-1).long()
    keep = (flat >= 0) & (flat < num_experts)
    flat = torch.where(keep, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(flat, stable=True)[:int(keep.sum())]
    counts = torch.bincount(flat[order], minlength=num_experts)
    return order, order // k, counts


def _combine(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
             token: torch.Tensor) -> torch.Tensor:
    """sum over each token's routes of weight * expert output (rows in expert order)."""
    w = weights.reshape(-1)[order].unsqueeze(-1)
    # index_put's backward keeps the indices only (index_add's keeps its source too)
    return torch.zeros_like(x).index_put((token,), (y * w.to(y.dtype)).to(x.dtype),
                                         accumulate=True)


def experts_reference(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                      gated: bool = True) -> torch.Tensor:
    """The operation on one process, differentiable (the math of the module docstring)."""
    _check(x, index, weights, gate_up, down, act, gated)
    order, token, counts = _routes(index, gate_up.shape[0])
    y = _run_experts(x[token], counts.tolist(), gate_up, down, act, gated)
    return _combine(x, y, weights, order, token)


# ---------------------------------------------------------------------------------------------
# The captured operation
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str, gated: bool
                ) -> torch.Tensor:
    """The experts of a mixture-of-experts block as one operation (module docstring)."""
    with torch.no_grad():
        return experts_reference(x, index, weights, gate_up, down, act, gated)


@moe_experts.register_fake
def _moe_experts_fake(x, index, weights, gate_up, down, act, gated):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    x, index, weights, gate_up, down, act, gated = inputs
    ctx.save_for_backward(x, index, weights, gate_up, down)
    ctx.act, ctx.gated = act, gated


def _backward(ctx, grad):
    """Recomputes the forward with autograd and differentiates it (the operation's backward when
    the captured graph is run as it is; the runtime calls :func:`experts` instead)."""
    x, index, weights, gate_up, down = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (x, weights, gate_up, down)]
        out = experts_reference(leaves[0], index, leaves[1], leaves[2], leaves[3], ctx.act,
                                ctx.gated)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True)) if wanted else iter(())
    gx, gw, gg, gd = (next(grads) if t.requires_grad else None for t in leaves)
    return gx, None, gw, gg, gd, None, None


moe_experts.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """Rows sent with ``send`` split sizes, received with ``recv``; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any,
                what: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.what = send, recv, group, what
        return _all_to_all(x.contiguous(), send, recv, group, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_all_to_all(grad.contiguous(), ctx.recv, ctx.send, ctx.group,
                            f"{ctx.what} (backward)"), None, None, None, None)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any,
                what: str) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    collective(dist.all_to_all_single, out, x, output_split_sizes=recv, input_split_sizes=send,
               group=group, what=what)
    return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class EPGroup:
    """This rank's expert-parallel group and the experts operation over it (size 1: every
    expert is local and :meth:`experts` is :func:`experts_reference`)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1

    @classmethod
    def from_mesh(cls, mesh: Any) -> "EPGroup":
        return cls(getattr(mesh, "ep_group", None))

    def __repr__(self) -> str:
        return f"EPGroup(rank={self.rank}, size={self.size})"

    def experts(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                gated: bool = True) -> torch.Tensor:
        """The operation with this rank's ``E / ep`` experts (``gate_up``, ``down``: their
        weights) and this rank's tokens (module docstring)."""
        if self.size == 1:
            return experts_reference(x, index, weights, gate_up, down, act, gated)
        _check(x, index, weights, gate_up, down, act, gated)
        p, local = self.size, gate_up.shape[0]
        order, token, counts = _routes(index, local * p)
        # rows per (destination rank, its expert) -> rows per (source rank, my expert)
        received = torch.empty_like(counts)
        collective(dist.all_to_all_single, received, counts, group=self.group,
                   what=f"the expert-parallel exchange of {local * p} row counts")
        sent_rows = counts.view(p, local)
        got_rows = received.view(p, local)
        send = sent_rows.sum(1).tolist()
        recv = got_rows.sum(1).tolist()
        what = f"the expert-parallel all-to-all of {x.dtype} rows of {x.shape[1]}"
        arrived = _AllToAll.apply(x[token], send, recv, self.group, what)
        # arrived is grouped by (source, expert); the experts want (expert, source): a stable
        # sort of each row's segment by expert first
        segment = torch.arange(p * local, device=x.device).view(p, local)
        key = (segment % local) * p + segment // local
        perm = torch.argsort(torch.repeat_interleave(key.flatten(), got_rows.flatten()),
                             stable=True)
        scale = 1.0 / p
        y = _run_experts(arrived[perm], got_rows.sum(0).tolist(),
                         _ScaleGrad.apply(gate_up, scale), _ScaleGrad.apply(down, scale),
                         act, gated)
        back = torch.empty_like(y).index_copy(0, perm, y)
        returned = _AllToAll.apply(back, recv, send, self.group, what)
        return _combine(x, returned, weights, order, token)


def experts(ep: EPGroup, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
            gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
            gated: bool = True) -> torch.Tensor:
    """``ep.experts(...)``: what a rank's program calls in place of the captured operation."""
    return ep.experts(x, index, weights, gate_up, down, act, gated)
