"""Sharding rules: for every op, the placements it can compute in and what it then needs.

A :class:`Strategy` of a node is one way to run it on ``tp`` ranks: the placement of its output
and the placement it requires of each tensor input (in ``node.all_input_nodes`` order). The
search (passes/shard.py) picks one strategy per node; where a producer's placement differs from
what a consumer requires, a collective is inserted (autopar.sharding.redistribution).

Rules, by op family (the dims named are those of the output unless said otherwise):

- GEMMs (linear, mm, addmm, bmm, baddbmm, matmul): *replicate*; *column* (weight split on its output
  features, output sharded on the last dim; a StridedShard when the output is later split into
  equal parts, e.g. fused QKV); *row* (weight split on its input features, input sharded on the
  last dim, output Partial); for bmm / baddbmm / matmul also a batch dim (heads; baddbmm's
  added input sharded alike, or replicated where it broadcasts). Splitting the tokens
  (rows) of a GEMM with the weight replicated is data parallelism, left to the dp axis. A
  GEMM's bias is split off before the search (passes/shard.py) because it must be added after a
  row-parallel reduction.
- Pointwise ops: any placement of the output, the same one required of every input (a broadcast
  dim is required replicated). Partial passes through ops linear in it: add/sub of partials,
  mul/div by a replicated factor, neg, casts, clones.
- Views (view, reshape, flatten, unsqueeze, expand, transpose, permute, t, full slices, split +
  getitem, cat): placements follow the dims. Merging dims keeps a shard of the outermost merged
  dim; splitting a sharded dim shards the outermost new dim; an expanded size-1 dim may be
  sharded with a replicated input. ``split`` into k equal parts along a dim gives k shards of
  that dim from a StridedShard of k blocks, which is how fused QKV's layout is derived.
- Reductions (sum, mean) over a sharded dim give Partial (mean rescaled by 1/tp); softmax, layer
  norm, RMS norm (``aten.rms_norm``: torch's nn.RMSNorm / F.rms_norm) and the like need their
  reduced dims whole and may be sharded over the leading ones (heads or, with sequence
  parallelism, the sequence), with their weight (and bias) replicated.
- scaled_dot_product_attention: by heads (dim 1 of q, k, v and of the mask if it has heads).
- embedding: vocab-parallel (table Shard(0), masked lookup, output Partial), hidden-parallel
  (table Shard(1)) or by tokens (indices sharded).
- cross_entropy_loss: vocab-parallel (logits sharded on the class dim, replicated loss).
- Integer and boolean ops (masks, positions) are replicated. An op with a floating result and
  no rule here takes the strategies torch's DTensor registers for it (passes/dtensor_rules.py:
  cumsum, sort, gather, group norm, ...), kept where they obey the rules below; with none, it
  is replicated and reported (autopar.UnsupportedOpWarning).

A dim may be sharded only if ``tp`` divides it; the batch never (that is data parallelism) and
the sequence only with sequence parallelism on.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from autopar.ir import SEQ, NodeKind, TensorSpec, info, op_name
from autopar.passes.analyze import (CONV_OPS, MATMUL_OPS, conv_groups, conv_groups_index,
                                    conv_is_transposed)
from autopar.plan_types import GemmSharding
from autopar.sharding import (
    PARTIAL,
    REPLICATE,
    Collective,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    is_sharded,
    make_shard,
    num_blocks,
    placement_str,
)

__all__ = ["Strategy", "Rewrite", "Item", "RuleContext", "node_strategies",
           "placeholder_strategies", "tensor_spec", "is_tensor_node", "is_elementwise"]

INT_MAX = 9223372036854775807


class Rewrite(enum.Enum):
    """How a sharded op's local program differs from the op itself."""

    NONE = "none"
    VOCAB_EMBEDDING = "vocab_embedding"  # masked lookup in this rank's rows
    VOCAB_CROSS_ENTROPY = "vocab_cross_entropy"  # Megatron-LM's vocab-parallel loss
    MEAN_OVER_SHARD = "mean_over_shard"  # local mean / tp is this rank's share of the mean


