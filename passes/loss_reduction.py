"""How the step's loss reduces over the batch, so that its parts add up to one process's loss.

A step runs the captured loss once per part of the global batch: per micro-batch (the pipeline
adds them with weight ``1 / m``), per data-parallel replica and per context-parallel rank (their
gradients averaged). That is one process's loss only for a term that is a mean over equal
parts. The step's loss is walked from its output through the ops it is linear in (``+``, ``-``,
a product or quotient by a number, views and casts, tensor parallelism's all-reduce); the terms
reached that way are rewritten when they are not such a mean (``runtime/loss_scale.py``):

- a **token mean** (``cross_entropy`` / ``nll_loss`` / the vocabulary-parallel cross entropy,
  reduction mean, no class weights; context parallelism's ``cp.token_mean``) becomes
  ``loss_scale.token_mean(scale, k, sum, target, ignore_index)``: the part's sum times
  ``P / N``, ``N`` the targets counted on the whole batch. The step's padding, prompt masks
  and uneven counts then weigh as in one process, and a micro-batch whose targets are all
  ignored adds 0 instead of 0/0;
- a **batch sum** (a token or element-wise loss with reduction sum, ``.sum()`` of a tensor with
  a batch dim) becomes ``loss_scale.batch_sum(scale, value)``: the part's sum times ``P``.

Every other term is left as it is: a mean over elements (equal parts), a value that does not
depend on the batch (a regularizer), or a term the loss is not linear in (``exp(ce)``, a
mixture-of-experts balance loss over the part's routing): those are each part's own, as in
every pipeline. Where the batch dim was captured static, a batch sum divided by a multiple of a
part's rows (``/ 8`` at 8 rows) may be a mean per row written out: it stays as written, with a
warning (a batch sum divided by nothing such is still scaled).

:func:`target_counts` finds, for every token mean of the captured step in graph order, the part
of the graph that computes its targets from the step's inputs and targets (``labels[:, 1:]``,
a ``where`` that masks padding); ``autopar.parallel_model`` runs it on the whole batch before
each step and sets the counts on the :class:`~autopar.runtime.loss_scale.LossScale` the stages
read (a count it cannot compute, from targets read off the model's state, falls back to each
part's own mean).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autopar.captured import CapturedGraph
from autopar.ir import BATCH, META_KEY, SEQ, NodeInfo, NodeKind, info, op_name
from autopar.passes.index_checks import index_program, row_wise
from autopar.passes.infra import PassContext, PassResult, call_like, graph_pass, graph_property
from autopar.runtime import cp as cp_runtime
from autopar.runtime import loss_scale as scale_runtime
from autopar.runtime import tp as tp_runtime

__all__ = ["TOKEN_LOSSES", "token_loss_args", "TargetCount", "target_counts", "scale_loss",
           "loss_scale_pass", "scaled_step", "PLACEHOLDER"]

aten = torch.ops.aten

#: ATen's reduction codes (``at::Reduction``).
_MEAN, _SUM = 1, 2

#: The name of the placeholder the rewritten graph reads its LossScale from.
PLACEHOLDER = "loss_scale"

#: Token losses: op -> its parameters, in order (a mean over the counted targets, or their sum).
TOKEN_LOSSES: dict[Any, tuple[str, ...]] = {
    aten.cross_entropy_loss.default: ("self", "target", "weight", "reduction", "ignore_index",
                                      "label_smoothing"),
    aten.nll_loss.default: ("self", "target", "weight", "reduction", "ignore_index"),
    aten.nll_loss_nd.default: ("self", "target", "weight", "reduction", "ignore_index"),
    tp_runtime.vocab_parallel_cross_entropy: ("tp", "logits", "target", "reduction",
                                              "ignore_index")}
_DEFAULTS = {"weight": None, "reduction": _MEAN, "ignore_index": -100, "label_smoothing": 0.0}

#: Element-wise losses -> the position of their reduction argument (with sum: a batch sum).
_ELEMENT_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2,
                   aten.smooth_l1_loss.default: 2, aten.huber_loss.default: 2,
                   aten.soft_margin_loss.default: 2, aten.kl_div.default: 2,
                   aten.binary_cross_entropy.default: 3,
                   aten.binary_cross_entropy_with_logits.default: 4}

#: Ops the loss is linear in their first operand (views, casts, a sign).
_PASS_FIRST = frozenset({"neg", "to", "_to_copy", "clone", "alias", "detach", "view", "reshape",
                         "squeeze", "unsqueeze", "type_as", "float", "contiguous"})


def token_loss_args(node: torch.fx.Node) -> dict[str, Any] | None:
    """A token loss's arguments by name (defaults filled), or None if ``node`` is not one."""
    names = TOKEN_LOSSES.get(node.target)
    if names is None:
        return None
    bound = {n: _DEFAULTS.get(n) for n in names}
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def _token_mean(node: torch.fx.Node) -> bool:
    """A mean over counted targets: a token loss with reduction mean and no class weights, or
    context parallelism's ``cp.token_mean``."""
    if node.op != "call_function":
        return False
    if node.target is cp_runtime.token_mean:
        return True
    bound = token_loss_args(node)
    return bound is not None and bound["reduction"] == _MEAN and bound.get("weight") is None


