"""What the step checks in a batch before it runs: the indexes that read a table of the model.

One process's embedding (and loss) raises ``IndexError`` for an index outside its table. The
generated program may not: a vocabulary-parallel lookup masks the rows a rank does not hold, and a
padded vocabulary (``passes/pad_vocab.py``) has rows beyond the model's, so such an index would
read zeros silently; and an index that fails inside a stage fails it mid-step, where the executor
cannot go on. So ``ParallelModel`` checks, before the step and on every rank:

- :func:`index_bounds`: the inputs and targets that index a table through views only (token ids
  into an embedding, targets into a loss's classes): their values;
- :func:`size_bounds`: the indexes the model computes from the batch's sizes (GPT-2's positions
  ``arange(s)`` into its position table): their range, as expressions in the capture's size
  symbols (``s``), evaluated at the batch's sizes; a sequence longer than the table is refused
  by name, the model left usable;
- :func:`computed_bounds`: the indexes the model computes from the batch's values (OPT's and
  RoBERTa's positions, a ``cumsum`` of the attention mask or of the non-padding tokens; targets
  masked with ``where``): the part of the graph that computes each, copied out and run on the
  batch, each micro-batch as its stage would see it.

The range of a computed index is followed through the ops whose result's range is known exactly
from their operands' ranges: ``arange``, adding or subtracting one value (a constant or a size), a
multiplication by a non-negative constant, ``clamp``, and the views that keep every value (an
``unsqueeze``, a ``view``, an ``expand``, a cast). The range's ends are values the index takes,
so a batch is refused exactly when one process's lookup would fail. An index the ranges do not
follow (the sum of two computed tensors, whose extremes need not meet; a ``cumsum``) is run
instead, where it reads only the batch and constants through ops that write nothing and draw no
random numbers. One that reads the model's state (a slice of a buffer, an offset parameter) is
left unchecked before the step; the lookup's own failure inside the stage is then the batch's
``InvalidInputError`` (``runtime/pipeline.stage_failure``).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import sympy
import torch
import torch.fx

from autopar.captured import CapturedGraph
from autopar.ir import BATCH, NodeKind, info, op_name

__all__ = ["reads_model_input", "IndexBound", "index_bounds", "SizeBound", "size_bounds",
           "ComputedBound", "computed_bounds", "index_program", "row_wise"]

_INDEX_VIEWS = frozenset({"view", "reshape", "flatten", "slice", "clone", "contiguous", "to",
                          "_to_copy", "alias", "detach", "_unsafe_view"})


def reads_model_input(node: Any) -> bool:
    """Whether a tensor is a model input seen through views only (token ids)."""
    for _ in range(32):
        if not isinstance(node, torch.fx.Node):
            return False
        if node.op == "placeholder":
            return info(node).kind is NodeKind.INPUT
        if node.op != "call_function" or op_name(node) not in _INDEX_VIEWS:
            return False
        node = node.args[0]
    return False


def _input_root(node: Any) -> torch.fx.Node | None:
    """The model input or target ``node`` is, seen through views only; else None."""
    path = _input_path(node)
    return None if path is None else path[0]


def _input_path(node: Any) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The model input or target ``node`` is seen through views only, and those views from the
    input outwards; else None."""
    views: list[torch.fx.Node] = []
    for _ in range(32):
        if not isinstance(node, torch.fx.Node):
            return None
        if node.op == "placeholder":
            if info(node).kind in (NodeKind.INPUT, NodeKind.TARGET):
                return node, views[::-1]
            return None
        if node.op != "call_function" or op_name(node) not in _INDEX_VIEWS:
            return None
        views.append(node)
        node = node.args[0]
    return None


#: Views that keep a tensor's shape and values: they do not move the part a slice selects.
_KEEP_SHAPE = frozenset({"clone", "contiguous", "to", "_to_copy", "alias", "detach"})
#: aten.slice's end for "to the end" (``x[:, 1:]``).
_TO_THE_END = 2**63 - 1