@dataclass(frozen=True, slots=True)
class Item:
    """Requirement of ``getitem(x, index)``: element ``index`` of x's outputs placed so."""

    index: int
    placement: Any


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    #: Placement of the output (a tuple for multi-output ops, None for non-tensor items).
    output: Any
    #: Required placement of each input in node.all_input_nodes order (None: not a tensor).
    inputs: tuple[Any, ...]
    #: Fraction of the op's work (FLOPs, bytes) one rank does.
    compute_scale: float = 1.0
    gemm: GemmSharding | None = None
    rewrite: Rewrite = Rewrite.NONE
    #: Collectives the op performs inside (vocab-parallel cross-entropy): (kind, elements).
    internal: tuple[tuple[Collective, Any], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.compute_scale <= 1.0:
            raise ValueError(f"compute_scale must be in (0, 1], got {self.compute_scale}")


@dataclass
class RuleContext:
    tp: int
    sequence_parallel: bool = False
    #: StridedShard placements consumers demand of a node's output (filled by the search).
    demanded: dict[torch.fx.Node, set] = field(default_factory=dict)
    #: Float ops with no rule, by op name (for the warning).
    unruled: dict[str, list[str]] = field(default_factory=dict)
    #: Float ops with no rule of autopar's whose strategies came from DTensor, by op name.
    borrowed: dict[str, list[str]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def tensor_spec(node: Any) -> TensorSpec | None:
    return info(node).spec if isinstance(node, torch.fx.Node) else None


def is_tensor_node(node: torch.fx.Node) -> bool:
    value = info(node).value
    return isinstance(value, TensorSpec) or (
        isinstance(value, tuple) and any(isinstance(v, TensorSpec) for v in value))


def _shardable(size: Any, ctx: RuleContext, blocks: int = 1) -> bool:
    if ctx.tp == 1:
        return False
    size = sympy.sympify(size)
    if size.is_Integer:
        return int(size) % (ctx.tp * blocks) == 0 and int(size) >= ctx.tp * blocks
    return ctx.sequence_parallel and blocks == 1 and size == SEQ


def _dims(spec: TensorSpec, ctx: RuleContext) -> list[int]:
    return [d for d in range(spec.ndim) if _shardable(spec.shape[d], ctx)]


def _candidates(node: torch.fx.Node, ctx: RuleContext) -> list[Any]:
    """R, Shard(d) for every dim tp may split, and StridedShards consumers asked for."""
    spec = info(node).spec
    out: list[Any] = [REPLICATE]
    if spec is None:
        return out
    out += [Shard(d) for d in _dims(spec, ctx)]
    extra = ctx.demanded.get(node, ())
    out += sorted((p for p in extra if p not in out), key=lambda p: (p.dim, num_blocks(p)))
    return out


def _with_dim(p: Any, dim: int) -> Any:
    return make_shard(dim, num_blocks(p))


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as",
                    "_reshape_alias", "t", "transpose", "permute", "numpy_T", "unsqueeze",
                    "squeeze", "expand", "slice", "select", "split", "split_with_sizes", "chunk",
                    "unsafe_split", "getitem"})


def is_elementwise(node: torch.fx.Node) -> bool:
    """Pointwise ops and views: memory-bound work a compiler fuses into neighbouring kernels."""
    return node.op == "call_function" and op_name(node) in (_POINTWISE | _VIEWS)


def _is_float(spec: TensorSpec | None) -> bool:
    return spec is not None and spec.is_float


def _scale(p: Any, tp: int) -> float:
    if isinstance(p, tuple):
        return min((_scale(q, tp) for q in p if q is not None), default=1.0)
    return 1.0 / tp if is_sharded(p) else 1.0


def _strategy(node: torch.fx.Node, name: str, output: Any, inputs: dict[torch.fx.Node, Any],
              ctx: RuleContext, **kw: Any) -> Strategy:
    reqs = tuple(inputs.get(a, REPLICATE) if is_tensor_node(a) else None
                 for a in node.all_input_nodes)
    kw.setdefault("compute_scale", _scale(output, ctx.tp) if not isinstance(output, Partial)
                  else 1.0 / ctx.tp)
    return Strategy(name, output, reqs, **kw)


def _replicated(node: torch.fx.Node, ctx: RuleContext) -> Strategy:
    value = info(node).value
    out = tuple(REPLICATE if isinstance(v, TensorSpec) else None for v in value) \
        if isinstance(value, tuple) else REPLICATE
    return _strategy(node, "replicate", out, {}, ctx, compute_scale=1.0,
                     gemm=GemmSharding.REPLICATE if info(node).is_gemm or
                     op_name(node) in MATMUL_OPS else None)


# ---------------------------------------------------------------------------------------------
# Pointwise
# ---------------------------------------------------------------------------------------------

