"""One pipeline stage as a module: what the executor needs of a stage of the split
(:class:`StageProgram`, spelled out so the runtime does not import the passes), the stage's graph
module with its parameters registered on it (:class:`StageModule`: ZeRO-3 units, per-block
recompute, ``torch.compile``), and the batch split into micro-batches with the shape symbols
bound (:func:`split_microbatches`, :func:`bind_sizes`). :mod:`autopar.runtime.pipeline` runs
these modules by a schedule."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import sympy
import torch
import torch.nn as nn

from autopar.errors import InvalidInputError
from autopar.runtime.layer_recompute import layer_regions
from autopar.runtime.layer_units import instrument_layers
from autopar.runtime.running_stats import eager_in_compiled_code

__all__ = ["StageCut", "StageProgram", "StageModule", "split_microbatches", "bind_sizes",
           "module_attribute", "placeholder_kind", "stage_params", "in_order_of_use"]


class StageCut(Protocol):
    """A tensor crossing a stage boundary (``autopar.passes.split_stages``)."""

    name: str
    spec: Any  # autopar.ir.TensorSpec
    requires_grad: bool

    def shape_at(self, **sizes: int) -> tuple[int, ...]: ...


class _Placeholder(Protocol):
    name: str
    kind: Any  # an enum whose value is parameter/buffer/constant/activation/input/target
    key: str | int


class StageProgram(Protocol):
    """What the executor needs of one stage (``autopar.passes.split_stages.StageGraph``)."""

    index: int
    gm: torch.fx.GraphModule
    placeholders: Sequence[_Placeholder]
    inputs: Sequence[StageCut]
    outputs: Sequence[StageCut]
    returns_loss: bool


def split_microbatches(tensors: Sequence[Any], m: int) -> list[tuple[Any, ...]]:
    """Split every tensor along dim 0 into m equal micro-batches (non-tensors are repeated)."""
    out: list[list[Any]] = [[] for _ in range(m)]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            if t.shape[0] % m:
                raise InvalidInputError("the batch does not split into equal micro-batches",
                                        expected=f"batch size divisible by {m} micro-batches",
                                        found=f"batch size {t.shape[0]}",
                                        fix="change the batch size or the micro-batch count")
            for i, chunk in enumerate(t.chunk(m, dim=0)):
                out[i].append(chunk)
        else:
            for i in range(m):
                out[i].append(t)
    return [tuple(x) for x in out]


def bind_sizes(specs: Sequence[Any], tensors: Sequence[Any]) -> dict[str, int]:
    """Sizes of the shape symbols (``b``, ``s``) from tensors and their symbolic specs."""
    sizes: dict[str, int] = {}
    for spec, t in zip(specs, tensors):
        if spec is None or not isinstance(t, torch.Tensor):
            continue
        if len(spec.shape) != t.dim():
            raise InvalidInputError("an input has the wrong number of dims",
                                    expected=str(spec), found=str(tuple(t.shape)))
        for dim, size in zip(spec.shape, t.shape):
            if isinstance(dim, sympy.Symbol):
                if sizes.setdefault(dim.name, int(size)) != int(size):
                    raise InvalidInputError(f"inputs disagree on the size of {dim.name}",
                                            found=f"{sizes[dim.name]} and {int(size)}")
    return sizes


def module_attribute(fqn: str) -> str:
    """A parameter FQN as a module attribute name (attributes cannot contain dots)."""
    return fqn.replace(".", "__")


class StageModule(nn.Module):
    """One stage's graph module with the stage's parameters registered on it.

    Its forward takes the stage's whole argument list (parameters included, as the lifted graph
    binds them), so the module owns exactly the parameters it reads and any module hook (a ZeRO-3
    gather before the call, a free after) wraps each stage call.
    """

    _graph: Callable[..., Any]  # the graph (instrumented, compiled), set without registering it

    def __init__(self, stage: StageProgram, params: Mapping[str, nn.Parameter], *,
                 layer_units: bool = False, compile_backend: str | None = None,
                 recompute_blocks: frozenset[str] | None = None) -> None:
        """``layer_units``: instrument the graph with one :class:`LayerBoundary` per captured
        layer (``runtime/layer_units.py``), children of this module, so that ZeRO-3 gathers
        one layer at a time rather than the whole stage. ``compile_backend``: run the graph
        through ``torch.compile`` with that backend (compiled on its first call, again for a
        new micro-batch shape or for inference). ``recompute_blocks`` (full recompute; None:
        none): the layers checkpointed one at a time (``runtime/layer_recompute.py``), inside
        ZeRO-3's per-layer gathers when ``layer_units``; :attr:`recomputes_layers` says whether
        this stage holds any. A stage holding none runs as it is, as the cost model prices the
        layers around the blocks. With an empty set (a caller that names no layers) the stage
        is checkpointed whole (:attr:`checkpoints_whole`). Under ``compile_backend`` with
        ``layer_units`` or ``recompute_blocks``, each captured layer is compiled on its own
        (``layer_regions``: the gathers and checkpoints stay around the compiled layers), else
        the stage's graph whole."""
        super().__init__()
        self.index = stage.index
        graph = getattr(stage, "gm", None)
        #: The stage gathers a sequence-parallel input that autograd should keep as its shard
        #: (``runtime/tp.py``'s ``saved_gathers``); else the executor installs no saved-tensor
        #: hooks, whose two Python calls per saved tensor are host time on every micro-batch.
        self.regathers = graph is None or any(keeps_gather_as_shard(n) for n in graph.graph.nodes)
        for fqn in in_order_of_use(stage):
            self.register_parameter(module_attribute(fqn), params[fqn])
        if layer_units and graph is not None:
            attribute_of = {ph.name: module_attribute(str(ph.key)) for ph in stage.placeholders
                            if placeholder_kind(ph) == "parameter"}
            graph, boundaries = instrument_layers(graph, dict(self.named_parameters()),
                                                  attribute_of)
            # registered after the parameters, so named_parameters() keeps their names
            self.layers = nn.ModuleList(boundaries)
        #: Full recompute checkpoints this stage's blocks one by one (its graph calls them
        #: through layer_recompute.checkpointed). Applied after the ZeRO-3 instrumentation: a
        #: layer's gather and free stay outside its checkpoint, and its recompute in the
        #: backward reads the parameters the unit gathered again for that backward.
        self.recomputes_layers = False
        #: Full recompute checkpoints the stage call whole (the executor does it).
        self.checkpoints_whole = False
        checkpoint: frozenset[str] = frozenset()
        if recompute_blocks is not None:
            if recompute_blocks and graph is not None:
                checkpoint = recompute_blocks
            else:
                self.checkpoints_whole = True
        # under compile, each captured layer on its own where ZeRO-3's gathers or the blocks'
        # checkpoints lie between the layers; else (or with no layer found) the graph whole
        whole = graph
        if graph is not None and (checkpoint or (compile_backend is not None and layer_units)):
            graph, runs = layer_regions(graph, checkpoint=checkpoint,
                                        compile_backend=compile_backend)
            self.recomputes_layers = runs > 0
        if compile_backend is not None and graph is not None and graph is whole:
            graph = torch.compile(eager_in_compiled_code(graph), backend=compile_backend,
                                  dynamic=False)
        object.__setattr__(self, "_graph", graph)  # not a submodule: no params

    def forward(self, *args: Any) -> Any:
        return self._graph(*args)


