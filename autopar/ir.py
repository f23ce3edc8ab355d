"""The graph IR shared by every step: what a node of a captured graph carries, and layers.

A captured graph is an ATen-level ``torch.fx.GraphModule`` whose parameters, buffers and inputs
are placeholders. Everything autopar knows about a node lives in one namespaced place,
``node.meta["autopar"]``, as a :class:`NodeInfo`. Shapes are tuples of sympy expressions in the
symbols :data:`BATCH` and :data:`SEQ` (``b`` and ``s``), so one capture serves every batch size
and sequence length: costs are evaluated later by substitution, never by re-tracing.

This is a leaf module: it imports nothing from autopar except :mod:`autopar.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Iterator, Mapping, TypeAlias

import sympy
import torch
import torch.fx

_lazy: ModuleType | None
try:  # torch's graphs that compile on first use: private, marked not backward compatible
    _lazy = importlib.import_module("torch.fx._lazy_graph_module")
except ImportError:  # pragma: no cover - a torch without it: graphs compile when built
    _lazy = None

__all__ = [
    "BATCH",
    "SEQ",
    "META_KEY",
    "NodeKind",
    "LayerKind",
    "TensorSpec",
    "NodeInfo",
    "Layer",
    "info",
    "has_info",
    "dtype_bytes",
    "evaluate",
    "to_sympy",
    "spec_from_value",
    "op_name",
    "iter_tensor_specs",
    "copy_graph_module",
]

META_KEY = "autopar"

#: Symbolic batch size (the global micro-batch dimension of the model's inputs).
BATCH = sympy.Symbol("b", integer=True, positive=True)
#: Symbolic sequence length.
SEQ = sympy.Symbol("s", integer=True, positive=True)

Expr: TypeAlias = sympy.Expr


class NodeKind(enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"
    INPUT = "input"  # a model input (token ids, masks)
    TARGET = "target"  # an input of the loss function (labels)
    OP = "op"
    OUTPUT = "output"
    COMMUNICATOR = "communicator"  # the tensor-parallel group handle of a per-rank program


class LayerKind(enum.Enum):
    PRE = "pre"  # everything before the first repeated block (embeddings, masks, rotary tables)
    BLOCK = "block"  # one item of the model's repeated block list
    POST = "post"  # everything after the last block (final norm, LM head, loss)
    MODULE = "module"  # a top-level child of a model that has no repeated blocks


_DTYPE_BYTES: dict[torch.dtype, int] = {}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (bool counts one byte, as torch stores it)."""
    size = _DTYPE_BYTES.get(dtype)
    if size is None:
        size = torch.empty((), dtype=dtype, device="meta").element_size()
        _DTYPE_BYTES[dtype] = size
    return size


def to_sympy(value: Any, rename: Mapping[sympy.Symbol, sympy.Expr] | None = None) -> Expr:
    """An int, SymInt or sympy expression as a sympy expression in autopar's symbols."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
    elif isinstance(value, sympy.Expr):
        expr = value
    else:
        return sympy.Integer(int(value))
    if rename:
        expr = expr.xreplace(rename)
    return expr


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape (sympy expressions) and dtype of one tensor."""

    shape: tuple[Expr, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> Expr:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def concrete_shape(self, **sizes: int) -> tuple[int, ...]:
        return tuple(int(evaluate(d, **sizes)) for d in self.shape)

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]"


@dataclass(slots=True)
class NodeInfo:
    """Everything autopar records on one fx node (``node.meta["autopar"]``).

    Capture fills the first block; the analysis pass fills the costs; later passes fill the
    sharding and stage fields. Costs are sympy expressions in ``b`` and ``s`` for one forward.
    """

    kind: NodeKind
    #: TensorSpec for a tensor, a tuple of them (None for non-tensor items) for a multi-output
    #: op, a sympy expression for a symbolic int, None otherwise.
    value: Any = None
    #: Module path of the innermost module the node came from ("" for the root).
    module_path: str = ""
    #: Name of the layer the node belongs to (see Layer).
    layer: str = ""
    #: For parameters, buffers and constants: the fully qualified name in the original model.
    fqn: str | None = None
    #: FQNs of the parameters and buffers this node reads directly.
    reads: tuple[str, ...] = ()
    requires_grad: bool = False

    # -- analysis (passes/analyze.py) -----------------------------------------------------
    flops: Expr = sympy.Integer(0)
    bytes_read: Expr = sympy.Integer(0)
    bytes_written: Expr = sympy.Integer(0)
    #: Activation bytes this op keeps alive for its backward (deduplicated per graph: a tensor
    #: saved by two ops is charged to the first). Floating tensors at the graph's dtype.
    saved_bytes: Expr = sympy.Integer(0)
    #: The part of saved_bytes held in floating-point tensors, as an element count, so the
    #: cost model can re-price activations at another precision (bf16 vs fp32).
    saved_float_elems: Expr = sympy.Integer(0)
    is_gemm: bool = False

    # -- sharding (passes/shard.py) and stage split -------------------------------------------
    placement: Any = None
    #: The chosen sharding strategy (passes/sharding_rules.Strategy; ``.name`` for display).
    strategy: Any = None
    #: Per-rank shape after tensor-parallel sharding (TensorSpec, or a tuple for multi-output).
    local_value: Any = None
    #: For a collective inserted by the tensor-parallel pass: its autopar.sharding.CollectiveStep.
    collective: Any = None
    stage: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> TensorSpec | None:
        return self.value if isinstance(self.value, TensorSpec) else None


