"""Analysis pass: FLOPs, memory traffic and saved activations per node and per layer.

Every quantity is a sympy expression in the batch ``b`` and sequence ``s`` symbols, so the
planner evaluates it at any shape without re-tracing. Repeated layers (equal structural
signature) are analyzed once: the representative's per-node costs are copied by position.

Conventions (the ones Megatron-LM and the MFU literature use):

- FLOPs count a multiply-add as 2. GEMMs: ``2 m n k`` (a fused bias add is not counted, as in
  ``torch.utils.flop_counter``); attention (``scaled_dot_product_attention``)
  ``4 b a s_q s_k d`` for the two batched matmuls (masking does not halve it). Elementwise ops and
  reductions count one FLOP per element they produce or reduce; they are memory-bound and the cost
  model prices them by bytes.
- Bytes read and written: every tensor an op reads and writes, except views (no data movement).
- Saved activations: the tensors an op keeps for its backward, by the rules of PyTorch's autograd
  formulas (``derivatives.yaml``); parameters are not activations. Fused attention saves q, k, v,
  the output and the log-sum-exp; dropout saves a one-byte mask. A tensor saved by several ops is
  charged once, to the first; a tensor made before the blocks and read by all of them (masks,
  rotary tables) is charged once, to the layer that made it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import sympy
import torch
import torch.fx

from autopar.ir import (
    META_KEY,
    Layer,
    LayerKind,
    NodeKind,
    TensorSpec,
    dtype_bytes,
    evaluate,
    info,
    iter_tensor_specs,
    op_name,
)
from autopar.passes.infra import PassContext, PassManager, PassResult, graph_pass, graph_property

__all__ = ["analyze", "analyze_graph", "ModelProfile", "LayerCost", "VIEW_OPS", "GEMM_OPS",
           "MATMUL_OPS", "CONV_OPS", "gemm_dims", "conv_dims", "conv_kernel_elements",
           "conv_images", "conv_groups", "conv_groups_index", "conv_is_transposed", "moe_dims",
           "MoEDims", "view_root", "identity_root", "saved_tensors"]

ZERO = sympy.Integer(0)

#: Ops that only change the view of a tensor: no FLOPs, no data movement.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "getitem",
    "alias", "detach", "detach_", "flatten", "unflatten", "as_strided", "narrow",
    "_reshape_alias", "view_as", "expand_as", "sym_size", "lift_fresh_copy", "movedim",
    "diagonal", "unfold", "numpy_T", "_assert_tensor_metadata", "contiguous_noop",
})
#: Ops that create a tensor from nothing (write only).
CREATION_OPS = frozenset({
    "arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full",
    "new_empty", "zeros_like", "ones_like", "full_like", "empty_like", "rand", "randn",
    "randint", "rand_like", "randn_like", "scalar_tensor", "tensor",
})
#: Matrix products: a (batch of) M x K times K x N (:func:`gemm_dims`).
MATMUL_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"})
#: Ops priced as GEMM work: the matrix products, fused attention and convolutions.
#: Convolutions (channels first), priced as GEMMs over their channels.
CONV_OPS = frozenset({"convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                      "conv_transpose2d", "conv_transpose3d"})
GEMM_OPS = MATMUL_OPS | CONV_OPS | {"scaled_dot_product_attention"}
#: Ops whose backward needs their output (saved once, as the output).
_SAVES_OUTPUT = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "tanh",
                           "sigmoid", "relu", "exp", "rsqrt", "sqrt", "reciprocal", "elu"})
#: Ops whose backward needs their (first) input.
_SAVES_INPUT = frozenset({"gelu", "silu", "mish", "leaky_relu", "softplus", "log", "log1p", "sin",
                          "cos", "pow", "hardswish", "hardsigmoid", "abs", "erf", "clamp",
                          "square"})
#: Ops whose backward needs nothing (linear in their inputs, or index-free).
_SAVES_NOTHING = frozenset({"add", "sub", "neg", "sum", "mean", "cat", "stack", "to", "_to_copy",
                            "clone", "contiguous", "copy", "cumsum", "dropout_eval", "mul_scalar",
                            "fill", "masked_fill_scalar", "type_as", "repeat", "flip", "roll",
                            "pad", "constant_pad_nd", "zero", "lift_fresh_copy"})


# ---------------------------------------------------------------------------------------------
# Per-node rules
# ---------------------------------------------------------------------------------------------

def _spec(a: Any) -> TensorSpec | None:
    return info(a).spec if isinstance(a, torch.fx.Node) else None


def _prod(dims: Iterable[sympy.Expr]) -> sympy.Expr:
    out = sympy.Integer(1)
    for d in dims:
        out = out * d
    return out


@dataclass(frozen=True)
class MoEDims:
    """The shapes of an experts operation (runtime/moe.py), sympy in b and s."""

    experts: Any  # E
    rows: Any  # routed rows: tokens x k
    hidden: Any  # H
    gate_up: Any  # rows of gate_up per expert: 2I gated, I not
    inner: Any  # I
    gated: bool


def moe_dims(node: torch.fx.Node) -> MoEDims:
    """The one place an experts operation's shapes are read (its FLOPs and saved tensors here,
    the cost model's grouped GEMMs and all-to-alls)."""
    args = node.args
    x, index, gate_up, down = _spec(args[0]), _spec(args[1]), _spec(args[3]), _spec(args[4])
    return MoEDims(gate_up.shape[0], x.shape[0] * index.shape[1], x.shape[1], gate_up.shape[1],
                   down.shape[-1], bool(args[6]) if len(args) > 6 else True)


