"""ZeRO-3 gather units per captured layer inside a stage program.

A stage program is one graph over all its layers, so module hooks around it could only gather
the whole stage: a rank would hold every parameter of its stage at once, which is what ZeRO-3
exists to avoid (FSDP gathers one block at a time; the planner prices ZeRO-3 per layer). This
module instruments a stage graph instead. Each captured layer (``meta["autopar"].layer``: the
embeddings, each block, the head) gets a :class:`LayerBoundary` module, and the graph calls it
twice: ``("enter", *tensors)`` right before the layer's first node, with every tensor from
outside the layer its nodes read (parameters and buffers aside), and ``("exit", *tensors)`` right
after its last node, with every tensor of the layer that a node outside it reads. The data-parallel
engine binds its ZeRO-3 unit to those calls (``runtime/zero.py`` ``ParamUnit``): enter gathers the
layer's parameters, exit frees them and hooks the exit tensors, whose first gradient gathers them
again for the layer's backward (``torch.autograd.graph.register_multi_grad_hook``).

A boundary registers the parameters its layer's nodes read, so that the engine's unit owns them
(the innermost unit wins). A parameter two layers read (a tied embedding and LM head in one stage)
stays with the stage module's own unit, gathered from the stage's forward to the end of its
backward (as FSDP keeps a tied embedding in its root unit): its gradient is accumulated only
after both layers' backwards. The stage's last layer is a root too: it stays gathered from its
forward into the backward that starts right after it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.fx
import torch.nn as nn

from autopar.ir import has_info, info

__all__ = ["LayerBoundary", "instrument_layers"]

#: Submodule path of the boundaries in an instrumented stage graph.
BOUNDARIES = "autopar_layers"


class LayerBoundary(nn.Module):
    """One layer of a stage: the parameters it reads (also registered on the stage module, which
    names them) and the two calls the instrumented graph makes around it."""

    def __init__(self, layer: str, params: Mapping[str, nn.Parameter], *, root: bool) -> None:
        super().__init__()
        self.layer = layer
        #: Kept gathered from its forward to its backward (the stage's last layer).
        self.root = root
        for attr, p in params.items():
            self.register_parameter(attr, p)
        self._enter: Callable[[tuple[Any, ...]], None] | None = None
        self._exit: Callable[[tuple[Any, ...]], None] | None = None

    def bind_unit(self, enter: Callable[[tuple[Any, ...]], None] | None,
                  exit: Callable[[tuple[Any, ...]], None] | None) -> None:
        """Route the graph's calls to a ZeRO-3 unit (None, None: unbind). ``enter`` gets the
        tensors entering the layer, ``exit`` those leaving it."""
        self._enter, self._exit = enter, exit

    def forward(self, event: str, *tensors: Any) -> None:
        if event == "enter":
            if self._enter is not None:
                self._enter(tensors)
        elif self._exit is not None:
            self._exit(tensors)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}, root={self.root}"


def instrument_layers(gm: torch.fx.GraphModule, params: Mapping[str, nn.Parameter],
                      attribute_of: Mapping[str, str]) -> tuple[torch.fx.GraphModule,
                                                                list[LayerBoundary]]:
    """A copy of stage graph ``gm`` that calls one :class:`LayerBoundary` per layer around the
    layer's nodes, and the boundaries (in the order the layers start).

    ``params``: the stage module's parameters by attribute name; ``attribute_of``: placeholder
    name -> that attribute name, for the placeholders that are parameters.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = list(gm.graph.nodes)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    layer_of = {n: (info(n).layer if has_info(n) else None) for n in body}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, n in enumerate(body):
        layer = layer_of[n]
        if layer is None:
            continue
        first.setdefault(layer, i)
        last[layer] = i
    order = sorted(first, key=first.__getitem__)
    reads: dict[str, dict[str, nn.Parameter]] = {layer: {} for layer in order}
    for n in body:
        if layer_of[n] is None:
            continue
        for a in n.all_input_nodes:
            attr = attribute_of.get(a.name) if a.op == "placeholder" else None
            if attr is not None:
                reads[layer_of[n]][attr] = params[attr]
    readers: dict[str, int] = {}
    for layer_reads in reads.values():
        for attr in layer_reads:
            readers[attr] = readers.get(attr, 0) + 1
    for layer_reads in reads.values():  # a weight two layers read stays with the stage's unit
        for attr in [a for a in layer_reads if readers[a] > 1]:
            del layer_reads[attr]
    final = max(order, key=last.__getitem__) if order else None
    boundaries = [LayerBoundary(layer, reads[layer], root=layer == final) for layer in order]
    index = {layer: i for i, layer in enumerate(order)}
    # the tensors each layer reads from outside (not its weights) and those read outside it
    entering: dict[str, list[torch.fx.Node]] = {layer: [] for layer in order}
    for n in body:
        layer = layer_of[n]
        if layer is None:
            continue
        for a in n.all_input_nodes:
            # (buffers, constants and non-tensors pass too; the unit keeps what needs a grad)
            outside = a.name not in attribute_of if a.op == "placeholder" else \
                layer_of.get(a) != layer
            if outside and a not in entering[layer]:
                entering[layer].append(a)
    leaving: dict[str, list[torch.fx.Node]] = {layer: [] for layer in order}
    for n in body:
        layer = layer_of[n]
        if layer is not None and any(u.op == "output" or layer_of.get(u) != layer
                                     for u in n.users):
            leaving[layer].append(n)
    starts = {first[layer]: layer for layer in order}
    ends: dict[int, list[str]] = {}
    for layer in order:
        ends.setdefault(last[layer], []).append(layer)
    for n in nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n, lambda a: env[a])
    for i, n in enumerate(body):
        if i in starts:
            layer = starts[i]
            graph.call_module(f"{BOUNDARIES}.{index[layer]}",
                              ("enter", *[env[x] for x in entering[layer] if x in env]))
        env[n] = graph.node_copy(n, lambda a: env[a])
        for layer in ends.get(i, ()):
            tensors = [env[x] for x in leaving[layer]]  # the unit keeps those needing a grad
            graph.call_module(f"{BOUNDARIES}.{index[layer]}", ("exit", *tensors))
    for n in nodes:
        if n.op == "output":
            graph.node_copy(n, lambda a: env[a])
    root: dict[str, Any] = {f"{BOUNDARIES}.{i}": b for i, b in enumerate(boundaries)}
    for n in nodes:  # what the graph reads from its module: constants, recomputed regions
        if n.op == "get_attr":
            root[n.target] = _attr(gm, n.target)
        elif n.op == "call_module":
            root[n.target] = gm.get_submodule(n.target)
    instrumented = torch.fx.GraphModule(root, graph, class_name=type(gm).__name__)
    return instrumented, boundaries


def _attr(module: nn.Module, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name)
    return module

