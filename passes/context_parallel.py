"""Context parallelism as a graph transform: the per-rank program of a sequence split over cp ranks.

Under context parallelism every rank runs the same program on its own tokens of each sequence
(the head-tail layout of :mod:`autopar.runtime.cp`). Most of a transformer is token-wise and
runs unchanged on a piece of the sequence: GEMMs over features, norms over the hidden dim,
element-wise ops, the embedding lookup. What is not, :func:`context_parallelize` rewrites:

- ``scaled_dot_product_attention`` becomes ``cp.attention(cp, q, k, v, is_causal, scale)``:
  exact attention over the whole sequence's keys and values (ring or all-gather);
- ``arange(s)`` (a token's index: position ids, rotary positions) becomes
  ``cp.positions(cp, arange(s))``: the tokens' true positions;
- a dropout (``tp.dropout``) learns which dim holds the tokens: its mask is drawn for the whole
  sequence and this rank's tokens kept, so every plan drops what one device drops;
- a slice ``table[..., 0:s]`` of a parameter, buffer or constant along a sequence-long dim (BERT's
  ``position_ids`` buffer, a rotary cos/sin cache) becomes ``cp.take_positions(cp, table, dim,
  s)``: the rows at the true positions;
- a token-mean loss (``cross_entropy`` / ``nll_loss`` / the vocabulary-parallel cross-entropy,
  ``reduction="mean"``, no class weights) becomes ``cp.token_mean(cp, loss(reduction="sum"),
  target, ignore_index)``: this rank's sum times ``cp / N`` (N: the counted tokens of all cp
  ranks), so the data-parallel engine's average over replicas is one device's mean even when
  ranks count different tokens (``ignore_index``).

Attention written out by hand (``softmax(q k^T scale + causal mask) v``) is first made one
``scaled_dot_product_attention`` where it measurably computes one
(:mod:`autopar.passes.attention_fusion`). Everything else that would mix tokens across the
sequence is refused by name (:class:`autopar.errors.ShardingError`), never run on a piece:
attention written out otherwise (a ``[.., s, s]`` score tensor, a product contracting the
sequence, a softmax along it: a padding mask, a bias, dropout on the probabilities), an
attention mask (data-dependent: the attention-mask simplification turns causal and all-true
masks into ``is_causal``), attention dropout, a slice, gather, concatenation or cumulative op
along the sequence (BERT's pooler reading token 0), a reduction over the sequence that is not the
whole-tensor loss.

Which dims are the sequence is read from the captured specs: every tensor's shape is symbolic in
``b`` and ``s`` (autopar/ir.py), and a dim whose size involves ``s`` holds tokens.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from autopar.errors import ShardingError
from autopar.ir import META_KEY, SEQ, NodeInfo, NodeKind, TensorSpec, info, op_name
from autopar.passes.attention_fusion import fuse_written_attention
from autopar.passes.infra import PassContext, PassResult, call_like, graph_pass, graph_property
from autopar.passes.loss_reduction import TOKEN_LOSSES, token_loss_args
from autopar.runtime import cp as cp_runtime
from autopar.runtime import tp as tp_runtime

__all__ = ["context_parallelize", "context_parallel_pass", "sequence_split"]

aten = torch.ops.aten

#: Ops that take one ``dim`` argument (position 1) and mix or move tokens along it.
_DIM_OPS = {"softmax": 1, "_softmax": 1, "log_softmax": 1, "_log_softmax": 1, "cumsum": 1,
            "cumprod": 1, "logcumsumexp": 1, "cummax": 1, "cummin": 1, "sort": 1, "topk": 2,
            "index_select": 1, "gather": 1, "select": 1, "narrow": 1, "flip": 1, "roll": 2,
            "unbind": 1, "split": 2, "split_with_sizes": 2, "chunk": 2}
#: Reductions: mixing tokens when a reduced dim holds them (a whole-tensor reduction is the loss).
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "logsumexp",
               "var_mean", "std_mean", "argmax", "argmin", "any", "all", "norm", "linalg_vector_norm"}
_MATMULS = {"mm", "bmm", "matmul", "baddbmm", "addmm"}
#: Normalizations over every dim but the channels (dim 1): the batch's and the tokens'.
_BATCH_NORMS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                "_native_batch_norm_legit_no_training", "instance_norm"}
_SDPA = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}


def _spec(node: Any) -> TensorSpec | None:
    if not isinstance(node, torch.fx.Node) or META_KEY not in node.meta:
        return None
    return info(node).spec


def _holds_tokens(expr: Any) -> bool:
    return SEQ in getattr(expr, "free_symbols", ())


def _seq_dims(spec: TensorSpec | None) -> list[int]:
    return [] if spec is None else [d for d, e in enumerate(spec.shape) if _holds_tokens(e)]


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _where(node: torch.fx.Node) -> str:
    meta = info(node) if META_KEY in node.meta else None
    at = f" in {meta.module_path}" if meta is not None and meta.module_path else ""
    return f"{node.name} ({op_name(node)}{at})"


def _refuse(node: torch.fx.Node, why: str, fix: str) -> ShardingError:
    return ShardingError(f"context parallelism cannot split the sequence through {_where(node)}",
                         expected="token-wise ops, and attention as scaled_dot_product_attention",
                         found=why, fix=fix)


_UNRECOGNIZED = ("write attention as torch.nn.functional.scaled_dot_product_attention (with "
                 "is_causal instead of a mask), or plan with cp=1")


def _is_full_slice(node: torch.fx.Node) -> bool:
    args = list(node.args) + [None] * 4
    start, end = args[2], args[3]
    if start not in (None, 0):
        return False
    if end is None or (isinstance(end, int) and end >= 2 ** 62):
        return True
    src, out = _spec(node.args[0]), _spec(node)
    if src is None or out is None:
        return False
    dim = _norm_dim(args[1] if args[1] is not None else 0, len(src.shape))
    return bool(src.shape[dim] == out.shape[dim])


def _check_token_wise(node: torch.fx.Node) -> None:
    """Raise if ``node`` mixes tokens along the sequence (what a piece of it cannot compute)."""
    name = op_name(node)
    out = _spec(node)
    if out is not None and len(_seq_dims(out)) > 1 and name not in ("expand", "view", "reshape"):
        raise _refuse(node, f"an output of shape {out.shape} with two sequence dims (attention "
                            "scores computed by hand)", _UNRECOGNIZED)
    first = node.args[0] if node.args else None
    src = _spec(first)
    if src is None:
        return
    seq = _seq_dims(src)
    if not seq:
        return
    ndim = len(src.shape)
    if name in _MATMULS:
        a, b = (node.args[1], node.args[2]) if name in ("baddbmm", "addmm") else node.args[:2]
        spec_a = _spec(a)
        if spec_a is not None and _holds_tokens(spec_a.shape[-1]):
            raise _refuse(node, f"a product contracting a sequence dim ({spec_a.shape})",
                          _UNRECOGNIZED)
        return
    if name == "slice":
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
        if dim in seq and not _is_full_slice(node):
            raise _refuse(node, f"a slice along the sequence (dim {dim} of {src.shape})",
                          "shift targets outside the model (pass labels already shifted), or "
                          "plan with cp=1")
        return
    if name == "cat":
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0,
                        len(_spec(node.args[0][0]).shape) if _spec(node.args[0][0]) else 1)
        pieces = [_spec(t) for t in node.args[0]]
        if any(p is not None and dim in _seq_dims(p) for p in pieces):
            raise _refuse(node, f"a concatenation along the sequence (dim {dim})",
                          "plan with cp=1")
        return
    if name in _DIM_OPS:
        pos = _DIM_OPS[name]
        dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        if any(isinstance(d, int) and _norm_dim(d, ndim) in seq for d in dims):
            raise _refuse(node, f"{name} along the sequence (dim {dims} of {src.shape})",
                          _UNRECOGNIZED if "softmax" in name else "plan with cp=1")
        return
    if name in _BATCH_NORMS and any(d != 1 for d in seq):
        raise _refuse(node, f"a {name} over the tokens ({src.shape}: its statistics are the "
                            "whole sequence's)", "plan with cp=1")
    if name in _REDUCTIONS:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim is None or dim == [] or dim == ():
            return  # a whole-tensor reduction: the loss (each rank's mean over its tokens)
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        if any(isinstance(d, int) and _norm_dim(d, ndim) in seq for d in dims):
            raise _refuse(node, f"a {name} over the sequence (dim {dims} of {src.shape})",
                          "pool outside the sequence-parallel part, or plan with cp=1")
        return
    if name in ("convolution", "conv1d", "conv2d") and 2 in seq or name in (
            "constant_pad_nd", "pad") and any(d >= ndim - len(node.args[1]) // 2 for d in seq):
        raise _refuse(node, f"a {name} across tokens ({src.shape})", "plan with cp=1")


def context_parallelize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new per-rank program computing ``gm`` on this rank's tokens (``gm`` is not changed);
    it reads a :class:`autopar.runtime.cp.CPGroup` from a placeholder ``cp``. Attention written
    out by hand is first made one ``scaled_dot_product_attention`` where it measurably is one
    (``passes/attention_fusion.py``)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and META_KEY in n.meta
              and info(n).kind is NodeKind.INPUT]
    if inputs and not any(_seq_dims(_spec(n)) for n in inputs):
        raise ShardingError(
            "context parallelism needs the sequence length symbolic in the captured graph",
            expected="an input dim whose size is the symbol s (torch.export traced the "
                     "sequence as dynamic)",
            found="no input dim holds tokens: the capture kept the sequence length fixed "
                  f"({', '.join(f'{n.name} {_spec(n)}' for n in inputs[:3])})",
            fix="let the sequence length vary in the model (a slice of a fixed-size buffer "
                "by it, such as a causal mask buffer, pins it: build the mask from "
                "torch.arange or use is_causal), or plan with cp=1")
    gm, fused = _written_attention_fused(gm)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    graph.eliminate_dead_code()  # what nothing reads cannot mix tokens
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    anchor = next((n for n in placeholders if META_KEY in n.meta
                   and info(n).kind is NodeKind.COMMUNICATOR), None)
    if any(n.name == "cp" for n in placeholders):
        raise ShardingError("the program already reads a context-parallel group",
                            fix="context_parallelize a program once")
    with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(
            placeholders[0] if placeholders else None):
        cp = graph.placeholder("cp")
    cp.meta[META_KEY] = NodeInfo(NodeKind.COMMUNICATOR)
    tables = {n for n in placeholders if META_KEY in n.meta and info(n).kind in (
        NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT)}
    attention = 0
    refused: list[ShardingError] = []
    for node in nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        target_name = getattr(node.target, "__name__", "")
        if name in _SDPA or target_name == "attention_dropout":
            _rewrite_attention(graph, node, cp)
            attention += 1
        elif name == "arange" and _is_token_index(node):
            with graph.inserting_after(node):
                new = call_like(graph, cp_runtime.positions, (cp, node), {}, node)
            node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        elif name == "slice" and node.args and node.args[0] in tables and not _is_full_slice(node):
            _rewrite_table_slice(graph, node, cp)
        elif node.target is tp_runtime.dropout:
            try:
                _mark_dropout(node)
            except ShardingError as exc:  # on attention probabilities: the core explains it
                refused.append(exc)
        elif _mean_loss(node) is not None:
            _rewrite_mean_loss(graph, node, cp)
        elif node.target is not operator.getitem:
            try:
                _check_token_wise(node)
            except ShardingError as exc:
                refused.append(exc)
    if refused:  # attention written out explains the rest (its mask, its slices): name it first
        raise min(refused, key=lambda e: 0 if e.fix == _UNRECOGNIZED else 1)
    graph.eliminate_dead_code()
    result = torch.fx.GraphModule(gm, graph)
    result.meta["cp_attention_sites"] = attention
    result.meta["cp_fused_attention"] = fused
    return result


def _written_attention_fused(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """``gm``, or a copy of it with its written-out attention fused, and how many were."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = torch.fx.GraphModule(gm, graph)
    fused = fuse_written_attention(copy)
    return (copy, fused) if fused else (gm, 0)