def gemm_dims(node: torch.fx.Node) -> tuple[Any, Any, Any, Any] | None:
    """(batch, M, N, K) of a matrix product (:data:`MATMUL_OPS`), sympy in b and s; None for a
    matmul of vectors. The one place GEMM shapes are read: the FLOPs here and the cost model's
    per-shape GEMM efficiency use it."""
    name, args = op_name(node), node.args
    if name == "linear":
        x, w = _spec(args[0]), _spec(args[1])
        return 1, _prod(x.shape[:-1]), w.shape[0], x.shape[-1]
    if name in ("mm", "addmm"):
        a, b = (_spec(args[0]), _spec(args[1])) if name == "mm" else (_spec(args[1]),
                                                                       _spec(args[2]))
        return 1, a.shape[0], b.shape[1], a.shape[1]
    if name in ("bmm", "baddbmm"):
        a, b = (_spec(args[0]), _spec(args[1])) if name == "bmm" else (_spec(args[1]),
                                                                       _spec(args[2]))
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    if name == "matmul":
        a, b, out = _spec(args[0]), _spec(args[1]), info(node).spec
        if a.ndim >= 2 and b.ndim >= 2 and out is not None and out.ndim >= 2:
            return _prod(out.shape[:-2]), out.shape[-2], out.shape[-1], a.shape[-1]
    return None


def conv_dims(node: torch.fx.Node) -> tuple[Any, Any, Any, Any]:
    """(groups, M, N, K) of a convolution as the implicit GEMM cuDNN runs (NVIDIA's
    *Convolutional Layers User's Guide*: M = output pixels N P Q, N = output channels, K = input
    channels times the kernel C R S), per group: M the batch times the output's spatial
    elements, N the output channels per group, K the weight's input channels per group times
    its kernel elements. A transposed convolution is the input-gradient GEMM of one: M the
    input's pixels, N its output channels per group times the kernel, K its input channels per
    group. ``2 groups M N K`` is its FLOPs."""
    x, w = _spec(node.args[0]), _spec(node.args[1])
    kernel = conv_kernel_elements(node)
    groups = conv_groups(node)
    if conv_is_transposed(node):  # weight [C_in, C_out / groups, *kernel]
        return groups, x.numel // x.shape[1], w.shape[1] * kernel, w.shape[0] // groups
    out = info(node).spec
    return groups, out.numel // out.shape[1], w.shape[0] // groups, w.shape[1] * kernel


def conv_kernel_elements(node: torch.fx.Node) -> int:
    """The elements of a convolution's kernel (9 for a 3 x 3 one)."""
    return int(_prod(_spec(node.args[1]).shape[2:]))


def conv_images(node: torch.fx.Node) -> Any:
    """The images (batch) a convolution node convolves: its output's first dimension, 1 for an
    unbatched input (no batch dimension: the output has the weight's rank less one)."""
    out = info(node).spec
    return out.shape[0] if out.ndim == _spec(node.args[1]).ndim else 1


def conv_groups_index(node: torch.fx.Node) -> int:
    """Where a convolution node takes ``groups``: ``conv1d / conv2d / conv3d(input, weight,
    bias, stride, padding, dilation, groups)``, ``conv_transpose*(input, weight, bias, stride,
    padding, output_padding, groups, dilation)``, ``convolution(input, weight, bias, stride,
    padding, dilation, transposed, output_padding, groups)``."""
    return 8 if op_name(node) == "convolution" else 6


