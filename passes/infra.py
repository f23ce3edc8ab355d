"""Pass infrastructure: one signature for every graph pass, and the driver that runs them.

A pass is a callable ``(gm, ctx) -> PassResult(gm, modified)``. It declares the properties it
``requires`` of the graph and the ones it ``ensures``; the :class:`PassManager` checks them, times
each pass, can disable passes by name, lints and recompiles the graph after every pass that
changed it, and reports which pass failed after which.

A property is an executable predicate on the graph (:func:`graph_property`, registered by the
module of the pass that establishes it): before a pass its ``requires`` are evaluated on the graph
it gets, so a pass run out of order fails by name with the reason; after it, its ``ensures`` are
evaluated, so a pass that does not do what it promises fails too. A name without a registered
predicate is a label, held once a pass that ensures it has run (for ad-hoc passes and tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch.fx

from autopar.errors import AutoparError, PassError
from autopar.ir import META_KEY, NodeInfo, NodeKind, info

__all__ = ["PassResult", "PassContext", "GraphPass", "graph_pass", "PassManager",
           "GraphProperty", "graph_property", "PROPERTIES", "check_property", "call_like"]


@dataclass(frozen=True, slots=True)
class PassResult:
    """What a pass returns: the graph, whether it changed, and what else it produced (a
    sharding solution, a stage split...), which the manager files under the pass's name in
    ``ctx.results``: passes hand their products on in their results, not by writing shared
    options."""

    gm: torch.fx.GraphModule
    modified: bool
    value: Any = None


@dataclass
class PassContext:
    """What passes share: the captured graph, the plan under construction, options.

    ``options`` are the caller's inputs to the passes (read, never written by a pass);
    ``results`` what each pass produced besides its graph (``PassResult.value``), by pass name,
    filled by the :class:`PassManager`; ``properties`` the names of the guarantees established
    so far (e.g. "analyzed", "placements", "collectives").
    """

    captured: Any = None
    plan: Any = None
    cluster: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    properties: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GraphProperty:
    """A named guarantee about a graph: ``check(gm, ctx)`` returns None when it holds, else the
    first reason it does not (a node and what is wrong with it)."""

    name: str
    check: Callable[[torch.fx.GraphModule, "PassContext"], str | None]


#: Every registered property by name (the modules in passes/ register theirs on import).
PROPERTIES: dict[str, GraphProperty] = {}


def graph_property(name: str):
    """Decorator: register ``fn(gm, ctx) -> str | None`` as the predicate of property ``name``."""

    def wrap(fn: Callable[[torch.fx.GraphModule, "PassContext"], str | None]) -> GraphProperty:
        prop = GraphProperty(name, fn)
        PROPERTIES[name] = prop
        return prop

    return wrap


def check_property(name: str, gm: torch.fx.GraphModule, ctx: "PassContext") -> str | None:
    """None when property ``name`` holds of ``gm``, else why not."""
    prop = PROPERTIES.get(name)
    if prop is None:  # a label: established by a pass that ensures it
        return None if name in ctx.properties else "no earlier pass established it"
    return prop.check(gm, ctx)


class GraphPass(Protocol):
    name: str
    requires: tuple[str, ...]
    ensures: tuple[str, ...]

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult: ...


@dataclass(frozen=True)
class _FunctionPass:
    fn: Callable[[torch.fx.GraphModule, PassContext], PassResult]
    name: str
    requires: tuple[str, ...]
    ensures: tuple[str, ...]

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        return self.fn(gm, ctx)


def graph_pass(*, requires: Iterable[str] = (), ensures: Iterable[str] = (), name: str | None = None):
    """Decorator: turn ``fn(gm, ctx) -> PassResult`` into a named pass with its contract."""

    def wrap(fn):
        return _FunctionPass(fn, name or fn.__name__, tuple(requires), tuple(ensures))

    return wrap


class PassManager:
    """Runs passes in order, checking contracts and recording where time went."""

    def __init__(self, passes: Iterable[GraphPass], *, disabled: Iterable[str] = (),
                 lint: bool = True) -> None:
        self.passes = list(passes)
        self.disabled = set(disabled)
        unknown = self.disabled - {p.name for p in self.passes}
        if unknown:
            raise PassError(f"cannot disable unknown pass(es) {sorted(unknown)}",
                            expected=f"one of {[p.name for p in self.passes]}")
        self.lint = lint

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        previous = "<start>"
        for p in self.passes:
            if p.name in self.disabled:
                continue
            missing = {r: why for r in p.requires
                       if (why := check_property(r, gm, ctx)) is not None}
            if missing:
                raise PassError(f"pass {p.name!r} cannot run after {previous!r}",
                                expected=f"graph properties {list(p.requires)}",
                                found="; ".join(f"{r}: {why}" for r, why in missing.items()),
                                fix=f"run the passes that establish {list(missing)} before "
                                    f"{p.name!r}")
            start = time.perf_counter()
            options = {k: id(v) for k, v in ctx.options.items()}
            try:
                result = p(gm, ctx)
            except AutoparError:
                raise
            except Exception as exc:
                raise PassError(f"pass {p.name!r} (after {previous!r}) failed: "
                                f"{type(exc).__name__}: {exc}") from exc
            if not isinstance(result, PassResult):
                raise PassError(f"pass {p.name!r} returned {type(result).__name__}",
                                expected="PassResult(gm, modified)")
            if {k: id(v) for k, v in ctx.options.items()} != options:
                raise PassError(f"pass {p.name!r} wrote ctx.options",
                                expected="options read only; a pass's product in "
                                         "PassResult.value (ctx.results[name])",
                                fix=f"return what {p.name!r} produced as its result's value")
            gm = result.gm
            if result.value is not None:
                ctx.results[p.name] = result.value
            if result.modified:
                if self.lint:
                    gm.graph.lint()
                gm.recompile()
            ctx.timings[p.name] = ctx.timings.get(p.name, 0.0) + time.perf_counter() - start
            ctx.properties.update(p.ensures)
            broken = {e: why for e in p.ensures if e in PROPERTIES
                      and (why := PROPERTIES[e].check(gm, ctx)) is not None}
            if broken:
                raise PassError(f"pass {p.name!r} did not establish what it ensures",
                                expected=f"graph properties {list(p.ensures)}",
                                found="; ".join(f"{e}: {why}" for e, why in broken.items()))
            previous = p.name
        return gm


def call_like(graph: torch.fx.Graph, fn: Any, args: tuple, kwargs: dict, like: torch.fx.Node,
              value: Any = None, name: str | None = None) -> torch.fx.Node:
    """A new ``call_function`` node of ``fn`` at the graph's insertion point that stands where
    ``like`` stands: its layer, module path and placement (what the stage split and the
    cost model read), its value unless ``value`` is given, and torch's metadata; named
    ``name`` where the graph has no node of that name yet."""
    new = graph.create_node("call_function", fn, args, kwargs, name=name)
    meta = info(like) if META_KEY in like.meta else NodeInfo(NodeKind.OP)
    new.meta[META_KEY] = NodeInfo(NodeKind.OP, value=value if value is not None else meta.value,
                                  module_path=meta.module_path, layer=meta.layer,
                                  placement=meta.placement, local_value=meta.local_value)
    for key in ("val", "tensor_meta", "stack_trace", "nn_module_stack"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    return new
