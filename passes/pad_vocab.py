"""Pad the vocabulary: a captured model whose word embedding and LM head have ``V`` rows becomes
one whose rows are ``V'``, the next multiple of ``multiple * tp`` (Megatron-LM's
``--make-vocab-size-divisible-by 128``, Shoeybi et al. 2019), with the padded classes masked.

Why: tensor parallelism splits the vocabulary over the tp ranks (the embedding by rows, the LM head
by output features, the loss over classes), so ``V`` must divide by tp; and the LM head's GEMM runs
at full speed only when its output dimension is a multiple of the GPU's tile (GPT-2's 50257 ->
50304). Numerics are unchanged:

- the padded embedding rows are never read (token ids are below ``V``: the step refuses a batch
  with one outside, :func:`autopar.passes.index_checks.index_bounds`);
- the padded LM-head rows (and bias entries) start at zero; right before every operation that
  reduces over the classes (``cross_entropy_loss``, ``log_softmax``) the padded logits are set to
  ``-inf`` (``masked_fill`` with a constant mask), so they add exactly ``0`` to the softmax's sum
  and receive a gradient of exactly ``0``; their weights stay zero under any optimizer;
- logits the graph returns are cut back to ``V`` columns.

Between the LM head and those consumers the logits may pass through views that keep the classes as
the last dim (``view``/``reshape``/``flatten`` of the leading dims, ``slice`` of a leading dim),
dtype casts and element-wise maps with scalars (``tanh`` soft-capping, a temperature). Anything
else (a label-smoothed or class-weighted loss, a sum over the classes, a transpose) cannot be padded
without changing the result: :func:`pad_vocabulary` then leaves the model as it is and says why
(:attr:`VocabPadding.skipped`).

The result is a new :class:`~autopar.captured.CapturedGraph` (the input is not modified) and the
map from each padded tensor's FQN to its logical shape, which the sharded program keeps so that
everything that enters or leaves it (state dicts, checkpoints, ``save_pretrained``) has the model's
own shapes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx

from autopar.captured import CapturedGraph
from autopar.ir import META_KEY, NodeInfo, NodeKind, TensorSpec, copy_graph_module, info, op_name
from autopar.passes.index_checks import reads_model_input

__all__ = ["VocabPadding", "pad_vocabulary", "padded_size", "MASK_CONSTANT"]

aten = torch.ops.aten

#: The placeholder (and constant) name of the padded-class mask.
MASK_CONSTANT = "autopar_vocab_padding_mask"

#: Views that keep the classes as the last dim (checked per node: which dims they touch).
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view"})
_KEEPS = frozenset({"contiguous", "clone", "alias", "detach", "to", "_to_copy", "type_as"})
_SCALAR_MAPS = frozenset({"mul", "div", "add", "sub", "tanh", "neg"})


def padded_size(vocab: int, multiple: int, tp: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple * tp`` (``multiple`` 0: to a multiple of
    tp only, which is what splitting needs)."""
    step = max(1, multiple) * tp
    return -(-vocab // step) * step


@dataclass(frozen=True)
class VocabPadding:
    """What :func:`pad_vocabulary` did."""

    #: The (possibly) padded graph: ``captured`` itself when nothing was padded.
    captured: CapturedGraph
    #: The model's vocabulary (0: the model has none: no embedding reads token ids).
    vocab: int = 0
    #: The padded vocabulary (== vocab when nothing was padded).
    padded: int = 0
    #: FQN -> the model's (logical) shape of every padded tensor.
    logical_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: Why the vocabulary was left as it is (None: padded, or nothing to pad).
    skipped: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.logical_shapes)


def _rows(node: torch.fx.Node) -> int | None:
    spec = info(node).spec
    if spec is None or not spec.ndim or not spec.shape[0].is_Integer:
        return None
    return int(spec.shape[0])


def _last(node: torch.fx.Node) -> Any:
    spec = info(node).spec
    return spec.shape[-1] if spec is not None and spec.ndim else None


def _spec(node: torch.fx.Node) -> TensorSpec:
    spec = info(node).spec
    if spec is None:
        raise _Refused(f"{node.name} has no tensor shape")
    return spec


def _word_embeddings(gm: torch.fx.GraphModule) -> tuple[int, list[torch.fx.Node]]:
    """(V, the embedding weight placeholders with V rows that look token ids up): the largest
    table read with model inputs."""
    found: list[tuple[int, torch.fx.Node]] = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and op_name(n) == "embedding" and reads_model_input(n.args[1]):
            w = n.args[0]
            if isinstance(w, torch.fx.Node) and w.op == "placeholder" \
                    and info(w).kind is NodeKind.PARAMETER and _rows(w):
                found.append((_rows(w), w))  # type: ignore[arg-type]
    if not found:
        return 0, []
    vocab = max(v for v, _ in found)
    return vocab, list(dict.fromkeys(w for v, w in found if v == vocab))