def keeps_gather_as_shard(node: torch.fx.Node) -> bool:
    """A call of ``runtime/tp.py``'s ``all_gather`` with ``grad="reduce_scatter"`` (sequence
    parallel before a column-parallel GEMM)."""
    from autopar.runtime import tp

    if node.op != "call_function" or node.target is not tp.all_gather:
        return False
    grad = node.kwargs.get("grad", node.args[4] if len(node.args) > 4 else "slice")
    return grad == "reduce_scatter"


def placeholder_kind(ph: _Placeholder) -> str:
    """A placeholder's kind as its string value (parameter, buffer, activation, ...)."""
    kind = ph.kind
    return kind.value if hasattr(kind, "value") else str(kind)


def in_order_of_use(stage: StageProgram) -> list[str]:
    """The stage's parameters in the order its graph first reads them. Registration order is
    what the data-parallel engine's buckets follow (reversed: the order gradients arrive in);
    each bucket's reduction launches in bucket order, so a bucket whose gradients come last
    must come last, or it holds back the reductions of all the others and every full gradient
    buffer stays alive until the end of the backward."""
    fqns = list(dict.fromkeys(stage_params(stage)))
    graph = getattr(stage, "gm", None)
    if graph is None:
        return fqns
    key_of = {ph.name: str(ph.key) for ph in stage.placeholders if placeholder_kind(ph) == "parameter"}
    first: dict[str, int] = {}
    for i, node in enumerate(graph.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        for a in node.all_input_nodes:
            if a.name in key_of:
                first.setdefault(key_of[a.name], i)
    return sorted(fqns, key=lambda f: first.get(f, -1))


def stage_params(stage: StageProgram) -> list[str]:
    """The parameters a stage reads (FQNs, in placeholder order)."""
    return [str(ph.key) for ph in stage.placeholders if placeholder_kind(ph) == "parameter"]
