"""Per-layer costs: the captured graph's layers as templates of cost terms, priced on a cluster.

:class:`ModelCosts` turns the analysis pass's results (its profile of bytes per node, and its
``gemm_dims`` and ``saved_tensors``, the same derivations the profile uses) into one template
per layer, symbolic in the micro-batch ``b`` and the
sequence ``s``; :func:`price_layer` prices a template under a tensor-parallel layout on a
cluster (:mod:`autopar.planner.kernels` for each term) into :class:`LayerCosts`: forward and
backward time, saved activations, boundary bytes and the layout's collectives.

**Per node** (one micro-batch of ``b`` sequences of ``s``):

- GEMM ``(batch, M, N, K)``: :func:`~autopar.planner.kernels.gemm_time`; backward: the
  input-gradient GEMM ``(batch, M, K, N)`` and, for weights, the weight-gradient GEMM
  ``(1, N, K, batch M)``.
- fused attention: ``t = max(F / (peak * e_attn), bytes / (bw * e_mem), floor)``, backward
  ``2.5 F`` (FlashAttention-2 recomputes the scores: 5 matmuls to the forward's 2); a device's
  measured ``attention_table`` where it has one.
- everything else is memory-bound, backward twice the bytes (gradient in, saved input, gradient
  out), and only for ops on the gradient path.

Bytes are the analysis pass's, re-priced at the training precision.

**Tensor parallel** (``t``): the layout is the sharding search's (:mod:`autopar.planner.tp_layout`:
``tensor_parallelize`` on the captured graph, once per ``(t, SP)``). A node whose strategy splits
it does ``1/t`` of the work (column GEMMs ``N/t``, row GEMMs ``K/t``, batched GEMMs and attention
by heads, everything else ``1/t`` of its bytes); a saved activation, a pipeline boundary tensor
or a parameter costs ``1/t`` of its bytes per rank when its producer's placement is sharded.
Communication per micro-batch is the program's own list (``TPProgram.layer_comm``: each
collective's kind, direction and bytes), priced by :mod:`autopar.planner.comm` on the
tensor-parallel group; Megatron-LM does not overlap it, neither does this model.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch.fx

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.ir import BATCH, SEQ, LayerKind, NodeKind, TensorSpec, info, op_name
from autopar.plan_types import GemmSharding
from autopar.planner.comm import Collective, collective_time, p2p_time
from autopar.planner.kernels import (ATTENTION_BACKWARD_FACTOR, PRECISION_BYTES,
                                     gemm_time, memory_time, table_rate)
from autopar.planner.memory import STATE_BYTES
from autopar.planner.tp_layout import TPLayout, solve_layout

__all__ = ["ModelCosts", "LayerCosts", "price_layer", "seq_degree", "BIAS_OP",
           "GRAD_ACCUMULATION_READS_WRITES"]

#: Gradient-sized reads and writes of accumulating one micro-batch's weight gradients: read the
#: buffer and the new gradient, write the buffer (autograd's ``.grad +=``, or the data-parallel
#: layer's add into its flat bucket, runtime/zero.py), once per micro-batch: what makes many small
#: micro-batches cost more than a few large ones beyond their GEMM rates. Megatron can fuse it into
#: the weight-gradient GEMM (``gradient_accumulation_fusion``); autopar's runtime does not.
GRAD_ACCUMULATION_READS_WRITES = 3

#: The op tag of an experts operation's GEMM terms (their rows scale with the routing imbalance).
EXPERT_OP = "moe_experts"
#: Ops runtime/moe.py runs per local expert (linear, chunk, activation, product, linear) and for
#: the routing around them (sort, count, gather, weigh, accumulate...; with expert parallelism
#: also the count exchange, two all-to-alls and the regrouping): what the host's per-node cost
#: multiplies, counted from the code.
MOE_OPS_PER_EXPERT = 5
MOE_ROUTING_OPS = (25, 43)  # forward ops: without, with expert parallelism
MOE_ROUTING_GRAD_OPS = (8, 14)  # of them, autograd nodes the backward runs


class _Kind(enum.Enum):
    GEMM = "gemm"
    ATTENTION = "attention"
    MEMORY = "memory"


class _Split(enum.Enum):
    NONE = 0
    COLUMN = 1  # N / t
    ROW = 2  # K / t
    BATCH = 3  # batch (heads) / t


@dataclass(slots=True)
class _Term:
    kind: _Kind
    name: str
    backward: bool
    weight_grad: bool  # a GEMM whose second operand is a trainable weight
    input_grads: int  # activation inputs that need a gradient (GEMM backward count)
    core: bool
    #: first of this term's values (GEMM: batch, m, n, k; attention: flops, bytes, s, d, K/V
    #: elements;
    #: memory: flops, bytes, elements of its largest float tensor)
    index: int
    #: the op's name in a device's op_table: memory terms; GEMMs with a bias vector have
    #: ``BIAS_OP`` (a CPU GEMM first copies the broadcast bias into its output)
    op: str = ""


@dataclass(slots=True)
class _Tensor:
    """A tensor the layer holds or sends: its per-rank share follows the placement its reader
    requires of it (``reader``: node and input index) or else ``owner``'s placement."""

    owner: str
    is_float: bool  # value = float elements (priced at the training precision), else bytes
    core: bool  # an attention-core tensor (dropped by selective recompute)
    index: int
    reader: tuple[str, int] | None = None