def _region(views: list[torch.fx.Node]) -> tuple[tuple[int, Any, Any, int], ...] | None:
    """The part of the input that ``views`` (from the input outwards) select, as slices
    ``(dim, start, end, step)`` applied in order, with ``start``/``end`` expressions in the
    capture's size symbols; ``()``: all of it. None where the part cannot be named that way (a
    slice after a reshape, across the batch dim, or with bounds the graph computes otherwise):
    every value is checked then, which may refuse an id that only a sliced-away part holds
    but never lets one through."""
    region: list[tuple[int, Any, Any, int]] = []
    reshaped = False
    for v in views:
        name = op_name(v)
        if name in _KEEP_SHAPE:
            continue
        if name != "slice":
            reshaped = True  # view, reshape, flatten: the values kept, the dims renumbered
            continue
        given = list(v.args[1:])
        dim, start, end, step = (given + [0, None, None, 1][len(given):])[:4]
        dim, start, end, step = (v.kwargs.get(k, x) for k, x in
                                 zip(("dim", "start", "end", "step"), (dim, start, end, step)))
        start, end = (0 if start is None else start), (_TO_THE_END if end is None else end)
        whole = start == 0 and isinstance(end, int) and end >= _TO_THE_END and step == 1
        if whole:
            continue  # x[:, ...]: export's slice of every row
        bounds = [_scalar(x) for x in (start, end)]
        spec = info(v.args[0]).spec
        ndim = spec.ndim if spec is not None else None
        if reshaped or ndim is None or not isinstance(dim, int) or not isinstance(step, int) \
                or step < 1 or any(b is None for b in bounds):
            return None
        dim = dim % ndim
        if dim == 0 or any(sym == BATCH for b in bounds for sym in b.free_symbols):
            return None  # the batch passed holds every micro-batch: a slice of one is not one of it
        region.append((dim, bounds[0], bounds[1], step))
    return tuple(region)


@dataclass(frozen=True)
class IndexBound:
    """An input of the step whose values index a table: every value of ``region`` must lie in
    ``[0, rows)`` or equal ``ignore`` (a loss's ignore_index). ``table`` names the lookup.
    ``region``: the slices ``(dim, start, end, step)`` the model takes of the input before the
    lookup (``ids[:, :-1]``), start and end in the capture's size symbols; empty: all of it."""

    rows: int
    table: str
    ignore: int | None = None
    region: tuple[tuple[int, Any, Any, int], ...] = ()

    def outside(self, t: torch.Tensor, sizes: dict[str, int], what: str
                ) -> tuple[int, int, int] | None:
        """``(count, lowest, highest)`` of the values the lookup reads of ``t`` that lie
        outside the table; None when all lie inside (see :func:`_outside`; ``what`` names the
        input on a device's assert)."""
        return _outside(self.indexed(t, sizes), self.rows, self.ignore,
                        f"{what} indexes outside {self.table}")

    def indexed(self, t: torch.Tensor, sizes: dict[str, int]) -> torch.Tensor:
        """The values of the step's input ``t`` that the lookup reads (``sizes``: the batch's
        size symbols; a bound whose symbol has no size is read as "to the end")."""
        for dim, start, end, step in self.region:
            if dim >= t.dim():
                return t  # _check_input refuses a tensor of another form
            ends = []
            for bound in (start, end):
                symbols = bound.free_symbols
                if any(sym.name not in sizes for sym in symbols):
                    return t
                ends.append(int(bound.xreplace({sym: sympy.Integer(sizes[sym.name])
                                                for sym in symbols})))
            index = [slice(None)] * t.dim()
            index[dim] = slice(ends[0], ends[1], step)
            t = t[tuple(index)]
        return t


