r"""The sharding search: one placement per tensor, chosen by an ILP over time and memory.

Every node v has strategies S_v (passes/sharding_rules.py): an output placement over the
tensor-parallel axis and the placement it requires of each input. Repeated blocks (equal
``Layer.signature``) are solved once: every block is mapped position by position onto the first
block of its signature, so the ILP holds pre + one representative block per signature + post,
and a representative node stands for ``c_v`` graph nodes (c_v = number of blocks). The choice is
exact for the tied problem; the GPT-3 175B graph (96 blocks) solves as fast as a 2-layer one.
A shallower capture of a deep model (the planner captures two blocks) is weighed at the real
depth (``depth=``): the last captured block counts for the blocks not captured, so the blocks
weigh against the embedding and the LM head as they do in the real model.

Variables (built in :func:`_build_ilp`):

    x[v,s] in {0,1}    v runs strategy s                          (one per node and strategy)
    d[u,q] in {0,1}    some consumer needs u's output as q         (q = placement, partial-grad)
    m[u,s,q] in [0,1]  u is placed s and must be turned into q     (x[u,s] AND d[u,q])

Objective (seconds per step, in microseconds for the solver), :func:`_build_ilp`::

    min  sum_v sum_s  c_v * x[v,s] * ( (1 + beta) * t_op(v) * scale(s)       compute
                                       + t_internal(s)                         collectives inside
                                       + lambda_p * state(v,s)                 parameter memory
                                       + lambda_a * act(v,s) )                 activation memory
       + sum_{u,s,q}  c_u * m[u,s,q] * t_redist(s -> q)                        edges: fwd + bwd

with t_op = max(FLOPs / peak, bytes / HBM bandwidth) for GEMMs and attention (memory-bound ops
are taken as fused into them unless TPCostSpec.price_memory_bound_ops), beta the
backward-to-forward work ratio,
scale(s) the share one rank computes (1/tp when sharded), state the per-rank bytes of parameter
state (weights, gradients, Adam moments; x 1/tp when sharded) priced by default at one link
transfer per byte, act the saved activations (x scale) priced only to break ties, and t_redist
the forward and backward collectives of autopar.sharding.redistribution priced by a ring model
(latency + volume / bandwidth). Float tensors are priced at the training precision
(TPCostSpec.float_bytes: a model captured in fp32 and trained in bf16 moves 2-byte elements);
t_internal (the vocab-parallel loss's statistics) stays fp32. Replicated tensors consumed by a sharded op have partial gradients (Megatron's f);
that demand q = (Replicate, partial) costs its backward all-reduce (or reduce-scatter instead of
a slice after an all-gather) once per producer, however many consumers share it.

Constraints:

- one strategy per node:                 sum_s x[v,s] = 1                    (:func:`_build_ilp`)
- demands from consumers:                d[u,q] >= sum_{t needs q of u} x[v,t]   for each consumer v
- a partial-gradient demand needs the plain one:   d[u,(R,partial)] <= d[u,(R,full)]
- the product, where t_redist(s -> q) > 0:  m[u,s,q] <= x[u,s]   and
                                          sum_{s paid} m[u,s,q] + sum_{s free} x[u,s] >= d[u,q]
  (a demand is met through the strategy u runs: where that one pays, its m is 1.) This is the
  disaggregated form of m = x AND d: with sum_s x[u,s] = 1 it implies the textbook
  m[u,s,q] >= x[u,s] + d[u,q] - 1 and is tighter in the LP relaxation, whose bound on GPT-3
  175B's tp-8 program rose from 6.4% to 0.9% below the optimum. Same optima (checked on GPT-3
  175B's 37 and LLaMA-65B's 25 planning ILPs), half the solve time (2.7 -> 1.2 s, 4.8 -> 2.1 s).
- impossible redistributions (anything -> Partial): x[u,s] + d[u,q] <= 1
- tuple outputs (split + getitem):       x[g,t] <= sum_{s: s.out[i] = t.out} x[u,s]
- outputs are replicated:               d[u,(R,full)] = 1
- optional memory capacity:             sum c_v x[v,s] mem(v,s) <= M

With sequence parallelism on, activations that need a gradient and span batch and sequence may
not be replicated (their strategies drop Replicate): that is what sequence parallelism means,
and it turns every Megatron all-reduce into an all-gather and a reduce-scatter. The elements of
a tuple-valued op that can only run replicated (no rule: ``broadcast_tensors`` before
``F.mse_loss``) keep Replicate, or nothing could consume them.

The pass :func:`shard_graph` writes each node's strategy and placement into its NodeInfo.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import pulp
import sympy
import torch
import torch.fx

from autopar import solver
from autopar.errors import InfeasiblePlanError, UnsupportedOpWarning
from autopar.ir import (BATCH, META_KEY, SEQ, NodeInfo, NodeKind, TensorSpec, dtype_bytes, info,
                        op_name)
from autopar.plan_types import GemmSharding
from autopar.passes.infra import PassContext, PassResult, graph_pass, graph_property
from autopar.passes.sharding_rules import (
    Item,
    RuleContext,
    Strategy,
    is_tensor_node,
    node_strategies,
    placeholder_strategies,
)
from autopar.sharding import (
    REPLICATE,
    Collective,
    Replicate,
    StridedShard,
    gradient_is_partial,
    is_sharded,
    redistribution,
)

__all__ = ["TPCostSpec", "ShardingSolution", "split_gemm_bias", "shard_graph",
           "search_placements", "representatives", "collective_time"]

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class TPCostSpec:
    """The hardware numbers the sharding search prices with (one tensor-parallel group).

    Defaults are an A100 SXM node: bf16 dense peak, HBM2e, NVLink 3 per-direction bandwidth
    and a typical NCCL small-message latency. The planner's cost model may pass its own.
    """

    peak_flops: float = 312e12
    hbm_bandwidth: float = 2.0e12
    link_bandwidth: float = 300e9
    link_latency: float = 10e-6
    #: Seconds one byte of per-rank parameter state (weights, gradients, optimizer moments) is
    #: worth. Default: 1 / link_bandwidth, i.e. a replicated byte costs what fetching it over
    #: the link once per step would (the ZeRO-3 alternative to holding it).
    param_memory_weight: float | None = None
    #: Seconds one byte of saved activations is worth. The default (1 us per GB) only breaks
    #: ties: activation memory is the business of sequence parallelism and recompute, which
    #: the planner chooses; pass memory_limit for a hard capacity.
    activation_memory_weight: float = 1e-15
    #: Optional per-rank capacity (bytes) for parameter state plus saved activations.
    memory_limit: float | None = None
    #: Parameter state per parameter byte: weight, gradient and two Adam moments.
    state_bytes_per_param_byte: float = 4.0
    #: Backward work relative to forward (2: two GEMMs per forward GEMM).
    backward_factor: float = 2.0
    #: Memory-bound ops (elementwise, norms, reductions, embeddings, casts) cost no time of
    #: their own by default: fused into the kernels around them (torch.compile, Megatron's
    #: fused bias-dropout-add and norms), they are second order next to GEMMs, attention and
    #: collectives, as in Megatron-LM's own analysis. True prices each as a kernel that reads
    #: and writes its tensors at HBM bandwidth. Either way they cost memory.
    price_memory_bound_ops: bool = False
    #: Bytes of one floating-point element of activations, compute weights and collectives at
    #: the training precision (2 under bf16 mixed precision); None: the graph's own dtype (a
    #: model captured in fp32 would pay twice the bf16 traffic). Parameter state stays
    #: state_bytes_per_param_byte x the graph's bytes: 16 per fp32 parameter, mixed-precision
    #: Adam's weights, gradients and moments.
    float_bytes: float | None = None
    #: Collectives that do not run as rings at ``link_bandwidth`` / ``link_latency``:
    #: ``((kind, latency_s, bandwidth), ...)`` with kind a :class:`Collective` value (gloo's
    #: reduce-scatter, measured by ``autopar calibrate``, reaches a third of the all-reduce's bus
    #: bandwidth). A tuple, so that the spec stays hashable.
    collectives: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("peak_flops", "hbm_bandwidth", "link_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("link_latency", "activation_memory_weight", "state_bytes_per_param_byte",
                     "backward_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise ValueError(f"memory_limit must be positive, got {self.memory_limit}")
        if self.param_memory_weight is not None and self.param_memory_weight < 0:
            raise ValueError(f"param_memory_weight must be >= 0, got {self.param_memory_weight}")
        if self.float_bytes is not None and not self.float_bytes > 0:
            raise ValueError(f"float_bytes must be positive, got {self.float_bytes}")
        for kind, latency, bandwidth in self.collectives:
            Collective(kind)  # a known kind, or ValueError
            if latency < 0 or not bandwidth > 0:
                raise ValueError(f"collective {kind}: latency must be >= 0 and bandwidth "
                                 f"positive, got {latency}, {bandwidth}")

    def link_for(self, kind: Collective) -> tuple[float, float]:
        """(latency, bandwidth) of one collective of ``kind``."""
        for name, latency, bandwidth in self.collectives:
            if name == kind.value:
                return latency, bandwidth
        return self.link_latency, self.link_bandwidth

    @property
    def param_weight(self) -> float:
        return (1.0 / self.link_bandwidth if self.param_memory_weight is None
                else self.param_memory_weight)

    def float_scale(self, spec: Any) -> float:
        """Training-precision bytes per graph byte of a tensor (1 for integers)."""
        if self.float_bytes is None or spec is None or not spec.is_float:
            return 1.0
        return self.float_bytes / dtype_bytes(spec.dtype)


def collective_time(kind: Collective, nbytes: float, tp: int, cost: TPCostSpec) -> float:
    """Ring model: latency + bytes each rank sends / link bandwidth (0 for local steps)."""
    if not kind.communicates or tp == 1:
        return 0.0
    latency, bandwidth = cost.link_for(kind)
    return latency + kind.ring_factor(tp) * nbytes / bandwidth


# ---------------------------------------------------------------------------------------------
# Pre-pass: GEMM biases become adds
# ---------------------------------------------------------------------------------------------

@graph_property("gemm_bias_split")
def gemm_bias_split(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """No ``aten.linear`` adds its own bias (the search sees every bias as its own add)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default \
                and len(node.args) > 2 and isinstance(node.args[2], torch.fx.Node):
            return f"{node.name} adds its bias {node.args[2].name} itself"
    return None