def has_info(node: torch.fx.Node) -> bool:
    return META_KEY in node.meta


def info(node: torch.fx.Node) -> NodeInfo:
    """The autopar annotation of ``node`` (KeyError if the graph was not captured by autopar)."""
    return node.meta[META_KEY]


@dataclass(frozen=True, slots=True)
class Layer:
    """A contiguous group of graph nodes: one repeated block, or the parts before and after.

    Layers are the unit the pipeline partitioner places and the unit the analysis repeats:
    blocks with equal ``signature`` have the same structure, so one analysis serves them all.
    """

    name: str
    index: int
    kind: LayerKind
    #: Structural hash; equal for repeated blocks of the same shape.
    signature: str
    nodes: tuple[str, ...]
    #: Parameter FQNs owned by this layer (a tied parameter belongs to its first user).
    params: tuple[str, ...]
    #: Module paths the layer's nodes came from, outermost first (for display).
    modules: tuple[str, ...] = ()

    @property
    def is_block(self) -> bool:
        return self.kind is LayerKind.BLOCK


def next_block_names(name: str, count: int) -> list[str]:
    """The names of the ``count`` blocks after block ``name`` when a shallow capture stands for
    a deeper model: ``h.1`` -> ``h.2``, ``h.3``, ...; a name that does not end in a number
    gets ``name_1``, ``name_2``, ..."""
    prefix, _, tail = name.rpartition(".")
    if tail.isdigit():
        return [f"{prefix + '.' if prefix else ''}{int(tail) + 1 + i}" for i in range(count)]
    return [f"{name}_{i + 1}" for i in range(count)]


_LAMBDA_CACHE: dict[tuple[Expr, tuple[str, ...]], Any] = {}


def evaluate(expr: Any, **sizes: int) -> int | float:
    """Evaluate an expression in ``b``/``s`` (and any other named symbol) at concrete sizes."""
    if not isinstance(expr, sympy.Basic):
        return expr
    if expr.is_Number:
        return int(expr) if expr.is_Integer else float(expr)
    subs = {sym: sympy.Integer(sizes[sym.name]) for sym in expr.free_symbols if sym.name in sizes}
    missing = [sym.name for sym in expr.free_symbols if sym.name not in sizes]
    if missing:
        raise KeyError(f"no size given for symbol(s) {sorted(missing)} in {expr}")
    value = expr.xreplace(subs)
    if not isinstance(value, sympy.Basic):  # a bare symbol is replaced by the plain number
        return value
    return int(value) if value.is_Integer else float(value)


def spec_from_value(val: Any, rename: Mapping[sympy.Symbol, sympy.Expr] | None = None) -> Any:
    """The NodeInfo.value for an fx ``meta["val"]`` (fake tensor, tuple of them, SymInt)."""
    if isinstance(val, torch.Tensor):
        return TensorSpec(tuple(to_sympy(d, rename) for d in val.shape), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(spec_from_value(v, rename) for v in val)
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return to_sympy(val, rename)
    return None


def op_name(node: torch.fx.Node) -> str:
    """The bare op name of a call_function node: 'linear' for aten.linear.default."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def copy_graph_module(gm: torch.fx.GraphModule
                      ) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, torch.fx.Node]]:
    """A structural copy of ``gm`` (same node names) whose annotations can be changed without
    touching ``gm``'s, and the map from each node to its copy."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        new = graph.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        if META_KEY in n.meta:
            old = info(n)
            new.meta[META_KEY] = dataclasses.replace(old, extra=dict(old.extra))
        env[n] = new
    return new_graph_module(gm, graph), env


def new_graph_module(root: torch.nn.Module | dict[str, Any], graph: torch.fx.Graph,
                     class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph)``; inside :func:`graphs_read_only`, one that
    generates its Python code only when first run or printed."""
    if _lazy is None:
        return torch.fx.GraphModule(root, graph, class_name=class_name)
    return _lazy._make_graph_module(root, graph, class_name=class_name)


@contextlib.contextmanager
def graphs_read_only() -> Iterator[None]:
    """GraphModules built (:func:`new_graph_module`) or recompiled inside generate their code
    lazily: torch's ``_LazyGraphModule``, made for compilers that build many graphs and run few
    of them. The planner's sharding searches only read their graphs (on GPT-3 175B, code
    generation was 15% of the 24 sharding searches). A graph run or printed later compiles
    then, so nothing changes but when the code is generated. The flag is process-wide: enter
    it on the thread that starts the planner's worker threads, not inside them."""
    if _lazy is None:  # a torch without the switch: the same graphs, compiled eagerly
        yield
        return
    with _lazy._use_lazy_graph_module(True):
        yield


def iter_tensor_specs(value: Any) -> Iterable[TensorSpec]:
    if isinstance(value, TensorSpec):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensor_specs(item)
