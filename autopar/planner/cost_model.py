"""The cost model: what one training step of a plan costs on a cluster.

Written as math first; every factor below comes from the :class:`~autopar.cluster.Cluster`
(datasheet numbers times documented efficiencies) or from the captured graph, never fitted to
end-to-end throughput. docs/cost-model.md has the same formulas with their sources.

**Per node** (graph node of the analysis pass, one micro-batch of ``b`` sequences of ``s``):

- GEMM ``(batch, M, N, K)``: ``t = max(2 batch M N K / (peak * e_gemm * e_wave),
  bytes / (bw * e_mem), floor)``; ``e_wave`` is wave quantization (NVIDIA's *Matrix
  Multiplication Background* guide): the output's ``ceil(M/tm) ceil(N/tn)`` tiles run in waves of
  ``sm_count``, the best of the 256x128, 128x256 and 128x128 tiles (shrunk to a power of two
  >= 16 for a dimension shorter than the tile). A device with a measured ``gemm_table``
  (``autopar calibrate``) uses ``t = max(2 batch M N K / rate(batch M, N, K), floor)`` instead,
  the rate interpolated between measured shapes; likewise ``attention_table`` for attention.
  Backward: the input-gradient GEMM ``(batch, M, K, N)`` and, for weights, the weight-gradient
  GEMM ``(1, N, K, batch M)``.
- fused attention: ``t = max(F / (peak * e_attn), bytes / (bw * e_mem), floor)``, backward
  ``2.5 F`` (FlashAttention-2 recomputes the scores: 5 matmuls to the forward's 2).
- everything else is memory-bound: ``t = max(bytes / (bw * e_mem), floor)``, backward twice the
  bytes (gradient in, saved input, gradient out), and only for ops on the gradient path.

Bytes are the analysis pass's, re-priced at the training precision.

**Tensor parallel** (``t``): the layout is the sharding search's (:mod:`autopar.planner.tp_layout`:
``tensor_parallelize`` on the captured graph, once per ``(t, SP)``). A node whose strategy splits
it does ``1/t`` of the work (column GEMMs ``N/t``, row GEMMs ``K/t``, batched GEMMs and attention
by heads, everything else ``1/t`` of its bytes); a saved activation, a pipeline boundary tensor
or a parameter costs ``1/t`` of its bytes per rank when its producer's placement is sharded.
Communication per micro-batch is the program's own list (``TPProgram.layer_comm``: each
collective's kind, direction and bytes), priced by :mod:`autopar.planner.comm` on the
tensor-parallel group; Megatron-LM does not overlap it, neither does this model.

**Recompute**: full re-runs each block's forward (with its TP communication) in backward and
keeps only the block's input; selective re-runs the attention core (the nodes whose saved tensors
grow as ``s^2``) and drops those tensors (Korthikanti et al. 2022).

**Stages and schedule**: :meth:`CostModel.evaluate` is the search's first pass: the min-max
contiguous split (:func:`autopar.planner.stage_partition.min_max_split`) and the closed-form
pipeline time (:func:`autopar.planner.schedule_model.closed_form_pipeline_time`).
:meth:`CostModel.refine` prices a finalist for real: the stage ILP
(:func:`autopar.planner.stage_partition.partition_stages`, with this model's per-layer times,
parameters, activations, transfers and the memory left by the ZeRO stage) cuts the stages, and
the runtime's simulator runs the executor's action lists
(:func:`autopar.planner.schedule_model.simulated_pipeline_time`); activation memory follows the
in-flight micro-batches of those lists.

**Step** = pipeline time + exposed data-parallel communication + optimizer step. Data-parallel
gradients are reduced in 25 MB buckets (PyTorch DDP's default) overlapped with the backward of
the last micro-batch; the last bucket and anything beyond the overlap window are exposed, and
while a collective overlaps compute it holds ``collective_sms`` of the ``sm_count`` SMs (one per
NCCL channel), slowing that compute by the same fraction of the overlapped time. ZeRO-1/2 add an
all-gather of the updated weights after the step (exposed); ZeRO-2 reduce-scatters every
micro-batch; ZeRO-3 gathers weights before each forward and backward and reduce-scatters
gradients every micro-batch, prefetched so only the excess over the compute it overlaps is
exposed. The optimizer step is memory-bound: 28 bytes moved per parameter of the local optimizer
shard (Adam reads weights, gradients, two moments and writes three, plus the low-precision copy),
or the device's measured time per parameter where that is longer (``optimizer_s_per_param``: a
CPU core's for-loop AdamW makes ~10 passes).

**Reported**: MFU = model FLOPs / (step x devices x peak), model FLOPs = 3 x forward GEMM FLOPs
of the graph (6 P per token + attention, as Megatron-LM counts); the hardware FLOP rate also
counts recomputation (what Narayanan et al. 2021 report as "achieved teraFLOP/s").
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import sympy
import torch.fx

from autopar.cluster import Cluster, GroupSpan, LinkKind
from autopar.errors import AutoparError
from autopar.ir import BATCH, SEQ, LayerKind, NodeKind, TensorSpec, info, op_name
from autopar.plan_types import GemmSharding, Plan, Prediction, RecomputeKind, ScheduleKind, StagePlan
from autopar.planner.comm import Collective, collective_time, mesh_span, p2p_link, p2p_time
from autopar.planner.memory import STATE_BYTES, RankMemory, model_state_bytes
from autopar.planner.stage_partition import min_max_split
from autopar.planner.schedule_model import (PipelineTime, PipelineWork,
                                            closed_form_pipeline_time, in_flight_micro_batches,
                                            simulated_pipeline_time)
from autopar.planner.tp_layout import TPLayout, solve_layout, tp_cost_spec

__all__ = ["Candidate", "ModelCosts", "LayerCosts", "CostModel", "Evaluation", "StageCost",
           "TrainingSetup", "price_layer", "lower_bound_step", "COMPONENTS",
           "gemm_time", "wave_efficiency", "DDP_BUCKET_BYTES", "OPTIMIZER_BYTES_PER_PARAM",
           "optimizer_time"]

#: PyTorch DDP's default gradient bucket (bucket_cap_mb=25).
DDP_BUCKET_BYTES = 25 * 2**20
#: Gradient-sized reads and writes of accumulating one micro-batch's weight gradients: read the
#: buffer and the new gradient, write the buffer (autograd's ``.grad +=``, or the data-parallel
#: layer's add into its flat bucket, runtime/zero.py), once per micro-batch: what makes many small
#: micro-batches cost more than a few large ones beyond their GEMM rates. Megatron can fuse it into
#: the weight-gradient GEMM (``gradient_accumulation_fusion``); autopar's runtime does not.
GRAD_ACCUMULATION_READS_WRITES = 3

#: Bytes the Adam step moves per parameter of the local shard (see module docstring).
OPTIMIZER_BYTES_PER_PARAM = 28
#: Thread-block tiles cuBLAS uses for large GEMMs (NVIDIA Matrix Multiplication Background).
GEMM_TILES = ((256, 128), (128, 256), (128, 128))
#: FlashAttention-2's backward does 5 matmuls to the forward's 2.
ATTENTION_BACKWARD_FACTOR = 2.5
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: What the plan search uses (reported in the plan document).
COMPONENTS = {
    "sharding": "sharding ILP (passes/shard.py via tensor_parallelize), per (tp, sp, "
                "micro-batch)",
    "stage_partition": "stage ILP (planner/stage_partition.py) for the finalists; "
                       "min-max contiguous split as the first pass",
    "schedule": "runtime/simulator.py over runtime/schedules.py action lists for the "
                "finalists; closed form as the first pass",
}


# ---------------------------------------------------------------------------------------------
# Kernel times
# ---------------------------------------------------------------------------------------------

def wave_efficiency(batch: float, m: float, n: float, sm_count: int) -> float:
    """Useful fraction of the tile waves a GEMM's output needs (1 when sm_count is 0).

    A dimension shorter than the tile gets a tile shrunk to it (at least 16, the tensor-core
    MMA granule), as cuBLAS's kernels for skinny matrices do."""
    if sm_count <= 0:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tm = min(tm, max(16, 2 ** math.ceil(math.log2(max(m, 1)))))
        tn = min(tn, max(16, 2 ** math.ceil(math.log2(max(n, 1)))))
        tiles = math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sm_count)
        best = max(best, batch * m * n / (waves * sm_count * tm * tn))
    return min(best, 1.0)


