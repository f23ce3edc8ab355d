"""Stand-in for the tensor-parallel sharding search: Megatron-LM's column/row pattern, found by
dataflow on the captured graph.

STAND-IN: the real sharding search is ``passes/shard.py`` (tensor-parallel issue). Until it lands
the cost model asks this module which nodes are split across the tp group; the search plugs in
through :class:`autopar.planner.components.Components` (one place).

The pattern (Shoeybi et al. 2019, Megatron-LM, section 3): a GEMM whose input is replicated is
split by *columns* (output features); the ops after it stay split (attention heads, GELU, SwiGLU
products, softmax over keys) until a GEMM that reads a split tensor, which is split by *rows*
and whose partial sums are all-reduced. So an attention or MLP block needs:

- ``f`` before a column group: identity forward, all-reduce of the input's gradient backward;
- ``g`` after a row GEMM: all-reduce forward, identity backward;

with sequence parallelism the all-reduces become all-gather + reduce-scatter of the same tensor.
The embedding whose table is the largest (the vocabulary) is vocab-parallel (``g`` on its
output); an LM head over a replicated input is a column GEMM and the loss is Megatron's
vocab-parallel cross-entropy (three all-reduces of b*s floats).

A column candidate is kept only if everything between it and the row GEMMs can stay split: no
normalization or reduction, nothing leaving the layer, and no elementwise op mixing it with a
full-size replicated activation (a residual). Otherwise the GEMM is replicated (BERT's MLM
transform dense, for example, feeds a LayerNorm).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch.fx

from autopar.ir import SEQ, Layer, NodeKind, info, op_name
from autopar.plan import GemmSharding

__all__ = ["Role", "CollectiveSite", "LayerSharding", "MegatronPatternSharding"]

#: Ops after which a tensor split over features cannot stay split.
_BLOCKING = frozenset({
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm", "sum", "mean",
    "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "nll_loss",
    "nll_loss_forward", "argmax", "topk", "sort", "cumsum",
})


class Role(str, enum.Enum):
    """How a node's output is laid out over the tensor-parallel group."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


class SiteKind(str, enum.Enum):
    F = "f"  # column input: identity forward, all-reduce backward
    G = "g"  # row output / vocab embedding: all-reduce forward, identity backward
    CE = "ce"  # vocab-parallel cross-entropy: 3 all-reduces of b*s floats forward


@dataclass(frozen=True, slots=True)
class CollectiveSite:
    kind: SiteKind
    #: Node whose tensor is communicated.
    tensor: str


@dataclass(frozen=True, slots=True)
class LayerSharding:
    """Tensor-parallel layout of one layer."""

    roles: Mapping[str, Role]
    gemms: Mapping[str, GemmSharding]
    sites: tuple[CollectiveSite, ...]
    #: Parameter FQNs split across the tp group.
    sharded_params: frozenset[str] = field(default_factory=frozenset)
    #: (node, dim size) that must divide by tp: split GEMM dims and attention heads.
    split_dims: tuple[tuple[str, Any], ...] = ()

    def role(self, node_name: str) -> Role:
        return self.roles.get(node_name, Role.REPLICATED)


def _param_root(a: Any) -> torch.fx.Node | None:
    """The parameter placeholder ``a`` is a view of, if any."""
    from autopar.passes.analyze import VIEW_OPS

    while isinstance(a, torch.fx.Node):
        if info(a).kind is NodeKind.PARAMETER:
            return a
        if a.op == "call_function" and op_name(a) in VIEW_OPS and a.args:
            a = a.args[0]
            continue
        return None
    return None


def _is_activation(a: Any) -> bool:
    if not isinstance(a, torch.fx.Node) or info(a).spec is None:
        return False
    return info(a).kind not in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT) \
        and _param_root(a) is None