def conv_groups(node: torch.fx.Node) -> int:
    """The ``groups`` of a convolution node (1 when not given)."""
    index = conv_groups_index(node)
    groups = node.args[index] if len(node.args) > index else node.kwargs.get("groups", 1)
    return int(groups)


def conv_is_transposed(node: torch.fx.Node) -> bool:
    """A transposed convolution: ``conv_transpose*``, or ``convolution(..., transposed=True)``."""
    name = op_name(node)
    return name.startswith("conv_transpose") or (
        name == "convolution" and len(node.args) > 6 and bool(node.args[6]))


def _gemm_flops(node: torch.fx.Node) -> sympy.Expr:
    name = op_name(node)
    args = node.args
    dims = gemm_dims(node) if name in MATMUL_OPS else None
    if dims is not None:
        batch, m, n, k = dims
        return 2 * batch * m * n * k
    if name == "matmul":  # with a vector operand
        return 2 * info(node).spec.numel * _spec(args[0]).shape[-1]
    if name == "scaled_dot_product_attention":
        q, k, v = _spec(args[0]), _spec(args[1]), _spec(args[2])
        batch = _prod(q.shape[:-2])
        lq, d = q.shape[-2], q.shape[-1]
        lk, dv = k.shape[-2], v.shape[-1]
        return 2 * batch * lq * lk * d + 2 * batch * lq * lk * dv
    if name in CONV_OPS:
        # every output element sums (input channels per group) x kernel products: the weight's
        # dim 1 is C_in / groups (a transposed convolution's C_out / groups, summed per input
        # element), whatever the groups
        groups, m, n, k = conv_dims(node)
        return 2 * groups * m * n * k
    raise AssertionError(name)


def _flops(node: torch.fx.Node, name: str) -> sympy.Expr:
    if name in GEMM_OPS:
        return _gemm_flops(node)
    if name == "moe_experts":  # every token through k experts: two GEMMs each (runtime/moe.py)
        d = moe_dims(node)
        return 2 * d.rows * d.hidden * (d.gate_up + d.inner)
    if name in VIEW_OPS or name in CREATION_OPS or _is_identity(node):
        return ZERO
    out = info(node).spec
    if name in ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
                "cross_entropy_loss", "nll_loss", "nll_loss_forward"):
        first = _spec(node.args[0])
        return first.numel if first is not None else ZERO
    if out is not None:
        return out.numel
    return ZERO


def _bytes(node: torch.fx.Node, name: str) -> tuple[sympy.Expr, sympy.Expr]:
    if name in VIEW_OPS or _is_identity(node):
        return ZERO, ZERO
    written = sum((s.nbytes for s in iter_tensor_specs(info(node).value)), ZERO)
    if name in CREATION_OPS:
        return ZERO, written
    read = ZERO
    seen = set()
    for a in node.all_input_nodes:
        if a in seen:
            continue
        seen.add(a)
        s = info(a).spec
        if s is not None:
            read += s.nbytes
    return read, written


#: A saved tensor: (key for deduplication, its spec).
Saved = tuple[Any, TensorSpec]


def _rg(a: Any) -> bool:
    return isinstance(a, torch.fx.Node) and info(a).requires_grad


def view_root(a: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``a`` is a view of (through any chain of view ops)."""
    while (a.op == "call_function" and op_name(a) in VIEW_OPS and a.args
           and isinstance(a.args[0], torch.fx.Node)):
        a = a.args[0]
    return a


def _is_identity(node: torch.fx.Node) -> bool:
    """Ops that hand back their input tensor itself (same storage, same values)."""
    if node.op != "call_function":
        return False
    name = op_name(node)
    if name in ("alias", "detach", "lift_fresh_copy"):
        return True
    if name == "dropout":
        p = node.args[1] if len(node.args) > 1 else 0.5
        train = node.args[2] if len(node.args) > 2 else True
        return not p or not train
    if name == "to" and node.args and isinstance(node.args[0], torch.fx.Node):
        # aten.to to the tensor's own dtype (HF's `probs.type(value.dtype)`) returns it as is
        src, out = info(node.args[0]).spec, info(node).spec
        return src is not None and out is not None and src.dtype == out.dtype
    return False


def identity_root(a: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``a`` is, through ops that hand back their input (alias, detach, a no-op
    dropout or cast): saved tensors are counted once by it."""
    while _is_identity(a) and isinstance(a.args[0], torch.fx.Node):
        a = a.args[0]
    return a


def _is_activation(a: Any) -> bool:
    """A tensor computed from inputs (not a weight, buffer or constant, nor a view of one)."""
    return isinstance(a, torch.fx.Node) and info(a).spec is not None and info(view_root(a)).kind \
        not in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT)


