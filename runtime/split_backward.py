"""The zero-bubble schedules' split backward: input gradients first (``I``), weight gradients
later (``W``), with nothing computed twice.

``backward_input(roots, grads, inputs, params)`` computes the gradients of the stage's inputs
(what the previous stage waits for) and keeps what the weight gradients still need: the
gradient arriving at each autograd node that computes both an input-side gradient and a
weight-side one (a linear's ``AddmmBackward``, a layer norm's backward), asked of the same
``autograd.grad`` call as a ``GradientEdge`` (autograd captures it where it arrives). ``backward_weight(pending)`` later runs
those nodes again from the captured gradients, asking autograd for the weights only, so each
node computes just its weight-side outputs (autograd skips the outputs no requested gradient
needs). The input-gradient chain is not re-run: ``W`` costs the weight-gradient GEMMs and
reductions, ``I`` the input-gradient ones, together one backward (as in Qi et al. 2024).

The graph is cut where the nodes ``I`` runs (those with a path to an input) meet the nodes only
the weights need. Weights are grouped by the cut nodes they hang from; one ``autograd.grad``
per group, so that a group's call reaches only its own weights. Within a group several cut
nodes may lie on one path (a weight used twice in a row): their captured gradients are pinned
with a pre-hook during ``W``, so a gradient is never counted twice. A weight whose gradient
path reaches the stage's outputs without crossing the input side is computed in ``W`` from the
outputs themselves. A stage without inputs that need a gradient (the first) takes as its input
side the nodes with a path to two or more weights (:func:`_chain`), so that its ``W`` too goes
one layer's weights at a time (``by_layer=True``: what ZeRO-3 needs, gathering one layer for each
group). Without ZeRO-3 (``by_layer=False``) such a stage's ``I`` does nothing and its ``W`` is the
whole backward in one autograd call, without the graph walk: splitting it bought nothing there
(no stage waits for its ``I``, and its ``W`` is one action either way) and cost a call per weight
group and the walk: 12-15% of the backward of a first stage holding the embeddings and one or two
GPT blocks (hidden 256, 128 tokens, one CPU thread). ``torch.distributed.pipelining`` likewise
runs its first stage's backward whole (at ``I``).

A weight two distant layers read (a tied embedding and LM head in one stage) hangs from cut
nodes at both ends of the input side: its group's ``W`` would run everything between again,
other groups' cut nodes included, which read weights ZeRO-3 has freed by then. Such a group is
merged with the groups whose cut nodes lie on that path (:func:`_merge_reruns`), so that their
weights are gathered for one call; a stage without inputs left with one group runs its whole
backward at ``W``.

Public autograd API (``torch.autograd.graph``: ``Node``, ``GradientEdge``,
``get_gradient_edge``, node pre-hooks), but for ``Node._input_metadata`` (how many gradients
arrive at a node, which ``torch.autograd.grad`` itself reads for a ``GradientEdge``); the same
construction as
``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``, which
drop the gradient of a weight not reached through the input side.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PendingWeightGradients", "backward_input", "backward_weight", "weight_groups",
           "weight_gradient_groups"]


@dataclass
class _Group:
    """Weights whose gradients come from the same cut nodes."""

    params: list[torch.Tensor]
    cut: list[Node] = field(default_factory=list)  # cut nodes (each is run again by W)
    captured: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)
    outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def absorb(self, other: "_Group") -> None:
        """Take ``other``'s weights, cut nodes and outputs (one W call for both)."""
        self.params += other.params
        self.cut += [n for n in other.cut if n not in self.cut]
        self.outputs += [o for o in other.outputs
                         if all(o[0] is not x[0] for x in self.outputs)]


@dataclass
class PendingWeightGradients:
    """What ``I`` leaves for ``W`` (holds the autograd graph until then)."""

    groups: list[_Group]
    #: The stage's output tensors, kept so that their graph stays alive until W.
    roots: list[torch.Tensor]


def _node(t: torch.Tensor) -> Node | None:
    return get_gradient_edge(t).node if t.requires_grad else None


def _input_side(parents: dict[Node, list[Node]], seeds: list[Node]) -> set[Node]:
    """``seeds`` and every node above them (with a path down to one)."""
    side = set(seeds)
    queue = deque(seeds)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent not in side:
                side.add(parent)
                queue.append(parent)
    return side