def _weighted_linear(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op == "call_function" and op_name(node) == "linear" and len(node.args) > 1:
        return _param_root(node.args[1])
    return None


class MegatronPatternSharding:
    """STAND-IN for passes/shard.py: Megatron's column/row pattern found by dataflow."""

    name = "megatron-pattern (stand-in)"

    def shard_layer(self, captured: Any, layer: Layer, *, vocab_embedding: str | None
                    ) -> LayerSharding:
        nodes = [captured.node(n) for n in layer.nodes]
        in_layer = {n.name for n in nodes}
        roles: dict[str, Role] = {}
        gemms: dict[str, GemmSharding] = {}
        sites: list[CollectiveSite] = []
        sharded_params: set[str] = set()
        split_dims: list[tuple[str, Any]] = []
        seen_f: set[str] = set()

        def role(a: Any) -> Role:
            return roles.get(a.name, Role.REPLICATED) if isinstance(a, torch.fx.Node) \
                else Role.REPLICATED

        def region(start: torch.fx.Node) -> set[str] | None:
            """Nodes a column split starting at ``start`` reaches before row GEMMs / the loss;
            None if the split cannot stay split along the way."""
            out: set[str] = set()
            todo = [start]
            while todo:
                cur = todo.pop()
                for user in cur.users:
                    if user.name not in in_layer:
                        return None
                    if user.op != "call_function":
                        return None
                    name = op_name(user)
                    if _weighted_linear(user) is not None:
                        if user.args[0] is not cur:
                            return None  # the split tensor would be a weight
                        continue
                    if name == "cross_entropy_loss":
                        if user.args[0] is not cur:
                            return None
                        continue
                    if name in _BLOCKING:
                        return None
                    if user.name not in out:
                        out.add(user.name)
                        todo.append(user)
            return out

        # candidate column groups: weighted linears, in order; a region may mix several
        regions: dict[str, set[str]] = {}
        for node in nodes:
            w = _weighted_linear(node)
            if w is None or node.name in regions:
                continue
            r = region(node)
            if r is not None:
                regions[node.name] = r

        def full_size(a: torch.fx.Node, ref: torch.fx.Node) -> bool:
            sa, sr = info(a).spec, info(ref).spec
            if sa is None or sr is None or not sa.is_float:
                return False
            return sympy.simplify(sa.numel - sr.numel) == 0

        for node in nodes:
            if node.op != "call_function":
                continue
            name = op_name(node)
            w = _weighted_linear(node)
            if w is not None:
                x = node.args[0]
                wshape = info(node.args[1]).spec.shape  # [out, in] as the linear sees it
                if role(x) is Role.SHARDED:
                    gemms[node.name] = GemmSharding.ROW
                    roles[node.name] = Role.REPLICATED
                    sharded_params.add(info(w).fqn)
                    split_dims.append((node.name, wshape[1]))
                    sites.append(CollectiveSite(SiteKind.G, node.name))
                elif node.name in regions and self._region_ok(node, regions, role, full_size,
                                                              captured):
                    gemms[node.name] = GemmSharding.COLUMN
                    roles[node.name] = Role.SHARDED
                    sharded_params.add(info(w).fqn)
                    if len(node.args) > 2 and isinstance(node.args[2], torch.fx.Node):
                        bias = _param_root(node.args[2])
                        if bias is not None:
                            sharded_params.add(info(bias).fqn)
                    split_dims.append((node.name, wshape[0]))
                    root = _identity_root(x)
                    if root.name not in seen_f:
                        seen_f.add(root.name)
                        sites.append(CollectiveSite(SiteKind.F, x.name))
                else:
                    gemms[node.name] = GemmSharding.REPLICATE
                    roles[node.name] = Role.REPLICATED
                continue
            if name == "embedding" and vocab_embedding is not None:
                table = _param_root(node.args[0])
                if table is not None and info(table).fqn == vocab_embedding:
                    roles[node.name] = Role.REPLICATED
                    sharded_params.add(vocab_embedding)
                    sites.append(CollectiveSite(SiteKind.G, node.name))
                    continue
            if name == "cross_entropy_loss" and role(node.args[0]) is Role.SHARDED:
                roles[node.name] = Role.REPLICATED
                sites.append(CollectiveSite(SiteKind.CE, node.args[0].name))
                continue
            if any(role(a) is Role.SHARDED for a in node.all_input_nodes):
                roles[node.name] = Role.SHARDED
                if name == "scaled_dot_product_attention":
                    for a in node.args[:2]:  # query heads, key/value heads
                        split_dims.append((node.name, info(a).spec.shape[1]))
            else:
                roles[node.name] = Role.REPLICATED
        return LayerSharding(roles=roles, gemms=gemms, sites=tuple(sites),
                             sharded_params=frozenset(sharded_params),
                             split_dims=tuple(split_dims))

    @staticmethod
    def _region_ok(column: torch.fx.Node, regions: Mapping[str, set[str]], role, full_size,
                   captured) -> bool:
        """Every op in the column's region mixes it only with other column regions, broadcast
        (smaller) tensors or masks."""
        mine = regions[column.name]
        others: set[str] = set()
        for name, r in regions.items():
            if name != column.name and role(captured.node(name).args[0]) is Role.REPLICATED:
                others |= r | {name}
        allowed = mine | others | {column.name}
        for name in mine:
            node = captured.node(name)
            for a in node.all_input_nodes:
                if a.name in allowed or not _is_activation(a):
                    continue
                if full_size(a, node):
                    return False
        return True


def _identity_root(a: torch.fx.Node) -> torch.fx.Node:
    from autopar.passes.analyze import _identity_root as root

    return root(a)


def seq_degree(expr: Any) -> int:
    """Degree of ``expr`` in the sequence symbol (2 for attention scores)."""
    try:
        return int(sympy.degree(sympy.sympify(expr), SEQ))
    except Exception:  # noqa: BLE001 - non-polynomial: treat as linear
        return 1