def saved_tensors(node: torch.fx.Node, name: str) -> list[Saved]:
    """Tensors ``node`` keeps for its backward (activations only)."""
    meta = info(node)
    if not meta.requires_grad:
        return []
    args = node.args
    out: list[Saved] = []

    def keep(a: Any) -> None:
        if _is_activation(a):
            out.append((identity_root(a).name, info(a).spec))

    if name in VIEW_OPS or name in CREATION_OPS or name in _SAVES_NOTHING:
        return []
    if name == "linear":
        if _rg(args[1]):
            keep(args[0])
        if _rg(args[0]):
            keep(args[1])
    elif name in ("mm", "bmm", "matmul"):
        if _rg(args[1]):
            keep(args[0])
        if _rg(args[0]):
            keep(args[1])
    elif name in ("addmm", "baddbmm"):
        if _rg(args[2]):
            keep(args[1])
        if _rg(args[1]):
            keep(args[2])
    elif name == "scaled_dot_product_attention":
        for a in args[:3]:
            keep(a)
        spec = meta.spec
        out.append((node.name, spec))
        lse = TensorSpec(spec.shape[:-1], torch.float32)
        out.append(((node.name, "lse"), lse))
    elif name in ("layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm"):
        keep(args[0])
        x = _spec(args[0])
        normalized = args[1] if name in ("layer_norm", "native_layer_norm", "rms_norm") else [1]
        rows = _prod(x.shape[: x.ndim - len(normalized)])
        stats = 1 if name == "rms_norm" else 2
        out.append(((node.name, "stats"), TensorSpec((rows * stats,), torch.float32)))
    elif name in _SAVES_OUTPUT:
        out.append((node.name, meta.spec))
    elif name in _SAVES_INPUT:
        keep(args[0])
    elif name in ("mul", "div"):
        a, b = args[0], args[1]
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            if name == "div" or _rg(a):
                keep(b)
            if name == "div" and _rg(b) or name == "mul" and _rg(b):
                keep(a)
    elif name in ("dropout", "native_dropout", "feature_dropout"):
        p = args[1] if len(args) > 1 else 0.5
        train = args[2] if len(args) > 2 else True
        if p and train:
            spec = meta.spec if meta.spec is not None else _spec(args[0])
            out.append(((node.name, "mask"), TensorSpec(spec.shape, torch.bool)))
    elif name == "moe_experts":  # what runtime/moe.py's autograd keeps, per routed row
        d, dtype = moe_dims(node), _spec(args[0]).dtype
        out.append(((node.name, "rows"), TensorSpec((d.rows, d.hidden), dtype)))
        out.append(((node.name, "hidden"), TensorSpec((d.rows, d.gate_up), dtype)))
        out.append(((node.name, "act"), TensorSpec((d.rows, 2 * d.inner if d.gated
                                                    else d.inner), dtype)))
        out.append(((node.name, "out"), TensorSpec((d.rows, d.hidden), dtype)))
        out.append(((node.name, "weights"), TensorSpec((d.rows,), _spec(args[2]).dtype)))
        out.append(((node.name, "routes"), TensorSpec((2 * d.rows,), torch.int64)))
    elif name == "embedding":
        keep(args[1])
    elif name in ("cross_entropy_loss",):
        logits = _spec(args[0])
        out.append(((node.name, "log_probs"), logits))
        keep(args[1])
    elif name in ("nll_loss", "nll_loss_forward", "nll_loss2d"):
        keep(args[1])
    elif name in ("where",):
        keep(args[0])
    elif name in ("index", "gather", "index_select", "masked_fill", "scatter", "take_along_dim"):
        for a in node.all_input_nodes:
            if info(a).spec is not None and not info(a).spec.is_float:
                keep(a)
    else:
        for a in node.all_input_nodes:
            if _rg(a) or (info(a).spec is not None and info(a).spec.is_float):
                keep(a)
    return out


# ---------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------