def _is_token_index(node: torch.fx.Node) -> bool:
    """``arange(s)`` or ``arange(0, s)`` (step 1): the index of each token of a sequence."""
    spec = _spec(node)
    if spec is None or len(spec.shape) != 1 or not _holds_tokens(spec.shape[0]):
        return False
    if node.target is aten.arange.default:
        return True
    if node.target is aten.arange.start:
        return node.args[0] == 0
    if node.target is aten.arange.start_step:
        return node.args[0] == 0 and (len(node.args) < 3 or node.args[2] == 1)
    return False


def _rewrite_attention(graph: torch.fx.Graph, node: torch.fx.Node, cp: torch.fx.Node) -> None:
    name = op_name(node)
    if name != "scaled_dot_product_attention" and getattr(node.target, "__name__", "") != \
            "attention_dropout":
        raise _refuse(node, f"the fused attention kernel {name}", _UNRECOGNIZED)
    args = list(node.args)
    if getattr(node.target, "__name__", "") == "attention_dropout":
        args = args[1:]  # (tp, q, k, v, ...)
    q, k, v = args[:3]
    params = ("attn_mask", "dropout_p", "is_causal")
    given = dict(zip(params, args[3:]))
    given.update({k_: v_ for k_, v_ in node.kwargs.items() if k_ in params})
    if given.get("attn_mask") is not None:
        raise _refuse(node, "an attention mask (a tensor the data decides, which the ring would "
                            "have to split by position)",
                      "use is_causal (autopar turns causal and all-true masks into it) or no "
                      "mask; padding masks are not supported under cp")
    if float(given.get("dropout_p") or 0.0) > 0.0:
        raise _refuse(node, f"attention dropout p={given['dropout_p']}",
                      "set the attention dropout to 0 (LLaMA-style recipes do), or plan with cp=1")
    scale = node.kwargs.get("scale")
    with graph.inserting_after(node):
        new = call_like(graph, cp_runtime.attention, (cp, q, k, v),
                    {"is_causal": bool(given.get("is_causal") or False), "scale": scale}, node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _mean_loss(node: torch.fx.Node) -> dict[str, Any] | None:
    """A mean-reduced token loss without class weights (its arguments by name), or None."""
    bound = token_loss_args(node)
    if bound is None or bound["reduction"] != 1 or bound.get("weight") is not None:
        return None
    return bound


def _rewrite_mean_loss(graph: torch.fx.Graph, node: torch.fx.Node, cp: torch.fx.Node) -> None:
    """``loss(..., reduction=mean)`` -> ``cp.token_mean(cp, loss(..., reduction=sum), target,
    ignore_index)``: the mean over every cp rank's counted tokens, not the mean of each rank's
    means (they differ when ranks count different tokens: ``ignore_index`` targets)."""
    bound = token_loss_args(node)
    assert bound is not None
    names = TOKEN_LOSSES[node.target]
    bound["reduction"] = 2  # sum
    with graph.inserting_before(node):
        total = call_like(graph, node.target, tuple(bound[n] for n in names), {}, node)
    with graph.inserting_after(node):
        new = call_like(graph, cp_runtime.token_mean,
                    (cp, total, bound["target"], bound["ignore_index"]), {}, node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _mark_dropout(node: torch.fx.Node) -> None:
    """A dropout draws its mask for the whole sequence and keeps this rank's tokens: tell it
    which dim holds them (a dim that is ``s`` itself; tokens flattened with samples are
    refused)."""
    p = node.args[2] if len(node.args) > 2 else node.kwargs.get("p", 0.0)
    spec = _spec(node.args[1])
    if spec is None or not p:
        return
    exact = [d for d, e in enumerate(spec.shape) if e == SEQ]
    if len(exact) == 1:
        node.kwargs = {**node.kwargs, "seq_dim": exact[0]}
    elif _seq_dims(spec):
        raise _refuse(node, f"dropout on tokens flattened with other dims ({spec.shape})",
                      "apply dropout before flattening the sequence, or plan with cp=1")


def _rewrite_table_slice(graph: torch.fx.Graph, node: torch.fx.Node, cp: torch.fx.Node) -> None:
    src, out = _spec(node.args[0]), _spec(node)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(src.shape) if src else 1)
    if out is None or not _holds_tokens(out.shape[dim]) or (len(node.args) > 2 and
                                                             node.args[2] not in (None, 0)):
        _check_token_wise(node)
        return
    length = node.args[3]
    with graph.inserting_after(node):
        new = call_like(graph, cp_runtime.take_positions, (cp, node.args[0], dim, length), {}, node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


@graph_property("sequence_split")
def sequence_split(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every attention is context-parallel attention reading the cp group; no op left that
    mixes tokens across the sequence."""
    cp = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "cp"), None)
    if cp is None:
        return "no cp placeholder"
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) in _SDPA:
            return f"{node.name} is still {op_name(node)}"
        if node.op == "call_function" and node.target is cp_runtime.attention \
                and node.args[0] is not cp:
            return f"{node.name} reads another group than the cp placeholder"
    return None


@graph_pass(ensures=("sequence_split",))
def context_parallel_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """:func:`context_parallelize` as a pass."""
    return PassResult(context_parallelize(gm), True)
