"""The captured graph's layers: what the planner cuts into pipeline stages and prices once per
kind.

:func:`find_layers` splits a :class:`~autopar.captured.CapturedGraph` into PRE / BLOCK* / POST
layers by the module path each node was traced in: the blocks are the items of the model's
outermost container of like modules (a ``ModuleList`` or ``Sequential`` of one class with
parameters, e.g. a transformer's ``h`` or ``layers``); what runs before the first block is PRE,
after the last POST. A model without such a container gets one layer per top-level module, in
execution order. Each layer carries a structural signature (:func:`layer_signature`: its ops,
their wiring inside the layer, shapes and parameter roles), so that equal blocks are solved and
priced once.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from autopar.captured import CapturedGraph
from autopar.ir import Layer, LayerKind, NodeKind, info

__all__ = ["find_layers", "block_lists", "layer_signature"]


def block_lists(model: nn.Module) -> list[str]:
    """Module paths of the model's repeated-block containers (ModuleLists of like modules)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(True for _ in next(iter(module)).parameters()):
                found.append(name)
    # keep outermost containers only
    outer = [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]
    return outer


def find_layers(captured: CapturedGraph, model: nn.Module) -> list[Layer]:
    """Split the graph into PRE / BLOCK* / POST layers (or top-level modules if no blocks)."""
    lists = block_lists(model)
    block_re = [re.compile(re.escape(p) + r"\.(\d+)(\.|$)") if p else re.compile(r"^(\d+)(\.|$)")
                for p in lists]

    def block_of(path: str) -> str | None:
        for prefix, rx in zip(lists, block_re):
            m = rx.match(path) if not prefix else rx.match(path)
            if m:
                return (prefix + "." if prefix else "") + m.group(1)
        return None

    nodes = list(captured.gm.graph.nodes)
    op_nodes = [n for n in nodes if n.op not in ("placeholder", "output")]
    raw: dict[torch.fx.Node, str | None] = {}
    for n in op_nodes:
        path = info(n).module_path
        raw[n] = block_of(path) if lists else (path.split(".")[0] if path else None)

    names: dict[torch.fx.Node, str] = {}
    if lists:
        blocks_seen = [raw[n] for n in op_nodes if raw[n] is not None]
        if not blocks_seen:
            lists = []
        else:
            first = next(i for i, n in enumerate(op_nodes) if raw[n] is not None)
            last = max(i for i, n in enumerate(op_nodes) if raw[n] is not None)
            current = None
            for i, n in enumerate(op_nodes):
                if raw[n] is not None:
                    current = raw[n]
                    names[n] = current
                elif i < first:
                    names[n] = "pre"
                elif i > last:
                    names[n] = "post"
                else:  # a root-level op between blocks: belongs to the block before it
                    names[n] = current
    if not lists:  # no repeated blocks: one layer per top-level module, in execution order
        current = "pre"
        for n in op_nodes:
            current = raw[n] or current  # root-level ops (the loss) join the layer before them
            names[n] = current

    order: list[str] = []
    for n in op_nodes:
        if names[n] not in order:
            order.append(names[n])
    members: dict[str, list[torch.fx.Node]] = {name: [] for name in order}
    for n in op_nodes:
        members[names[n]].append(n)
        info(n).layer = names[n]

    # placeholders: parameters and buffers belong to the layer of their first user
    owner: dict[str, str] = {}
    for n in nodes:
        if n.op != "placeholder":
            continue
        users = [u for u in n.users if u in names]
        layer = names[users[0]] if users else (order[0] if order else "pre")
        info(n).layer = layer
        if info(n).kind is NodeKind.PARAMETER:
            owner[n.name] = layer
    for n in nodes:
        if n.op == "output":
            info(n).layer = order[-1] if order else "post"

    layers = []
    block_names = {name for name in order if name not in ("pre", "post")} if lists else set()
    for index, name in enumerate(order):
        kind = (LayerKind.BLOCK if name in block_names else LayerKind.PRE if name == "pre"
                else LayerKind.POST if name == "post" else LayerKind.MODULE)
        node_list = members[name]
        params = tuple(captured.params[p].fqn for p, layer in owner.items() if layer == name)
        modules: list[str] = []  # the modules whose weights the layer reads, in order
        for n in node_list:
            path = info(n).module_path
            if info(n).reads and path and path not in modules:
                modules.append(path)
        layers.append(Layer(name=name, index=index, kind=kind,
                            signature=layer_signature(node_list, name if kind is LayerKind.BLOCK else None),
                            nodes=tuple(n.name for n in node_list), params=params,
                            modules=tuple(modules[:8])))
    return layers


def layer_signature(nodes: list[torch.fx.Node], prefix: str | None) -> str:
    """A structural hash: ops, argument wiring inside the layer, shapes, parameter roles."""
    local = {n: i for i, n in enumerate(nodes)}
    h = hashlib.sha1()

    def ref(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            if a in local:
                return f"%{local[a]}"
            meta = info(a)
            # a frozen parameter: no weight gradient, no optimizer state; its layer is priced
            # apart from a trainable one of the same ops (fine-tuning freezes some blocks)
            frozen = ":frozen" if meta.kind is NodeKind.PARAMETER and not meta.requires_grad \
                else ""
            if meta.kind is NodeKind.PARAMETER and meta.fqn and prefix and meta.fqn.startswith(prefix + "."):
                return f"param:{meta.fqn[len(prefix) + 1:]}:{meta.value}{frozen}"
            return f"ext:{meta.kind.value}:{meta.value}{frozen}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(ref(x) for x in a) + "]"
        return repr(a)

    for n in nodes:
        h.update(f"{n.target}|{ref(n.args)}|{ref(sorted(n.kwargs.items()))}|{info(n).value}\n".encode())
    return h.hexdigest()[:16]
