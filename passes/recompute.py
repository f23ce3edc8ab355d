"""Selective activation recompute: each attention core of a stage graph is recomputed in backward.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models") keep
every GEMM input and recompute only the attention core, the ops between Q, K, V and the
attention output: ``Q K^T``, scaling, masking, softmax, dropout and ``P V``. Their saved tensors
(scores, probabilities, dropout masks) grow as ``s^2`` (``5 a s^2 b`` bytes per layer at 16 bits,
more than the rest of the layer once ``s > 34 h / 5 a``), while the core is a small share of the
layer's FLOPs. This pass finds the cores and wraps each in a
:class:`autopar.runtime.recompute.RecomputedRegion` (``torch.utils.checkpoint``,
non-reentrant), so that after a stage's forward autograd holds the block's GEMM inputs,
norm inputs etc. as before, and of the core only its inputs Q, K, V.

**Which nodes.** Found from the graph's structure, so it needs no symbolic shapes:

- an *attention GEMM* is a ``matmul`` / ``bmm`` of two activations (both need a gradient; no
  weight, buffer or constant). ``Q K^T`` is one, and the first attention GEMM downstream of it is
  ``P V``; the core is those two and every node on a path between them (scaling, mask add,
  softmax, casts, dropout). Being the nodes on paths from one node to another, the region is
  convex: no node outside reads a core tensor and feeds the core again;
- a ``scaled_dot_product_attention`` (or autopar's ``tp.attention_dropout``) *with dropout* is a
  core of its own: autopar computes attention with dropout the math way (plan-independent
  masks, ``runtime/tp.py``), which saves the ``s^2`` probabilities and mask;
- fused attention without dropout is left alone: it saves q, k, v, its output and the
  log-sum-exp, no ``s^2`` tensor, and recomputing it would cost an attention forward for
  nothing.

An additive or boolean mask the core reads (GPT-2's ``[b, 1, s, s]`` causal mask made before the
blocks) is ``s^2`` too; kept as an input of every region it would stay alive until the stage's
backward. Masks need no gradient and come from the inputs, buffers and sizes
(:func:`autopar.passes.split_stages.recomputable_nodes`), so the region computes its own copy
from the mask's last smaller-than-``s^2`` ancestors (index vectors ``[b, 1, s, 1]``), the way the
stage split recomputes masks on every stage rather than sending them. That repeats a few
elementwise ops on ``b s^2`` elements per block, next to the core's own ``a`` times larger
softmax.

**Cost.** The core's forward runs again in every backward pass that reaches it: once per
backward action (``B``, or ``I``). A zero-bubble ``W`` does not reach it (its autograd calls
start at the weights' own nodes, whose saved inputs lie outside the core), except in a stage
whose ``I`` computes nothing, which recomputes at ``W`` instead: once per micro-batch under
every schedule, counted in ``tests/test_plan_sweep.py`` (docs/recompute.md).

The pass works on any graph with autopar's annotations: a captured graph, a tensor-parallel
program (the core is local per rank: heads are sharded, so no collective lies between the two
attention GEMMs) or a stage graph (what ``autopar.parallelize`` applies it to, after the stage
split).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx

from autopar.ir import META_KEY, NodeInfo, NodeKind, has_info, info, op_name
from autopar.passes.infra import PassContext, PassResult, graph_pass
from autopar.passes.split_stages import recomputable_nodes
from autopar.runtime.recompute import RecomputedRegion

__all__ = ["AttentionCore", "attention_cores", "recompute_attention_cores",
           "checkpoint_attention_cores", "ATTENTION_GEMMS"]

#: Ops that multiply two activations (``Q K^T``, ``P V``).
ATTENTION_GEMMS = frozenset({"matmul", "bmm"})
#: Attention ops that keep ``s^2`` tensors when they drop out probabilities.
_ATTENTION_WITH_DROPOUT = frozenset({"scaled_dot_product_attention", "attention_dropout"})
_WEIGHT_KINDS = (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT)


@dataclass(frozen=True)
class AttentionCore:
    """One region recomputed in backward (names of nodes in the graph the pass looked at)."""

    #: The core's nodes in graph order (``Q K^T`` first, ``P V`` last).
    nodes: tuple[str, ...]
    #: Mask nodes the region computes its own copy of (see the module docstring).
    recomputed_masks: tuple[str, ...]
    #: What the region reads (its inputs: Q, K, V, mask sources, the tp communicator, sizes).
    inputs: tuple[str, ...]
    #: Core nodes read outside the region (``P V``, normally alone).
    outputs: tuple[str, ...]
    #: The layer of the core (``node.meta["autopar"].layer``).
    layer: str
    #: The submodule that runs it (after :func:`recompute_attention_cores`).
    module: str = ""


#: Ops between a weight and a GEMM that leave it a weight (``t``, ``transpose``, a cast).
_VIEWS = frozenset({"t", "transpose", "permute", "view", "reshape", "expand", "unsqueeze",
                    "_unsafe_view", "alias", "detach", "getitem", "to"})


def _is_activation(a: Any) -> bool:
    """A tensor computed from the inputs that needs a gradient (not a weight, or a view of one)."""
    if not isinstance(a, torch.fx.Node) or not has_info(a) or not info(a).requires_grad:
        return False
    root = a
    while root.op == "call_function" and op_name(root) in _VIEWS and root.args \
            and isinstance(root.args[0], torch.fx.Node):
        root = root.args[0]
    return not (has_info(root) and info(root).kind in _WEIGHT_KINDS)


def _is_attention_gemm(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or op_name(n) not in ATTENTION_GEMMS or not has_info(n):
        return False
    operands = [a for a in n.args[:2]]
    return len(operands) == 2 and all(_is_activation(a) for a in operands)


def _drops_out(n: torch.fx.Node) -> bool:
    """An attention op with dropout on its probabilities (saves ``s^2`` tensors)."""
    if n.op != "call_function" or op_name(n) not in _ATTENTION_WITH_DROPOUT:
        return False
    name = op_name(n)
    first = 4 if name == "attention_dropout" else 3  # the tp communicator comes first
    p = n.args[first + 1] if len(n.args) > first + 1 else n.kwargs.get("dropout_p", 0.0)
    return bool(p) and has_info(n) and info(n).requires_grad


def _seq_degree(node: torch.fx.Node) -> int:
    import sympy

    from autopar.ir import SEQ

    spec = info(node).spec if has_info(node) else None
    if spec is None:
        return 0
    try:
        return int(sympy.degree(sympy.sympify(spec.numel), SEQ))
    except Exception:  # noqa: BLE001 - not a polynomial in s
        return 0


def attention_cores(gm: torch.fx.GraphModule) -> list[AttentionCore]:
    """The attention cores of ``gm`` in graph order (see the module docstring); the graph is
    not changed."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    taken: set[torch.fx.Node] = set()
    cores: list[AttentionCore] = []
    recomputable: set[torch.fx.Node] | None = None
    for a in nodes:
        if a in taken:
            continue
        if _drops_out(a):
            region = [a]
        elif _is_attention_gemm(a):
            region = _between(a, order)
            if region is None:
                continue
        else:
            continue
        inside = set(region)
        outputs = [n for n in region if any(u not in inside for u in n.users)]
        last = max(order[n] for n in region)
        if any(order[u] <= last for n in outputs for u in n.users if u not in inside):
            continue  # a core tensor read before the core ends: not a region we can cut out
        if recomputable is None:
            recomputable = recomputable_nodes(gm)
        masks = _quadratic_masks(region, recomputable, order)
        body = set(region) | set(masks)
        inputs: dict[torch.fx.Node, None] = {}
        for n in sorted(body, key=order.__getitem__):
            for x in n.all_input_nodes:
                if x not in body:
                    inputs.setdefault(x)
        taken |= inside
        cores.append(AttentionCore(
            nodes=tuple(n.name for n in region), recomputed_masks=tuple(n.name for n in masks),
            inputs=tuple(n.name for n in inputs), outputs=tuple(n.name for n in outputs),
            layer=info(region[-1]).layer))
    return cores