@dataclass(slots=True)
class _Template:
    signature: str
    kind: LayerKind
    representative: int
    layer_name: str
    terms: list[_Term]
    exprs: list[sympy.Expr]
    saved: list[_Tensor]  # saved activations
    checkpoint: list[_Tensor]  # the block's input (what full recomputation keeps)
    boundary: list[_Tensor]  # what a pipeline cut after the layer sends
    gemm_flops: int
    core_flops: int
    params: dict[str, int]  # fqn -> numel (a tied table is read by two layers)
    #: Graph nodes the layer's program calls in forward (every op, views included), and the
    #: autograd nodes its backward runs (ops whose output needs a gradient, and one gradient
    #: accumulation per parameter): what the host's per-node cost multiplies.
    nodes: int = 0
    grad_nodes: int = 0
    #: True when several layers use this template (repeated blocks).
    shared: bool = False
    #: Per experts operation: the index of its rows x hidden (elements each all-to-all of
    #: expert parallelism moves per rank) and the parameters holding its experts.
    moe_rows: list[int] = field(default_factory=list)
    moe_experts: list[int] = field(default_factory=list)
    expert_params: frozenset[str] = frozenset()
    fn: Any = None
    cache: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)

    def values(self, b: int, s: int) -> tuple[float, ...]:
        key = (b, s)
        out = self.cache.get(key)
        if out is None:
            if self.fn is None:
                self.fn = sympy.lambdify((BATCH, SEQ), self.exprs, modules="math")
            out = tuple(float(v) for v in self.fn(b, s))
            self.cache[key] = out
        return out


@dataclass(slots=True)
class _LayerSplit:
    """A template under one tensor-parallel layout (see :func:`_layer_split`)."""

    gemm: list[_Split]  # per term
    divisor: list[int]  # per term: 1 or tp (non-GEMM work)
    saved: list[int]  # per saved tensor: 1 or tp
    checkpoint: list[int]
    boundary: list[int]
    #: (collective, forward?, re-priced at the training precision?) per call
    comm: list[tuple[Collective, bool, bool]]
    comm_fn: Any  # (b, s) -> bytes of each call at the graph's dtype
    sharded_params: frozenset[str]
    cache: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)
    #: per saved tensor: kept as this rank's sequence shard and gathered again in the backward
    #: (a column-parallel GEMM's input under sequence parallelism: runtime/tp.py saved_gathers)
    regather: list[bool] = field(default_factory=list)

    def comm_bytes(self, b: int, s: int) -> tuple[float, ...]:
        out = self.cache.get((b, s))
        if out is None:
            out = tuple(float(v) for v in self.comm_fn(b, s)) if self.comm else ()
            self.cache[(b, s)] = out
        return out


_COMM_KIND = {"all_reduce": Collective.ALL_REDUCE, "all_gather": Collective.ALL_GATHER,
              "reduce_scatter": Collective.REDUCE_SCATTER, "all_to_all": Collective.ALL_TO_ALL}


def _layer_split(template: _Template, layout: TPLayout | None, tp: int) -> _LayerSplit:
    """Which of the template's work, tensors and parameters ``layout`` splits over tp ranks,
    and the layer's collectives."""
    if layout is None or tp == 1:
        n = len(template.terms)
        return _LayerSplit([_Split.NONE] * n, [1] * n, [1] * len(template.saved),
                           [1] * len(template.checkpoint), [1] * len(template.boundary), [],
                           None, frozenset())
    gemm, divisor = [], []
    for term in template.terms:
        scale = layout.compute_scale.get(term.name, 1.0)
        div = max(1, round(1.0 / scale))
        divisor.append(div)
        g = layout.gemm_sharding.get(term.name)
        if term.kind is not _Kind.GEMM:
            gemm.append(_Split.NONE)
        elif g is GemmSharding.COLUMN:
            gemm.append(_Split.COLUMN)
        elif g is GemmSharding.ROW:
            gemm.append(_Split.ROW)
        else:
            gemm.append(_Split.BATCH if div > 1 else _Split.NONE)

    def regathered(t: _Tensor) -> bool:
        """A sequence-sharded tensor a column-parallel GEMM reads gathered: autopar's runtime
        keeps the shard for the GEMM's weight gradient and gathers it again in the backward."""
        return (layout.sequence_parallel and t.reader is not None
                and layout.read_sharded(*t.reader) is False and layout.sharded(t.owner)
                and layout.gemm_sharding.get(t.reader[0]) is GemmSharding.COLUMN)

    def shares(tensors: list[_Tensor]) -> list[int]:
        out = []
        for t in tensors:
            read = layout.read_sharded(*t.reader) if t.reader else None
            if regathered(t):
                read = True
            out.append(tp if (layout.sharded(t.owner) if read is None else read) else 1)
        return out

    calls = layout.comm.get(template.layer_name, ())
    comm = [(_COMM_KIND[c.collective.value], c.direction == "forward", c.float_tensor)
            for c in calls]
    fn = sympy.lambdify((BATCH, SEQ), [sympy.sympify(c.message_bytes) for c in calls],
                        modules="math") if calls else None
    return _LayerSplit(gemm, divisor, shares(template.saved), shares(template.checkpoint),
                       shares(template.boundary), comm, fn, layout.sharded_params,
                       regather=[regathered(t) for t in template.saved])


def _spec(a: Any) -> TensorSpec | None:
    return info(a).spec if isinstance(a, torch.fx.Node) else None