def table_rate(table: Sequence[Sequence[float]], point: Sequence[float]) -> float:
    """Rate at ``point`` from measured rows (coordinates..., rate): inverse-distance weighting
    (power 4) in log2 space, each coordinate clamped to the measured range (exact at measured
    points, smooth between, flat outside)."""
    logs = []
    for i, x in enumerate(point):  # outside the measured range: the nearest measured size
        lo = min(row[i] for row in table)
        hi = max(row[i] for row in table)
        logs.append(math.log2(min(max(x, lo), hi)))
    num = den = 0.0
    for row in table:
        d2 = sum((math.log2(c) - x) ** 2 for c, x in zip(row, logs))
        if d2 < 1e-12:
            return row[len(point)]
        w = 1.0 / (d2 * d2)
        num += w * row[len(point)]
        den += w
    return num / den


def gemm_time(cluster: Cluster, dtype: str, batch: float, m: float, n: float, k: float) -> float:
    d = cluster.device
    esize = PRECISION_BYTES[dtype]
    flops = 2.0 * batch * m * n * k
    if d.gemm_table and dtype == d.default_dtype:  # measured rates by shape
        return max(flops / table_rate(d.gemm_table, (batch * m, n, k)), d.kernel_floor_s)
    rate = d.peak(dtype) * d.gemm_efficiency * wave_efficiency(batch, m, n, d.sm_count)
    nbytes = esize * batch * (m * k + k * n + m * n)
    return max(flops / rate, nbytes / (d.memory_bandwidth * d.memory_efficiency),
               d.kernel_floor_s)


def memory_time(cluster: Cluster, nbytes: float) -> float:
    d = cluster.device
    return max(nbytes / (d.memory_bandwidth * d.memory_efficiency), d.kernel_floor_s)


def optimizer_time(cluster: Cluster, params: float) -> float:
    """One device's Adam step over ``params`` parameters, alone on its core: the memory traffic
    (``OPTIMIZER_BYTES_PER_PARAM``) or the measured time per parameter, whichever is longer."""
    return max(memory_time(cluster, OPTIMIZER_BYTES_PER_PARAM * params),
               params * cluster.device.optimizer_s_per_param)


# ---------------------------------------------------------------------------------------------
# Layer templates: everything the graph says about a layer, as expressions in b and s
# ---------------------------------------------------------------------------------------------

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
    #: first of this term's values (GEMM: batch, m, n, k; attention: flops, bytes, s, d;
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

    def shares(tensors: list[_Tensor]) -> list[int]:
        out = []
        for t in tensors:
            read = layout.read_sharded(*t.reader) if t.reader else None
            out.append(tp if (layout.sharded(t.owner) if read is None else read) else 1)
        return out

    calls = layout.comm.get(template.layer_name, ())
    comm = [(_COMM_KIND[c.collective.value], c.direction == "forward", c.float_tensor)
            for c in calls]
    fn = sympy.lambdify((BATCH, SEQ), [sympy.sympify(c.message_bytes) for c in calls],
                        modules="math") if calls else None
    return _LayerSplit(gemm, divisor, shares(template.saved), shares(template.checkpoint),
                       shares(template.boundary), comm, fn, layout.sharded_params)


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
            grad_nodes=grad_calls + len(params))

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

    def tp_problem(self, tp: int, sequence_parallel: bool, *, cost: Any,
                   sizes: Mapping[str, int]) -> str | None:
        """Why tensor parallelism of ``tp`` does not fit the model (None if it does)."""
        try:
            self.layout(tp, sequence_parallel, cost=cost, sizes=sizes)
        except _LayoutProblem as exc:
            return str(exc)
        return None

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