@graph_property("placements")
def placements(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every parameter and every floating op output has a placement."""
    for node in gm.graph.nodes:
        meta = info(node) if META_KEY in node.meta else None
        if meta is None or meta.placement is not None:
            continue
        spec = meta.value
        floating = isinstance(spec, TensorSpec) and spec.is_float
        if (node.op == "placeholder" and meta.kind is NodeKind.PARAMETER) or (
                node.op == "call_function" and floating):
            what = op_name(node) if node.op == "call_function" else "parameter"
            return f"{node.name} ({what}) has no placement"
    return None


@graph_pass(ensures=("gemm_bias_split",))
def split_gemm_bias(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """``linear(x, W, b)`` -> ``add(linear(x, W), b)``: a row-parallel GEMM's bias must be added
    once, after the reduction, so the search has to see it as its own op. The collective pass
    fuses it back where the placements allow (column-parallel and replicated GEMMs)."""
    modified = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        if len(node.args) < 3 or not isinstance(node.args[2], torch.fx.Node):
            continue
        bias = node.args[2]
        with gm.graph.inserting_after(node):
            add = gm.graph.call_function(aten.add.Tensor, (node, bias))
        node.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        node.args = node.args[:2]
        for key in ("nn_module_stack", "stack_trace"):
            if key in node.meta:
                add.meta[key] = node.meta[key]
        src = info(node)
        spec = src.spec
        add.meta["autopar"] = NodeInfo(
            NodeKind.OP, spec, module_path=src.module_path, layer=src.layer,
            reads=tuple(sorted(set(info(bias).reads))),
            requires_grad=src.requires_grad or info(bias).requires_grad,
            flops=spec.numel, bytes_read=spec.nbytes + info(bias).spec.nbytes,
            bytes_written=spec.nbytes, extra={"bias_of": node.name})
        src.reads = tuple(r for r in src.reads if r not in info(bias).reads) or src.reads
        modified = True
    return PassResult(gm, modified)


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ShardingSolution:
    """The search's answer: a strategy per node (every node of the graph, blocks included)."""

    strategies: Mapping[str, Strategy]
    #: node name -> the representative node it was solved as.
    representative: Mapping[str, str]
    objective_s: float
    solve_s: float
    build_s: float
    num_variables: int
    num_constraints: int
    #: Float ops that had no rule and ran replicated.
    unruled: tuple[str, ...] = ()
    sizes: Mapping[str, int] = field(default_factory=dict)
    #: Per GEMM of the program, whether the roofline priced it compute-bound at ``sizes``
    #: (else bandwidth-bound). Every term of the objective is affine in each size within one
    #: roofline regime, which is what lets a solution serve the sizes between two solves that
    #: agree (autopar/planner/layer_costs.py, ``ModelCosts.prepare_layouts``).
    roofline: Mapping[str, bool] = field(default_factory=dict)
    #: The ILP's objective coefficients (microseconds) and the solved point, by variable name
    #: (nonzero values only). The constraints do not depend on the sizes, so a point solved at
    #: one size can be priced at another: ``Σ coefficients[k] * point[k]``.
    coefficients: Mapping[str, float] = field(default_factory=dict)
    point: Mapping[str, float] = field(default_factory=dict)

    def objective_at(self, other: "ShardingSolution") -> float:
        """The objective (microseconds) of ``other``'s solved point in this solution's program."""
        return sum(self.coefficients.get(k, 0.0) * v for k, v in other.point.items())

    def gemm_sharding(self, graph: torch.fx.Graph) -> dict[str, GemmSharding]:
        out = {}
        for node in graph.nodes:
            s = self.strategies.get(node.name)
            if s is not None and s.gemm is not None:
                out[node.name] = s.gemm
        return out


def representatives(gm: torch.fx.GraphModule, layers: list[Any]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Map every node of a repeated block (and the parameters it owns) onto the node at the
    same position of the first block with the same signature; other nodes map to themselves."""
    by_layer: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            by_layer[info(n).layer].append(n)
    rep = {n: n for n in gm.graph.nodes}
    first: dict[str, str] = {}
    for layer in layers:
        if not layer.is_block:
            continue
        r = first.setdefault(layer.signature, layer.name)
        if r == layer.name:
            continue
        nodes, rnodes = by_layer.get(layer.name, []), by_layer.get(r, [])
        if len(nodes) != len(rnodes) or any(a.target != b.target for a, b in zip(nodes, rnodes)):
            continue
        params: dict[torch.fx.Node, torch.fx.Node] = {}
        consistent = True
        for a, b in zip(nodes, rnodes):
            if len(a.all_input_nodes) != len(b.all_input_nodes):
                consistent = False
                break
            for x, y in zip(a.all_input_nodes, b.all_input_nodes):
                if x.op == "placeholder" and info(x).kind is NodeKind.PARAMETER and \
                        info(x).layer == layer.name:
                    if params.setdefault(x, y) is not y or info(x).value != info(y).value:
                        consistent = False
        if not consistent:
            continue
        for a, b in zip(nodes, rnodes):
            rep[a] = b
        rep.update(params)
    return rep


def _ev(expr: Any, sizes: Mapping[str, int]) -> float:
    """A sympy size expression at concrete sizes (b, s)."""
    if not isinstance(expr, sympy.Basic):
        return float(expr or 0)
    if expr.is_Number:
        return float(expr)
    missing = sorted(sym.name for sym in expr.free_symbols if sym.name not in sizes)
    if missing:
        raise KeyError(f"no size given for {missing} in {expr}")
    return float(expr.xreplace({sym: sympy.Integer(sizes[sym.name]) for sym in expr.free_symbols}))


def _is_sequence_activation(node: torch.fx.Node) -> bool:
    spec = info(node).spec
    return (spec is not None and spec.is_float and info(node).requires_grad
            and any(d == BATCH for d in spec.shape) and any(d == SEQ for d in spec.shape))


def _strategies_for(node: torch.fx.Node, rctx: RuleContext) -> list[Strategy]:
    if node.op == "placeholder":
        return placeholder_strategies(node, rctx)
    out = node_strategies(node, rctx)
    # an element of a tuple-valued op is placed by its producer: an op without a rule yields
    # replicated elements only (broadcast_tensors before F.mse_loss), so they keep Replicate
    if rctx.sequence_parallel and node.op == "call_function" and _is_sequence_activation(node) \
            and not _element_of_unruled(node, rctx):
        kept = [s for s in out if not isinstance(s.output, Replicate)]
        out = kept or out
    return out


def _element_of_unruled(node: torch.fx.Node, rctx: RuleContext) -> bool:
    """A getitem of a tuple-valued op that has only its replicated strategy."""
    if op_name(node) != "getitem" or not isinstance(node.args[0], torch.fx.Node):
        return False
    src = node.args[0]
    if src.op != "call_function" or not isinstance(info(src).value, tuple):
        return False
    fresh = RuleContext(tp=rctx.tp, sequence_parallel=rctx.sequence_parallel)  # no reports
    return all(isinstance(s.output, tuple) and all(p is None or isinstance(p, Replicate)
                                                   for p in s.output)
               for s in node_strategies(src, fresh))


def _ilp_nodes(gm: torch.fx.GraphModule, rep: Mapping[torch.fx.Node, torch.fx.Node]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if rep[n] is n and n.op in ("placeholder", "call_function")
            and is_tensor_node(n)]


def _generate(nodes: list[torch.fx.Node], rep: Mapping, rctx: RuleContext,
              pins: Mapping[torch.fx.Node, GemmSharding]) -> dict[torch.fx.Node, list[Strategy]]:
    """Strategies of every ILP node; StridedShard demands flow from consumers to producers
    (the split of fused QKV asks its producer for blocks), so iterate to a fixed point."""
    strategies: dict[torch.fx.Node, list[Strategy]] = {}
    pending = list(reversed(nodes))
    for _ in range(len(nodes) + 1):
        if not pending:
            break
        changed: set[torch.fx.Node] = set()
        for v in pending:
            before = {rep[u]: set(rctx.demanded.get(rep[u], ())) for u in v.all_input_nodes}
            strategies[v] = _strategies_for(v, rctx)
            for s in strategies[v]:
                for u, req in zip(v.all_input_nodes, s.inputs):
                    if isinstance(req, StridedShard):
                        rctx.demanded.setdefault(rep[u], set()).add(req)
            for u in v.all_input_nodes:
                if rctx.demanded.get(rep[u], set()) != before.get(rep[u], set()) and rep[u] in strategies:
                    changed.add(rep[u])
        pending = [v for v in reversed(nodes) if v in changed]
    for v, pin in pins.items():
        kept = [s for s in strategies[v] if s.gemm is pin]
        if not kept:
            raise InfeasiblePlanError(f"GEMM {v.name!r} cannot be {pin.value}-parallel here",
                                      expected=f"one of {sorted({s.gemm.value for s in strategies[v] if s.gemm})}",
                                      fix="drop or change the pin")
        strategies[v] = kept
    return strategies


def search_placements(gm: torch.fx.GraphModule, layers: list[Any], tp: int, *,
                      sequence_parallel: bool = False, cost: TPCostSpec | None = None,
                      sizes: Mapping[str, int], pins: Mapping[str, GemmSharding] | None = None,
                      depth: int | None = None, time_limit_s: float = 120.0,
                      warn_unruled: bool = True) -> ShardingSolution:
    """Solve the ILP of the module docstring for ``gm`` (with biases split off).

    ``depth``: the number of repeated blocks of the real model when ``gm`` is a shallower
    capture of it (the planner captures two): the last captured block stands for the rest, so
    the blocks weigh against the embedding and the head as they do in the real model."""
    cost = cost or TPCostSpec()
    start = time.perf_counter()
    rep = representatives(gm, layers)
    extra = _extra_block_copies(layers, depth)
    nodes = _ilp_nodes(gm, rep)
    rctx = RuleContext(tp=tp, sequence_parallel=sequence_parallel)
    by_name = {n.name: n for n in gm.graph.nodes}
    pinned: dict[torch.fx.Node, GemmSharding] = {}
    for name, kind in (pins or {}).items():
        if name not in by_name:
            raise InfeasiblePlanError(f"pinned GEMM {name!r} is not a node of the graph",
                                      fix="pin GEMMs by their node names (see the plan report)")
        r = rep[by_name[name]]
        if pinned.setdefault(r, GemmSharding(kind)) is not GemmSharding(kind):
            raise InfeasiblePlanError(f"conflicting pins for repeated GEMM {r.name!r}",
                                      expected="the same sharding in every repeated block",
                                      found=f"{pinned[r].value} and {GemmSharding(kind).value}")
    strategies = _generate(nodes, rep, rctx, pinned)
    if tp > 1 and rctx.unruled and warn_unruled:
        names = ", ".join(f"{op} ({len(ns)}x, e.g. {ns[0]})" for op, ns in sorted(rctx.unruled.items()))
        warnings.warn(UnsupportedOpWarning(f"no sharding rule for {names}: these ops run "
                                           f"replicated on every tensor-parallel rank"),
                      stacklevel=3)
    prob, x, stats, roofline = _build_ilp(gm, nodes, rep, strategies, tp, cost, sizes, extra)
    build_s = time.perf_counter() - start
    answer = solver.solve(prob, time_limit_s=time_limit_s)
    solve_s = answer.seconds
    if answer.status != "optimal":
        raise InfeasiblePlanError(f"the sharding ILP ended {answer.status} ({answer.backend})",
                                  expected="an optimal placement",
                                  fix="raise the memory limit, drop pins, or change tp"
                                  if cost.memory_limit or pins else "report this graph as a bug")
    chosen: dict[str, Strategy] = {}
    for v in nodes:
        values = [pulp.value(var) or 0.0 for var in x[v]]
        chosen[v.name] = strategies[v][max(range(len(values)), key=lambda i: (values[i], -i))]
    full: dict[str, Strategy] = {}
    for n in gm.graph.nodes:
        r = rep[n]
        if r.name in chosen:
            full[n.name] = chosen[r.name]
    point = {var.name: var.varValue for var in prob.variables() if var.varValue}
    coefficients = {var.name: coef for var, coef in prob.objective.items()}
    return ShardingSolution(
        strategies=full, representative={n.name: rep[n].name for n in gm.graph.nodes},
        objective_s=float(pulp.value(prob.objective) or 0.0) * 1e-6, solve_s=solve_s,
        build_s=build_s, num_variables=stats[0], num_constraints=stats[1],
        unruled=tuple(sorted(rctx.unruled)), sizes=dict(sizes), roofline=roofline,
        coefficients=coefficients, point=point)


def _extra_block_copies(layers: list[Any], depth: int | None) -> tuple[str, int]:
    """(the last block's layer name, how many more copies of it the real model has)."""
    blocks = [layer for layer in layers if layer.is_block]
    if depth is None or not blocks:
        return ("", 0)
    if depth < len(blocks):
        raise InfeasiblePlanError(f"depth={depth} is below the {len(blocks)} blocks captured",
                                  expected=f"depth >= {len(blocks)}", found=str(depth),
                                  fix="pass the real model's number of blocks")
    return (blocks[-1].name, depth - len(blocks))


def _steps_time(steps, nbytes: float, tp: int, cost: TPCostSpec) -> float:
    return sum(collective_time(s.forward, nbytes, tp, cost) + collective_time(s.backward, nbytes, tp, cost)
               for s in steps)


def _build_ilp(gm, nodes, rep, strategies, tp, cost: TPCostSpec, sizes, extra=("", 0)):
    prob = pulp.LpProblem("tensor_parallel_sharding", pulp.LpMinimize)
    index = {v: i for i, v in enumerate(nodes)}
    count: dict[torch.fx.Node, int] = defaultdict(int)
    last_block, copies = extra
    for n in gm.graph.nodes:
        if rep[n] in index:
            count[rep[n]] += 1 + (copies if copies and info(n).layer == last_block else 0)
    us = 1e6  # the objective in microseconds keeps CBC's tolerances meaningful
    x: dict[torch.fx.Node, list[Any]] = {}
    objective: list[Any] = []
    memory: list[Any] = []
    roofline: dict[str, bool] = {}
    n_constraints = 0
    for v in nodes:
        i = index[v]
        x[v] = [prob.add_variable(f"x_{i}_{j}", cat=pulp.LpBinary) for j in range(len(strategies[v]))]
        prob += pulp.lpSum(x[v]) == 1, f"one_{i}"
        n_constraints += 1
        meta = info(v)
        if v.op == "placeholder":
            base = 0.0
            param_bytes = _ev(meta.spec.nbytes, sizes) * cost.state_bytes_per_param_byte \
                if meta.kind is NodeKind.PARAMETER else 0.0
        else:
            param_bytes = 0.0
            precision = cost.float_scale(meta.spec)
            if meta.is_gemm:
                flops = _ev(meta.flops, sizes)
                moved = (_ev(meta.bytes_read, sizes) + _ev(meta.bytes_written, sizes)) * precision
                roofline[v.name] = flops / cost.peak_flops >= moved / cost.hbm_bandwidth
                base = (1 + cost.backward_factor) * max(flops / cost.peak_flops,
                                                        moved / cost.hbm_bandwidth)
            elif cost.price_memory_bound_ops:  # views move no bytes, so cost nothing
                moved = (_ev(meta.bytes_read, sizes) + _ev(meta.bytes_written, sizes)) * precision
                base = 2 * moved / cost.hbm_bandwidth  # forward + a backward of the same traffic
            else:
                base = 0.0
        saved = _ev(meta.saved_bytes, sizes) * cost.float_scale(meta.spec)
        for j, s in enumerate(strategies[v]):
            t = base * s.compute_scale
            t += sum(collective_time(kind, _ev(elems, sizes) * 4, tp, cost)  # fp32 statistics
                     for kind, elems in s.internal)
            act = saved * s.compute_scale
            state = param_bytes * (1.0 / tp if is_sharded(s.output) else 1.0)
            mem = act + state
            coeff = count[v] * (t + cost.activation_memory_weight * act
                                + cost.param_weight * state) * us
            if coeff:
                objective.append(coeff * x[v][j])
            if cost.memory_limit is not None and mem:
                memory.append(count[v] * mem * x[v][j])

    # consumers' demands on each producer
    demand_users: dict[tuple[torch.fx.Node, Any], dict[torch.fx.Node, list[int]]] = defaultdict(
        lambda: defaultdict(list))
    item_links: set[tuple[torch.fx.Node, torch.fx.Node, int]] = set()
    edges: set[tuple[torch.fx.Node, torch.fx.Node, int]] = set()
    fixed: set[tuple[torch.fx.Node, Any]] = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            for u in n.all_input_nodes:
                if rep[u] in index:
                    fixed.add((rep[u], (REPLICATE, False)))
            continue
        if n.op != "call_function" or rep[n] not in index:
            continue
        for k, u in enumerate(n.all_input_nodes):
            if rep[u] in index:
                edges.add((rep[u], rep[n], k))
    for u, v, k in sorted(edges, key=lambda e: (index[e[0]], index[e[1]], e[2])):
        for j, t in enumerate(strategies[v]):
            req = t.inputs[k] if k < len(t.inputs) else None
            if req is None:
                continue
            if isinstance(req, Item):
                item_links.add((u, v, j, k))
                continue
            partial = gradient_is_partial(req, t.output) and info(u).requires_grad
            demand_users[(u, (req, partial))][v].append(j)
            if partial:
                demand_users[(u, (REPLICATE, False))]  # the plain demand exists too
    for key in fixed:
        demand_users[key]

    d: dict[tuple[torch.fx.Node, Any], Any] = {}
    keys = sorted(demand_users, key=lambda k: (index[k[0]], str(k[1][0]), k[1][1]))
    for q_i, (u, (req, partial)) in enumerate(keys):
        var = prob.add_variable(f"d_{index[u]}_{q_i}", cat=pulp.LpBinary)
        d[(u, (req, partial))] = var
        for v, js in sorted(demand_users[(u, (req, partial))].items(), key=lambda kv: index[kv[0]]):
            prob += var >= pulp.lpSum(x[v][j] for j in js), f"need_{q_i}_{index[v]}"
            n_constraints += 1
        if (u, (req, partial)) in fixed:
            prob += var == 1, f"output_{q_i}"
            n_constraints += 1
    for q_i, (u, (req, partial)) in enumerate(keys):
        var = d[(u, (req, partial))]
        if partial:
            prob += var <= d[(u, (REPLICATE, False))], f"plain_{q_i}"
            n_constraints += 1
        spec = info(u).spec
        nbytes = _ev(spec.nbytes, sizes) * cost.float_scale(spec) if spec is not None else 0.0
        paid, free = [], []  # the producer's strategies that pay to meet the demand, and not
        for j, s in enumerate(strategies[u]):
            if isinstance(s.output, tuple):
                prob += x[u][j] + var <= 1, f"tuple_{q_i}_{j}"
                n_constraints += 1
                continue
            steps = redistribution(s.output, req, partial)
            if steps is None:
                prob += x[u][j] + var <= 1, f"never_{q_i}_{j}"
                n_constraints += 1
                continue
            c = _steps_time(steps, nbytes, tp, cost)
            if partial:
                c -= _steps_time(redistribution(s.output, req, False), nbytes, tp, cost)
            if c > 1e-15:
                m = prob.add_variable(f"m_{q_i}_{j}", lowBound=0, upBound=1)
                prob += m <= x[u][j], f"and_{q_i}_{j}"
                n_constraints += 1
                objective.append(count[u] * c * us * m)
                paid.append(m)
            else:
                free.append(x[u][j])
        if paid:  # the demand is met through the strategy the producer chose
            prob += pulp.lpSum(paid) + pulp.lpSum(free) >= var, f"pay_{q_i}"
            n_constraints += 1
    for u, v, j, k in sorted(item_links, key=lambda e: (index[e[0]], index[e[1]], e[2], e[3])):
        item = strategies[v][j].inputs[k]
        ok = [x[u][i] for i, s in enumerate(strategies[u])
              if isinstance(s.output, tuple) and s.output[item.index] == item.placement]
        prob += x[v][j] <= pulp.lpSum(ok), f"item_{index[u]}_{index[v]}_{j}"
        n_constraints += 1
    if cost.memory_limit is not None:
        prob += pulp.lpSum(memory) <= cost.memory_limit, "memory"
        n_constraints += 1
    prob += pulp.lpSum(objective)
    return prob, x, (len(prob.variables()), n_constraints), roofline


@graph_pass(requires=("analyzed", "gemm_bias_split"), ensures=("placements",))
def shard_graph(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Choose every node's strategy (ctx.options: tp, sequence_parallel, cost, sizes, pins,
    depth) and record it in NodeInfo.strategy / NodeInfo.placement; the solution is the pass's
    result (``ctx.results["shard_graph"]``)."""
    opts = ctx.options
    solution = search_placements(
        gm, ctx.captured.layers, opts["tp"], sequence_parallel=opts.get("sequence_parallel", False),
        cost=opts.get("cost"), sizes=opts["sizes"], pins=opts.get("pins"), depth=opts.get("depth"),
        warn_unruled=opts.get("warn_unruled", True))
    for n in gm.graph.nodes:
        meta = info(n)
        s = solution.strategies.get(n.name)
        meta.strategy = s
        meta.placement = s.output if s is not None else None
    return PassResult(gm, False, solution)