def _prod(dims: Iterable[Any]) -> sympy.Expr:
    out = sympy.Integer(1)
    for d in dims:
        out = out * d
    return out


#: A device's ``op_table`` entry for a GEMM's bias vector: the broadcast copy of the bias into
#: the GEMM's output that a CPU GEMM makes before accumulating into it (``addmm``'s
#: ``out.copy_(bias.expand(m, n))``), and the bias gradient (a sum over rows), per output
#: element. GPU GEMMs add the bias in their epilogue: GPU tables have no such entry.
BIAS_OP = "linear.bias"


def _has_bias_vector(node: torch.fx.Node, op: str) -> bool:
    if op == "linear":
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    elif op == "addmm":
        bias = node.args[0]
    else:
        return False
    spec = _spec(bias)
    return spec is not None and spec.ndim == 1


def _table_key(node: torch.fx.Node, op: str) -> str:
    """The op's name in a device's ``op_table``: the graph's, with GELU's approximation."""
    if op == "gelu" and node.kwargs.get("approximate", "none") == "tanh":
        return "gelu(tanh)"
    return op


def _size_hint(expr: Any) -> float:
    """A symbolic element count at b = 1, s = 1024 (to pick a node's largest tensor)."""
    try:
        return float(sympy.sympify(expr).subs({BATCH: 1, SEQ: 1024}))
    except (TypeError, ValueError):
        return 0.0


def _is_weight(a: Any) -> bool:
    from autopar.passes.analyze import view_root

    return isinstance(a, torch.fx.Node) and info(view_root(a)).kind is NodeKind.PARAMETER \
        and info(a).requires_grad


_UNKNOWN = object()