def _target(node: torch.fx.Node) -> Any:
    """A token mean's target operand."""
    return node.args[2] if node.target is cp_runtime.token_mean else token_loss_args(node)["target"]


# -- counting the targets -----------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class TargetCount:
    """How a token mean's counted targets follow from the step's batch: ``program`` computes
    its targets from the inputs and targets named by ``reads``; ``ignore`` is not counted."""

    ignore: int | None
    program: torch.fx.GraphModule
    reads: tuple[str, ...]
    #: No op of ``program`` mixes the batch's rows: the whole batch runs at once
    #: (passes/index_checks.row_wise).
    row_wise: bool = False

    def count(self, whole: dict[str, Any], parts: list[dict[str, Any]]) -> int:
        """The targets counted over the whole batch (``whole``: the step's inputs and targets
        by placeholder name; ``parts``: the same split into the micro-batches the stages see,
        each run apart when the program mixes rows)."""
        if self.row_wise:
            return self._counted(self.program(*(whole[name] for name in self.reads)))
        return sum(self._counted(self.program(*(part[name] for name in self.reads)))
                   for part in parts)

    def _counted(self, targets: torch.Tensor) -> int:
        return int((targets != self.ignore).sum()) if self.ignore is not None \
            else targets.numel()


def target_counts(captured: CapturedGraph) -> list[TargetCount | None]:
    """For every token mean of the captured step, in graph order, how to count its targets
    from the batch (None: they read the model's state, or ops that cannot run again)."""
    out: list[TargetCount | None] = []
    for node in captured.gm.graph.nodes:
        if not _token_mean(node):
            continue
        bound = token_loss_args(node)
        assert bound is not None  # the captured graph holds no cp.token_mean
        target, ignore = bound["target"], bound["ignore_index"]
        part = index_program(captured, target) if isinstance(target, torch.fx.Node) else None
        if part is None:
            out.append(None)
            continue
        program, reads, needed = part
        out.append(TargetCount(None if ignore is None else int(ignore), program, reads,
                               row_wise(needed, target)))
    return out


# -- the rewrite ----------------------------------------------------------------------------------

