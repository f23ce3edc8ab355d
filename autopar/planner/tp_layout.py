"""Tensor-parallel layouts for the cost model: the sharding search's answer, per (tp, SP,
micro-batch).

For each tensor-parallel degree ``tp`` and sequence-parallel setting the planner prices, the
captured graph goes through :func:`autopar.tensor_parallel.tensor_parallelize`: the sharding ILP
of ``passes/shard.py`` (repeated blocks are solved once, so a 2-block capture of GPT-3 175B takes
~0.2 s) and the collective insertion of ``passes/tp_transform.py``. The cost model reads the
program back as a :class:`TPLayout`:

- ``compute_scale``: each captured node's share of the work on one rank (1/tp when its
  strategy splits it: column and row GEMMs, attention by heads, sequence-parallel norms);
- ``gemm_sharding``: column / row / replicate per GEMM, by captured node name. This is the
  plan's ``gemm_sharding``, and ``autopar.parallelize`` pins its tensor-parallel pass to it, so
  the program it builds has the layout that was priced;
- ``placements``: the placement of every node's final value (a GEMM whose bias the search split
  off is read after its bias add), and ``input_placements``: the placement each node requires of
  each input. A saved activation costs ``1/tp`` of its bytes per rank when the op that saves it
  reads it sharded (what autograd keeps on each rank: a column-parallel GEMM under sequence
  parallelism saves its all-gathered, full input); a pipeline boundary tensor or a parameter when
  its placement is sharded;
- ``comm``: per layer, the collectives of :attr:`autopar.tensor_parallel.TPProgram.layer_comm`
  (kind, direction, bytes of the full tensor as a sympy expression in ``b`` and ``s``), which
  the cost model prices with its collective model on the tensor-parallel group.

A layout depends on the sizes and the hardware numbers the ILP prices with; the planner solves it
at each candidate's micro-batch and the training sequence length, with :func:`tp_cost_spec` of
the cluster (a collective's latency is fixed while a GEMM's time grows with the tokens, so the
best layout of one sequence need not be the best of sixteen), and ``parallelize`` solves it at
the plan's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from autopar.ir import META_KEY, info
from autopar.plan_types import GemmSharding
from autopar.sharding import Collective, is_sharded

__all__ = ["CommCall", "TPLayout", "solve_layout", "tp_cost_spec"]


@dataclass(frozen=True, slots=True)
class CommCall:
    """One collective of one layer, per micro-batch (from ``TPProgram.layer_comm``)."""

    layer: str
    collective: Collective
    #: "forward" or "backward"
    direction: str
    #: Bytes of the full (unsharded) tensor at the graph's dtype, sympy in b and s.
    message_bytes: Any
    #: A tensor of the graph's floating dtype (re-priced at the training precision); False for
    #: integer tensors and for the fp32 statistics inside vocab-parallel cross-entropy.
    float_tensor: bool


@dataclass(frozen=True)
class TPLayout:
    """The sharding search's layout of one captured graph for one (tp, SP); see the module
    docstring."""

    tp: int
    sequence_parallel: bool
    gemm_sharding: Mapping[str, GemmSharding]
    compute_scale: Mapping[str, float]
    placements: Mapping[str, Any]
    #: Per node, the placement its strategy requires of each input (all_input_nodes order).
    input_placements: Mapping[str, tuple[Any, ...]]
    #: Parameter FQNs sharded over the tp group.
    sharded_params: frozenset[str]
    #: Layer name -> its collectives per micro-batch.
    comm: Mapping[str, tuple[CommCall, ...]]
    #: Sizes the ILP was solved at.
    sizes: Mapping[str, int] = field(default_factory=dict)
    solve_s: float = 0.0
    num_variables: int = 0
    #: Float ops without a sharding rule (they run replicated).
    unruled: tuple[str, ...] = ()
    #: Per GEMM, compute-bound (True) or bandwidth-bound in the ILP's roofline at ``sizes``.
    roofline: Mapping[str, bool] = field(default_factory=dict)
    #: The sharding search's answer (its objective and point; None for a hand-made layout).
    solution: Any = field(default=None, compare=False, repr=False)
    #: The solved size this layout was taken from, when it was not solved at ``sizes``
    #: (``ModelCosts.prepare_layouts``); None when solved here.
    solved_at: Mapping[str, int] | None = None

    def optimal_at(self, other: "TPLayout") -> bool:
        """Whether this layout's solved point is also optimal in ``other``'s program: priced with
        ``other``'s objective it costs no more than ``other``'s optimum (the constraints are the
        same at every size), and every GEMM is in the same roofline regime at both sizes (so
        each objective term keeps one affine form in the sizes between them)."""
        mine, theirs = self.solution, other.solution
        if mine is None or theirs is None or self.roofline != other.roofline:
            return False
        best = theirs.objective_at(theirs)
        return mine is theirs or theirs.objective_at(mine) <= best * (1 + 1e-9) + 1e-9

    def sharded(self, node: str) -> bool:
        """Whether the per-rank copy of ``node``'s value is 1/tp of it."""
        return _sharded(self.placements.get(node))

    def read_sharded(self, node: str, index: int) -> bool | None:
        """Whether ``node`` reads its input ``index`` sharded (None: not known)."""
        required = self.input_placements.get(node)
        if required is None or index >= len(required) or required[index] is None:
            return None
        return _sharded(required[index])


