"""A layer's cost template: what it computes, keeps and sends, symbolic in the micro-batch
``b`` and the sequence ``s``, independent of the cluster.

A :class:`Template` (repeated blocks share one) holds a layer's terms (GEMMs with their
dimensions, attention, memory-bound work, mixture-of-experts GEMMs), the tensors it saves, keeps
under full recomputation and sends across a pipeline cut, and the parameters it reads;
:class:`autopar.planner.model_costs.ModelCosts` builds them from the analysis pass's results. A
template under a tensor-parallel layout (the sharding search's, :mod:`autopar.planner.tp_layout`)
is a :class:`LayerSplit` (:func:`layer_split`): which terms, tensors and parameters ``t`` splits,
and the layer's collectives. Pricing both on a cluster is
:func:`autopar.planner.layer_costs.price_layer`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import sympy

from autopar.ir import BATCH, SEQ, LayerKind
from autopar.plan_types import GemmSharding
from autopar.planner.comm import Collective
from autopar.planner.tp_layout import TPLayout

__all__ = ["Template", "LayerSplit", "Term", "TermKind", "Split", "TensorRef",
           "layer_split", "seq_degree", "BIAS_OP", "EXPERT_OP", "CONV_OP"]

#: The op tag of an experts operation's GEMM terms (their rows scale with the routing imbalance).
EXPERT_OP = "moe_experts"
#: The op tag of a convolution's GEMM term: (groups, M, N, K) of its implicit GEMM
#: (``passes.analyze.conv_dims``), a fifth value, the bytes it reads and writes (the input,
#: weight and output once: an implicit GEMM never writes the im2col matrix), a sixth and a
#: seventh, its kernel's elements and its images (what a measured ``conv_table`` is indexed by
#: besides M, N, K).
CONV_OP = "convolution"


class TermKind(enum.Enum):
    GEMM = "gemm"
    ATTENTION = "attention"
    MEMORY = "memory"


class Split(enum.Enum):
    NONE = 0
    COLUMN = 1  # N / t
    ROW = 2  # K / t
    BATCH = 3  # batch (heads) / t


@dataclass(slots=True)
class Term:
    kind: TermKind
    name: str
    backward: bool
    weight_grad: bool  # a GEMM whose second operand is a trainable weight
    input_grads: int  # activation inputs that need a gradient (GEMM backward count)
    core: bool
    #: first of this term's values (GEMM: batch, m, n, k, and for ``CONV_OP`` the bytes moved,
    #: the kernel's elements and the images;
    #: attention: flops, bytes, s, d, K/V
    #: elements;
    #: memory: flops, bytes, elements of its largest float tensor)
    index: int
    #: the op's name in a device's op_table: memory terms; GEMMs with a bias vector have
    #: ``BIAS_OP`` (a CPU GEMM first copies the broadcast bias into its output)
    op: str = ""


@dataclass(slots=True)
class TensorRef:
    """A tensor the layer holds or sends: its per-rank share follows the placement its reader
    requires of it (``reader``: node and input index) or else ``owner``'s placement."""

    owner: str
    is_float: bool  # value = float elements (priced at the training precision), else bytes
    core: bool  # an attention-core tensor (dropped by selective recompute)
    index: int
    reader: tuple[str, int] | None = None
    #: Kept in fp32 whatever the training precision: under mixed precision the runtime computes
    #: the loss in fp32 (the model's outputs cast up), so the tensors of that region are fp32
    #: in a capture made in the compute dtype.
    wide: bool = False