def _chain(root_nodes: Sequence[Node | None], params: Sequence[torch.Tensor],
           seen: set[Node]) -> set[Node]:
    """A stage without inputs to differentiate: the nodes with a path down to two or more of
    ``params``. What hangs below them reaches one weight each, so the weight gradients split
    into per-layer groups as in any other stage; without this the first stage would be one group
    whose ``W`` is its whole backward (ZeRO-3 then gathered the whole stage for it)."""
    owner: dict[Node, Any] = {}  # node -> the one weight below it, or _MANY
    for p in params:
        n = _node(p)
        if n is not None and n in seen:
            owner[n] = id(p)
    # children before parents: an iterative post-order from the roots
    stack = [(n, False) for n in root_nodes if n is not None]
    done: set[Node] = set()
    while stack:
        node, expanded = stack.pop()
        if node in done:
            continue
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions
                         if c is not None and c not in done)
            continue
        done.add(node)
        if node in owner:
            continue
        below = {owner[c] for c, _ in node.next_functions if c is not None and c in owner}
        if len(below) == 1:
            owner[node] = below.pop()
        elif below:
            owner[node] = _MANY
    return {n for n, o in owner.items() if o is _MANY}


_MANY = object()


def _merge_reruns(groups: list[_Group], input_side: set[Node],
                  parents: dict[Node, list[Node]], root_nodes: Sequence[Node | None]
                  ) -> list[_Group]:
    """``groups`` with each group whose ``W`` would run other groups' cut nodes again merged
    with those groups (their weights then gathered for one call): the input-side nodes on a
    path from one of its sources (its cut nodes, the roots it starts from) down to one of its
    own cut nodes. Only a group with two or more sources can hold such a path."""
    owner = {n: i for i, g in enumerate(groups) for n in g.cut}
    merge = list(range(len(groups)))  # union-find over the groups

    def find(i: int) -> int:
        while merge[i] != i:
            merge[i] = merge[merge[i]]
            i = merge[i]
        return i

    for i, g in enumerate(groups):
        sources = list(g.cut) + [n for n in root_nodes if n is not None and any(
            o[0].grad_fn is n for o in g.outputs)]
        if len(sources) < 2:
            continue
        below: set[Node] = set()
        queue = deque(sources)
        while queue:
            for child, _ in queue.popleft().next_functions:
                if child is not None and child in input_side and child not in below:
                    below.add(child)
                    queue.append(child)
        above: set[Node] = set()
        queue = deque(n for n in g.cut if n in below)
        while queue:
            for parent in parents.get(queue.popleft(), ()):
                if parent in input_side and parent not in above:
                    above.add(parent)
                    queue.append(parent)
        for n in below & above:
            j = owner.get(n)
            if j is not None and find(j) != find(i):
                merge[find(j)] = find(i)
    if all(find(i) == i for i in range(len(groups))):
        return groups
    out: dict[int, _Group] = {}
    for i, g in enumerate(groups):  # each merged group where its first member was
        root = find(i)
        out.setdefault(root, _Group([])).absorb(g)
    return list(out.values())


def _whole_at_weight(roots: list[torch.Tensor], grads: list[torch.Tensor | None],
                     inputs: Sequence[torch.Tensor], params: list[torch.Tensor]
                     ) -> tuple[list[torch.Tensor | None], PendingWeightGradients]:
    """A stage without inputs to differentiate, not split: nothing at I, its whole backward in
    one call at W."""
    whole = _Group(params, outputs=list(zip(roots, grads)))
    return [None] * len(inputs), PendingWeightGradients([whole] if roots else [], roots)