def _lookups(captured: CapturedGraph) -> Iterator[tuple[torch.fx.Node, int, str, int | None]]:
    """Every lookup of a table of fixed size: ``(index, rows, table, ignore)`` for an embedding
    (its token ids or positions) and a loss over classes (its targets, with its
    ignore_index)."""
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or len(node.args) < 2 \
                or not isinstance(node.args[1], torch.fx.Node):
            continue
        name = op_name(node)
        if name == "embedding":
            weight = info(node.args[0]).spec
            rows = weight.shape[0] if weight is not None and weight.ndim else None
            table = "the embedding " + (getattr(info(node.args[0]), "fqn", None)
                                        or node.args[0].name)
            ignore = None
        elif name in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d"):
            logits = info(node.args[0]).spec
            if logits is None or not logits.ndim:
                continue
            rows = logits.shape[1] if logits.ndim > 1 else logits.shape[0]
            table = f"the classes of {name}"
            ignore = int(node.args[4] if len(node.args) > 4
                         else node.kwargs.get("ignore_index", -100))
        else:
            continue
        if rows is not None and rows.is_Integer and int(rows) > 0:
            yield node.args[1], int(rows), table, ignore


def _outside(index: torch.Tensor, rows: int, ignore: int | None, what: str
             ) -> tuple[int, int, int] | None:
    """``(count, lowest, highest)`` of the values of ``index`` outside ``[0, rows)`` (and not
    ``ignore``); None when all lie inside. On a device other than the CPU the check is an
    ``_assert_async`` (the host does not wait; a failure is CUDA's device-side assert, which
    ends the process), and None."""
    valid = (index >= 0) & (index < rows)
    if ignore is not None:
        valid |= index == ignore
    if index.device.type != "cpu":
        torch._assert_async(valid.all(), f"autopar: {what} of {rows} rows")
        return None
    if bool(valid.all()):
        return None
    bad = index[~valid]
    return int(bad.numel()), int(bad.min()), int(bad.max())


def index_bounds(captured: CapturedGraph) -> dict[str, tuple[IndexBound, ...]]:
    """The step's inputs and targets (placeholder name) that index a table of the model, read
    through views only: token ids into an embedding (its rows), targets into a loss's classes
    (``cross_entropy_loss``, ``nll_loss``; its ignore_index aside). One process's lookup refuses
    an index outside; a sharded one masks the rows a rank does not hold and a padded
    vocabulary has rows beyond the model's, where such an index would read zeros silently, so
    the step checks them (``ParallelModel``). Each lookup checks the part of the input it reads
    (a slice the model takes first: ``ids[:, :-1]``, a loss's ``labels[:, 1:]``): one process
    reads nothing else, so a value elsewhere is no error. Tables of a size the graph leaves
    symbolic are not listed."""
    out: dict[str, list[IndexBound]] = {}
    for index, rows, table, ignore in _lookups(captured):
        path = _input_path(index)
        if path is None:
            continue
        root, views = path
        region = _region(views)
        bound = IndexBound(rows, table, ignore, () if region is None else region)
        if bound not in out.setdefault(root.name, []):
            out[root.name].append(bound)
    return {name: tuple(bounds) for name, bounds in out.items()}



@dataclass(frozen=True)
class SizeBound:
    """An index the model computes from the batch's sizes: its values lie in ``[low, high]``
    (expressions in the capture's size symbols) and read ``table``, of ``rows`` rows."""

    low: sympy.Expr
    high: sympy.Expr
    rows: int
    table: str

    def outside(self, sizes: dict[str, int]) -> tuple[int, int] | None:
        """``(low, high)`` at ``sizes`` when the range leaves ``[0, rows)``; else None (also when
        a symbol of the range has no size given)."""
        symbols = self.low.free_symbols | self.high.free_symbols
        if any(sym.name not in sizes for sym in symbols):
            return None
        subs = {sym: sympy.Integer(sizes[sym.name]) for sym in symbols}
        low, high = int(self.low.xreplace(subs)), int(self.high.xreplace(subs))
        return (low, high) if low < 0 or high >= self.rows else None

    def longest(self, symbol: str) -> int | None:
        """The largest size of ``symbol`` whose range stays in the table, when the range grows
        linearly in it alone (GPT-2: ``s - 1 < rows``, so ``s <= rows``); else None."""
        if {sym.name for sym in self.high.free_symbols} != {symbol}:
            return None
        (sym,) = self.high.free_symbols
        if not self.high.is_polynomial(sym):  # a clamp's Min: it may never leave the table
            return None
        poly = sympy.Poly(self.high, sym)
        if poly.degree() != 1 or poly.LC() <= 0:
            return None
        return int(sympy.floor((self.rows - 1 - poly.eval(0)) / poly.LC()))