def _between(first: torch.fx.Node, order: dict[torch.fx.Node, int]
             ) -> list[torch.fx.Node] | None:
    """``first`` (``Q K^T``), the first attention GEMM downstream of it (``P V``) and every node
    on a path between them, in graph order; None when no attention GEMM follows."""
    below: set[torch.fx.Node] = set()
    todo = [first]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in below and u.op == "call_function":
                below.add(u)
                todo.append(u)
    ends = sorted((n for n in below if _is_attention_gemm(n)), key=order.__getitem__)
    if not ends:
        return None
    last = ends[0]
    region = {first, last}
    todo = [last]
    while todo:
        n = todo.pop()
        for x in n.all_input_nodes:
            if x in below and x not in region:
                region.add(x)
                todo.append(x)
    return sorted(region, key=order.__getitem__)


def _quadratic_masks(region: Iterable[torch.fx.Node], recomputable: set[torch.fx.Node],
                     order: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The ``s^2`` mask nodes the region reads (and theirs), which it can compute itself."""
    out: set[torch.fx.Node] = set()
    todo = [x for n in region for x in n.all_input_nodes]
    while todo:
        x = todo.pop()
        if x in out or x not in recomputable or _seq_degree(x) < 2:
            continue
        out.add(x)
        todo.extend(x.all_input_nodes)
    return sorted(out, key=order.__getitem__)


def recompute_attention_cores(gm: torch.fx.GraphModule) -> list[AttentionCore]:
    """Replace every attention core of ``gm`` by a call of a :class:`RecomputedRegion`
    submodule (``attention_core_<k>``) holding the core as a graph. In place; returns the cores
    with the submodule names. A graph without cores is left unchanged."""
    cores = attention_cores(gm)
    if not cores:
        return []
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    done = []
    masks_used: set[torch.fx.Node] = set()
    for k, core in enumerate(cores):
        name = f"attention_core_{k}"
        while hasattr(gm, name):
            name += "_"
        region = [by_name[n] for n in core.nodes]
        masks = [by_name[n] for n in core.recomputed_masks]
        masks_used.update(masks)
        body = _body_graph(masks + region, [by_name[n] for n in core.inputs],
                           [by_name[n] for n in core.outputs])
        gm.add_submodule(name, RecomputedRegion(torch.fx.GraphModule(
            torch.nn.Module(), body, class_name="AttentionCore")))
        outputs = [by_name[n] for n in core.outputs]
        with graph.inserting_after(region[-1]):
            call = graph.call_module(name, tuple(by_name[n] for n in core.inputs))
        if len(outputs) == 1:
            call.meta = _copied_meta(outputs[0])
            outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in region)
        else:
            call.meta = {META_KEY: NodeInfo(NodeKind.OP, value=tuple(
                info(o).value for o in outputs), layer=core.layer)}
            with graph.inserting_after(call):
                for i, o in reversed(list(enumerate(outputs))):
                    item = graph.call_function(operator.getitem, (call, i))
                    item.meta = _copied_meta(o)
                    o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in region)
        for n in reversed(region):
            graph.erase_node(n)
        done.append(AttentionCore(core.nodes, core.recomputed_masks, core.inputs, core.outputs,
                                  core.layer, name))
    # the graph's own mask computations, now read by no one (each region makes its copy), and
    # what only they read
    unused = masks_used | {x for n in masks_used for x in n.all_input_nodes
                           if x.op == "call_function" and not info(x).requires_grad}
    for n in sorted(unused, key={n: i for i, n in enumerate(graph.nodes)}.__getitem__,
                    reverse=True):
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return done


def _body_graph(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node],
                outputs: list[torch.fx.Node]) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for x in inputs:
        env[x] = graph.placeholder(x.name)
        env[x].meta = _copied_meta(x)
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    for n in sorted(nodes, key=position.__getitem__):
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = _copied_meta(n)
    result = env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs)
    graph.output(result)
    graph.lint()
    return graph


def _copied_meta(n: torch.fx.Node) -> dict[str, Any]:
    meta = dict(n.meta)
    if has_info(n):
        meta[META_KEY] = copy.copy(info(n))
    return meta


@graph_pass(ensures=("attention_recomputed",))
def checkpoint_attention_cores(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """The pass form of :func:`recompute_attention_cores`; the cores are its result."""
    cores = recompute_attention_cores(gm)
    return PassResult(gm, bool(cores), cores)