def _num_inputs(node: Node) -> int:
    """How many gradients arrive at ``node`` (its forward's outputs): ``Node._input_metadata``,
    declared by ``torch.autograd.graph.Node`` and read by ``torch.autograd.grad`` itself for a
    ``GradientEdge``."""
    return len(node._input_metadata)


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor], *,
                   by_layer: bool = True
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGradients]:
    """Gradients of ``inputs`` (leaves) from ``roots`` with incoming ``grads`` (None: ones, for
    a scalar loss); the weight gradients of ``params`` are left to :func:`backward_weight`.
    ``by_layer=False``: where no input needs a gradient, ``W`` computes every weight in one call
    (see the module docstring)."""
    roots, grads = list(roots), list(grads)
    params = [p for p in params if p.requires_grad]
    if not by_layer and not any(x.requires_grad for x in inputs):
        return _whole_at_weight(roots, grads, inputs, params)
    root_nodes = [t.grad_fn for t in roots]
    # the graph below the roots, with each node's parents (the nodes that feed it gradients)
    parents: dict[Node, list[Node]] = {}
    queue = deque(n for n in root_nodes if n is not None)
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    wanted = [x for x in inputs if x.requires_grad]
    # the input side: every node with a path down to an input (what I runs); in a stage without
    # one (the first), the nodes with a path down to two or more weights: the activations' chain
    input_side = (_input_side(parents, [n for n in map(_node, wanted) if n in seen]) if wanted
                  else _chain(root_nodes, params, seen))
    # each weight's cut: the input-side nodes its weight-only subgraph hangs from, and the
    # roots reached without crossing the input side
    by_cut: dict[Any, _Group] = {}
    groups: list[_Group] = []
    for p in params:
        start = _node(p)
        if start is None or start not in seen:
            continue  # the stage's outputs do not depend on it: no gradient
        cut: set[Node] = set()
        outs: set[int] = set()
        queue, visited = deque([start]), {start}
        while queue:
            node = queue.popleft()
            for i, r in enumerate(root_nodes):
                if r is node:
                    outs.add(i)
            for parent in parents.get(node, ()):
                if parent in input_side:
                    cut.add(parent)
                elif parent not in visited:
                    visited.add(parent)
                    queue.append(parent)
        keys = [("node", n) for n in cut] + [("root", i) for i in outs]
        merged = [by_cut[k] for k in keys if k in by_cut]
        group = merged[0] if merged else _Group([])
        for other in merged[1:]:
            if other is not group:
                group.absorb(other)
                groups.remove(other)
                for k, g in by_cut.items():
                    if g is other:
                        by_cut[k] = group
        if not merged:
            groups.append(group)
        group.params.append(p)
        for n in cut:
            if n not in group.cut:
                group.cut.append(n)
        for i in outs:
            pair = (roots[i], grads[i])
            if all(pair[0] is not o[0] for o in group.outputs):
                group.outputs.append(pair)
        for k in keys:
            by_cut[k] = group
    # a weight two layers read (a tied embedding and LM head in one stage, pp = 1): its W runs
    # the input side between them again, and with it other groups' cut nodes, which read their
    # own weights (freed by ZeRO-3 unless gathered with the group): one W for those groups
    groups = _merge_reruns(groups, input_side, parents, root_nodes)
    if not wanted and len(groups) == 1:  # nothing left to split
        return _whole_at_weight(roots, grads, inputs, params)
    # the gradient arriving at every cut node, asked of autograd as a GradientEdge beside the
    # inputs: captured where it arrives, without running the cut node for it
    cuts = list(dict.fromkeys(n for group in groups for n in group.cut))
    widths = [_num_inputs(n) for n in cuts]
    edges = [GradientEdge(n, i) for n, w in zip(cuts, widths) for i in range(w)]
    found: Sequence[torch.Tensor | None] = [None] * len(wanted)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    if roots and (wanted or edges):
        got = torch.autograd.grad(roots, [*wanted, *edges], grads, retain_graph=True,
                                  allow_unused=True)
        found = got[:len(wanted)]
        rest = iter(got[len(wanted):])
        for n, w in zip(cuts, widths):
            captured[n] = tuple(next(rest) for _ in range(w))
    for group in groups:
        group.captured = [captured.get(n) for n in group.cut]
    it = iter(found)
    return ([next(it) if x.requires_grad else None for x in inputs],
            PendingWeightGradients(groups, roots))


def backward_weight(pending: PendingWeightGradients
                    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The weight gradients :func:`backward_input` left: (parameter, gradient) pairs (None for a
    weight that got no gradient). Releases the graph."""
    return [pair for pairs in weight_gradient_groups(pending) for pair in pairs]


def weight_groups(pending: PendingWeightGradients) -> list[list[torch.Tensor]]:
    """The weights of each group :func:`weight_gradient_groups` computes, in its order."""
    return [list(group.params) for group in pending.groups]


def weight_gradient_groups(pending: PendingWeightGradients,
                           before: Callable[[list[torch.Tensor]], None] | None = None
                           ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """:func:`backward_weight` one group at a time: ``before(weights)`` runs ahead of each
    group's autograd call (ZeRO-3 gathers those weights' layer), and the group's (parameter,
    gradient) pairs are yielded as soon as they are computed, so that a caller can take them and
    free the layer before the next group. Releases the graph at the end."""
    for group in pending.groups:
        edges: list[Any] = []
        seeds: list[torch.Tensor] = []
        for node, grads in zip(group.cut, group.captured):
            for i, g in enumerate(grads or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        for root, g in group.outputs:
            edges.append(root)
            seeds.append(g if g is not None else torch.ones_like(root))
        if not edges:
            yield [(p, None) for p in group.params]
            continue
        if before is not None:
            before(list(group.params))
        pins = []
        if len(edges) > 1:  # a cut node below another one on a path: keep its captured input
            for node, grads in zip(group.cut, group.captured):
                if grads is not None:
                    pins.append(node.register_prehook(lambda _, grads=grads: grads))
        try:
            found = torch.autograd.grad(edges, group.params, seeds, retain_graph=True,
                                        allow_unused=True)
        finally:
            for h in pins:
                h.remove()
        yield list(zip(group.params, found))
    pending.groups = []
    pending.roots = []
