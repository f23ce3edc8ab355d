"""Pass infrastructure: one signature for every graph pass, and the driver that runs them.

A pass is a callable ``(gm, ctx) -> PassResult(gm, modified)``. It declares the properties it
``requires`` of the graph and the ones it ``ensures``; the :class:`PassManager` checks them, times
each pass, can disable passes by name, lints and recompiles the graph after every pass that
changed it, and reports which pass failed after which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch.fx

from autopar.errors import AutoparError, PassError

__all__ = ["PassResult", "PassContext", "GraphPass", "graph_pass", "PassManager"]


@dataclass(frozen=True, slots=True)
class PassResult:
    gm: torch.fx.GraphModule
    modified: bool


@dataclass
class PassContext:
    """What passes share: the captured graph, the plan under construction, options.

    ``properties`` holds the names of the guarantees established so far (e.g. "normalized",
    "analyzed", "placements", "collectives").
    """

    captured: Any = None
    plan: Any = None
    cluster: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    properties: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=dict)


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
            missing = [r for r in p.requires if r not in ctx.properties]
            if missing:
                raise PassError(f"pass {p.name!r} cannot run after {previous!r}",
                                expected=f"graph properties {list(p.requires)}",
                                found=f"{sorted(ctx.properties)} (missing {missing})",
                                fix=f"run the passes that establish {missing} before {p.name!r}")
            start = time.perf_counter()
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
            gm = result.gm
            if result.modified:
                if self.lint:
                    gm.graph.lint()
                gm.recompile()
            ctx.timings[p.name] = ctx.timings.get(p.name, 0.0) + time.perf_counter() - start
            ctx.properties.update(p.ensures)
            previous = p.name
        return gm
