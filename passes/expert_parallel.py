"""Expert parallelism: the experts operation of a per-rank program called on an expert group.

:func:`expert_parallelize` returns a new program (``gm`` is not changed) in which every
``torch.ops.autopar.moe_experts`` node (captured from a mixture-of-experts block, see
``autopar/moe.py``) is ``runtime.moe.experts(ep, ...)`` on an :class:`autopar.runtime.moe.EPGroup`
read from a new placeholder ``ep``. With ``ep`` ranks each rank's program reads ``E / ep`` of each
block's experts (:func:`expert_weights` names them; ``lower_to_rank`` slices them), and the group
sends every token to its experts' ranks and back. The program is the same for ep = 1 (a group of
one runs every expert locally), so one path runs everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from autopar.errors import ShardingError
from autopar.ir import META_KEY, NodeInfo, NodeKind, info, op_name
from autopar.passes.infra import PassContext, PassResult, graph_pass, graph_property
from autopar.runtime import moe as moe_runtime

__all__ = ["expert_parallelize", "expert_parallel_pass", "expert_weights", "moe_nodes"]

_OP = "moe_experts"


def moe_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The captured experts operations of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and (op_name(n) == _OP or n.target is moe_runtime.experts)]


def _weights(node: torch.fx.Node) -> tuple[Any, Any]:
    args = node.args[1:] if node.target is moe_runtime.experts else node.args
    return args[3], args[4]


def expert_weights(gm: torch.fx.GraphModule, ep: int) -> dict[str, int]:
    """Placeholder name -> number of experts, for every stacked expert weight (split over the
    ``ep`` ranks along dim 0); a count ``ep`` does not divide is a named error."""
    out: dict[str, int] = {}
    for node in moe_nodes(gm):
        for w in _weights(node):
            if not (isinstance(w, torch.fx.Node) and w.op == "placeholder"):
                raise ShardingError(f"the experts of {node.name} are not parameters of the model",
                                    found=str(w), fix="keep the stacked expert weights as "
                                                      "nn.Parameters of the experts module")
            spec = info(w).spec if META_KEY in w.meta else None
            experts = int(spec.shape[0]) if spec is not None else int(w.meta["val"].shape[0])
            if experts % ep:
                raise ShardingError(
                    f"ep={ep} does not divide the {experts} experts of {node.name}",
                    expected=f"a number of experts divisible by ep={ep}",
                    found=f"{experts} experts ({w.name})",
                    fix=f"pick ep among the divisors of {experts}")
            out[w.name] = experts
    return out


def expert_parallelize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new program calling every experts operation on the ``ep`` placeholder's group."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    nodes = [n for n in graph.nodes if n.op == "call_function" and op_name(n) == _OP]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if any(n.name == "ep" for n in placeholders):
        raise ShardingError("the program already reads an expert-parallel group",
                            fix="expert_parallelize a program once")
    if not nodes:
        return torch.fx.GraphModule(gm, graph)
    anchor = next((n for n in reversed(placeholders) if META_KEY in n.meta
                   and info(n).kind is NodeKind.COMMUNICATOR), None)
    with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(
            placeholders[0]):
        ep = graph.placeholder("ep")
    ep.meta[META_KEY] = NodeInfo(NodeKind.COMMUNICATOR)
    for node in nodes:
        x, index, weights, gate_up, down, act, gated = node.args
        with graph.inserting_after(node):
            new = graph.call_function(moe_runtime.experts,
                                      (ep, x, index, weights, gate_up, down, act, gated))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


@graph_property("experts_on_group")
def experts_on_group(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every experts operation runs on the ``ep`` placeholder's group."""
    ep = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "ep"), None)
    for node in moe_nodes(gm):
        if node.target is not moe_runtime.experts:
            return f"{node.name} is still the captured operation"
        if node.args[0] is not ep:
            return f"{node.name} reads another group than the ep placeholder"
    return None


@graph_pass(ensures=("experts_on_group",))
def expert_parallel_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """:func:`expert_parallelize` as a pass."""
    new = expert_parallelize(gm)
    return PassResult(new, new is not gm)
