"""Sharding strategies borrowed from torch's DTensor, for ops autopar has no rule of its own for.

DTensor's sharding propagation (``torch.distributed.tensor``) registers, per aten overload, the
placements an op can run in: a strategy function over every input's possible placements
(``op_strategy_funcs``: cumsum, sort, topk, gather, pooling, stack, ...) or a single-mesh-dim
rule listing ``[outputs..., inputs...]`` placements (``op_single_dim_strategy_funcs``: index
ops, group norm, upsampling, ...). A tensor-parallel axis is one mesh dim, so both translate
directly into :class:`~autopar.passes.sharding_rules.Strategy` values: ``Shard(d)`` stays
``Shard(d)``, ``Replicate`` and ``Partial`` (a sum) keep their meaning.

What is kept of them is what autopar's own rules also obey: a dim is split only where tp divides
it, never the batch (that is data parallelism), the sequence only under sequence parallelism.
And only what holds: every borrowed strategy is run once, on random inputs of the op's shapes,
as ``tp`` ranks would run it in one process (each input cut to its placement, the op on each
piece, the pieces joined by the output's placement) and compared with the op on the whole
inputs; a strategy that disagrees is dropped. (DTensor's ``cumsum`` strategy, for one, offers to
split the summed dim when it is given as ``-1``.)
Ops whose scalar or shape arguments DTensor rewrites to local values before running them
(``op_to_shape_and_stride_idx``, ``op_to_scalar_shape_adjuster``) are not borrowed: autopar
emits the op with its arguments as traced, which is only correct where the local op needs no
such rewrite. DTensor is asked on a one-dimensional mesh of ``tp`` devices built without a
process group (``_init_backend=False``); no collective runs.
"""

from __future__ import annotations

import functools
from typing import Any

import sympy
import torch
import torch.fx

from autopar.ir import TensorSpec, info
from autopar.sharding import PARTIAL, REPLICATE, make_shard

__all__ = ["borrowed_strategies"]

#: The size a symbolic dim (batch, sequence) is given when DTensor is asked: any size tp divides
#: does; which dims may really be split is autopar's own check afterwards.
_SYMBOLIC_SIZE = 64


def _propagator() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor._op_dispatcher.sharding_propagator


def _meta(spec: TensorSpec) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    dims = [sympy.sympify(d) for d in spec.shape]
    shape = torch.Size(int(d.subs({s: _SYMBOLIC_SIZE for s in d.free_symbols})) for d in dims)
    return TensorMeta(shape, torch.empty(shape, device="meta").stride(), spec.dtype)


def _placement(p: Any) -> Any:
    """A DTensor placement (or a single-dim rule's placeholder) as autopar's, or None."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    name = type(p).__name__
    if name == "_ShardingPlaceholder":
        return make_shard(p.dim)
    if isinstance(p, Replicate):
        return REPLICATE
    if isinstance(p, Shard) and name == "Shard":
        return make_shard(p.dim)
    if isinstance(p, Partial) and getattr(p, "reduce_op", "sum") == "sum":
        return PARTIAL
    return None  # strided shards, max/avg partials: not borrowed


def _tensor_args(node: torch.fx.Node) -> list[tuple[int, torch.fx.Node, TensorSpec]] | None:
    """(position, node, spec) of the positional tensor args; None when an arg is a list of
    tensors or a keyword is a tensor (not borrowed)."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
            return None
        if isinstance(a, torch.fx.Node):
            spec = info(a).spec
            if spec is None:
                return None
            out.append((i, a, spec))
    if any(isinstance(v, torch.fx.Node) for v in node.kwargs.values()):
        return None
    return out


def borrowed_strategies(node: torch.fx.Node, tp: int) -> list[tuple[Any, dict[torch.fx.Node, Any]]]:
    """DTensor's strategies for ``node`` as ``(output placement, {input node: placement})``,
    untested against tp's divisibility (the caller checks); empty when DTensor has none."""
    op = node.target
    prop = _propagator()
    if prop is None or not isinstance(op, torch._ops.OpOverload):
        return []
    if op in prop.op_to_shape_and_stride_idx or op in prop.op_to_scalar_shape_adjuster:
        return []
    args = _tensor_args(node)
    if not args:
        return []
    rules: list[tuple[list[Any], list[Any]]] = []  # (outputs, inputs in args order)
    try:
        if op in prop.op_single_dim_strategy_funcs:
            rules = _single_dim(prop, node, op, args)
        elif op in prop.op_strategy_funcs:
            rules = _strategy_func(prop, node, op, args, tp)
    except Exception:  # noqa: BLE001 - a strategy DTensor cannot give is no strategy
        return []
    out = []
    for outputs, inputs in rules:
        converted_out = [_placement(p) for p in outputs]
        converted_in = [_placement(p) for p in inputs]
        if None in converted_out or None in converted_in or len(converted_in) != len(args):
            continue
        reqs: dict[torch.fx.Node, Any] = {}
        if any(reqs.setdefault(a, p) != p for (_, a, _), p in zip(args, converted_in)):
            continue  # one node required in two placements
        value = info(node).value
        output = tuple(converted_out) if isinstance(value, tuple) else converted_out[0]
        if _holds(node, args, tuple(converted_in), output, tp):
            out.append((output, reqs))
    return out