class _Refused(Exception):
    pass


def _scalar(a: Any) -> bool:
    return isinstance(a, (int, float, bool))


def _follow(head: torch.fx.Node, vocab: int
            ) -> tuple[list[torch.fx.Node], list[tuple[torch.fx.Node, torch.fx.Node]]]:
    """The nodes that carry the LM head's classes as their last dim (the head first), and the
    (producer, consumer) edges where padded classes must be masked (a loss, a log-softmax) or
    cut (the graph output). Past a log-softmax the padded classes are -inf log-probabilities:
    only views, a loss that picks the targets' (``nll_loss``) and the output may read them.
    Raises _Refused naming the first node it cannot pad through."""
    path: list[torch.fx.Node] = []
    edges: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    todo: list[tuple[torch.fx.Node, bool]] = [(head, False)]  # (node, past a log-softmax)
    seen: set[torch.fx.Node] = set()
    while todo:
        n, logprobs = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        path.append(n)
        ndim = _spec(n).ndim
        for user in n.users:
            name = op_name(user) if user.op == "call_function" else user.op
            args: Any = user.args  # fx's Argument union: read by position below
            if user.op == "output":
                edges.append((n, user))
            elif name in _RESHAPES:
                shape = list(args[1])
                if args[0] is not n or not shape or shape[-1] not in (vocab, -1) \
                        or _last(user) != vocab:
                    raise _Refused(f"{user.name}: a {name} that moves the classes")
                todo.append((user, logprobs))
            elif name == "flatten":
                start = args[1] if len(args) > 1 else 0
                end = args[2] if len(args) > 2 else -1
                if end % ndim == ndim - 1 or start % ndim == ndim - 1:
                    raise _Refused(f"{user.name}: a flatten of the classes")
                todo.append((user, logprobs))
            elif name == "slice":
                dim = args[1] if len(args) > 1 else 0
                if dim % ndim == ndim - 1:
                    raise _Refused(f"{user.name}: a slice of the classes")
                todo.append((user, logprobs))
            elif name in _KEEPS and args[0] is n:
                todo.append((user, logprobs))
            elif logprobs:
                if name not in ("nll_loss", "nll_loss_nd") or args[0] is not n or (
                        len(args) > 2 and args[2] is not None):
                    raise _Refused(f"{user.name} ({name}): reads log-probabilities of every "
                                   "class")
            elif name == "cross_entropy_loss":
                weight = args[2] if len(args) > 2 else user.kwargs.get("weight")
                smoothing = args[5] if len(args) > 5 else user.kwargs.get(
                    "label_smoothing", 0.0)
                if args[0] is not n or weight is not None or smoothing:
                    raise _Refused(f"{user.name}: a class-weighted or label-smoothed loss sums "
                                   "over every class")
                if ndim != 2:
                    raise _Refused(f"{user.name}: a loss over the classes in dim 1 of a "
                                   f"{ndim}-d tensor")
                edges.append((n, user))
            elif name in ("log_softmax", "_log_softmax"):
                dim = args[1] if len(args) > 1 else user.kwargs.get("dim")
                if not isinstance(dim, int) or dim % ndim != ndim - 1:
                    raise _Refused(f"{user.name}: a log-softmax over dim {dim}")
                edges.append((n, user))
                todo.append((user, True))
            elif name in _SCALAR_MAPS and args[0] is n \
                    and all(_scalar(a) for a in args[1:]):
                todo.append((user, logprobs))
            else:
                raise _Refused(f"{user.name} ({name}) reads the logits")
    return path, edges


def _only_read_as_vocabulary(tables: list[torch.fx.Node], heads: list[torch.fx.Node]) -> None:
    """Every tensor about to be padded is read only as a table of token rows (``embedding``)
    or as an LM head's weight or bias: anything else (a norm of the table, a second product)
    would see the padded rows."""
    allowed = set(heads)
    weights = set(tables)
    for h in heads:
        weights.update(a for a in h.args[1:3] if isinstance(a, torch.fx.Node))
    for w in weights:
        for user in w.users:
            if user in allowed or (user.op == "call_function" and op_name(user) == "embedding"
                                   and user.args[0] is w):
                continue
            raise _Refused(f"{user.name} ({op_name(user) if user.op == 'call_function' else user.op}) "
                           f"reads {info(w).fqn or w.name} other than as a vocabulary")