class ModelCosts:
    """A captured model's costs as per-layer templates (repeated blocks share one), and its
    tensor-parallel layouts (solved on demand, cached).

    Independent of the cluster and the plan: :class:`CostModel` prices the templates.
    """

    def __init__(self, captured: Any, profile: Any = None, *, name: str | None = None,
                 depth: int | None = None) -> None:
        """``depth``: the number of repeated blocks the real model has, when ``captured`` is
        a shallower copy of it (same shapes, fewer blocks: capture time grows with depth).
        Blocks are identical computations, so the last captured block stands for the rest."""
        from autopar.passes.analyze import analyze

        self.captured = captured
        self.profile = profile if profile is not None else analyze(captured)
        #: Why the sequence cannot be split over cp ranks (None: it can), found on first use.
        self._cp_problem: object = _UNKNOWN
        self.name = name
        self.graph_float_bytes = self.profile.layers[0].graph_float_bytes
        layers = captured.layers
        self._param_numel = {}
        for p in captured.params.values():
            for fqn in (p.fqn, *p.aliases):
                self._param_numel[fqn] = int(p.spec.numel)
        self._canonical = {a: p.fqn for p in captured.params.values() for a in (p.fqn, *p.aliases)}
        self._layouts: dict[tuple, TPLayout | str] = {}
        self._splits: dict[tuple[int, int], _LayerSplit] = {}
        saved = self._saved_entries()
        # one template per signature, built from its last layer (the first block may carry
        # tables made before the blocks; later ones are the repeated steady state)
        last_of: dict[str, int] = {}
        for layer in layers:
            last_of[layer.signature] = layer.index
        built: dict[str, _Template] = {}
        self.templates: list[_Template] = []
        for layer in layers:
            key = f"{layer.kind.value}:{layer.signature}"
            if key not in built:
                built[key] = self._template(layers[last_of[layer.signature]], saved)
            self.templates.append(built[key])
        self.layer_names = [layer.name for layer in layers]
        self.kinds = [layer.kind for layer in layers]
        blocks = [layer.index for layer in layers if layer.kind is LayerKind.BLOCK]
        self.extended = bool(depth and blocks and depth > len(blocks))
        if depth is not None and depth < len(blocks):
            raise ValueError(f"depth={depth} is below the {len(blocks)} blocks captured")
        if self.extended:
            last = blocks[-1]
            extra = depth - len(blocks)
            self.templates[last + 1:last + 1] = [self.templates[last]] * extra
            prefix, _, tail = layers[last].name.rpartition(".")
            start = int(tail) + 1 if tail.isdigit() else len(blocks)
            names = [f"{prefix}.{start + i}" if prefix else f"block{start + i}"
                     for i in range(extra)]
            self.layer_names[last + 1:last + 1] = names
            self.kinds[last + 1:last + 1] = [LayerKind.BLOCK] * extra
        uses: dict[int, int] = {}
        for t in self.templates:
            uses[id(t)] = uses.get(id(t), 0) + 1
        for t in self.templates:
            t.shared = uses[id(t)] > 1
        self.num_layers = len(self.templates)
        #: Experts per mixture-of-experts block, their greatest common divisor over the blocks
        #: (what ep must divide; 0: no experts).
        self.num_experts = 0
        for node in captured.gm.graph.nodes:
            if node.op == "call_function" and op_name(node) == "moe_experts":
                self.num_experts = math.gcd(self.num_experts,
                                            int(info(node.args[3]).spec.shape[0]))

    # -- construction -------------------------------------------------------------------------
    def _saved_entries(self) -> dict[str, list[tuple[TensorSpec, str, tuple[str, int] | None]]]:
        """Per layer name: (saved tensor, node it belongs to, (the op that saves it, input index)
        when it saves an input), charged exactly as the analysis pass charges them (a tensor
        saved by several ops once; tables made before the blocks and read by all of them to
        their maker)."""
        from autopar.passes.analyze import identity_root, saved_tensors

        captured = self.captured
        index = {layer.name: layer.index for layer in captured.layers}
        kind = {layer.name: layer.kind for layer in captured.layers}
        nodes = {n.name: n for n in captured.gm.graph.nodes}
        charged: set[Any] = set()
        out: dict[str, list[tuple[TensorSpec, str, tuple[str, int] | None]]] = {
            layer.name: [] for layer in captured.layers}
        for node in captured.gm.graph.nodes:
            if node.op != "call_function":
                continue
            roots = [identity_root(a).name for a in node.all_input_nodes]
            for key, spec in saved_tensors(node, op_name(node)):
                if key in charged:
                    continue
                charged.add(key)
                target = node
                owner = key if isinstance(key, str) else key[0]
                producer = nodes.get(key) if isinstance(key, str) else None
                if producer is not None:
                    p_layer = info(producer).layer
                    if (kind.get(p_layer) is LayerKind.PRE
                            and index.get(info(node).layer, 0) > index.get(p_layer, 0) + 1):
                        target = producer
                layer = info(target).layer
                reader = (node.name, roots.index(key)) if isinstance(key, str) \
                    and key != node.name and key in roots else None
                if layer in out:
                    out[layer].append((spec, owner, reader))
        return out

    def _template(self, layer: Any,
                  saved: Mapping[str, list[tuple[TensorSpec, str, tuple[str, int] | None]]]
                  ) -> _Template:
        from autopar.passes.analyze import GEMM_OPS, VIEW_OPS, gemm_dims

        captured = self.captured
        exprs: list[sympy.Expr] = []

        def add(expr: Any) -> int:
            exprs.append(sympy.sympify(expr))
            return len(exprs) - 1

        terms: list[_Term] = []
        gemm_flops = sympy.Integer(0)
        core_flops = sympy.Integer(0)
        core_nodes = self._core_nodes(layer)
        calls = grad_calls = 0
        moe_rows: list[int] = []
        moe_experts: list[int] = []
        moe_params: set[str] = set()
        for name in layer.nodes:
            node = captured.node(name)
            if node.op != "call_function":
                continue
            meta = info(node)
            op = op_name(node)
            if op != "getitem":  # indexing a tuple output is not an op call
                calls += 1
                grad_calls += bool(meta.requires_grad)
            moved = meta.bytes_read + meta.bytes_written
            if op in GEMM_OPS:
                gemm_flops = gemm_flops + meta.flops
                if name in core_nodes:
                    core_flops = core_flops + meta.flops
            if op in VIEW_OPS or (moved == 0 and meta.flops == 0):
                continue
            core = name in core_nodes
            grads = sum(1 for a in node.all_input_nodes
                        if info(a).requires_grad and not _is_weight(a)
                        and info(a).kind not in (NodeKind.PARAMETER,))
            if op == "scaled_dot_product_attention":
                terms.append(_Term(_Kind.ATTENTION, name, meta.requires_grad, False, grads, core,
                                   add(meta.flops)))
                add(moved)
                q = info(node.args[0]).spec
                add(q.shape[-2])  # sequence
                add(q.shape[-1])  # head dim
                k, v_ = info(node.args[1]).spec, info(node.args[2]).spec
                add(k.numel + v_.numel)  # keys and values: what context parallelism exchanges
                continue
            if op == "moe_experts":  # two grouped GEMMs per routed token, its dispatch
                x, index = info(node.args[0]).spec, info(node.args[1]).spec
                gate_up, down = info(node.args[3]).spec, info(node.args[4]).spec
                rows = x.shape[0] * index.shape[1]
                hidden, inner = x.shape[1], down.shape[-1]
                gemm_flops = gemm_flops + meta.flops
                for n_, k_ in ((gate_up.shape[1], hidden), (hidden, inner)):
                    idx = add(gate_up.shape[0])  # experts: price_layer runs E / ep GEMMs
                    add(rows)
                    add(n_)
                    add(k_)
                    terms.append(_Term(_Kind.GEMM, name, meta.requires_grad, True, grads, False,
                                       idx, EXPERT_OP))
                # gather the routed rows, the activation, weigh and add back (4 row passes)
                element = x.nbytes / x.numel
                terms.append(_Term(_Kind.MEMORY, name, meta.requires_grad, False, grads, False,
                                   add(rows * gate_up.shape[1]), ""))
                add(element * rows * (4 * hidden + 2 * gate_up.shape[1]))
                add(rows * gate_up.shape[1])
                moe_rows.append(add(rows * hidden))
                moe_experts.append(int(gate_up.shape[0]))
                moe_params.update(info(a).fqn for a in node.args[3:5]
                                  if isinstance(a, torch.fx.Node) and info(a).fqn)
                continue
            dims = gemm_dims(node) if op in GEMM_OPS else None
            if dims is not None:
                weighted = op == "linear" and _is_weight(node.args[1])
                idx = add(dims[0])
                for d in dims[1:]:
                    add(d)
                terms.append(_Term(_Kind.GEMM, name, meta.requires_grad, weighted, grads, core,
                                   idx, BIAS_OP if _has_bias_vector(node, op) else ""))
                continue
            # memory-bound (including GEMM-like ops the model has no shape rule for)
            terms.append(_Term(_Kind.MEMORY, name, meta.requires_grad, False, grads, core,
                               add(meta.flops), _table_key(node, op)))
            add(moved)
            add(max((s.numel for s in (_spec(a) for a in (*node.all_input_nodes, node))
                     if s is not None and s.is_float), key=_size_hint, default=0))

        def tensor(owner: str, spec: TensorSpec, core: bool = False,
                   reader: tuple[str, int] | None = None) -> _Tensor:
            return _Tensor(owner, spec.is_float, core,
                           add(spec.numel if spec.is_float else spec.nbytes), reader)

        # saved activations (the placement their saving op reads them in decides the share)
        saved_tensors = [tensor(owner, spec, seq_degree(spec.numel) >= 2, reader)
                         for spec, owner, reader in saved.get(layer.name, ())]
        # the block's input (all full recomputation keeps)
        checkpoint = []
        inside = set(layer.nodes)
        prev = layer.index - 1
        seen: set[str] = set()
        for name in layer.nodes:
            for a in captured.node(name).all_input_nodes:
                if a.name in inside or a.name in seen or info(a).spec is None:
                    continue
                if info(a).kind in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT):
                    continue
                src = captured.layer(info(a).layer).index if info(a).layer else -1
                if src != prev:
                    continue
                seen.add(a.name)
                checkpoint.append(tensor(a.name, info(a).spec))
        # what a pipeline cut after this layer sends
        lc = self.profile.layers[layer.index]
        boundary = [tensor(name, info(captured.node(name)).spec) for name in lc.boundary_tensors]
        # parameters the layer reads (a tied table is read by two layers)
        params: dict[str, int] = {}
        for name in layer.nodes:
            for fqn in info(captured.node(name)).reads:
                canon = self._canonical.get(fqn)
                if canon is not None:
                    params[canon] = self._param_numel[canon]
        for fqn in layer.params:  # owned but not read directly (rare)
            canon = self._canonical.get(fqn, fqn)
            if canon in self._param_numel and canon not in params:
                params[canon] = self._param_numel[canon]
        return _Template(
            signature=layer.signature, kind=layer.kind, representative=layer.index,
            layer_name=layer.name, terms=terms, exprs=exprs, saved=saved_tensors,
            checkpoint=checkpoint, boundary=boundary, gemm_flops=add(gemm_flops),
            core_flops=add(core_flops), params=params, nodes=calls,
            grad_nodes=grad_calls + len(params), moe_rows=moe_rows, moe_experts=moe_experts,
            expert_params=frozenset(self._canonical.get(f, f) for f in moe_params))

    def _core_nodes(self, layer: Any) -> set[str]:
        """The attention core: fused attention, and the nodes whose output grows as s^2
        (scores, softmax, their dropout), plus the GEMMs that read or make them."""
        captured = self.captured
        out: set[str] = set()
        for name in layer.nodes:
            node = captured.node(name)
            if node.op != "call_function":
                continue
            spec = info(node).spec
            if op_name(node) == "scaled_dot_product_attention":
                out.add(name)
            elif spec is not None and spec.is_float and info(node).requires_grad \
                    and seq_degree(spec.numel) >= 2:
                out.add(name)
        for name in list(out):  # the matmul that turns the probabilities into the output
            for user in captured.node(name).users:
                if op_name(user) in ("matmul", "bmm") and user.name in set(layer.nodes):
                    out.add(user.name)
        return out

    # -- tensor-parallel layouts ---------------------------------------------------------------
    def layout(self, tp: int, sequence_parallel: bool, *, cost: Any, sizes: Mapping[str, int]
               ) -> TPLayout | None:
        """The sharding search's layout for ``tp`` (None at tp=1); raises
        :class:`autopar.errors.AutoparError` (ShardingError, ...) when tp does not fit."""
        if tp == 1:
            return None
        key = (tp, sequence_parallel, cost, tuple(sorted(sizes.items())))
        hit = self._layouts.get(key)
        if hit is None:
            try:
                hit = solve_layout(self.captured, tp, sequence_parallel, cost=cost, sizes=sizes,
                                   depth=self.kinds.count(LayerKind.BLOCK) or None)
            except AutoparError as exc:
                found = f" ({_short(exc.found)})" if exc.found else ""
                hit = f"{type(exc).__name__}: {exc.summary}{found}"
            self._layouts[key] = hit
        if isinstance(hit, str):
            raise _LayoutProblem(hit)
        return hit

    def prepare_layouts(self, tp: int, sequence_parallel: bool, *, cost: Any,
                        sizes: Sequence[Mapping[str, int]], vary: str = "b") -> None:
        """Solve the layouts of ``sizes`` (which differ only in ``vary``, the micro-batch) with
        as few sharding ILPs as exactness allows, and cache them for :meth:`layout`.

        Within one roofline regime of every GEMM, each term of the sharding ILP's objective
        is affine in the micro-batch b for a fixed placement x: f_b(x) = A(x) b + C(x) (compute
        and traffic grow with b, a collective's latency and the parameters' state do not). The
        optimum g(b) = min_x f_b(x) is then concave, so a placement x* optimal at b1 and at b2
        has f_b(x*) = g(b) on [b1, b2]: the chord of a concave function lies below it, and
        f_b(x*) is that chord. Hence: solve the smallest and largest b; when the smallest's
        solved point, priced in the largest's program, is optimal there too (the
        constraints do not depend on b) and every GEMM keeps its roofline regime, every b
        between takes that point; otherwise bisect. Ties are common (a cast placed sharded or
        replicated at equal cost), so the test is on the objective, not on the placements.
        A memory limit in the ILP makes the feasible set depend on b: then every size is
        solved."""
        if tp == 1 or getattr(cost, "memory_limit", None) is not None:
            return
        points = sorted({tuple(sorted(sz.items())): dict(sz) for sz in sizes}.values(),
                        key=lambda sz: sz[vary])

        def solved(i: int) -> TPLayout | None:
            try:
                return self.layout(tp, sequence_parallel, cost=cost, sizes=points[i])
            except _LayoutProblem:
                return None

        def fill(lo: int, hi: int) -> None:
            if hi - lo < 2:
                return
            a, b = solved(lo), solved(hi)
            if a is not None and b is not None and a.optimal_at(b):
                for i in range(lo + 1, hi):
                    key = (tp, sequence_parallel, cost, tuple(sorted(points[i].items())))
                    self._layouts.setdefault(key, dataclasses.replace(
                        a, sizes=dict(points[i]), solve_s=0.0, solved_at=dict(a.sizes)))
                return
            mid = (lo + hi) // 2
            fill(lo, mid)
            fill(mid, hi)

        if points:
            fill(0, len(points) - 1)

    def tp_problem(self, tp: int, sequence_parallel: bool, *, cost: Any,
                   sizes: Mapping[str, int]) -> str | None:
        """Why tensor parallelism of ``tp`` does not fit the model (None if it does)."""
        try:
            self.layout(tp, sequence_parallel, cost=cost, sizes=sizes)
        except _LayoutProblem as exc:
            return str(exc)
        return None

    def cp_problem(self) -> str | None:
        """Why the sequence cannot be split over context-parallel ranks (None if it can): the
        transform's refusal (passes/context_parallel.py) on the captured graph, once."""
        if self._cp_problem is _UNKNOWN:
            from autopar.passes.context_parallel import context_parallelize

            try:
                context_parallelize(self.captured.gm)
                self._cp_problem = None
            except AutoparError as exc:
                self._cp_problem = exc.summary + (f": {exc.found}" if exc.found else "")
        return self._cp_problem  # type: ignore[return-value]

    def split(self, template: _Template, layout: TPLayout | None, tp: int) -> _LayerSplit:
        key = (id(template), id(layout))
        out = self._splits.get(key)
        if out is None:
            out = _layer_split(template, layout, tp)
            self._splits[key] = out
        return out

    # -- queries ------------------------------------------------------------------------------
    def template(self, layer: int) -> _Template:
        return self.templates[layer]

    @property
    def layer_kinds(self) -> list[LayerKind]:
        return list(self.kinds)

    def tp_placement(self, layout: TPLayout | None) -> list[dict[str, Any]]:
        """Each GEMM's tensor-parallel split in ``layout``, once per distinct layer: layers,
        module, op node, split."""
        if layout is None:
            return []
        rows = []
        seen: dict[int, list[int]] = {}
        for i, t in enumerate(self.templates):
            seen.setdefault(id(t), []).append(i)
        for idxs in seen.values():
            t = self.templates[idxs[0]]
            rep = self.captured.layers[t.representative]
            for name in rep.nodes:
                g = layout.gemm_sharding.get(name)
                if g is None:
                    continue
                module = info(self.captured.node(name)).module_path
                if rep.kind is LayerKind.BLOCK:
                    module = module.replace(rep.name + ".", "", 1)
                rows.append({"layers": [idxs[0], idxs[-1]], "count": len(idxs),
                             "module": module, "node": name, "sharding": g.value})
        return rows


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _LayoutProblem(Exception):
    """tensor parallelism of some degree does not fit the model (the message says why)."""