def _linear_operands(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The operands the loss stays linear in through ``node`` (an affine op: a number added is
    the same in every part), or None where ``node`` is a term."""
    if node.op != "call_function":
        return None
    nodes = [a for a in node.args if isinstance(a, torch.fx.Node)]
    name = op_name(node)
    if node.target is tp_runtime.all_reduce:  # a sum over the tp ranks' parts
        return [node.args[1]]
    if node.target in (operator.add, operator.sub) or name in ("add", "sub"):
        return nodes if all(_tensor(n) for n in nodes) else None
    if name in ("mul", "div") or node.target in (operator.mul, operator.truediv):
        return nodes if len(nodes) == 1 and nodes[0] is node.args[0] else None
    if name in _PASS_FIRST and nodes and nodes[0] is node.args[0]:
        return [nodes[0]]
    return None


def _tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor) or \
        META_KEY in node.meta and info(node).spec is not None


def _holds(node: Any, symbol: Any) -> bool:
    """Whether a dim of ``node``'s captured shape grows with ``symbol`` (b or s)."""
    if not isinstance(node, torch.fx.Node) or META_KEY not in node.meta:
        return False
    spec = info(node).spec
    return spec is not None and any(symbol in getattr(e, "free_symbols", ()) for e in spec.shape)


def _batch_sum(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node`` sums over the whole batch (a token or element-wise loss with
    reduction sum, a whole-tensor ``sum`` of a tensor with a batch dim), or None."""
    if node.op != "call_function":
        return None
    bound = token_loss_args(node)
    if bound is not None:
        return bound["target"] if bound["reduction"] == _SUM else None
    position = _ELEMENT_LOSSES.get(node.target)
    if position is not None:
        reduction = node.args[position] if len(node.args) > position \
            else node.kwargs.get("reduction", _MEAN)
        return node.args[0] if reduction == _SUM else None
    if op_name(node) != "sum" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    source = node.args[0]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    spec = info(source).spec if META_KEY in source.meta else None
    if spec is None or dims not in (None, [], ()) and sorted(
            d % max(spec.ndim, 1) for d in dims) != list(range(spec.ndim)):
        return None  # a sum over some dims: not the loss's reduction
    if not _holds(source, BATCH) or _scaled_by_batch(source):
        return None
    return source


#: The values of size nodes: a batch's rows, a sequence's length, as traced.
_SIZES = (torch.SymInt, torch.SymFloat, int, float)


def _scaled_by_batch(node: torch.fx.Node, depth: int = 8) -> bool:
    """Whether the element-wise ops that make ``node`` divide or multiply it by a size
    (``(loss / b).sum()`` is a mean: scaling it as a sum would count the batch twice)."""
    for _ in range(depth):
        if node.op != "call_function":
            return False
        if any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), _SIZES)
               for a in list(node.args) + list(node.kwargs.values())):
            return True
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node) and _holds(a, BATCH)]
        if len(tensors) != 1:
            return False
        node = tensors[0]
    return False



def _loss_node(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    node = output.args[0]
    while isinstance(node, (tuple, list)) and len(node) == 1:
        node = node[0]
    return node if isinstance(node, torch.fx.Node) else None


def _terms(gm: torch.fx.GraphModule, loss: torch.fx.Node) -> list[torch.fx.Node]:
    """The terms the step's loss is linear in: the first nodes, walking from ``loss`` through
    :func:`_linear_operands`, that are not linear ops themselves, and are read only by them
    (a mean the loss also squares is not one)."""
    region: set[torch.fx.Node] = set()
    leaves: list[torch.fx.Node] = []
    stack = [loss]
    while stack:
        node = stack.pop()
        if node in region:
            continue
        region.add(node)
        operands = _linear_operands(node)
        if operands is None:
            leaves.append(node)
        else:
            stack.extend(operands)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    linear = region - set(leaves) | {output}
    return [leaf for leaf in leaves if set(leaf.users) <= linear]


def scale_loss(gm: torch.fx.GraphModule, *, static_rows: int | None = None,
               counted: int | None = None) -> torch.fx.GraphModule:
    """A copy of the graph with its loss's token means and batch sums scaled to their share of
    the whole batch (module docstring), reading a
    :class:`~autopar.runtime.loss_scale.LossScale` from a placeholder ``loss_scale``; ``gm``
    itself when no term needs it. Token mean ``k`` reads ``totals[k]``, ``k`` its place among
    the graph's token means, which must be the captured step's (``counted`` of them, when
    given: else the means are left as they are, with a warning). ``static_rows``: a part's
    rows where the batch dim was captured static (None: symbolic); a batch sum divided there
    by a multiple of them may be a mean per row written out, and is left as it is, with a
    warning."""
    loss = _loss_node(gm)
    if loss is None:
        return gm
    means = [n for n in gm.graph.nodes if _token_mean(n)]
    terms: list[tuple[str, torch.fx.Node]] = []
    for leaf in _terms(gm, loss):
        if _token_mean(leaf):
            terms.append(("mean", leaf))
        elif _batch_sum(leaf) is not None:
            rows = [d for d in _divisors(leaf) if static_rows and _multiple(d, static_rows)]
            if not rows:
                terms.append(("sum", leaf))
                continue
            warnings.warn(
                f"the loss sums over the batch ({op_name(leaf)}) and is divided "
                f"by {rows[0]:g}, a multiple of the {static_rows} rows of a part, in a graph "
                f"captured at a static batch: autopar cannot tell a mean per row written out "
                f"from a sum over the global batch, and takes each part's loss as written (for "
                f"a sum over the global batch, the step's loss is 1/(micro-batches x dp) of "
                f"one process's). Capture the batch dim symbolic, or write the loss as a mean",
                stacklevel=2)
    if counted is not None and counted != len(means) and any(k == "mean" for k, _ in terms):
        warnings.warn(f"the per-rank program holds {len(means)} token-mean losses where the "
                      f"captured step holds {counted}: each part's mean is left as its own "
                      f"(a batch padded unevenly weighs its micro-batches alike)", stacklevel=2)
        terms = [(k, leaf) for k, leaf in terms if k != "mean"]
    if not terms:
        return gm
    kinds = {leaf: kind for kind, leaf in terms}
    last_placeholder = [n for n in gm.graph.nodes if n.op == "placeholder"][-1:]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    scale = None if last_placeholder else _scale_placeholder(graph)
    for node in gm.graph.nodes:
        kind = kinds.get(node)
        if kind == "mean":  # the new node takes the mean's name: checks find it by name
            env[node] = _scaled_mean(graph, node, env, scale, means.index(node))
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        if kind == "sum":
            leaf = env[node]
            env[node] = call_like(graph, scale_runtime.batch_sum,
                                  (scale, leaf, _holds(_batch_sum(node), SEQ)), {}, leaf)
        if last_placeholder and node is last_placeholder[0]:
            scale = _scale_placeholder(graph)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


def _divisors(leaf: torch.fx.Node) -> list[float]:
    """What the loss divides term ``leaf`` by on its way to the output: each number it is
    divided by, and the reciprocal of each it is multiplied by."""
    out: list[float] = []
    stack, seen = [leaf], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            operands = _linear_operands(user)
            if user in seen or operands is None or node not in operands:
                continue
            seen.add(user)
            stack.append(user)
            numbers = [float(a) for a in user.args[1:2] if isinstance(a, (int, float))
                       and not isinstance(a, bool) and a]
            if op_name(user) == "div" or user.target is operator.truediv:
                out += numbers
            elif op_name(user) == "mul" or user.target is operator.mul:
                out += [1 / a for a in numbers]
    return out


def _multiple(divisor: float, rows: int) -> bool:
    """Whether ``divisor`` is a whole multiple of ``rows`` (a count of rows, or of tokens)."""
    ratio = abs(divisor) / rows
    return ratio >= 1 and abs(ratio - round(ratio)) < 1e-6


def _static_rows(captured: CapturedGraph) -> int | None:
    """A part's rows where the batch dim was captured static (the first batch-major input's
    size), None where it is symbolic."""
    if BATCH in captured.example_sizes:
        return None
    for name in captured.input_names:
        spec = info(captured.node(name)).spec
        rows = spec.shape[0] if spec is not None and spec.ndim else None
        if isinstance(rows, int) or getattr(rows, "is_Integer", False):
            return int(rows)
    return None


def _scale_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    scale = graph.placeholder(PLACEHOLDER)
    scale.meta[META_KEY] = NodeInfo(NodeKind.COMMUNICATOR)
    return scale


def _scaled_mean(graph: torch.fx.Graph, mean: torch.fx.Node, env: dict[torch.fx.Node, Any],
                 scale: torch.fx.Node | None, term: int) -> torch.fx.Node:
    """Token mean ``mean`` (of the old graph) as ``loss_scale.token_mean`` of its sum, in
    ``graph``, under ``mean``'s name."""
    def new(value: Any) -> Any:
        return torch.fx.map_arg(value, env.__getitem__)

    if mean.target is cp_runtime.token_mean:  # (cp, sum, target, ignore_index): already a sum
        total, ignore = new(mean.args[1]), (list(mean.args) + [-100])[3]
    else:
        bound = token_loss_args(mean)
        assert bound is not None
        bound["reduction"] = _SUM
        ignore = bound["ignore_index"]
        total = call_like(graph, mean.target,
                          new(tuple(bound[n] for n in TOKEN_LOSSES[mean.target])), {}, mean,
                          name=f"{mean.name}_sum")
    target = _target(mean)
    return call_like(graph, scale_runtime.token_mean,
                     (scale, term, total, new(target), ignore, _holds(target, SEQ)), {}, mean,
                     name=mean.name)


@graph_property("loss_scaled")
def loss_scaled(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """No token mean left among the loss's terms: each reads the step's count (unless the
    program's token means are not the captured step's, which :func:`scale_loss` warns of)."""
    loss = _loss_node(gm)
    if ctx.captured is not None and sum(map(_token_mean, ctx.captured.gm.graph.nodes)) != sum(
            map(_token_mean, gm.graph.nodes)) + sum(n.target is scale_runtime.token_mean
                                                     for n in gm.graph.nodes):
        return None
    for term in _terms(gm, loss) if loss is not None else []:
        if _token_mean(term):
            return f"{term.name} ({op_name(term)}) is each part's own mean"
    return None


@graph_pass(ensures=("loss_scaled",))
def loss_scale_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """:func:`scale_loss` as a pass, on the per-rank program of ``ctx.captured``."""
    captured = ctx.captured
    if captured is None:
        return PassResult(gm, False)
    new = scale_loss(gm, static_rows=_static_rows(captured),
                     counted=sum(map(_token_mean, captured.gm.graph.nodes)))
    return PassResult(new, new is not gm)


def scaled_step(captured: CapturedGraph) -> torch.fx.GraphModule:
    """The captured step with its loss scaled as every rank's program scales it (what a check
    against one process runs on one part of the batch), reading its LossScale last."""
    return scale_loss(captured.gm, static_rows=_static_rows(captured))