def _lm_heads(gm: torch.fx.GraphModule, vocab: int) -> list[torch.fx.Node]:
    """``linear`` nodes whose weight has ``vocab`` output features."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and op_name(n) == "linear":
            w = n.args[1]
            if isinstance(w, torch.fx.Node) and w.op == "placeholder" \
                    and info(w).kind is NodeKind.PARAMETER and _rows(w) == vocab \
                    and _last(n) == vocab:
                out.append(n)
    return out


def _widen(node: torch.fx.Node, vocab: int, padded: int, dim: int = -1) -> None:
    spec = _spec(node)
    shape = list(spec.shape)
    assert shape[dim] == vocab, (node.name, shape, vocab)
    shape[dim] = sympy.Integer(padded)
    info(node).value = TensorSpec(tuple(shape), spec.dtype)


def pad_vocabulary(captured: CapturedGraph, multiple: int, tp: int) -> VocabPadding:
    """``captured`` with its vocabulary padded to a multiple of ``multiple * tp`` (see the module
    docstring); ``multiple`` 0 pads only where tp does not divide the vocabulary. Nothing to pad
    (no token embedding, or the vocabulary already a multiple) returns ``captured`` itself."""
    vocab, tables = _word_embeddings(captured.gm)
    if not vocab:
        return VocabPadding(captured)
    padded = padded_size(vocab, multiple, tp)
    if padded == vocab:
        return VocabPadding(captured, vocab, vocab)
    heads = _lm_heads(captured.gm, vocab)
    try:
        walks = [_follow(h, vocab) for h in heads]
        _only_read_as_vocabulary(tables, heads)
    except _Refused as why:
        return VocabPadding(captured, vocab, vocab, skipped=str(why))

    gm, env = copy_graph_module(captured.gm)
    weights = {env[w] for w in tables}
    for h in heads:
        head_args: Any = h.args
        weights.add(env[head_args[1]])
        if len(head_args) > 2 and isinstance(head_args[2], torch.fx.Node):
            weights.add(env[head_args[2]])
    fqns: dict[str, tuple[int, ...]] = {}
    for w in weights:
        fqns[info(w).fqn or w.name] = tuple(int(d) for d in _spec(w).shape)
        _widen(w, vocab, padded, dim=0)
    layer_of = {name: layer for layer in captured.layers for name in layer.nodes}
    added: dict[str, list[tuple[str, str]]] = {}  # layer -> (after node, new node)

    mask_node = None
    if any(edges for _, edges in walks):
        last_constant = [n for n in gm.graph.nodes if n.op == "placeholder"
                         and info(n).kind in (NodeKind.PARAMETER, NodeKind.BUFFER,
                                              NodeKind.CONSTANT)][-1]
        with gm.graph.inserting_after(last_constant):
            mask_node = gm.graph.placeholder(MASK_CONSTANT)
        mask_node.meta[META_KEY] = NodeInfo(NodeKind.CONSTANT, TensorSpec(
            (sympy.Integer(padded),), torch.bool), fqn=MASK_CONSTANT)
    for path, edges in walks:
        for n in path:
            _widen(env[n], vocab, padded)
            if op_name(n) in _RESHAPES:
                view_args: Any = env[n].args
                sizes = list(view_args[1])
                if sizes[-1] == vocab:
                    sizes[-1] = padded
                    env[n].args = (view_args[0], sizes, *view_args[2:])
        for producer, consumer in edges:
            src, dst = env[producer], env[consumer]
            spec = _spec(src)
            layer = info(src).layer
            with gm.graph.inserting_after(src):
                if consumer.op == "output":
                    cut = gm.graph.call_function(aten.slice.Tensor, (src, -1, 0, vocab))
                    shape = (*spec.shape[:-1], sympy.Integer(vocab))
                    cut.meta[META_KEY] = NodeInfo(NodeKind.OP, TensorSpec(shape, spec.dtype),
                                                  module_path=info(src).module_path, layer=layer)
                else:
                    cut = gm.graph.call_function(aten.masked_fill.Scalar,
                                                 (src, mask_node, -math.inf))
                    cut.meta[META_KEY] = NodeInfo(NodeKind.OP, spec,
                                                  module_path=info(src).module_path, layer=layer)
            dst.replace_input_with(src, cut)
            if src.name in layer_of:
                added.setdefault(layer_of[src.name].name, []).append((src.name, cut.name))
    gm.graph.lint()
    gm.recompile()

    layers = []
    for old in captured.layers:
        names = list(old.nodes)
        for after, new in added.get(old.name, []):
            names.insert(names.index(after) + 1, new)
        layers.append(dataclasses.replace(old, nodes=tuple(names)))
    by_name = {n.name: n for n in gm.graph.nodes}
    params = {k: dataclasses.replace(p, spec=_spec(by_name[k])) if k in by_name
              and (info(by_name[k]).fqn or k) in fqns else p for k, p in captured.params.items()}
    constants = dict(captured.constants)
    if mask_node is not None:
        constants[mask_node.name] = torch.arange(padded) >= vocab
    padded_graph = dataclasses.replace(captured, gm=gm, params=params, constants=constants,
                                       layers=layers)
    return VocabPadding(padded_graph, vocab, padded, fqns)