def seq_degree(expr: Any) -> int:
    """Degree of ``expr`` in the sequence symbol (2 for attention scores)."""
    try:
        return int(sympy.degree(sympy.sympify(expr), SEQ))
    except Exception:  # noqa: BLE001 - non-polynomial: treat as linear
        return 1


# ---------------------------------------------------------------------------------------------
# Pricing a layer on a cluster
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LayerCosts:
    """One layer, one micro-batch, on one tensor-parallel rank."""

    forward_s: float  # compute only
    backward_s: float  # input gradients (and memory-bound backward)
    weight_s: float  # weight gradients
    core_forward_s: float  # attention core forward (selective recomputation)
    tp_forward_s: float
    tp_backward_s: float
    act_bytes: float  # saved activations, no recomputation
    act_selective_bytes: float
    ckpt_bytes: float  # the input full recomputation keeps
    boundary_bytes: float  # what a pipeline cut after it sends (per tp rank)
    gemm_flops: float  # forward GEMM FLOPs of the whole layer (unsplit)
    core_flops: float
    #: (collective, "forward"/"backward", bytes at the training precision) per call
    tp_calls: tuple[tuple[str, str, float], ...] = ()
    #: Context parallelism: the exposed time of the K/V exchange of its attention, forward and
    #: backward, by algorithm ("ring", "allgather"); empty at cp = 1.
    cp_comm: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: Backward all-gathers of the sequence-parallel GEMM inputs kept as shards (seconds; not
    #: in ``tp_backward_s``: a fully recomputed layer saves nothing and gathers nothing more)
    regather_s: float = 0.0
    #: Expert parallelism: the all-to-alls of its experts (dispatch and combine), forward and
    #: backward, exposed (also counted in ``tp_forward_s`` / ``tp_backward_s``).
    ep_forward_s: float = 0.0
    ep_backward_s: float = 0.0


def price_layer(template: _Template, split: _LayerSplit, cluster: Cluster, dtype: str, tp: int,
                b: int, s: int, graph_float_bytes: int, tp_span: Any, cp: int = 1,
                cp_span: Any = None, ep: int = 1, ep_span: Any = None,
                moe_imbalance: float = 1.0) -> LayerCosts:
    """One micro-batch of ``b`` sequences of ``s`` through a layer on one tensor-parallel rank
    (``split`` is the template under the plan's layout: :meth:`ModelCosts.split`).

    Under context parallelism (``cp`` > 1) the rank holds ``s / cp`` tokens of each sequence:
    every op is priced at that length but attention, whose queries see the whole sequence's
    keys (its FLOPs are the whole sequence's over ``cp``: the head-tail layout balances causal
    work), plus the exchange of keys and values over ``cp_span`` (:func:`cp_exchange`).

    Experts (mixture-of-experts): every routed row through its expert's two GEMMs, times
    ``moe_imbalance`` (the busiest expert rank's rows over the mean; 1 = uniform routing, which
    the load-balancing loss aims at); under expert parallelism (``ep`` > 1, over ``ep_span``) two
    all-to-alls per experts operation forward (dispatch, combine) and two backward, of each
    rank's routed rows, not overlapped (Megatron-LM's default)."""
    v = template.values(b, s // cp)
    full = template.values(b, s) if cp > 1 else v
    esize = PRECISION_BYTES[dtype]
    scale = esize / graph_float_bytes
    fwd = bwd = wgt = core = 0.0
    cp_comm: dict[str, list[float]] = {"ring": [0.0, 0.0], "allgather": [0.0, 0.0]}
    d = cluster.device
    for term, how, div in zip(template.terms, split.gemm, split.divisor):
        i = term.index
        if term.kind is _Kind.GEMM:
            batch, m, n, k = v[i], v[i + 1], v[i + 2], v[i + 3]
            if term.op == EXPERT_OP:  # this rank's E / ep experts, one GEMM each (a loop)
                experts = batch / ep
                rows = m * moe_imbalance / experts
                fwd += experts * gemm_time(cluster, dtype, 1, rows, n, k)
                if term.backward:
                    bwd += experts * gemm_time(cluster, dtype, 1, rows, k, n)
                    wgt += experts * gemm_time(cluster, dtype, 1, n, k, rows)
                continue
            if how is _Split.COLUMN:
                n = math.ceil(n / tp)
            elif how is _Split.ROW:
                k = k / tp
            elif how is _Split.BATCH:
                batch = batch / tp
            f = gemm_time(cluster, dtype, batch, m, n, k)
            bias = d.op_table.get(term.op) if term.op and dtype == d.default_dtype else None
            if bias is not None:  # measured: the bias broadcast into the output, its gradient
                f += batch * m * n * bias[0]
                if term.backward:
                    bwd += batch * m * n * bias[1]
            fwd += f
            if term.core:
                core += f
            if term.backward:
                if term.weight_grad:
                    bwd += gemm_time(cluster, dtype, batch, m, k, n)
                    wgt += gemm_time(cluster, dtype, 1, n, k, batch * m)
                else:
                    if term.input_grads >= 1:
                        bwd += gemm_time(cluster, dtype, batch, m, k, n)
                    if term.input_grads >= 2:
                        bwd += gemm_time(cluster, dtype, batch, k, n, m)
            continue
        flops, moved = v[i] / div, v[i + 1] * scale / div
        if term.kind is _Kind.ATTENTION and cp > 1:
            flops, moved = full[i] / div / cp, full[i + 1] * scale / div / cp
        if term.kind is _Kind.ATTENTION and d.attention_table and dtype == d.default_dtype:
            seq, head = v[i + 2], v[i + 3]
            rows_f = [(r[0], r[1], r[2]) for r in d.attention_table]
            rows_b = [(r[0], r[1], r[3]) for r in d.attention_table]
            f = max(flops / table_rate(rows_f, (seq, head)), d.kernel_floor_s)
            fb = max(ATTENTION_BACKWARD_FACTOR * flops / table_rate(rows_b, (seq, head)),
                     d.kernel_floor_s)
        elif term.kind is _Kind.ATTENTION:
            rate = d.peak(dtype) * d.attention_efficiency
            bw = d.memory_bandwidth * d.memory_efficiency
            f = max(flops / rate, moved / bw, d.kernel_floor_s)
            fb = max(ATTENTION_BACKWARD_FACTOR * flops / rate, 2 * moved / bw, d.kernel_floor_s)
        else:
            f = memory_time(cluster, moved)
            fb = memory_time(cluster, 2 * moved)
            per_element = d.op_table.get(term.op) if dtype == d.default_dtype else None
            if per_element is not None:  # measured: slower to compute than to stream
                elements = v[i + 2] / div
                f = max(f, elements * per_element[0])
                fb = max(fb, elements * per_element[1])
        fwd += f
        if term.core:
            core += f
        if term.backward:
            bwd += fb
        if term.kind is _Kind.ATTENTION and cp > 1:
            kv = v[i + 4] / div  # this rank's keys and values (elements)
            for kind, (tf, tb) in cp_exchange(cluster, cp, cp_span, kv, esize, f, fb).items():
                cp_comm[kind][0] += tf
                cp_comm[kind][1] += tb
    # the host's cost per node (CPU processes: dispatch and autograd, serial with the compute)
    fwd += template.nodes * d.node_overhead_s
    bwd += template.grad_nodes * d.node_backward_overhead_s
    for experts in template.moe_experts:  # runtime/moe.py's ops: per local expert and routing
        local = experts / ep
        fwd += (MOE_OPS_PER_EXPERT * local + MOE_ROUTING_OPS[ep > 1]) * d.node_overhead_s
        bwd += (MOE_OPS_PER_EXPERT * local + MOE_ROUTING_GRAD_OPS[ep > 1]) \
            * d.node_backward_overhead_s
    # gradient accumulation: each micro-batch's weight gradients are added into the step's
    # gradient buffer (read it and the new gradient, write it back), with the weight gradients
    local = sum(n / tp if fqn in split.sharded_params else n for fqn, n in template.params.items())
    wgt += memory_time(cluster, GRAD_ACCUMULATION_READS_WRITES * STATE_BYTES[dtype][1] * local)
    # tensor-parallel communication: the program's collectives
    tp_f = tp_b = 0.0
    calls = []
    for (kind, forward, float_tensor), nbytes in zip(split.comm, split.comm_bytes(b, s)):
        nbytes = nbytes * scale if float_tensor else nbytes
        t = collective_time(cluster, kind, nbytes, tp_span).seconds
        if forward:
            tp_f += t
        else:
            tp_b += t
        calls.append((kind.value, "forward" if forward else "backward", nbytes))

    ep_f = ep_b = 0.0
    if ep > 1:
        for i in template.moe_rows:  # the rows this rank routes, sent as ep parts
            nbytes = v[i] * esize * ep  # comm.py prices an all-to-all by the whole exchange
            t = collective_time(cluster, Collective.ALL_TO_ALL, nbytes, ep_span).seconds
            ep_f += 2 * t
            ep_b += 2 * t
        tp_f += ep_f
        tp_b += ep_b
        calls.extend((Collective.ALL_TO_ALL.value, d, v[i] * esize * ep)
                     for i in template.moe_rows for d in ("forward",) * 2 + ("backward",) * 2)

    regather_s = 0.0
    for t, again in zip(template.saved, split.regather):
        if again:  # the whole tensor, gathered once per backward (shared by its readers)
            whole = v[t.index] * (esize if t.is_float else 1)
            regather_s += collective_time(cluster, Collective.ALL_GATHER, whole, tp_span).seconds

    def nbytes(tensors: list[_Tensor], shares: list[int], include_core: bool = True) -> float:
        total = 0.0
        for t, share in zip(tensors, shares):
            if t.core and not include_core:
                continue
            total += v[t.index] * (esize if t.is_float else 1) / share
        return total

    return LayerCosts(
        forward_s=fwd, backward_s=bwd, weight_s=wgt, core_forward_s=core,
        tp_forward_s=tp_f, tp_backward_s=tp_b,
        act_bytes=nbytes(template.saved, split.saved),
        act_selective_bytes=nbytes(template.saved, split.saved, include_core=False),
        ckpt_bytes=nbytes(template.checkpoint, split.checkpoint),
        boundary_bytes=nbytes(template.boundary, split.boundary),
        gemm_flops=v[template.gemm_flops], core_flops=v[template.core_flops],
        tp_calls=tuple(calls), ep_forward_s=ep_f, ep_backward_s=ep_b,
        cp_comm={k: (f, b_) for k, (f, b_) in cp_comm.items()} if cp > 1 else {},
        regather_s=regather_s)


def cp_exchange(cluster: Cluster, cp: int, span: Any, kv_elements: float, esize: int,
                forward_s: float, backward_s: float) -> dict[str, tuple[float, float]]:
    """Exposed seconds (forward, backward) of one attention's K/V exchange over ``cp`` ranks, by
    algorithm (autopar/runtime/cp.py), for a rank holding ``kv_elements`` keys and values
    (``esize`` bytes each) whose attention takes ``forward_s`` / ``backward_s`` in all.

    ``ring``: ``cp - 1`` hops of the block forward, each overlapped with one block's attention
    (``forward_s / cp``), only the excess exposed; backward the same hops plus ``cp`` hops of the
    block's dK/dV accumulator (fp32: twice the bytes at bf16), overlapped with the backward's
    blocks. ``allgather``: the whole sequence's K/V gathered before the attention (exposed) and,
    backward, gathered again and the dK/dV reduce-scattered (fp32)."""
    inter = span is not None and span.nodes > 1
    block_bytes, grad_bytes = kv_elements * esize, kv_elements * 4  # dK/dV accumulate in fp32
    hop = p2p_time(cluster, block_bytes, inter_node=inter)
    grad_hop = p2p_time(cluster, grad_bytes, inter_node=inter)
    fwd_block, bwd_block = forward_s / cp, backward_s / cp
    ring = ((cp - 1) * max(0.0, hop - fwd_block),
            (cp - 1) * max(0.0, hop - bwd_block) + cp * max(0.0, grad_hop - bwd_block)
            + grad_hop)  # the last hop home waits for the last block
    gather = collective_time(cluster, Collective.ALL_GATHER, block_bytes * cp, span).seconds
    scatter = collective_time(cluster, Collective.REDUCE_SCATTER, grad_bytes * cp, span).seconds
    return {"ring": ring, "allgather": (gather, gather + scatter)}