def _sharded(p: Any) -> bool:
    if isinstance(p, tuple):
        return any(is_sharded(q) for q in p)
    return is_sharded(p)


#: Bytes of an activation element at the training precision (bf16 / fp16 mixed precision).
_FLOAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def tp_cost_spec(cluster: Any, dtype: str) -> Any:
    """The numbers the sharding ILP prices with, from the cluster: achieved GEMM rate, HBM
    bandwidth and the NVLink bus bandwidth and latency of a collective inside a node (the
    cluster's own figures for the collectives it measured, ``Cluster.collectives``); tensors
    at the training precision ``dtype`` (a model captured in fp32 moves bf16 activations)."""
    from autopar.passes.shard import TPCostSpec

    d = cluster.device
    link = cluster.intra_node
    measured = tuple((name.replace("-", "_"), cluster.collective_latency_s + spec.latency_s,
                      spec.bus_bandwidth) for name, spec in sorted(cluster.collectives.items()))
    return TPCostSpec(peak_flops=d.peak(dtype) * d.gemm_efficiency,
                      hbm_bandwidth=d.memory_bandwidth * d.memory_efficiency,
                      link_bandwidth=link.effective_bandwidth,
                      link_latency=cluster.collective_latency_s + link.latency_s,
                      float_bytes=_FLOAT_BYTES.get(dtype), collectives=measured)


def solve_layout(captured: Any, tp: int, sequence_parallel: bool, *, cost: Any,
                 sizes: Mapping[str, int], depth: int | None = None,
                 vocab_multiple: int = 0) -> TPLayout:
    """Run the sharding search on ``captured`` (not modified) and read its layout; ``depth``
    is the real model's number of blocks when ``captured`` is a shallower copy of it. A
    vocabulary tp does not divide is padded as the runtime pads it (``vocab_multiple`` 0: only
    to a multiple of tp; any multiple makes tp divide it, which is all that decides the layout,
    and a vocabulary tp divides is left alone, so the search does not analyze a second graph);
    the layout is read for the captured nodes (the LM head's FLOPs stay the captured
    vocabulary's: at most 128 x tp rows more).

    Raises :class:`autopar.errors.ShardingError` when ``tp`` does not divide the model's heads
    (or, with sequence parallelism, the sequence), or its vocabulary where that cannot be
    padded."""
    from autopar.tensor_parallel import tensor_parallelize

    start = time.perf_counter()
    # ops without a rule are listed in the layout (and the plan document), not warned about;
    # a flag, not warnings.catch_warnings, which is not safe on the planner's threads
    program = tensor_parallelize(captured, tp, sequence_parallel=sequence_parallel, cost=cost,
                                 sizes=dict(sizes), strict=True, depth=depth,
                                 warn_unruled=False, vocab_multiple=vocab_multiple)
    names = {n.name for n in captured.gm.graph.nodes}
    scale: dict[str, float] = {}
    placements: dict[str, Any] = {}
    inputs: dict[str, tuple[Any, ...]] = {}
    sharded_params: set[str] = set()
    for n in program.sharded.graph.nodes:
        if META_KEY not in n.meta:
            continue
        meta = info(n)
        s = meta.strategy
        if n.name in names:
            if s is not None:
                scale[n.name] = float(s.compute_scale)
                inputs[n.name] = tuple(s.inputs)
            placements.setdefault(n.name, meta.placement)
            if n.op == "placeholder" and meta.fqn and is_sharded(meta.placement):
                sharded_params.add(meta.fqn)
        bias_of = meta.extra.get("bias_of") if meta.extra else None
        if bias_of is not None:  # the captured GEMM's value is its bias add's
            placements[bias_of] = meta.placement
    collective_nodes = {n.name: n for n in program.gm.graph.nodes
                        if META_KEY in n.meta and info(n).collective is not None}
    comm: dict[str, tuple[CommCall, ...]] = {}
    for lc in program.layer_comm:
        calls = []
        for c in lc.calls:
            node = collective_nodes.get(c.node)
            spec = info(node).spec if node is not None else None
            calls.append(CommCall(lc.layer, c.collective, c.direction.value, c.message_bytes,
                                  bool(spec is not None and spec.is_float)))
        comm[lc.layer] = tuple(calls)
    solution = program.solution
    return TPLayout(tp=tp, sequence_parallel=sequence_parallel,
                    gemm_sharding=dict(program.gemm_sharding), compute_scale=scale,
                    placements=placements, input_placements=inputs,
                    sharded_params=frozenset(sharded_params), comm=comm,
                    sizes=dict(sizes), solve_s=time.perf_counter() - start,
                    num_variables=solution.num_variables, unruled=tuple(solution.unruled),
                    roofline=dict(solution.roofline), solution=solution)