def _analyze_node(node: torch.fx.Node) -> None:
    meta = info(node)
    if node.op != "call_function":
        return
    name = op_name(node)
    meta.is_gemm = name in GEMM_OPS
    meta.flops = _flops(node, name)
    meta.bytes_read, meta.bytes_written = _bytes(node, name)


@graph_property("analyzed")
def analyzed(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every GEMM carries its analysis (is_gemm and its FLOPs)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) in GEMM_OPS and META_KEY in node.meta \
                and not info(node).is_gemm:
            return f"{node.name} ({op_name(node)}) has no analysis"
    return None


@graph_pass(requires=("gemms_are_linear",), ensures=("analyzed",))
def analyze_graph(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotate every node's costs; repeated layers reuse their representative's numbers."""
    captured = ctx.captured
    nodes = {n.name: n for n in gm.graph.nodes}
    done: set[str] = set()
    representative: dict[str, Layer] = {}
    for layer in captured.layers:
        rep = representative.setdefault(layer.signature, layer)
        if rep is layer:
            for name in layer.nodes:
                _analyze_node(nodes[name])
        else:  # same structure: copy costs position by position
            for name, rep_name in zip(layer.nodes, rep.nodes):
                src, dst = info(nodes[rep_name]), info(nodes[name])
                dst.is_gemm, dst.flops = src.is_gemm, src.flops
                dst.bytes_read, dst.bytes_written = src.bytes_read, src.bytes_written
        done.update(layer.nodes)
    for node in gm.graph.nodes:
        if node.name not in done:
            _analyze_node(node)
    _charge_saved_activations(gm, captured.layers)
    return PassResult(gm, False)


def _charge_saved_activations(gm: torch.fx.GraphModule, layers: list[Layer]) -> None:
    layer_index = {layer.name: layer.index for layer in layers}
    layer_kind = {layer.name: layer.kind for layer in layers}
    nodes = {n.name: n for n in gm.graph.nodes}
    charged: set[Any] = set()
    for node in gm.graph.nodes:
        meta = info(node)
        meta.saved_bytes = ZERO
        meta.saved_float_elems = ZERO
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for key, spec in saved_tensors(node, op_name(node)):
            if key in charged:
                continue
            charged.add(key)
            target = node
            producer = nodes.get(key) if isinstance(key, str) else None
            if producer is not None:
                p_layer = info(producer).layer
                if (layer_kind.get(p_layer) is LayerKind.PRE
                        and layer_index.get(info(node).layer, 0) > layer_index.get(p_layer, 0) + 1):
                    target = producer  # a table made once before the blocks and read by all
            tmeta = info(target)
            tmeta.saved_bytes = tmeta.saved_bytes + spec.nbytes
            if spec.is_float:
                tmeta.saved_float_elems = tmeta.saved_float_elems + spec.numel


# ---------------------------------------------------------------------------------------------
# Per-layer summary
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerCost:
    """What one layer costs for one forward, as expressions in ``b`` and ``s``."""

    name: str
    index: int
    kind: LayerKind
    signature: str
    params: int
    param_bytes: int
    flops: sympy.Expr
    gemm_flops: sympy.Expr
    bytes_moved: sympy.Expr
    saved_bytes: sympy.Expr
    saved_float_elems: sympy.Expr
    #: Bytes of activations produced at or before this layer and used after it: what a
    #: pipeline cut right after this layer sends (zero for the last layer).
    boundary_bytes: sympy.Expr
    #: Names of the tensors crossing that cut.
    boundary_tensors: tuple[str, ...]
    modules: tuple[str, ...] = ()
    #: Bytes per floating element in the captured graph (4 for an fp32 capture).
    graph_float_bytes: int = 4

    def at(self, **sizes: int) -> dict[str, float]:
        return {
            "flops": evaluate(self.flops, **sizes),
            "gemm_flops": evaluate(self.gemm_flops, **sizes),
            "bytes_moved": evaluate(self.bytes_moved, **sizes),
            "saved_bytes": evaluate(self.saved_bytes, **sizes),
            "boundary_bytes": evaluate(self.boundary_bytes, **sizes),
        }

    def saved_bytes_at_precision(self, float_bytes: int, **sizes: int) -> float:
        """Saved activations with floating tensors stored at ``float_bytes`` per element
        (2 for bf16) and the rest (masks, indices) as captured."""
        total = evaluate(self.saved_bytes, **sizes)
        floats = evaluate(self.saved_float_elems, **sizes)
        return total - floats * self.graph_float_bytes + floats * float_bytes


@dataclass(frozen=True)
class ModelProfile:
    """The analysis of a whole captured model."""

    layers: tuple[LayerCost, ...]
    params: int
    param_bytes: int
    #: Layer signatures -> how many layers share it (the repeated blocks).
    repeated: dict[str, int] = field(default_factory=dict)

    @property
    def flops(self) -> sympy.Expr:
        return sympy.Add(*(layer.flops for layer in self.layers))

    @property
    def gemm_flops(self) -> sympy.Expr:
        return sympy.Add(*(layer.gemm_flops for layer in self.layers))

    @property
    def saved_bytes(self) -> sympy.Expr:
        return sympy.Add(*(layer.saved_bytes for layer in self.layers))

    def forward_flops(self, **sizes: int) -> int:
        return int(evaluate(self.flops, **sizes))

    @property
    def blocks(self) -> tuple[LayerCost, ...]:
        return tuple(layer for layer in self.layers if layer.kind is LayerKind.BLOCK)


def profile_layers(captured: Any) -> ModelProfile:
    """Sum node costs per layer and find what crosses each layer boundary."""
    gm = captured.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    index = {layer.name: layer.index for layer in captured.layers}
    float_bytes = max((dtype_bytes(p.spec.dtype) for p in captured.params.values()
                       if p.spec.dtype.is_floating_point), default=4)

    # last layer that reads each activation
    last_use: dict[str, int] = {}
    produced_in: dict[str, int] = {}
    for node in gm.graph.nodes:
        meta = info(node)
        if meta.kind in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT):
            continue
        if node.op == "output":
            continue
        produced_in[node.name] = index.get(meta.layer, 0)
        for user in node.users:
            if user.op == "output":
                continue
            li = index.get(info(user).layer, 0)
            last_use[node.name] = max(last_use.get(node.name, -1), li)

    owner_params: dict[str, list[str]] = {layer.name: list(layer.params) for layer in captured.layers}
    param_numel = {p.fqn: int(p.spec.numel) for p in captured.params.values()}
    param_nbytes = {p.fqn: int(p.spec.nbytes) for p in captured.params.values()}
    cache: dict[str, tuple] = {}
    out = []
    repeated: dict[str, int] = {}
    for layer in captured.layers:
        repeated[layer.signature] = repeated.get(layer.signature, 0) + 1
        key = layer.signature
        if key in cache and layer.kind is LayerKind.BLOCK:
            flops, gemm, moved, saved, saved_f = cache[key]
        else:
            metas = [info(nodes[n]) for n in layer.nodes]
            flops = sympy.Add(*(m.flops for m in metas))
            gemm = sympy.Add(*(m.flops for m in metas if m.is_gemm))
            moved = sympy.Add(*(m.bytes_read + m.bytes_written for m in metas))
            saved = sympy.Add(*(m.saved_bytes for m in metas))
            saved_f = sympy.Add(*(m.saved_float_elems for m in metas))
            cache[key] = (flops, gemm, moved, saved, saved_f)
        # activations made before the boundary after this layer and read after it
        crossing = [name for name, li in produced_in.items()
                    if li <= layer.index < last_use.get(name, -1)
                    and info(nodes[name]).spec is not None]
        boundary = sympy.Add(*(info(nodes[n]).spec.nbytes for n in crossing)) if crossing else ZERO
        params = owner_params.get(layer.name, [])
        # parameters used by this layer but owned elsewhere are not counted twice
        out.append(LayerCost(
            name=layer.name, index=layer.index, kind=layer.kind, signature=layer.signature,
            params=sum(param_numel[p] for p in params),
            param_bytes=sum(param_nbytes[p] for p in params),
            flops=flops, gemm_flops=gemm, bytes_moved=moved, saved_bytes=saved,
            saved_float_elems=saved_f, boundary_bytes=boundary,
            boundary_tensors=tuple(crossing), modules=layer.modules,
            graph_float_bytes=float_bytes))
    return ModelProfile(layers=tuple(out), params=captured.num_params,
                        param_bytes=sum(int(p.spec.nbytes) for p in captured.params.values()),
                        repeated=repeated)


def analyze(captured: Any) -> ModelProfile:
    """Run the analysis pass on a CapturedGraph and summarise it per layer (cached)."""
    profile = getattr(captured, "profile", None)
    if profile is not None:
        return profile
    ctx = PassContext(captured=captured)
    PassManager([analyze_graph]).run(captured.gm, ctx)
    profile = profile_layers(captured)
    captured.remember_profile(profile)
    return profile