def _holds(node: torch.fx.Node, args, placements: tuple[Any, ...], output: Any, tp: int) -> bool:
    """Whether the op computed piecewise under ``placements`` gives its whole result (see the
    module docstring); cached per op, shapes, arguments and placements."""
    key = (node.target, tuple((i, tuple(_meta(spec).shape), spec.dtype) for i, _, spec in args),
           repr([a for a in node.args if not isinstance(a, torch.fx.Node)]),
           repr(sorted(node.kwargs.items())), placements, repr(output), tp)
    if key not in _HOLDS:
        try:
            _HOLDS[key] = _check(node, args, placements, output, tp)
        except Exception:  # noqa: BLE001 - an op that cannot run piecewise is not borrowed
            _HOLDS[key] = False
    return _HOLDS[key]


_HOLDS: dict[tuple, bool] = {}


def _check(node, args, placements, output, tp) -> bool:
    from autopar.sharding import Partial, is_sharded

    gen = torch.Generator().manual_seed(0)
    full_args = list(node.args)
    for i, _, spec in args:
        shape = _meta(spec).shape
        if spec.dtype.is_floating_point:
            full_args[i] = torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            full_args[i] = torch.randint(0, 2, shape, generator=gen).to(spec.dtype)
    whole = node.target(*full_args, **node.kwargs)
    pieces = []
    for r in range(tp):
        local = list(full_args)
        for (i, _, _), p in zip(args, placements):
            if is_sharded(p):
                local[i] = full_args[i].chunk(tp, dim=p.dim)[r].contiguous()
            elif isinstance(p, Partial):
                local[i] = full_args[i] / tp
        pieces.append(node.target(*local, **node.kwargs))
    outs = output if isinstance(output, tuple) else (output,)
    wholes = whole if isinstance(whole, (tuple, list)) else (whole,)
    for k, (p, want) in enumerate(zip(outs, wholes)):
        if p is None or not isinstance(want, torch.Tensor):
            continue
        got = [piece[k] if isinstance(piece, (tuple, list)) else piece for piece in pieces]
        if is_sharded(p):
            joined = torch.cat(got, dim=p.dim)
        elif isinstance(p, Partial):
            joined = sum(got[1:], got[0])
        else:
            if not all(torch.equal(g, got[0]) for g in got):
                return False
            joined = got[0]
        if joined.shape != want.shape or not torch.allclose(
                joined.double(), want.double(), rtol=1e-6, atol=1e-9):
            return False
    return True


def _single_dim(prop, node, op, args) -> list[tuple[list[Any], list[Any]]]:
    schema_args = tuple(_meta(info(a).spec) if isinstance(a, torch.fx.Node) else a
                        for a in node.args)
    rules = prop.op_single_dim_strategy_funcs[op].func(op, schema_args, dict(node.kwargs))
    value = info(node).value
    n_out = len(value) if isinstance(value, tuple) else 1
    return [(list(rule[:n_out]), list(rule[n_out:])) for rule in rules]


@functools.lru_cache(maxsize=None)
def _mesh(tp: int) -> Any:
    """A one-dimensional mesh of ``tp`` devices to ask DTensor on (no process group)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)


def _strategy_func(prop, node, op, args, tp) -> list[tuple[list[Any], list[Any]]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    mesh = _mesh(tp)
    schema_args = []
    for a in node.args:
        if isinstance(a, torch.fx.Node):
            meta = _meta(info(a).spec)
            options = [Replicate()] + [Shard(d) for d in range(len(meta.shape))]
            schema_args.append(OpStrategy([OpSpec(DTensorSpec(mesh, (p,), meta))
                                           for p in options]))
        else:
            schema_args.append(a)
    strategy = prop.op_strategy_funcs[op](OpSchema(op, tuple(schema_args), dict(node.kwargs)))
    rules = []
    for spec in getattr(strategy, "strategies", ()):
        outputs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        if any(o is None for o in outputs) or spec.input_specs is None:
            continue
        rules.append(([o.placements[0] for o in outputs],
                      [i.placements[0] for i in spec.input_specs]))
    return rules