#: Ops whose result holds exactly its first operand's values (rearranged, repeated, cast).
_SAME_VALUES = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand",
                          "flatten", "clone", "contiguous", "alias", "detach", "to", "_to_copy",
                          "permute", "transpose", "t", "repeat", "lift_fresh_copy"})


def size_bounds(captured: CapturedGraph) -> list[SizeBound]:
    """Every embedding lookup whose indexes the model computes and whose range depends on the
    batch's sizes (see the module's docstring), with that range."""
    out: list[SizeBound] = []
    memo: dict[torch.fx.Node, tuple[sympy.Expr, sympy.Expr] | None] = {}
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or op_name(node) != "embedding" or len(node.args) < 2:
            continue
        if _input_root(node.args[1]) is not None:  # a model input: index_bounds checks it
            continue
        weight = info(node.args[0]).spec
        rows = weight.shape[0] if weight is not None and weight.ndim else None
        if rows is None or not rows.is_Integer:
            continue
        span = _range(node.args[1], memo)
        if span is None or not (span[0].free_symbols or span[1].free_symbols):
            continue
        table = getattr(info(node.args[0]), "fqn", None) or node.args[0].name
        out.append(SizeBound(span[0], span[1], int(rows), f"the embedding {table}"))
    return out


def _scalar(value: Any) -> sympy.Expr | None:
    """An int, or a size the graph computes (``sym_size``), as an expression; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.fx.Node):
        expr = info(value).value
        if isinstance(expr, sympy.Expr) and (expr.is_Integer or expr.free_symbols):
            return expr
    return None


def _range(value: Any, memo: dict) -> tuple[sympy.Expr, sympy.Expr] | None:
    """``[low, high]`` of an integer tensor's (or scalar's) values, when the ops that make it
    determine it; else None."""
    scalar = _scalar(value)
    if scalar is not None:
        return scalar, scalar
    if not isinstance(value, torch.fx.Node) or value.op != "call_function":
        return None
    if value not in memo:  # each node once: a position tensor may feed several lookups
        spec = info(value).spec
        integral = spec is not None and getattr(spec, "dtype", None) is not None \
            and not spec.dtype.is_floating_point and spec.dtype != torch.bool
        memo[value] = _op_range(value, memo) if integral else None
    return memo[value]


def _single(span: tuple[sympy.Expr, sympy.Expr]) -> bool:
    """Whether a range is one value (a scalar, or a size)."""
    return sympy.simplify(span[0] - span[1]) == 0


def _op_range(node: torch.fx.Node, memo: dict) -> tuple[sympy.Expr, sympy.Expr] | None:
    name, args = op_name(node), node.args
    if name == "arange":
        if node.kwargs.get("step", 1) != 1 or len(args) > 2 and args[2] != 1:
            return None
        bounds = [_scalar(a) for a in args[:2]]
        if any(b is None for b in bounds):
            return None
        start, end = (sympy.Integer(0), bounds[0]) if len(bounds) == 1 else bounds
        return start, end - 1
    if name in _SAME_VALUES:
        return _range(args[0], memo)
    if name in ("add", "sub", "rsub") and len(args) == 2 and node.kwargs.get("alpha", 1) == 1:
        a, b = _range(args[0], memo), _range(args[1], memo)
        if a is None or b is None or not (_single(a) or _single(b)):
            return None  # two tensors: the extremes of each need not meet (arange - arange)
        if name == "add":
            return a[0] + b[0], a[1] + b[1]
        if name == "sub":
            return a[0] - b[1], a[1] - b[0]
        return b[0] - a[1], b[1] - a[0]  # rsub: args[1] - args[0]
    if name == "mul" and len(args) == 2:
        a, b = _range(args[0], memo), _range(args[1], memo)
        if a is None or b is None or not (_single(b) and b[0].is_Integer and b[0] >= 0):
            return None
        return a[0] * b[0], a[1] * b[0]
    if name == "clamp":
        a = _range(args[0], memo)
        if a is None:
            return None
        low, high = a
        given = [args[i] if len(args) > i else node.kwargs.get(key)
                 for i, key in ((1, "min"), (2, "max"))]
        lo, hi = (None if g is None else _scalar(g) for g in given)
        if any(g is not None and b is None for g, b in zip(given, (lo, hi))):
            return None  # a bound that is a tensor: its values are not followed
        return (sympy.Max(low, lo) if lo is not None else low,
                sympy.Min(high, hi) if hi is not None else high)
    return None


# -- indexes computed from the batch's values -------------------------------------------------

#: Nodes a computed index may take from the graph: more is a part of the model, not an index.
_MAX_PROGRAM = 64


@dataclass(frozen=True, eq=False)
class ComputedBound:
    """An index the model computes from the batch's values (OPT's positions, a ``cumsum`` of
    the attention mask; targets masked with ``where``): ``program`` is the part of the graph
    that computes it, a function of the step's inputs and targets named by ``reads``
    (placeholder names); its values must lie in ``[0, rows)`` or equal ``ignore``. ``ops``:
    the ops it runs, for a refusal's message. ``row_wise``: each row of its batch-major inputs
    gives the index's own rows alone (no op mixes rows: an element-wise op, a ``cumsum`` over
    the sequence), so the whole batch runs at once as every micro-batch would."""

    program: torch.fx.GraphModule
    reads: tuple[str, ...]
    rows: int
    table: str
    ignore: int | None
    ops: tuple[str, ...]
    row_wise: bool = False

    def outside(self, values: dict[str, Any]) -> tuple[int, int, int] | None:
        """``(count, lowest, highest)`` of the index's values outside the table, computed from
        ``values`` (the step's inputs and targets of one micro-batch, by name); None when all
        lie inside. On a device other than the CPU: an ``_assert_async`` and None."""
        index = self.program(*(values[name] for name in self.reads))
        return _outside(index, self.rows, self.ignore, f"a computed index outside {self.table}")


def computed_bounds(captured: CapturedGraph) -> list[ComputedBound]:
    """Every lookup whose index the model computes from the values of its inputs or targets
    alone (with the graph's constants), by ops that neither draw random numbers nor write
    their operands: that part of the graph, copied out to run on the batch before the step, one
    micro-batch at a time as the stages run it, so the check is one process's lookup exactly.
    An index read through views only is :func:`index_bounds`'; one whose range the batch's
    sizes decide, :func:`size_bounds`'; one that reads a parameter or a buffer is left to the
    lookup inside the stage."""
    out: list[ComputedBound] = []
    memo: dict[torch.fx.Node, tuple[sympy.Expr, sympy.Expr] | None] = {}
    for index, rows, table, ignore in _lookups(captured):
        if _input_path(index) is not None:
            continue
        span = _range(index, memo)
        if span is not None and (span[0].free_symbols or span[1].free_symbols):
            continue  # size_bounds' range
        part = index_program(captured, index)
        if part is not None:
            program, reads, needed = part
            ops = tuple(dict.fromkeys(op_name(n) for n in needed if n.op == "call_function"
                                      and op_name(n) != "sym_size"))
            out.append(ComputedBound(program, reads, rows, table, ignore, ops,
                                     row_wise(needed, index)))
    return out


def index_program(captured: CapturedGraph, index: torch.fx.Node
                   ) -> tuple[torch.fx.GraphModule, tuple[str, ...], list[torch.fx.Node]] | None:
    """The nodes that compute ``index`` as a program of the step's inputs and targets (with
    the placeholders it reads, and those nodes in graph order), when they read nothing else but
    constants and run only pure ops (see :func:`computed_bounds`); else None."""
    needed: set[torch.fx.Node] = set()
    stack = [index]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if len(needed) > _MAX_PROGRAM:
            return None
        if node.op == "placeholder":
            if info(node).kind not in (NodeKind.INPUT, NodeKind.TARGET, NodeKind.CONSTANT):
                return None  # a parameter or a buffer: the rank's state, not the batch
        elif node.op != "call_function" or not _pure(node):
            return None
        stack.extend(node.all_input_nodes)
    if not any(n.op == "placeholder" and info(n).kind is not NodeKind.CONSTANT for n in needed):
        return None  # sizes and constants only: size_bounds' ranges, or fixed
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    reads: list[str] = []
    for node in captured.gm.graph.nodes:  # graph order: operands before their users
        if node not in needed:
            continue
        if node.op == "placeholder" and info(node).kind is NodeKind.CONSTANT:
            root.register_buffer(f"constant_{len(env)}", captured.constants[node.name])
            env[node] = graph.get_attr(f"constant_{len(env)}")
        elif node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            reads.append(node.name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[index])
    order = [n for n in captured.gm.graph.nodes if n in needed]
    return torch.fx.GraphModule(root, graph), tuple(reads), order


def _pure(node: torch.fx.Node) -> bool:
    """Whether running ``node`` again changes nothing: an ATen op that writes none of its
    operands and draws no random numbers (a second draw would move the generator, and the
    step's dropout with it), or Python arithmetic on sizes."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable \
            and torch.Tag.nondeterministic_seeded not in target.tags
    return getattr(target, "__module__", None) in ("_operator", "operator")


#: Ops that make a tensor from sizes and scalars alone, and views or casts that keep each value
#: in its place: none moves a value to another row.
_MAKES = frozenset({"ones", "zeros", "full", "arange", "ones_like", "zeros_like", "full_like",
                    "scalar_tensor", "clone", "contiguous", "to", "_to_copy", "alias", "detach",
                    "type_as", "lift_fresh_copy", "sym_size"})
#: Scans and reductions over the dims they are given.
_ALONG = frozenset({"cumsum", "cumprod", "sum", "amax", "amin", "max", "min", "mean", "any",
                    "all", "argmax", "argmin", "prod"})
#: Views that renumber the dims: a row-wise program may end with one (a target's flatten).
_RENUMBER = frozenset({"view", "reshape", "_unsafe_view", "flatten"})


def row_wise(nodes: list[torch.fx.Node], index: torch.fx.Node) -> bool:
    """Whether the program ``nodes`` (graph order, ending in ``index``) keeps the batch's rows
    apart: every op element-wise, a maker or cast (``_MAKES``), a scan or reduction over dims
    other than the first, a slice, ``unsqueeze``, ``squeeze`` or ``expand`` that leaves the
    first dim where it is; a view that renumbers the dims only as the last op. Anything else:
    not row-wise (the check then runs each micro-batch apart)."""
    for node in nodes:
        if node.op != "call_function":
            continue
        target, name = node.target, op_name(node)
        if getattr(target, "__module__", None) in ("_operator", "operator") or name in _MAKES:
            continue
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags \
                or name == "where":  # where's scalar overloads lack the tag
            continue
        spec = info(node.args[0]).spec if node.args and isinstance(node.args[0],
                                                                  torch.fx.Node) else None
        ndim = spec.ndim if spec is not None else None
        if name in _RENUMBER and node is index:
            continue
        if ndim is None:
            return False
        if name in _ALONG or name in ("unsqueeze", "squeeze", "slice"):
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            if not dims or any(not isinstance(d, int) for d in dims):
                return False  # a reduction over every dim, or a squeeze of all
            if name == "slice" and len(node.args) <= 2 and not node.kwargs:
                continue  # slice(x, dim): the whole of it
            if name == "slice" and (node.args[1] % ndim == 0) and _whole_slice(node):
                continue
            if any(d % (ndim + (name == "unsqueeze")) == 0 for d in dims):
                return False
            continue
        if name == "expand":
            out = info(node).spec
            if out is not None and out.ndim == ndim:
                continue
        return False
    return True


def _whole_slice(node: torch.fx.Node) -> bool:
    """Whether an aten.slice takes all of its dim (``x[:, ...]``, export's spelling of it)."""
    given = list(node.args[1:])
    _, start, end, step = (given + [0, None, None, 1][len(given):])[:4]
    return start in (0, None) and (end is None or isinstance(end, int) and end >= _TO_THE_END) \
        and step == 1