def price_layer(template: _Template, split: _LayerSplit, cluster: Cluster, dtype: str, tp: int,
                b: int, s: int, graph_float_bytes: int, tp_span: Any) -> LayerCosts:
    """One micro-batch of ``b`` sequences of ``s`` through a layer on one tensor-parallel rank
    (``split`` is the template under the plan's layout: :meth:`ModelCosts.split`)."""
    v = template.values(b, s)
    esize = PRECISION_BYTES[dtype]
    scale = esize / graph_float_bytes
    fwd = bwd = wgt = core = 0.0
    d = cluster.device
    for term, how, div in zip(template.terms, split.gemm, split.divisor):
        i = term.index
        if term.kind is _Kind.GEMM:
            batch, m, n, k = v[i], v[i + 1], v[i + 2], v[i + 3]
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
    # the host's cost per node (CPU processes: dispatch and autograd, serial with the compute)
    fwd += template.nodes * d.node_overhead_s
    bwd += template.grad_nodes * d.node_backward_overhead_s
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
        tp_calls=tuple(calls))


# ---------------------------------------------------------------------------------------------
# Candidates and their evaluation
# ---------------------------------------------------------------------------------------------

class Candidate(NamedTuple):
    dp: int
    tp: int
    pp: int
    virtual_stages: int
    micro_batch_size: int
    schedule: ScheduleKind
    recompute: RecomputeKind
    zero: int
    sequence_parallel: bool

    def key(self) -> tuple:
        """Deterministic order for ties."""
        return (self.tp, self.pp, self.dp, self.virtual_stages, self.micro_batch_size,
                self.schedule.value, self.recompute.value, self.zero, self.sequence_parallel)

    def label(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{v} mbs={self.micro_batch_size} "
                f"{self.schedule.value} recompute={self.recompute.value} zero={self.zero}{sp}")


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage, one micro-batch (what the schedule model and `simulate` consume)."""

    index: int
    layers: tuple[int, int]
    pp_rank: int
    chunk: int
    forward_s: float  # compute + TP communication
    backward_s: float  # input gradients + recomputation + TP communication
    weight_s: float
    recompute_s: float
    tp_comm_s: float
    p2p_s: float  # send to the next stage
    activation_bytes: float  # per micro-batch

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "layers": list(self.layers), "pp_rank": self.pp_rank,
                "chunk": self.chunk, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "weight_s": self.weight_s, "recompute_s": self.recompute_s,
                "tp_comm_s": self.tp_comm_s, "p2p_s": self.p2p_s,
                "activation_bytes": self.activation_bytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StageCost":
        return cls(index=d["index"], layers=tuple(d["layers"]), pp_rank=d["pp_rank"],
                   chunk=d["chunk"], forward_s=d["forward_s"], backward_s=d["backward_s"],
                   weight_s=d["weight_s"], recompute_s=d["recompute_s"],
                   tp_comm_s=d["tp_comm_s"], p2p_s=d["p2p_s"],
                   activation_bytes=d["activation_bytes"])


@dataclass(frozen=True, slots=True)
class _RankSums:
    params: float
    largest_layer_params: float
    layers: int
    activations: float  # per micro-batch, at the recompute setting
    working: float  # one block re-materialized (recompute)
    forward: float
    backward: float
    backward_chunk0: float
    recompute: float
    tp_comm: float


@dataclass(frozen=True, slots=True)
class _Staging:
    stages: tuple[StageCost, ...]
    ranks: tuple[_RankSums, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    p2p: tuple[float, ...]
    recompute_flops: float  # per micro-batch
    cuts: tuple[tuple[int, int], ...] = ()
    #: per stage, the part of forward / backward waiting on tensor-parallel peers (a0 per call)
    forward_wait: tuple[float, ...] = ()
    backward_wait: tuple[float, ...] = ()


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    #: None when the candidate fits; else why not (kept by the search).
    infeasible: str | None
    plan: Plan | None = None
    prediction: Prediction | None = None
    ranks: tuple[RankMemory, ...] = ()
    stages: tuple[StageCost, ...] = ()
    extra: Mapping[str, float] = field(default_factory=dict)
    #: Priced by :meth:`CostModel.refine` (stage ILP + simulator), not the first pass.
    refined: bool = False

    @property
    def feasible(self) -> bool:
        return self.infeasible is None

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s if self.prediction else math.inf


@dataclass(frozen=True, slots=True)
class TrainingSetup:
    """What the user fixed: the global batch (sequences), the sequence length, precision."""

    global_batch: int
    seq: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.seq < 1:
            raise ValueError(f"seq must be >= 1, got {self.seq}")
        if self.dtype not in PRECISION_BYTES:
            raise ValueError(f"dtype must be one of {sorted(PRECISION_BYTES)}, got {self.dtype!r}")


class CostModel:
    """Prices candidates of one model on one cluster at one global batch."""

    #: CBC's time limit for one stage ILP (a finalist's; GPT-3 175B's solve in 0.1-2.5 s). When
    #: it is hit the status says so and the LP bound still certifies the gap.
    ilp_time_limit_s: float = 5.0

    def __init__(self, model: ModelCosts, cluster: Cluster, setup: TrainingSetup) -> None:
        self.model = model
        self.cluster = cluster
        self.setup = setup
        #: What the sharding search prices with; it is solved at each candidate's micro-batch
        #: (:meth:`tp_sizes`).
        self.tp_cost = tp_cost_spec(cluster, setup.dtype)
        self._layer_cache: dict[tuple, list[LayerCosts]] = {}
        self._split_cache: dict[tuple, tuple[tuple[int, int], ...]] = {}
        self._staging_cache: dict[tuple, _Staging] = {}
        self._params_cache: dict[tuple, tuple[float, float]] = {}
        # weights read by several layers (a tied embedding and LM head): fqn -> (layers, numel);
        # a repeated block's template names its representative's weights, so it is left out
        readers: dict[str, list[int]] = {}
        for i in range(model.num_layers):
            tmpl = model.template(i)
            if not tmpl.shared:
                for fqn in tmpl.params:
                    readers.setdefault(fqn, []).append(i)
        self._tied_weights = {fqn: (tuple(layers), model.template(layers[0]).params[fqn])
                              for fqn, layers in readers.items() if len(layers) > 1}
        self._coll_cache: dict[Any, dict[tuple, float]] = {}
        self._tp_problems: dict[tuple[int, bool], str | None] = {}
        self._refined: dict[tuple, Evaluation] = {}
        self.device_peak = cluster.peak_flops(setup.dtype)
        t = [model.template(i) for i in range(model.num_layers)]
        self.model_flops_per_sequence = 3 * sum(
            tt.values(1, setup.seq)[tt.gemm_flops] for tt in t)
        self.is_block = [k is LayerKind.BLOCK for k in model.layer_kinds]

    # -- tensor parallelism -------------------------------------------------------------------
    def tp_sizes(self, micro_batch_size: int) -> dict[str, int]:
        """The sizes the sharding search solves a candidate's layout at: its micro-batch and the
        training sequence. The micro-batch matters: a collective's latency is fixed while a
        GEMM's time grows with the tokens, so a layout that replicates small GEMMs to save
        collectives at one micro-batch can lose at sixteen (docs/cost-model.md)."""
        return {"b": micro_batch_size, "s": self.setup.seq}

    def layout(self, tp: int, sequence_parallel: bool, micro_batch_size: int
               ) -> TPLayout | None:
        """The sharding search's layout at this micro-batch (None at tp=1)."""
        return self.model.layout(tp, sequence_parallel, cost=self.tp_cost,
                                 sizes=self.tp_sizes(micro_batch_size))

    # -- per-layer ---------------------------------------------------------------------------
    def layer_costs(self, tp: int, sp: bool, mbs: int, dp: int = 1, pp: int = 1
                    ) -> list[LayerCosts]:
        span = mesh_span(self.cluster, dp, pp, tp, "tp")
        key = (tp, sp, mbs, span)
        out = self._layer_cache.get(key)
        if out is None:
            layout = self.layout(tp, sp, mbs)
            priced: dict[int, LayerCosts] = {}
            out = []
            for i in range(self.model.num_layers):
                tmpl = self.model.template(i)
                lc = priced.get(id(tmpl))
                if lc is None:
                    lc = price_layer(tmpl, self.model.split(tmpl, layout, tp), self.cluster,
                                     self.setup.dtype, tp, mbs, self.setup.seq,
                                     self.model.graph_float_bytes, span)
                    priced[id(tmpl)] = lc
                out.append(lc)
            self._layer_cache[key] = out
        return out

    def _layer_times(self, costs: Sequence[LayerCosts], recompute: RecomputeKind
                     ) -> list[tuple[float, float, float, float, float]]:
        """(forward, backward, weight, recompute, tp) per layer, forward/backward incl. TP."""
        out = []
        for lc, block in zip(costs, self.is_block):
            r = 0.0
            if block and recompute is RecomputeKind.FULL:
                r = lc.forward_s + lc.tp_forward_s
            elif block and recompute is RecomputeKind.SELECTIVE:
                r = lc.core_forward_s
            tp = lc.tp_forward_s + lc.tp_backward_s
            out.append((lc.forward_s + lc.tp_forward_s, lc.backward_s + lc.tp_backward_s + r,
                        lc.weight_s, r, tp))
        return out

    def _activation(self, i: int, lc: LayerCosts, recompute: RecomputeKind) -> float:
        """Saved bytes of layer ``i`` per micro-batch at the recompute setting."""
        if self.is_block[i] and recompute is RecomputeKind.FULL:
            return lc.ckpt_bytes
        if self.is_block[i] and recompute is RecomputeKind.SELECTIVE:
            return lc.act_selective_bytes
        return lc.act_bytes

    def split(self, times: Sequence[float], num_stages: int, key: tuple
              ) -> tuple[tuple[int, int], ...]:
        """The first pass's stage cut (min-max contiguous split), cached by ``key``."""
        k = (key, num_stages)
        out = self._split_cache.get(k)
        if out is None:
            out = min_max_split(times, num_stages)
            self._split_cache[k] = out
        return out

    # -- a candidate ---------------------------------------------------------------------------
    def check(self, c: Candidate) -> str | None:
        """Structural problems (no pricing needed); None if the candidate is well formed."""
        n = self.cluster.num_devices
        if c.dp * c.tp * c.pp != n:
            return f"dp x tp x pp = {c.dp * c.tp * c.pp}, not the {n} devices"
        if self.setup.global_batch % (c.dp * c.micro_batch_size):
            return (f"global batch {self.setup.global_batch} is not divisible by dp x "
                    f"micro-batch = {c.dp * c.micro_batch_size}")
        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        if c.tp > self.cluster.devices_per_node or self.cluster.devices_per_node % c.tp:
            return (f"tp={c.tp} does not fit inside a node of "
                    f"{self.cluster.devices_per_node} devices")
        if c.sequence_parallel and (c.tp == 1 or self.setup.seq % c.tp):
            return f"sequence parallel needs tp > 1 dividing seq={self.setup.seq}"
        if c.tp > 1:
            key = (c.tp, c.sequence_parallel)
            if key not in self._tp_problems:
                self._tp_problems[key] = self.model.tp_problem(  # divisibility: any micro-batch
                    c.tp, c.sequence_parallel, cost=self.tp_cost, sizes=self.tp_sizes(1))
            if self._tp_problems[key]:
                return self._tp_problems[key]
        if c.pp * c.virtual_stages > self.model.num_layers:
            return (f"{c.pp * c.virtual_stages} stages but only {self.model.num_layers} "
                    f"layers to place")
        spec = c.schedule.spec
        if spec.min_virtual_stages > 1 and c.pp < 2:
            return f"{c.schedule.value} needs pp >= 2"
        problem = spec.shape_problem(c.pp, c.virtual_stages, m)
        return problem[0] if problem is not None else None

    def evaluate(self, c: Candidate) -> Evaluation:
        """The first pass: min-max stage split and closed-form pipeline time (fast)."""
        problem = self.check(c)
        if problem:
            return Evaluation(c, problem)
        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        st = self._staging(c)
        return self._finish(c, m, st, closed_form_pipeline_time(self._work(c, m, st)))

    def refine(self, ev: Evaluation) -> Evaluation:
        """``ev``'s candidate priced for real: stages from the stage ILP, pipeline time from the
        runtime's simulator, activation memory from the schedule's in-flight micro-batches
        (cached by the candidate). Infeasible when no cut fits the memory the ILP is given."""
        from autopar.planner.stage_partition import modeled_step_time, partition_stages

        c = ev.candidate
        if ev.plan is None:
            return ev
        hit = self._refined.get(c)
        if hit is not None:
            return hit
        m = ev.plan.num_micro_batches
        problem = self.partition_problem(c)
        first_cut = self._staging(c).cuts
        try:
            part = partition_stages(problem, time_limit_s=self.ilp_time_limit_s)
        except AutoparError as exc:
            found = f" ({exc.found})" if exc.found else ""
            out = Evaluation(c, f"stage ILP: {exc.summary}{found}")
            self._refined[c] = out
            return out
        st = self._staging(c, part.ranges)
        pipe, _ = simulated_pipeline_time(self._work(c, m, st))
        acts = self._schedule_activations(c, problem, st)
        lp = part.lp_bound if part.lp_bound is not None else part.step_time
        info_ = {"method": "ilp" if problem.num_stages > 1 else "single stage",
                 "status": part.status, "objective_s": part.step_time, "lp_bound_s": lp,
                 "gap": max(0.0, (part.step_time - lp) / part.step_time) if part.step_time
                 else 0.0,
                 "integer_variables": part.num_variables,
                 "first_pass_objective_s": modeled_step_time(problem, first_cut),
                 "simulated_pipeline_s": pipe.total_s}
        out = self._finish(c, m, st, pipe, rank_acts=acts, partition=info_)
        out = dataclasses.replace(out, refined=True,
                                  extra={**out.extra, "stage_ilp_solve_s": part.solve_seconds})
        self._refined[c] = out
        return out

    def partition_problem(self, c: Candidate) -> Any:
        """The stage ILP's inputs for ``c``: this model's per-layer times (TP communication and
        recomputation included), per-rank parameters, activations at the recompute setting and
        boundary transfers; memory is what the ZeRO stage, ZeRO-3's gathered layers and the
        recomputed block leave of the device."""
        from autopar.planner.stage_partition import LayerCosts as StageLayer
        from autopar.planner.stage_partition import PartitionProblem

        m = self.setup.global_batch // (c.dp * c.micro_batch_size)
        costs = self.layer_costs(c.tp, c.sequence_parallel, c.micro_batch_size, c.dp, c.pp)
        times = self._layer_times(costs, c.recompute)
        layout = self.layout(c.tp, c.sequence_parallel, c.micro_batch_size)
        layers = []
        largest = working = 0.0
        for i, (lc, (f, b, w, _, _)) in enumerate(zip(costs, times)):
            params = self._layer_params(i, layout, c.tp)
            largest = max(largest, params)
            if self.is_block[i] and c.recompute is not RecomputeKind.NONE:
                working = max(working, lc.act_bytes - self._activation(i, lc, c.recompute))
            layers.append(StageLayer(self.model.layer_names[i], f, b + w, w, params,
                                     self._activation(i, lc, c.recompute), lc.boundary_bytes))
        w_bytes, g_bytes, o_bytes = STATE_BYTES[self.setup.dtype]
        per_param = (w_bytes / (c.dp if c.zero >= 3 else 1) + g_bytes / (c.dp if c.zero >= 2
                     else 1) + o_bytes / (c.dp if c.zero >= 1 else 1))
        buffers = 2 * largest * (w_bytes + g_bytes) if c.zero == 3 else 0.0
        memory = max(self.cluster.device.usable_memory_bytes - buffers - working, 1.0)
        p, v = c.pp, c.virtual_stages
        nodes = {self._stage_node(r, c.tp) for r in range(p)}
        latency, bandwidth = p2p_link(self.cluster, inter_node=len(nodes) > 1)
        return PartitionProblem(tuple(layers), p, m, c.schedule, v, memory, per_param,
                                bandwidth, latency)

    def _schedule_activations(self, c: Candidate, problem: Any, st: "_Staging") -> list[float]:
        """Per pipeline rank: the peak over its action list of the activations its in-flight
        micro-batches hold, per local stage (what the stage ILP constrains), plus a recomputed
        block's working set."""
        from autopar.planner.stage_partition import in_flight_vectors

        if problem.num_stages == 1:
            return [st.ranks[0].activations * in_flight_micro_batches(
                c.schedule, 1, 1, problem.num_microbatches, 0) + st.ranks[0].working]
        vectors = in_flight_vectors(problem)
        out = []
        for r, rs in enumerate(st.ranks):
            mine = [s.activation_bytes for s in st.stages if s.pp_rank == r]
            peak = max((sum(n * a for n, a in zip(vec, mine)) for vec in vectors[r]),
                       default=0.0)
            out.append(peak + rs.working)
        return out

    def _work(self, c: Candidate, m: int, st: "_Staging") -> PipelineWork:
        cl = self.cluster
        return PipelineWork(c.schedule, c.pp, c.virtual_stages, m, st.forward, st.backward,
                            st.weight, st.p2p, cores=float(cl.cores_per_node * cl.nodes),
                            replicas=c.dp * c.tp, efficiency=cl.oversubscription_efficiency,
                            forward_wait_s=st.forward_wait, backward_wait_s=st.backward_wait)

    def _staging(self, c: Candidate, cuts: Sequence[tuple[int, int]] | None = None
                 ) -> "_Staging":
        """Stage cut (the first pass's unless ``cuts`` are given) and per-stage, per-rank sums
        of a candidate (cached: many candidates share them; only m, ZeRO and the schedule's
        shape differ)."""
        zero_bubble = c.schedule.spec.splits_backward
        key = (c.tp, c.sequence_parallel, c.micro_batch_size, c.recompute, c.dp, c.pp,
               c.virtual_stages, zero_bubble, c.schedule.spec.placement,
               tuple(cuts) if cuts else None)
        hit = self._staging_cache.get(key)
        if hit is not None:
            return hit
        p, v = c.pp, c.virtual_stages
        costs = self.layer_costs(c.tp, c.sequence_parallel, c.micro_batch_size, c.dp, p)
        times = self._layer_times(costs, c.recompute)
        if cuts is None:
            cuts = self.split([f + b + w for f, b, w, _, _ in times], p * v,
                              (c.tp, c.sequence_parallel, c.micro_batch_size, c.recompute,
                               mesh_span(self.cluster, c.dp, p, c.tp, "tp")))
        layout = self.layout(c.tp, c.sequence_parallel, c.micro_batch_size)
        p2ps = []
        spec = c.schedule.spec
        for s, (first, last) in enumerate(cuts[:-1]):
            inter = self._stage_node(spec.stage_to_rank(s, p), c.tp) != \
                self._stage_node(spec.stage_to_rank(s + 1, p), c.tp)
            p2ps.append(p2p_time(self.cluster, costs[last].boundary_bytes, inter_node=inter))
        # Local processes (a loopback link): a transfer is a copy through the kernel that both
        # ends' cores make, so each stage's forward and backward also spend the time of the
        # transfers it receives and sends (measured: docs/cost-model.md).
        host_copies = self.cluster.intra_node.kind is LinkKind.LOOPBACK
        stages: list[StageCost] = []
        for s, (first, last) in enumerate(cuts):
            rng = range(first, last + 1)
            f = sum(times[i][0] for i in rng)
            b = sum(times[i][1] for i in rng)
            w = sum(times[i][2] for i in rng)
            r = sum(times[i][3] for i in rng)
            tpc = sum(times[i][4] for i in rng)
            if not zero_bubble:
                b, w = b + w, 0.0
            act = sum(self._activation(i, costs[i], c.recompute) for i in rng)
            p2p = p2ps[s] if s < len(cuts) - 1 else 0.0
            if host_copies:
                copies = p2p + (p2ps[s - 1] if s > 0 else 0.0)
                f, b = f + copies, b + copies
            rank = spec.stage_to_rank(s, p)
            stages.append(StageCost(s, (first, last), rank,
                                    spec.stages_of_rank(rank, p, v).index(s), f, b, w, r, tpc,
                                    p2p, act))
        ranks = []
        for rank in range(p):
            mine = [st for st in stages if st.pp_rank == rank]
            held, largest = self._rank_params(tuple(st.layers for st in mine), layout, c.tp)
            working = 0.0
            if c.recompute is not RecomputeKind.NONE:  # one block re-materialized at a time
                for st in mine:
                    for i in range(st.layers[0], st.layers[1] + 1):
                        if self.is_block[i]:
                            working = max(working, costs[i].act_bytes
                                          - self._activation(i, costs[i], c.recompute))
            ranks.append(_RankSums(
                params=held, largest_layer_params=largest,
                layers=sum(st.layers[1] - st.layers[0] + 1 for st in mine),
                activations=sum(st.activation_bytes for st in mine), working=working,
                forward=sum(st.forward_s for st in mine),
                backward=sum(st.backward_s + st.weight_s for st in mine),
                backward_chunk0=sum(st.backward_s + st.weight_s for st in mine if st.chunk == 0),
                recompute=sum(st.recompute_s for st in mine),
                tp_comm=sum(st.tp_comm_s for st in mine)))
        rec_flops = 0.0
        for lc, block in zip(costs, self.is_block):
            if block and c.recompute is RecomputeKind.FULL:
                rec_flops += lc.gemm_flops
            elif block and c.recompute is RecomputeKind.SELECTIVE:
                rec_flops += lc.core_flops
        # a tensor-parallel collective's arrival (a0 per call) is spent waiting on the peers,
        # not computing: on shared cores it takes no core (runtime/simulator.py)
        a0 = self.cluster.collective_latency_s if c.tp > 1 else 0.0
        fwd_wait, bwd_wait = [], []
        for first, last in cuts:
            f_calls = b_calls = 0
            for i in range(first, last + 1):
                calls = costs[i].tp_calls
                f = sum(1 for _, direction, _ in calls if direction == "forward")
                f_calls += f
                b_calls += sum(1 for _, direction, _ in calls if direction == "backward")
                if self.is_block[i] and c.recompute is RecomputeKind.FULL:
                    b_calls += f  # the forward re-run inside the backward
            fwd_wait.append(a0 * f_calls)
            bwd_wait.append(a0 * b_calls)
        out = _Staging(tuple(stages), tuple(ranks),
                       tuple(st.forward_s for st in stages), tuple(st.backward_s for st in stages),
                       tuple(st.weight_s for st in stages), tuple(st.p2p_s for st in stages[:-1]),
                       rec_flops, tuple(cuts), tuple(fwd_wait), tuple(bwd_wait))
        self._staging_cache[key] = out
        return out

    def _tied_sum_time(self, c: Candidate, st: "_Staging") -> float:
        """Seconds of summing the gradients of weights tied across pipeline ranks (a GPT's
        embedding on the first stage and its LM head on the last): one all-reduce per tied
        weight over the ranks holding it, after their data-parallel reduction and before the
        step (runtime/data_parallel.py ``finish_gradient_sync``), so exposed."""
        if c.pp == 1 or not self._tied_weights:
            return 0.0
        layout = self.layout(c.tp, c.sequence_parallel, c.micro_batch_size)
        split = layout.sharded_params if layout is not None else frozenset()
        rank_of = {i: stage.pp_rank for stage in st.stages
                   for i in range(stage.layers[0], stage.layers[1] + 1)}
        _, g_bytes, _ = STATE_BYTES[self.setup.dtype]
        total = 0.0
        for fqn, (layers, numel) in self._tied_weights.items():
            ranks = {rank_of[i] for i in layers}
            if len(ranks) < 2:
                continue
            nodes = {self._stage_node(r, c.tp) for r in ranks}
            per_node = max(sum(1 for r in ranks if self._stage_node(r, c.tp) == node)
                           for node in nodes)
            nbytes = numel / (c.tp if fqn in split else 1) * g_bytes
            total += collective_time(self.cluster, Collective.ALL_REDUCE, nbytes,
                                     GroupSpan(len(ranks), len(nodes), per_node)).seconds
        return total

    def _stage_node(self, pp_rank: int, tp: int) -> int:
        return (pp_rank * tp) // self.cluster.devices_per_node

    def _layer_params(self, i: int, layout: TPLayout | None, tp: int) -> float:
        """Parameters layer ``i`` reads, per tensor-parallel rank."""
        split = layout.sharded_params if layout is not None else frozenset()
        return float(sum(numel / tp if fqn in split else numel
                         for fqn, numel in self.model.template(i).params.items()))

    def _rank_params(self, ranges: tuple[tuple[int, int], ...], layout: TPLayout | None,
                     tp: int) -> tuple[float, float]:
        """(parameters held, largest layer's parameters) of one tp rank holding the layers of
        ``ranges`` (a tied table read by two of them once)."""
        key = (ranges, id(layout), tp)
        hit = self._params_cache.get(key)
        if hit is not None:
            return hit
        split = layout.sharded_params if layout is not None else frozenset()
        seen: dict[Any, float] = {}
        largest = 0.0
        for first, last in ranges:
            for i in range(first, last + 1):
                tmpl = self.model.template(i)
                layer_total = 0.0
                for fqn, numel in tmpl.params.items():
                    share = numel / tp if fqn in split else numel
                    layer_total += share
                    # a repeated block's template names its representative's parameters
                    seen[(i, fqn) if tmpl.shared else fqn] = share
                largest = max(largest, layer_total)
        out = (sum(seen.values()), largest)
        self._params_cache[key] = out
        return out


    def _finish(self, c: Candidate, m: int, st: "_Staging", pipe: PipelineTime,
                rank_acts: Sequence[float] | None = None,
                partition: Mapping[str, Any] | None = None) -> Evaluation:
        cl, setup = self.cluster, self.setup
        p, v = c.pp, c.virtual_stages
        dtype = setup.dtype
        w_bytes, g_bytes, _ = STATE_BYTES[dtype]
        usable = cl.device.usable_memory_bytes
        dp_span = mesh_span(cl, c.dp, p, c.tp, "dp") if c.dp > 1 else None
        d = cl.device
        interference = d.collective_sms / d.sm_count if d.sm_count else 0.0
        if cl.intra_node.kind is LinkKind.LOOPBACK:
            interference = 1.0  # local processes: gloo runs on the cores the compute uses
        ranks: list[RankMemory] = []
        dp_exposed = optimizer_s = slack = 0.0
        for r, rs in enumerate(st.ranks):
            # -- memory
            states = model_state_bytes(rs.params, c.dp, c.zero, dtype)
            if rank_acts is not None:
                acts = rank_acts[r]
            else:
                acts = rs.activations * in_flight_micro_batches(c.schedule, p, v, m, r) \
                    + rs.working
            # ZeRO-3: the gathered weights of the layer running and of the one prefetched, and
            # the unsharded gradients of the layer computed and of the one reduce-scattered
            buffers = 2 * rs.largest_layer_params * (w_bytes + g_bytes) if c.zero == 3 else 0.0
            ranks.append(RankMemory(r, states.weights, states.gradients, states.optimizer, acts,
                                    buffers))
            # -- data-parallel communication, overlapped with the last micro-batch's backward;
            #    rank r's backward ends `slack` before rank 0's (the drain of the pipeline)
            grads, weights = rs.params * g_bytes, rs.params * w_bytes
            window = rs.backward
            if dp_span is not None:
                cache = self._coll_cache.setdefault(dp_span, {})

                def one(op: Collective, nbytes: float) -> float:
                    t = cache.get((op, nbytes))
                    if t is None:
                        t = cache[(op, nbytes)] = collective_time(cl, op, nbytes, dp_span).seconds
                    return t

                def coll(op: Collective, nbytes: float, unit: float) -> float:
                    """``nbytes`` moved as collectives of ``unit`` bytes (buckets, layers)."""
                    if nbytes <= 0:
                        return 0.0
                    whole, rest = divmod(nbytes, unit)
                    return whole * one(op, unit) + one(op, rest)

                reduce_op = Collective.ALL_REDUCE if c.zero == 0 else Collective.REDUCE_SCATTER
                bucket = DDP_BUCKET_BYTES
                last_bucket = coll(reduce_op, min(grads, bucket), bucket)
                # the last bucket waits for the end of the backward, and what the backward
                # cannot hide follows it; the rest overlaps the backward
                if c.zero <= 1:
                    t = coll(reduce_op, grads, bucket)
                    exposed = max(last_bucket, t - window)
                    overlapped = t - exposed
                elif c.zero == 2:  # a reduce-scatter after every micro-batch's backward
                    t = coll(Collective.REDUCE_SCATTER, grads, bucket)
                    tail = max(last_bucket, t - window)
                    exposed = (m - 1) * max(0.0, t - window) + tail
                    overlapped = (m - 1) * min(t, window) + t - tail
                else:  # ZeRO-3 (FSDP): per layer, gather for forward and backward,
                    #     reduce-scatter after backward, prefetched one layer ahead
                    unit = max(rs.params / max(rs.layers, 1), 1.0)
                    ag = coll(Collective.ALL_GATHER, weights, unit * w_bytes)
                    rs_t = coll(Collective.REDUCE_SCATTER, grads, unit * g_bytes)
                    exposed = (m * (max(0.0, ag - rs.forward) + max(0.0, ag + rs_t - window))
                               + coll(Collective.ALL_GATHER, rs.largest_layer_params * w_bytes,
                                      rs.largest_layer_params * w_bytes))
                    overlapped = m * (min(ag, rs.forward) + min(ag + rs_t, window))
                # overlapped communication takes SMs from the compute it hides behind
                exposed += overlapped * interference
                exposed = max(0.0, exposed - slack)
                if c.zero in (1, 2):  # updated weights gathered after the step
                    exposed += coll(Collective.ALL_GATHER, weights, bucket)
                dp_exposed = max(dp_exposed, exposed)
            local = rs.params / c.dp if c.zero >= 1 else rs.params
            # every rank steps at once: on a CPU host they share its cores
            optimizer_s = max(optimizer_s, optimizer_time(cl, local)
                              / cl.compute_share(cl.devices_per_node))
            slack += rs.backward_chunk0
        peak_rank = max(ranks, key=lambda x: x.total)
        dp_exposed += self._tied_sum_time(c, st)
        step = pipe.total_s + dp_exposed + optimizer_s
        # -- breakdown from the bottleneck rank
        b = st.ranks[pipe.bottleneck_rank]
        unit = b.forward + b.backward
        scale = pipe.busy_s / unit if unit > 0 else 0.0
        breakdown = {
            "compute_s": (unit - b.recompute - b.tp_comm) * scale,
            "tp_comm_s": b.tp_comm * scale,
            "pp_comm_s": pipe.p2p_s,
            "dp_comm_s": dp_exposed,
            "bubble_s": pipe.total_s - pipe.busy_s - pipe.p2p_s,
            "recompute_s": b.recompute * scale,
            "optimizer_s": optimizer_s,
        }
        tokens = setup.global_batch * setup.seq
        model_flops = self.model_flops_per_sequence * setup.global_batch
        hw_flops = model_flops + st.recompute_flops * setup.global_batch / c.micro_batch_size
        n = cl.num_devices
        prediction = Prediction(
            step_time_s=step, tokens_per_s=tokens / step,
            tflops_per_gpu=model_flops / step / n / 1e12,
            mfu=model_flops / (step * n * self.device_peak),
            peak_memory_bytes=int(peak_rank.total), breakdown=breakdown,
            memory={k: val for k, val in peak_rank.to_json().items() if k != "total"},
            stage_partition=dict(partition or {"method": "min-max split (first pass)",
                                               "pipeline": pipe.method}))
        plan = Plan(dp=c.dp, tp=c.tp, pp=p, virtual_stages=v, micro_batch_size=c.micro_batch_size,
                    num_micro_batches=m, schedule=c.schedule, recompute=c.recompute, zero=c.zero,
                    sequence_parallel=c.sequence_parallel,
                    stages=tuple(StagePlan(s.index, s.layers, s.pp_rank, s.chunk)
                                 for s in st.stages))
        extra = {"hfu": hw_flops / (step * n * self.device_peak),
                 "hardware_tflops_per_gpu": hw_flops / step / n / 1e12,
                 "model_flops_per_step": model_flops, "memory_limit_bytes": usable,
                 "tokens_per_s_per_gpu": tokens / step / n}
        infeasible = None
        if peak_rank.total > usable:
            infeasible = (f"needs {peak_rank.total / 2**30:.1f} GiB on pp rank "
                          f"{peak_rank.pp_rank} (weights {peak_rank.weights / 2**30:.1f}, "
                          f"grads {peak_rank.gradients / 2**30:.1f}, optimizer "
                          f"{peak_rank.optimizer / 2**30:.1f}, activations "
                          f"{peak_rank.activations / 2**30:.1f}); {usable / 2**30:.1f} GiB "
                          f"usable")
        return Evaluation(c, infeasible, plan, prediction, tuple(ranks), st.stages, extra)

    def with_sharding(self, ev: Evaluation) -> Evaluation:
        """``ev`` with its plan's per-GEMM tensor-parallel choices (the sharding search's, by
        node name of the captured graph; left empty when the graph is a shallower copy of the
        model: the names of the blocks it did not capture do not exist)."""
        if ev.plan is None or ev.candidate.tp == 1 or self.model.extended:
            return ev
        layout = self.layout(ev.candidate.tp, ev.candidate.sequence_parallel,
                             ev.candidate.micro_batch_size)
        return dataclasses.replace(
            ev, plan=ev.plan.replace(gemm_sharding=dict(layout.gemm_sharding)))


def lower_bound_step(cm: CostModel, c: Candidate) -> float:
    """A step time no candidate with this (dp, tp, pp, micro-batch, sp) can beat: its compute
    and tensor-parallel communication spread perfectly over the pipeline, without bubble,
    pipeline or data-parallel communication, recompute or optimizer step."""
    costs = cm.layer_costs(c.tp, c.sequence_parallel, c.micro_batch_size, c.dp, c.pp)
    m = cm.setup.global_batch // (c.dp * c.micro_batch_size)
    work = sum(lc.forward_s + lc.backward_s + lc.weight_s + lc.tp_forward_s + lc.tp_backward_s
               for lc in costs)
    return m * work / c.pp