@dataclass(slots=True)
class Template:
    signature: str
    kind: LayerKind
    representative: int
    layer_name: str
    terms: list[Term]
    exprs: list[sympy.Expr]
    saved: list[TensorRef]  # saved activations
    checkpoint: list[TensorRef]  # the block's input (what full recomputation keeps)
    boundary: list[TensorRef]  # what a pipeline cut after the layer sends
    gemm_flops: int
    core_flops: int
    params: dict[str, int]  # fqn -> numel (a tied table is read by two layers)
    #: Of ``params``: the frozen ones (``requires_grad=False``), which hold weights but no
    #: gradient or optimizer state (the runtime keeps their fp32 master copy under mixed
    #: precision; memory.sharded_state_bytes with no optimizer state). Layers that differ in
    #: what is frozen have different signatures (autopar/layers.py), so this holds for every
    #: layer of the template.
    frozen: frozenset[str] = frozenset()
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
    #: What a cut between two layers of this template sends: the first captured instance's
    #: boundary (tables made before the blocks, e.g. rotary cos / sin, go on to the next
    #: block; after the last block only the hidden state does). ``boundary`` is the last's.
    inner_boundary: list[TensorRef] = field(default_factory=list)
    #: The layer's largest tensor that carries a gradient: its backward holds that gradient and
    #: its input's at once, on top of the saved activations (the logits' at the loss).
    transient: list[TensorRef] = field(default_factory=list)
    fn: Any = None
    cache: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)

    def param_key(self, index: int, fqn: str) -> Any:
        """Which tensor parameter ``fqn`` of this template at layer ``index`` is: a repeated
        block's own weights (under its module, ``layer_name``) are its own in each repeat, so
        keyed by the layer; a parameter it reads from outside its module (DeBERTa's relative
        embeddings, read by every block) is one tensor for all, as is a tied table."""
        if self.shared and fqn.startswith(self.layer_name + "."):
            return (index, fqn)
        return fqn

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
class LayerSplit:
    """A template under one tensor-parallel layout (see :func:`layer_split`)."""

    gemm: list[Split]  # per term
    divisor: list[int]  # per term: 1 or tp (non-GEMM work)
    saved: list[int]  # per saved tensor: 1 or tp
    checkpoint: list[int]
    boundary: list[int]
    inner_boundary: list[int]
    #: (collective, forward?, re-priced at the training precision?) per call
    comm: list[tuple[Collective, bool, bool]]
    comm_fn: Any  # (b, s) -> bytes of each call at the graph's dtype
    sharded_params: frozenset[str]
    cache: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)
    #: per saved tensor: kept as this rank's sequence shard and gathered again in the backward
    #: (a column-parallel GEMM's input under sequence parallelism: runtime/tp.py saved_gathers)
    regather: list[bool] = field(default_factory=list)
    transient: list[int] = field(default_factory=list)

    def comm_bytes(self, b: int, s: int) -> tuple[float, ...]:
        out = self.cache.get((b, s))
        if out is None:
            out = tuple(float(v) for v in self.comm_fn(b, s)) if self.comm else ()
            self.cache[(b, s)] = out
        return out


_COMM_KIND = {"all_reduce": Collective.ALL_REDUCE, "all_gather": Collective.ALL_GATHER,
              "reduce_scatter": Collective.REDUCE_SCATTER, "all_to_all": Collective.ALL_TO_ALL}


def layer_split(template: Template, layout: TPLayout | None, tp: int) -> LayerSplit:
    """Which of the template's work, tensors and parameters ``layout`` splits over tp ranks,
    and the layer's collectives."""
    if layout is None or tp == 1:
        n = len(template.terms)
        return LayerSplit([Split.NONE] * n, [1] * n, [1] * len(template.saved),
                           [1] * len(template.checkpoint), [1] * len(template.boundary),
                           [1] * len(template.inner_boundary), [], None, frozenset(),
                           transient=[1] * len(template.transient))
    gemm, divisor = [], []
    for term in template.terms:
        scale = layout.compute_scale.get(term.name, 1.0)
        div = max(1, round(1.0 / scale))
        divisor.append(div)
        g = layout.gemm_sharding.get(term.name)
        if term.kind is not TermKind.GEMM:
            gemm.append(Split.NONE)
        elif g is GemmSharding.COLUMN:
            gemm.append(Split.COLUMN)
        elif g is GemmSharding.ROW:
            gemm.append(Split.ROW)
        else:
            gemm.append(Split.BATCH if div > 1 else Split.NONE)

    def regathered(t: TensorRef) -> bool:
        """A sequence-sharded tensor a column-parallel GEMM reads gathered: autopar's runtime
        keeps the shard for the GEMM's weight gradient and gathers it again in the backward."""
        return (layout.sequence_parallel and t.reader is not None
                and layout.read_sharded(*t.reader) is False and layout.sharded(t.owner)
                and layout.gemm_sharding.get(t.reader[0]) is GemmSharding.COLUMN)

    def shares(tensors: list[TensorRef]) -> list[int]:
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
    return LayerSplit(gemm, divisor, shares(template.saved), shares(template.checkpoint),
                       shares(template.boundary), shares(template.inner_boundary), comm, fn,
                       layout.sharded_params,
                       regather=[regathered(t) for t in template.saved],
                       transient=shares(template.transient))


#: A device's ``op_table`` entry for a GEMM's bias vector: the broadcast copy of the bias into
#: the GEMM's output that a CPU GEMM makes before accumulating into it (``addmm``'s
#: ``out.copy_(bias.expand(m, n))``), and the bias gradient (a sum over rows), per output
#: element. GPU GEMMs add the bias in their epilogue: GPU tables have no such entry.
BIAS_OP = "linear.bias"


def seq_degree(expr: Any) -> int:
    """Degree of ``expr`` in the sequence symbol (2 for attention scores)."""
    try:
        return int(sympy.degree(sympy.sympify(expr), SEQ))
    except Exception:  # noqa: BLE001 - non-polynomial: treat as linear
        return 1