_POINTWISE = frozenset({
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "log1p",
    "tanh", "sigmoid", "relu", "gelu", "silu", "sin", "cos", "abs", "erf", "where",
    "masked_fill", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "dropout", "to",
    "_to_copy", "clone", "contiguous", "alias", "detach", "type_as", "reciprocal", "square",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "__and__",
    "__or__", "bitwise_and", "bitwise_or", "bitwise_not", "softplus", "leaky_relu", "hardtanh",
    "zeros_like", "ones_like", "full_like", "empty_like", "lift_fresh_copy", "mish", "elu",
    "hardswish", "hardsigmoid", "sign", "floor", "ceil", "round", "trunc", "native_dropout_eval",
})
#: Ops linear in each Partial operand, and how: "all" (every tensor operand Partial),
#: "one" (one Partial operand times/over replicated others), "first" (only the first operand).
_PARTIAL_LINEAR = {"add": "all", "sub": "all", "neg": "all", "mul": "one", "div": "first",
                   "to": "all", "_to_copy": "all", "clone": "all", "contiguous": "all",
                   "alias": "all", "detach": "all", "type_as": "first", "lift_fresh_copy": "all"}


def _broadcast_requirement(p: Any, in_spec: TensorSpec, out_spec: TensorSpec) -> Any:
    """What an input broadcast into an output placed as ``p`` must be (None: impossible)."""
    if not is_sharded(p):
        return REPLICATE
    offset = out_spec.ndim - in_spec.ndim
    j = p.dim - offset
    if j < 0 or (in_spec.shape[j] == 1 and out_spec.shape[p.dim] != 1):
        return REPLICATE
    if in_spec.shape[j] != out_spec.shape[p.dim]:
        return None
    return _with_dim(p, j)


def _pointwise(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    out_spec = info(node).spec
    tensors = [a for a in node.all_input_nodes if is_tensor_node(a)]
    strategies = []
    for p in _candidates(node, ctx):
        reqs = {}
        ok = True
        for a in tensors:
            req = _broadcast_requirement(p, tensor_spec(a), out_spec) if tensor_spec(a) else REPLICATE
            if req is None:
                ok = False
                break
            reqs[a] = req
        if ok:
            strategies.append(_strategy(node, _pname(p), p, reqs, ctx))
    mode = _PARTIAL_LINEAR.get(op_name(node))
    floats = [a for a in tensors if _is_float(tensor_spec(a))]
    if mode and floats and out_spec is not None and out_spec.is_float:
        same_shape = all(tensor_spec(a).shape == out_spec.shape for a in floats)
        scalars = [a for a in node.args[1:] if isinstance(a, (int, float)) and a != 0] \
            if op_name(node) in ("add", "sub") else []
        if mode == "all" and same_shape and not scalars and len(floats) == len(tensors):
            strategies.append(_strategy(node, "partial", PARTIAL, {a: PARTIAL for a in floats},
                                        ctx, compute_scale=1.0))
        elif mode == "one":
            for a in floats:
                if tensor_spec(a).shape == out_spec.shape:
                    strategies.append(_strategy(node, f"partial@{a.name}", PARTIAL, {a: PARTIAL},
                                                ctx, compute_scale=1.0))
        elif mode == "first" and isinstance(node.args[0], torch.fx.Node) and \
                node.args[0] in floats and tensor_spec(node.args[0]).shape == out_spec.shape:
            strategies.append(_strategy(node, "partial", PARTIAL, {node.args[0]: PARTIAL}, ctx,
                                        compute_scale=1.0))
    return strategies


def _pname(p: Any) -> str:
    return "replicate" if isinstance(p, Replicate) else placement_str(p)


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------

def _equal(a: Any, b: Any) -> bool:
    """Whether two symbolic sizes are equal: a difference that is a polynomial in the sizes'
    symbols is zero exactly when its expansion is (no ``sympy.simplify``, which is slow and
    imports ``sympy.physics`` on its first call); anything else (a floor division) is left to
    ``sympy.simplify``."""
    diff = sympy.expand(sympy.sympify(a) - b)
    if diff == 0:
        return True
    return not diff.is_polynomial() and sympy.simplify(diff) == 0


@functools.lru_cache(maxsize=4096)
def _reshape_groups(in_shape: tuple[Any, ...], out_shape: tuple[Any, ...]
                    ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None:
    """Pair up runs of input and output dims with equal products (None if they never match).
    Cached by the two symbolic shapes: comparing products was most of a sharding search's rule
    time, and the planner solves one graph at several tp degrees and micro-batch sizes."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = sympy.Integer(1)
        if i < n_in:
            gi.append(i)
            pi = pi * in_shape[i]
            i += 1
        if j < n_out:
            gj.append(j)
            pj = pj * out_shape[j]
            j += 1
        for _ in range(n_in + n_out + 1):
            if _equal(pi, pj):
                break
            num, den = sympy.fraction(sympy.together(pj / pi))
            grow_in = den == 1 and i < n_in
            grow_out = num == 1 and j < n_out
            if not grow_in and not grow_out:
                if i < n_in:
                    grow_in = True
                elif j < n_out:
                    grow_out = True
                else:
                    return None
            if grow_in:
                gi.append(i)
                pi = pi * in_shape[i]
                i += 1
            if grow_out:
                gj.append(j)
                pj = pj * out_shape[j]
                j += 1
        else:
            return None
        groups.append((gi, gj))
    return tuple((tuple(gi), tuple(gj)) for gi, gj in groups)


def _reshape(node: torch.fx.Node, ctx: RuleContext, src: torch.fx.Node) -> list[Strategy]:
    in_spec, out_spec = tensor_spec(src), info(node).spec
    groups = _reshape_groups(tuple(in_spec.shape), tuple(out_spec.shape))
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    if groups is None:
        return strategies
    for p in _candidates(node, ctx):
        if not is_sharded(p):
            continue
        for gi, gj in groups:
            if p.dim not in gj:
                continue
            big_in = [d for d in gi if in_spec.shape[d] != 1]
            big_out = [d for d in gj if out_spec.shape[d] != 1]
            if not big_in or not big_out or p.dim != big_out[0]:
                break
            if len(big_in) == 1 and len(big_out) == 1:
                req = _with_dim(p, big_in[0])
            elif num_blocks(p) == 1 and (len(big_in) == 1 or len(big_out) == 1) and \
                    _shardable(in_spec.shape[big_in[0]], ctx):
                req = Shard(big_in[0])
            else:
                break
            strategies.append(_strategy(node, _pname(p), p, {src: req}, ctx))
            break
    if _is_float(out_spec):
        strategies.append(_strategy(node, "partial", PARTIAL, {src: PARTIAL}, ctx, compute_scale=1.0))
    return strategies


def _dim_map_view(node: torch.fx.Node, ctx: RuleContext, src: torch.fx.Node,
                  out_to_in: Callable[[int], int | None], sharded_ok: Callable[[int], bool] = lambda d: True
                  ) -> list[Strategy]:
    """A view whose output dim d is input dim out_to_in(d) (None: a new dim)."""
    out_spec = info(node).spec
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    for p in _candidates(node, ctx):
        if not is_sharded(p) or not sharded_ok(p.dim):
            continue
        j = out_to_in(p.dim)
        if j is None:
            continue
        strategies.append(_strategy(node, _pname(p), p, {src: _with_dim(p, j)}, ctx))
    if _is_float(out_spec):
        strategies.append(_strategy(node, "partial", PARTIAL, {src: PARTIAL}, ctx, compute_scale=1.0))
    return strategies


def _view_rule(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy] | None:
    name = op_name(node)
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or tensor_spec(src) is None or info(node).spec is None:
        return None
    in_spec, out_spec = tensor_spec(src), info(node).spec
    if name in ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as",
                "_reshape_alias"):
        return _reshape(node, ctx, src)
    if name in ("t", "transpose", "permute", "numpy_T"):
        if name == "permute":
            perm = [_norm_dim(d, out_spec.ndim) for d in node.args[1]]
        else:
            perm = list(range(out_spec.ndim))
            if out_spec.ndim >= 2:
                a, b = (0, 1) if name in ("t", "numpy_T") else \
                    (_norm_dim(node.args[1], out_spec.ndim), _norm_dim(node.args[2], out_spec.ndim))
                perm[a], perm[b] = perm[b], perm[a]
        return _dim_map_view(node, ctx, src, lambda d: perm[d])
    if name == "unsqueeze":
        new = _norm_dim(node.args[1], out_spec.ndim)
        return _dim_map_view(node, ctx, src, lambda d: None if d == new else d - (d > new))
    if name == "squeeze":
        dims = node.args[1] if len(node.args) > 1 else None
        kept = [d for d in range(in_spec.ndim) if in_spec.shape[d] != 1 or (
            dims is not None and _norm_dim(dims, in_spec.ndim) != d
            if isinstance(dims, int) else dims is not None and
            d not in [_norm_dim(x, in_spec.ndim) for x in dims])]
        if len(kept) != out_spec.ndim:
            return None
        return _dim_map_view(node, ctx, src, lambda d: kept[d])
    if name == "expand":
        offset = out_spec.ndim - in_spec.ndim
        strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
        for p in _candidates(node, ctx):
            if not is_sharded(p):
                continue
            j = p.dim - offset
            if j < 0 or (in_spec.shape[j] == 1 and out_spec.shape[p.dim] != 1):
                req = REPLICATE  # a broadcast dim: every rank expands to its own share
            elif in_spec.shape[j] == out_spec.shape[p.dim]:
                req = _with_dim(p, j)
            else:
                continue
            strategies.append(_strategy(node, _pname(p), p, {src: req}, ctx))
        if _is_float(out_spec):
            strategies.append(_strategy(node, "partial", PARTIAL, {src: PARTIAL}, ctx,
                                        compute_scale=1.0))
        return strategies
    if name == "slice":
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, in_spec.ndim)
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else INT_MAX
        step = node.args[4] if len(node.args) > 4 else 1
        full = start in (0, None) and step == 1 and (
            end is None or (isinstance(end, int) and end >= INT_MAX // 2) or
            in_spec.shape[dim] == out_spec.shape[dim])
        return _dim_map_view(node, ctx, src, lambda d: d, lambda d: full or d != dim)
    if name == "select":
        dim = _norm_dim(node.args[1], in_spec.ndim)
        return _dim_map_view(node, ctx, src, lambda d: d if d < dim else d + 1)
    return None


def _split(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    src = node.args[0]
    in_spec = tensor_spec(src)
    name = op_name(node)
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), in_spec.ndim)
    specs = info(node).value
    n_out = len(specs)
    sizes = [s.shape[dim] for s in specs]

    def tup(p):
        return tuple(p if isinstance(s, TensorSpec) else None for s in specs)

    strategies = [_strategy(node, "replicate", tup(REPLICATE), {}, ctx)]
    for d in _dims(in_spec, ctx):
        if d != dim:
            strategies.append(_strategy(node, f"S({d})", tup(Shard(d)), {src: Shard(d)}, ctx))
    equal = n_out > 1 and all(_equal(s, sizes[0]) for s in sizes)
    if equal and _shardable(in_spec.shape[dim], ctx, blocks=n_out) and name in (
            "split", "split_with_sizes", "chunk", "unsafe_split"):
        strategies.append(_strategy(node, f"S({dim})", tup(Shard(dim)),
                                    {src: StridedShard(dim, split_factor=n_out)}, ctx))
    if _is_float(in_spec):
        strategies.append(_strategy(node, "partial", tup(PARTIAL), {src: PARTIAL}, ctx,
                                    compute_scale=1.0))
    return strategies


def _getitem(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy] | None:
    src, index = node.args[0], node.args[1]
    if not isinstance(src, torch.fx.Node) or not isinstance(info(src).value, tuple):
        return None
    spec = info(node).spec
    out = []
    for p in _candidates(node, ctx) + ([PARTIAL] if _is_float(spec) else []):
        out.append(Strategy(_pname(p) if not isinstance(p, Partial) else "partial", p,
                            (Item(index, p),), compute_scale=1.0))
    return out


def _cat(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    tensors = [a for a in node.args[0] if isinstance(a, torch.fx.Node)]
    out_spec = info(node).spec
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, out_spec.ndim)
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    for p in _candidates(node, ctx):
        if is_sharded(p) and p.dim != dim and all(tensor_spec(a).ndim == out_spec.ndim for a in tensors):
            strategies.append(_strategy(node, _pname(p), p, {a: p for a in tensors}, ctx))
    if _is_float(out_spec) and all(_is_float(tensor_spec(a)) for a in tensors):
        strategies.append(_strategy(node, "partial", PARTIAL, {a: PARTIAL for a in tensors}, ctx,
                                    compute_scale=1.0))
    return strategies


# ---------------------------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------------------------



def _linear(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], torch.fx.Node) else None
    out_spec, w_spec = info(node).spec, tensor_spec(w)
    last = out_spec.ndim - 1
    strategies = [_replicated(node, ctx)]
    for p in _candidates(node, ctx):
        if not is_sharded(p):
            continue
        if p.dim == last:  # column: output features split
            reqs = {x: REPLICATE, w: _with_dim(p, 0)}
            if bias is not None:
                reqs[bias] = _with_dim(p, 0)
            strategies.append(_strategy(node, "column", p, reqs, ctx, gemm=GemmSharding.COLUMN))
    k = tensor_spec(x).shape[-1]
    if bias is None and _shardable(k, ctx) and _shardable(w_spec.shape[1], ctx):
        strategies.append(_strategy(node, "row", PARTIAL,
                                    {x: Shard(tensor_spec(x).ndim - 1), w: Shard(1)}, ctx,
                                    gemm=GemmSharding.ROW))
    return strategies


def _mm(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    """mm / addmm / bmm / baddbmm / matmul with both operands at least 2-D (addmm and baddbmm:
    ``beta * input + alpha * a @ b``, the added input placed like the product)."""
    name = op_name(node)
    added = name in ("addmm", "baddbmm")
    bias = node.args[0] if added else None
    a, b = (node.args[1], node.args[2]) if added else (node.args[0], node.args[1])
    sa, sb, so = tensor_spec(a), tensor_spec(b), info(node).spec
    if sa is None or sb is None or sa.ndim < 2 or sb.ndim < 2:
        return [_replicated(node, ctx)]
    strategies = [_replicated(node, ctx)]

    for p in _candidates(node, ctx):
        if not is_sharded(p):
            continue
        d = p.dim
        if d == so.ndim - 1:  # columns of b
            reqs = {a: REPLICATE, b: _with_dim(p, sb.ndim - 1)}
            kind = GemmSharding.COLUMN
        elif d == so.ndim - 2:  # rows of a: splitting tokens is data parallelism, not TP
            continue
        else:  # a batch dim (bmm / matmul: heads)
            if num_blocks(p) > 1:
                continue
            ra = _broadcast_requirement(p, sa, so)
            rb = _broadcast_requirement(p, sb, so)
            if ra is None or rb is None:
                continue
            reqs = {a: ra, b: rb}
            kind = GemmSharding.REPLICATE
        if bias is not None:
            r = _broadcast_requirement(p, tensor_spec(bias), so)
            if r is None:
                continue
            reqs[bias] = r
        strategies.append(_strategy(node, "column" if kind is GemmSharding.COLUMN else _pname(p),
                                    p, reqs, ctx, gemm=kind))
    if bias is None and _shardable(sa.shape[-1], ctx):
        strategies.append(_strategy(node, "row", PARTIAL,
                                    {a: Shard(sa.ndim - 1), b: Shard(sb.ndim - 2)}, ctx,
                                    gemm=GemmSharding.ROW))
    return strategies


def _conv(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A convolution is a GEMM over channels (the weight ``[C_out, C_in / groups, *kernel]``),
    split as Megatron splits a linear layer:

    - column: output channels split (weight dim 0, bias dim 0), the input whole;
    - row: input channels split (input dim 1, weight dim 1), each rank's output a partial sum
      (no bias: it would be added ``tp`` times), for ``groups == 1``;
    - grouped: ``tp`` divides the groups (a depthwise convolution: one group per channel):
      input and output channels split alike, each rank convolving its ``groups / tp`` groups
      alone (``local_args`` gives the local op its groups), no collective.

    A transposed convolution stays replicated."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], torch.fx.Node) \
        else None
    strategies = [_replicated(node, ctx)]
    if conv_is_transposed(node):
        return strategies
    sx, sw = tensor_spec(x), tensor_spec(w)
    if sx is None or sw is None or sx.ndim < 3:
        return strategies  # an unbatched input: channels are dim 0
    groups = conv_groups(node)
    out_channels = Shard(1)
    if _shardable(sw.shape[0], ctx) and out_channels in _candidates(node, ctx):
        if groups == 1:
            reqs = {x: REPLICATE, w: Shard(0)}
            if bias is not None:
                reqs[bias] = Shard(0)
            strategies.append(_strategy(node, "column", out_channels, reqs, ctx,
                                        gemm=GemmSharding.COLUMN))
        elif groups % ctx.tp == 0 and _shardable(sx.shape[1], ctx) and \
                len(node.args) > conv_groups_index(node):  # positional: local_args sets it
            reqs = {x: Shard(1), w: Shard(0)}
            if bias is not None:
                reqs[bias] = Shard(0)
            strategies.append(_strategy(node, "grouped", out_channels, reqs, ctx,
                                        gemm=GemmSharding.COLUMN))
    if groups == 1 and bias is None and _shardable(sx.shape[1], ctx) \
            and _shardable(sw.shape[1], ctx):
        strategies.append(_strategy(node, "row", PARTIAL, {x: Shard(1), w: Shard(1)}, ctx,
                                    gemm=GemmSharding.ROW))
    return strategies


# ---------------------------------------------------------------------------------------------
# Reductions, normalizations, attention, embedding, loss
# ---------------------------------------------------------------------------------------------

def _reduction(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    name = op_name(node)
    src = node.args[0]
    in_spec, out_spec = tensor_spec(src), info(node).spec
    if getattr(node.target, "_overloadname", "") == "default" and name in ("sum", "mean"):
        dims, keepdim = None, False
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(in_spec.ndim))
    elif isinstance(dims, int):
        dims = [dims]
    dims = sorted({_norm_dim(d, in_spec.ndim) for d in dims})
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    for d in _dims(in_spec, ctx):
        if d in dims:
            if name not in ("sum", "mean") or not _is_float(out_spec):
                continue
            strategies.append(_strategy(node, f"partial from S({d})", PARTIAL, {src: Shard(d)},
                                        ctx, compute_scale=1.0 / ctx.tp,
                                        rewrite=Rewrite.MEAN_OVER_SHARD if name == "mean"
                                        else Rewrite.NONE))
        else:
            od = d if keepdim else d - sum(1 for r in dims if r < d)
            strategies.append(_strategy(node, f"S({od})", Shard(od), {src: Shard(d)}, ctx))
    if name in ("sum", "mean") and _is_float(out_spec):
        strategies.append(_strategy(node, "partial", PARTIAL, {src: PARTIAL}, ctx, compute_scale=1.0))
    return strategies


def _along_dim_op(node: torch.fx.Node, ctx: RuleContext, whole: Sequence[int]) -> list[Strategy]:
    """An op that needs dims ``whole`` of its first input intact and maps others 1:1."""
    src = node.args[0]
    params = [a for a in node.all_input_nodes if a is not src]
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    for p in _candidates(node, ctx):
        if is_sharded(p) and p.dim not in whole and num_blocks(p) == 1:
            reqs = {src: p}
            reqs.update({a: REPLICATE for a in params})
            strategies.append(_strategy(node, _pname(p), p, reqs, ctx))
    return strategies


def _softmax(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    ndim = tensor_spec(node.args[0]).ndim
    return _along_dim_op(node, ctx, [_norm_dim(node.args[1], ndim)])


def _layer_norm(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    """layer_norm and rms_norm: ``(input, normalized_shape, weight, ...)``; the trailing
    normalized dims stay whole, the weight (and bias) replicated."""
    ndim = tensor_spec(node.args[0]).ndim
    k = len(node.args[1])
    return _along_dim_op(node, ctx, list(range(ndim - k, ndim)))


def _sdpa(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    sq, sk, sv = tensor_spec(q), tensor_spec(k), tensor_spec(v)
    if sq.ndim == 4 and all(_shardable(s.shape[1], ctx) for s in (sq, sk, sv)):
        reqs = {q: Shard(1), k: Shard(1), v: Shard(1)}
        if isinstance(mask, torch.fx.Node):
            ms = tensor_spec(mask)
            hd = 1 - (4 - ms.ndim)
            reqs[mask] = Shard(hd) if hd >= 0 and ms.shape[hd] != 1 else REPLICATE
        strategies.append(_strategy(node, "heads", Shard(1), reqs, ctx))
    return strategies


def _embedding(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    w, idx = node.args[0], node.args[1]
    ws, ids, out = tensor_spec(w), tensor_spec(idx), info(node).spec
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    by_frequency = any(bool(a) for a in node.args[3:5]) or node.kwargs.get("scale_grad_by_freq")
    if by_frequency:  # gradient scaled by token counts: only splits that see every token
        if _shardable(ws.shape[1], ctx):
            strategies.append(_strategy(node, "hidden", Shard(out.ndim - 1),
                                        {w: Shard(1), idx: REPLICATE}, ctx))
        return strategies
    if _shardable(ws.shape[0], ctx):
        strategies.append(_strategy(node, "vocab", PARTIAL, {w: Shard(0), idx: REPLICATE}, ctx,
                                    compute_scale=1.0 / ctx.tp, rewrite=Rewrite.VOCAB_EMBEDDING))
    if _shardable(ws.shape[1], ctx):
        strategies.append(_strategy(node, "hidden", Shard(out.ndim - 1),
                                    {w: Shard(1), idx: REPLICATE}, ctx))
    for d in _dims(ids, ctx):
        strategies.append(_strategy(node, f"tokens S({d})", Shard(d), {w: REPLICATE, idx: Shard(d)},
                                    ctx))
    return strategies


def _cross_entropy(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    logits, target = node.args[0], node.args[1]
    ls = tensor_spec(logits)
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    strategies = [_strategy(node, "replicate", REPLICATE, {}, ctx)]
    if ls.ndim == 2 and weight is None and not smoothing and _shardable(ls.shape[1], ctx):
        tokens = ls.shape[0]
        strategies.append(_strategy(
            node, "vocab", REPLICATE, {logits: Shard(1), target: REPLICATE}, ctx,
            compute_scale=1.0 / ctx.tp, rewrite=Rewrite.VOCAB_CROSS_ENTROPY,
            internal=((Collective.ALL_GATHER, 2 * tokens * ctx.tp),)))
    return strategies


_CREATION = frozenset({"arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros",
                       "new_full", "new_empty", "rand", "randn", "randint", "scalar_tensor",
                       "tensor", "empty_strided", "full_like_creation"})

_RULES: dict[str, Callable[[torch.fx.Node, RuleContext], list[Strategy] | None]] = {
    "linear": _linear, "mm": _mm, "addmm": _mm, "bmm": _mm, "baddbmm": _mm, "matmul": _mm,
    **{name: _conv for name in CONV_OPS},
    "sum": _reduction, "mean": _reduction, "amax": _reduction, "amin": _reduction,
    "softmax": _softmax, "_softmax": _softmax, "log_softmax": _softmax,
    "_log_softmax": _softmax,
    "layer_norm": _layer_norm, "rms_norm": _layer_norm, "scaled_dot_product_attention": _sdpa,
    "embedding": _embedding, "cross_entropy_loss": _cross_entropy,
    "split": _split, "split_with_sizes": _split, "chunk": _split, "unsafe_split": _split,
    "getitem": _getitem, "cat": _cat,
    # the experts of a mixture-of-experts block (runtime/moe.py): whole on every tp rank, its
    # tokens and routes replicated; expert parallelism splits the experts over data-parallel ranks
    "moe_experts": lambda node, ctx: [_replicated(node, ctx)],
    # a router's top-k and its in-place renormalization: over experts, on every token
    "topk": lambda node, ctx: [_replicated(node, ctx)],
    "div_": lambda node, ctx: [_replicated(node, ctx)],
}


def _allowed(p: Any, spec: Any, ctx: RuleContext) -> bool:
    """Whether placement ``p`` of a value with ``spec`` obeys autopar's splitting rules (tp
    divides the dim; never the batch; the sequence only under sequence parallelism)."""
    if isinstance(p, tuple):
        return isinstance(spec, tuple) and len(p) == len(spec) and all(
            q is None or _allowed(q, s, ctx) for q, s in zip(p, spec))
    if not is_sharded(p):
        return True
    return isinstance(spec, TensorSpec) and p.dim < spec.ndim and p.dim in _dims(spec, ctx)


def _borrowed(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy] | None:
    """DTensor's strategies for an op autopar has no rule for (passes/dtensor_rules.py), kept
    where they obey autopar's splitting rules."""
    from autopar.passes.dtensor_rules import borrowed_strategies

    out = []
    for output, reqs in borrowed_strategies(node, ctx.tp):
        if not _allowed(output, info(node).value, ctx):
            continue
        if not all(_allowed(p, tensor_spec(a), ctx) for a, p in reqs.items()):
            continue
        if not (is_sharded(output) or isinstance(output, Partial) or any(
                is_sharded(p) for p in reqs.values())):
            continue  # all replicated: the default strategy already
        out.append(_strategy(node, "dtensor", output, reqs, ctx))
    return [_replicated(node, ctx), *out] if out else None


def node_strategies(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Every strategy of a call_function node (at least one: replicated)."""
    name = op_name(node)
    spec = info(node).value
    floating = any(isinstance(s, TensorSpec) and s.is_float for s in
                   (spec if isinstance(spec, tuple) else (spec,)))
    strategies: list[Strategy] | None = None
    if not floating or name in _CREATION:
        strategies = None  # masks, positions and fresh tensors stay replicated
    elif name in _RULES:
        strategies = _RULES[name](node, ctx)
    elif name in _POINTWISE:
        strategies = _pointwise(node, ctx)
    else:
        strategies = _view_rule(node, ctx)
        if strategies is None:
            strategies = _borrowed(node, ctx)
            if strategies:
                ctx.borrowed.setdefault(name, []).append(node.name)
            else:
                ctx.unruled.setdefault(name, []).append(node.name)
    if name == "getitem" and strategies is None and isinstance(node.args[0], torch.fx.Node) \
            and isinstance(info(node.args[0]).value, tuple):
        strategies = [Strategy("replicate", REPLICATE, (Item(node.args[1], REPLICATE),))]
    if not strategies:
        return [_replicated(node, ctx)]
    # one strategy per distinct (output, inputs): rules may reach the same one twice
    seen: dict[tuple, Strategy] = {}
    for s in strategies:
        seen.setdefault((s.output, s.inputs, s.rewrite), s)
    return list(seen.values())


def placeholder_strategies(node: torch.fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Parameters may be sharded along any dim tp divides; inputs, buffers and constants are
    replicated (every tensor-parallel rank sees the same batch)."""
    if info(node).kind is not NodeKind.PARAMETER or info(node).spec is None or any(
            u.op == "call_function" and op_name(u) == "moe_experts" for u in node.users):
        # expert weights stay whole over tp (expert parallelism splits them over experts)
        return [Strategy("replicate", REPLICATE, ())]
    return [Strategy(_pname(p), p, ()) for p in _candidates(node, ctx)]

