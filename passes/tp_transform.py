"""Collective insertion: the sharded graph becomes the program every tensor-parallel rank runs.

Input: a graph whose nodes carry a chosen strategy (passes/shard.py). Output: a new graph of
per-rank (local) tensors, rank-agnostic (the rank enters through the ``tp`` communicator):

- a first placeholder ``tp`` (NodeKind.COMMUNICATOR), a :class:`autopar.runtime.tp.TPGroup`;
- wherever a producer's placement differs from what a consumer requires, the steps of
  :func:`autopar.sharding.redistribution`, as ``call_function`` nodes whose target is one of
  autopar.runtime.tp's functional collectives (``all_reduce(tp, x)``, ``tp.all_reduce(x)`` in
  the generated source); each carries ``NodeInfo.collective`` and the
  layer of the consumer it serves, so a pipeline split by layer keeps them with their block.
  A replicated tensor whose consumers compute sharded results gets one Megatron f (identity
  forward, all-reduce backward) shared by all of them, so their partial gradients are summed
  once; after an all-gather the f becomes a reduce-scatter in the backward;
- size arguments of views (``view(x, [b, s, 4, 16])``), expands and splits made local where a
  dim is sharded (``4 // tp``; symbolic sizes through ``operator.floordiv`` nodes);
- ops whose sharded form differs: vocab-parallel embedding and cross-entropy become
  ``tp.vocab_parallel_embedding`` / ``tp.vocab_parallel_cross_entropy``, a mean over a sharded
  dim is rescaled by 1/tp, and a GEMM bias split off before the search is fused back when
  its add needs no collective (column-parallel and replicated GEMMs);
- export's runtime asserts are dropped (they check global shapes and devices);
- dropout (``aten.dropout``, and attention dropout inside ``scaled_dot_product_attention``)
  becomes ``tp.dropout`` / ``tp.attention_dropout``, whose masks are a function of the seed, the
  step, the site (the node's name) and each element's global coordinates: every plan draws the
  single-device program's masks (runtime/rng.py);
- a training batch norm and in-place updates of buffers (BatchNorm's running statistics and
  its counter) become ``tp.batch_norm`` / ``tp.update_buffer``: no update in evaluation or in
  a recompute, the running statistics in evaluation (runtime/running_stats.py).

Every node's NodeInfo keeps its global ``value`` and gains ``placement`` and ``local_value``.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections import defaultdict
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx.node import map_arg

from autopar.errors import ShardingError, UnsupportedOpWarning
from autopar.ir import (BATCH, META_KEY, SEQ, NodeInfo, NodeKind, TensorSpec, info, new_graph_module,
                        op_name)
from autopar.passes.infra import PassContext, PassResult, graph_pass, graph_property
from autopar.passes.analyze import CONV_OPS, conv_groups, conv_groups_index
from autopar.passes.sharding_rules import Item, Rewrite, Strategy, is_tensor_node
from autopar.runtime.rng import TORCH_RANDOM_OPS
from autopar.runtime.tp import FUNCTIONS
from autopar.sharding import (
    REPLICATE,
    CollectiveStep,
    Partial,
    Replicate,
    gradient_is_partial,
    is_sharded,
    local_shape,
    num_blocks,
    make_shard,
    placement_str,
    redistribution,
)

__all__ = ["insert_collectives", "build_local_program", "TP_METHODS", "batch_dim_of",
           "draws_per_sample"]

aten = torch.ops.aten

#: Ops that are no-ops in a training program and check global metadata.
_DROPPED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
            "sym_constrain_range", "_assert_async"}
_SIZED_VIEWS = {"view", "reshape", "_unsafe_view", "expand"}

#: What a per-rank graph calls (autopar.runtime.tp's functional forms: fn(tp, x, ...)).
TP_METHODS = FUNCTIONS


def _local_value(value: Any, placement: Any, tp: int) -> Any:
    if isinstance(value, TensorSpec):
        return TensorSpec(local_shape(value.shape, placement, tp), value.dtype)
    if isinstance(value, tuple):
        places = placement if isinstance(placement, tuple) else (placement,) * len(value)
        return tuple(_local_value(v, p, tp) for v, p in zip(value, places))
    return value


def _after_step(step: CollectiveStep, before: Any) -> Any:
    kw = step.kwargs_dict
    if step.method in ("all_reduce", "copy_to_tp", "all_gather"):
        return REPLICATE
    if step.method == "reduce_scatter":
        return make_shard(kw["dim"])
    if step.method == "shard":
        return make_shard(kw["dim"], kw.get("blocks", 1))
    if step.method == "all_to_all":
        return make_shard(kw["dst_dim"])
    raise AssertionError(step.method)


class _Builder:
    def __init__(self, gm: torch.fx.GraphModule, tp: int) -> None:
        self.old = gm
        self.tp = tp
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.cache: dict[tuple, torch.fx.Node] = {}
        self.tp_node = self.graph.placeholder("tp")
        self.tp_node.meta[META_KEY] = NodeInfo(NodeKind.COMMUNICATOR)
        #: Random ops (not dropout) drawn per sample by the program, and left to torch's RNG.
        self.per_sample: list[str] = []
        self.global_draws: list[str] = []
        #: What each tensor's consumers need of it, (placement, partial gradient), in
        #: the order consumers appear.
        self.demands: dict[torch.fx.Node, list[tuple]] = defaultdict(list)
        self.fused: dict[torch.fx.Node, torch.fx.Node] = {}

    # -- analysis before emitting ---------------------------------------------------------
    def strategy(self, n: torch.fx.Node) -> Strategy | None:
        return info(n).strategy

    def requirement(self, n: torch.fx.Node, u: torch.fx.Node) -> tuple[Any, bool] | None:
        """(placement, partial gradient) ``n`` needs of its input ``u``."""
        if n.op == "output":
            return (REPLICATE, False)
        s = self.strategy(n)
        if s is None or not is_tensor_node(u):
            return None
        req = s.inputs[n.all_input_nodes.index(u)]
        if req is None or isinstance(req, Item):
            return None
        return req, gradient_is_partial(req, s.output) and info(u).requires_grad

    def collect(self) -> None:
        for n in self.old.graph.nodes:
            if n.op not in ("call_function", "output"):
                continue
            for u in n.all_input_nodes:
                r = self.requirement(n, u)
                if r is not None and r not in self.demands[u]:
                    self.demands[u].append(r)
        for n in self.old.graph.nodes:  # a bias add that needs no collective fuses back
            bias_of = info(n).extra.get("bias_of") if n.op == "call_function" else None
            if not bias_of:
                continue
            lin = n.args[0]
            if not isinstance(lin, torch.fx.Node) or lin.name != bias_of or len(lin.users) != 1:
                continue
            ls, s = self.strategy(lin), self.strategy(n)
            if ls is None or s is None or isinstance(ls.output, Partial):
                continue
            req = self.requirement(n, lin)
            if req is not None and req[0] == ls.output and not req[1] and s.output == ls.output:
                self.fused[lin] = n

    def _layer(self, n: torch.fx.Node) -> str:
        return info(n).layer

    # -- emission -----------------------------------------------------------------------------
    def node_info(self, n: torch.fx.Node, placement: Any, **changes: Any) -> NodeInfo:
        base = info(n)
        return dataclasses.replace(base, placement=placement,
                                   local_value=_local_value(base.value, placement, self.tp),
                                   extra=dict(base.extra), **changes)

    def redistribute(self, u: torch.fx.Node, req: Any, partial: bool, layer: str) -> torch.fx.Node:
        """``u`` as ``req`` (once per producer; a parameter's or input's conversions are made
        per consuming layer, so they stay with the layer that uses them)."""
        src = info(u).placement
        if src is None:
            raise ShardingError(f"{u.name} has no placement", fix="run shard_graph first")
        key = (u, req, partial, layer if u.op == "placeholder" else None)
        if key in self.cache:
            return self.cache[key]
        if partial and isinstance(req, Replicate) and not (
                is_sharded(src) and (req, False) not in self.demands[u]):
            # f on the replicated value: one backward all-reduce for every partial consumer
            base = self.redistribute(u, req, False, layer)
            steps = redistribution(REPLICATE, REPLICATE, True)
            out = self.emit_steps(base, u, steps, REPLICATE, layer)
        else:
            steps = redistribution(src, req, partial)
            if steps is None:
                raise ShardingError(f"no collective turns {u.name} from {src} into {req}",
                                    fix="this is a bug in the sharding search")
            out = self.emit_steps(self.env[u], u, steps, src, layer)
        self.cache[key] = out
        return out

    def emit_conversions(self, u: torch.fx.Node) -> None:
        """Right after an op, every placement its consumers need, in the op's own layer (a
        pipeline boundary then carries the converted, usually smaller, tensor)."""
        for req, partial in self.demands.get(u, ()):
            self.redistribute(u, req, partial, self._layer(u))

    def emit_steps(self, x: torch.fx.Node, u: torch.fx.Node, steps, placement: Any,
                   layer: str) -> torch.fx.Node:
        for step in steps:
            placement = _after_step(step, placement)
            x = self.graph.call_function(TP_METHODS[step.method], (self.tp_node, x),
                                         step.kwargs_dict)
            meta = info(u)
            x.meta[META_KEY] = NodeInfo(
                NodeKind.OP, meta.value, module_path=meta.module_path, layer=layer,
                requires_grad=meta.requires_grad, placement=placement,
                local_value=_local_value(meta.value, placement, self.tp), collective=step)
        return x

    def local_size(self, size: Any, what: str) -> Any:
        if isinstance(size, int):
            if size == -1:
                return -1
            if size % self.tp:
                raise ShardingError(f"{what}: size {size} is not divisible by tp={self.tp}",
                                    fix="choose a tensor-parallel size that divides it")
            return size // self.tp
        if isinstance(size, torch.fx.Node):
            out = self.graph.call_function(operator.floordiv, (size, self.tp))
            value = info(size).value if META_KEY in size.meta else None
            out.meta[META_KEY] = NodeInfo(
                NodeKind.OP, value // self.tp if isinstance(value, sympy.Basic) else None,
                layer=info(size).layer if META_KEY in size.meta else "")
            return out
        raise ShardingError(f"{what}: cannot make size {size!r} local")

    def run(self) -> torch.fx.Graph:
        self.collect()
        for n in self.old.graph.nodes:
            if n.op == "placeholder":
                new = self.graph.placeholder(n.name)
                new.meta.update({k: v for k, v in n.meta.items() if k != "val"})
                new.meta[META_KEY] = self.node_info(n, info(n).placement)
                self.env[n] = new
            elif n.op == "output":
                layer = self._layer(n)
                self.graph.output(map_arg(n.args[0], lambda u: self.redistribute(
                    u, REPLICATE, False, layer)))
            elif n.op == "call_function":
                self.emit_op(n)
            else:
                raise ShardingError(f"unsupported node {n.format_node()} in a captured graph")
        self.warn_random()
        return self.graph

    def warn_random(self) -> None:
        """Say which random ops of the training graph are not dropout: drawn per sample, they
        run in ``eval_step`` too (a ``if self.training`` branch was captured in training); drawn
        from torch's RNG, their numbers depend on the plan."""
        if self.per_sample:
            warnings.warn(UnsupportedOpWarning(
                f"random ops other than dropout ({', '.join(self.per_sample[:4])}: stochastic "
                f"depth?) are drawn per sample in training, alike under every plan; eval_step "
                f"runs the training graph, so it draws them too"), stacklevel=4)
        if self.global_draws:
            warnings.warn(UnsupportedOpWarning(
                f"random ops {', '.join(self.global_draws[:4])} draw from each process's torch "
                f"RNG: their numbers depend on the plan (tensor-parallel ranks draw their own)"),
                stacklevel=4)

    def emit_op(self, n: torch.fx.Node) -> None:
        name = op_name(n)
        if name in _DROPPED:
            return
        s = self.strategy(n)
        layer = self._layer(n)
        if s is None:  # a symbolic size (sym_size) or other non-tensor value
            args = map_arg(n.args, lambda a: self.env[a])
            kwargs = map_arg(n.kwargs, lambda a: self.env[a])
            new = self.graph.create_node("call_function", n.target, args, kwargs, name=n.name)
            new.meta[META_KEY] = dataclasses.replace(info(n), extra=dict(info(n).extra))
            if name == "sym_size":
                src, dim = n.args[0], n.args[1]
                p = info(src).placement
                if is_sharded(p) and p.dim == (dim if dim >= 0 else dim + info(src).spec.ndim):
                    scaled = self.graph.call_function(operator.mul, (new, self.tp))
                    scaled.meta[META_KEY] = dataclasses.replace(info(n), extra={})
                    new = scaled
            self.env[n] = new
            return
        if n in self.fused.values():
            return  # emitted with its GEMM

        def arg(a: torch.fx.Node) -> torch.fx.Node:
            r = self.requirement(n, a)
            if r is None:
                return self.env[a]
            return self.redistribute(a, r[0], r[1], layer)

        args = map_arg(n.args, arg)
        kwargs = dict(map_arg(n.kwargs, arg))
        target = n.target
        out_node = n
        placement = s.output
        if n in self.fused:  # linear + its bias add, as one linear again
            add = self.fused[n]
            bias = add.args[1]
            r = self.requirement(add, bias)
            b = self.redistribute(bias, r[0], r[1], layer) if r else self.env[bias]
            args = tuple(args) + (b,)
            out_node = add
            placement = self.strategy(add).output
        args = self.local_args(n, s, args)
        if s.rewrite is Rewrite.VOCAB_EMBEDDING:
            padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
            new = self.graph.call_function(TP_METHODS["vocab_parallel_embedding"],
                                           (self.tp_node, args[0], args[1]),
                                           {"padding_idx": padding})
        elif s.rewrite is Rewrite.VOCAB_CROSS_ENTROPY:
            reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
            ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
            new = self.graph.call_function(TP_METHODS["vocab_parallel_cross_entropy"],
                                           (self.tp_node, args[0], args[1]),
                                           {"reduction": reduction, "ignore_index": ignore})
        elif _draws_dropout(n):
            new = self.emit_dropout(n, args, kwargs, placement)
        elif _draws_feature_dropout(n):
            extra = {"site": n.name, "batch_dim": batch_dim_of(info(n).spec),
                     "shard_dim": placement.dim if is_sharded(placement) else None}
            if is_sharded(placement):
                extra["blocks"] = num_blocks(placement)
            new = self.graph.create_node("call_function", TP_METHODS["feature_dropout"],
                                         (self.tp_node, *args[:3]), extra, name=n.name)
        elif _draws_per_sample(n, placement):
            self.per_sample.append(n.name)
            new = self.graph.create_node(
                "call_function", TP_METHODS["draw_random"], (self.tp_node, *args),
                {**kwargs, "op": n.target.name(), "site": n.name,
                 "batch_dim": batch_dim_of(info(n).spec)}, name=n.name)
        elif _updates_running_stats(n):
            new = self.graph.create_node("call_function", TP_METHODS["batch_norm"],
                                         (self.tp_node, *args), kwargs, name=n.name)
        elif _updates_buffer(n):
            new = self.graph.create_node("call_function", TP_METHODS["update_buffer"],
                                         (self.tp_node, *args), {**kwargs, "op": n.target.name()},
                                         name=n.name)
        else:
            if op_name(n) in TORCH_RANDOM_OPS and not _draws_nothing(n):
                self.global_draws.append(n.name)
            new = self.graph.create_node("call_function", target, tuple(args), kwargs,
                                         name=n.name)
        for key in ("nn_module_stack", "stack_trace"):
            if key in n.meta:
                new.meta[key] = n.meta[key]
        new.meta[META_KEY] = self.node_info(out_node, placement, strategy=self.strategy(out_node))
        if s.rewrite is Rewrite.MEAN_OVER_SHARD:
            scaled = self.graph.call_function(aten.mul.Tensor, (new, 1.0 / self.tp))
            scaled.meta[META_KEY] = self.node_info(n, placement, strategy=s)
            new = scaled
        self.env[n] = new
        if out_node is not n:
            self.env[out_node] = new
        self.emit_conversions(out_node)

    def emit_dropout(self, n: torch.fx.Node, args: tuple, kwargs: dict,
                     placement: Any) -> torch.fx.Node:
        """``tp.dropout`` / ``tp.attention_dropout`` for a dropout op (see the module docstring):
        the site is the captured node's name, the placement says which slice of the full mask
        this rank keeps, the batch dim which dim runs over samples."""
        spec = info(n).spec
        extra = {"site": n.name, "batch_dim": batch_dim_of(spec),
                 "shard_dim": placement.dim if is_sharded(placement) else None}
        if op_name(n) == "dropout":
            x, p = args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            train = args[2] if len(args) > 2 else kwargs.get("train", True)
            if is_sharded(placement):
                extra["blocks"] = num_blocks(placement)
            return self.graph.create_node("call_function", TP_METHODS["dropout"],
                                          (self.tp_node, x, p, train), extra, name=n.name)
        names = ("attn_mask", "dropout_p", "is_causal")
        call = dict(zip(names, args[3:]))
        call.update({k: v for k, v in kwargs.items()})
        return self.graph.create_node("call_function", TP_METHODS["attention_dropout"],
                                      (self.tp_node, *args[:3]), {**call, **extra}, name=n.name)

    def local_args(self, n: torch.fx.Node, s: Strategy, args: tuple) -> tuple:
        """Global sizes in a view's, expand's or split's arguments, made local."""
        name = op_name(n)
        args = list(args)
        out = s.output
        if name in _SIZED_VIEWS and len(args) > 1 and isinstance(args[1], (list, tuple)) \
                and is_sharded(out):
            sizes = list(args[1])
            sizes[out.dim] = self.local_size(sizes[out.dim], f"{n.name} ({name})")
            args[1] = sizes
        elif name in ("split", "split_with_sizes") and isinstance(n.args[0], torch.fx.Node):
            src = n.args[0]
            req = s.inputs[n.all_input_nodes.index(src)]
            ndim = info(src).spec.ndim
            dim = args[2] if len(args) > 2 else 0
            dim = dim + ndim if dim < 0 else dim
            if is_sharded(req) and req.dim == dim:
                if isinstance(args[1], (list, tuple)):
                    args[1] = [self.local_size(x, n.name) for x in args[1]]
                else:
                    args[1] = self.local_size(args[1], n.name)
        elif name in CONV_OPS and s.name == "grouped":  # each rank convolves its groups
            args[conv_groups_index(n)] = self.local_size(conv_groups(n),
                                                         f"{n.name} ({name} groups)")
        elif name == "slice" and isinstance(n.args[0], torch.fx.Node):
            src = n.args[0]
            req = s.inputs[n.all_input_nodes.index(src)]
            ndim = info(src).spec.ndim
            dim = args[1] if len(args) > 1 else 0
            dim = dim + ndim if dim < 0 else dim
            if is_sharded(req) and req.dim == dim and len(args) > 3:
                args[3] = 9223372036854775807  # a full slice of the local shard
        return tuple(args)


#: Random ops drawn per sample by the program (``tp.draw_random``): stochastic depth's
#: ``torch.rand`` (Hugging Face's drop path) or ``new_empty(...).bernoulli_(p)`` (timm's,
#: torchvision's), and the other plain fills.
_PER_SAMPLE_DRAWS = frozenset({
    "aten::rand", "aten::randn", "aten::rand_like", "aten::randn_like", "aten::bernoulli",
    "aten::bernoulli.p", "aten::bernoulli_.float", "aten::uniform_", "aten::normal_"})


def draws_per_sample(n: torch.fx.Node) -> bool:
    """A random op of :data:`_PER_SAMPLE_DRAWS` (``tp.draw_random`` draws it per sample)."""
    target = n.target
    return isinstance(target, torch._ops.OpOverload) and target.name() in _PER_SAMPLE_DRAWS


def _draws_per_sample(n: torch.fx.Node, placement: Any) -> bool:
    """A random op the program draws per sample (:data:`_PER_SAMPLE_DRAWS`) on a replicated
    tensor without sequence dims: what every plan can draw alike."""
    spec = info(n).spec
    return draws_per_sample(n) and not is_sharded(placement) \
        and isinstance(spec, TensorSpec) and not any(
            isinstance(d, sympy.Basic) and d.has(SEQ) for d in spec.shape) \
        and "generator" not in n.kwargs


def _draws_nothing(n: torch.fx.Node) -> bool:
    """A dropout of probability 0 or outside training: the identity."""
    if "dropout" not in op_name(n):
        return False
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
    return (isinstance(p, (int, float)) and p == 0) or train is False


def _draws_feature_dropout(n: torch.fx.Node) -> bool:
    """``aten.feature_dropout`` (``nn.Dropout1d/2d/3d``) that draws a mask when training."""
    if op_name(n) != "feature_dropout":
        return False
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
    return isinstance(p, (int, float)) and p > 0 and train is not False


def _updates_running_stats(n: torch.fx.Node) -> bool:
    """A training batch norm with running statistics (``aten.batch_norm(x, w, b, mean, var,
    training=True, ...)``): it updates them in place (runtime/running_stats.py)."""
    if n.target is not aten.batch_norm.default:
        return False
    training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", False)
    mean = n.args[3] if len(n.args) > 3 else n.kwargs.get("running_mean")
    return training is not False and mean is not None


def _updates_buffer(n: torch.fx.Node) -> bool:
    """An in-place ATen op on a buffer (BatchNorm's ``num_batches_tracked.add_(1)``)."""
    target = n.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return False
    first = n.args[0] if n.args else None
    return isinstance(first, torch.fx.Node) and first.op == "placeholder" \
        and info(first).kind is NodeKind.BUFFER


def _draws_dropout(n: torch.fx.Node) -> bool:
    """A dropout that draws a mask when training: aten.dropout, or attention dropout."""
    name = op_name(n)
    if name == "dropout":
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        return isinstance(p, (int, float)) and p > 0 and train is not False
    if name == "scaled_dot_product_attention":
        p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
        return isinstance(p, (int, float)) and p > 0
    return False


def batch_dim_of(spec: Any) -> int | None:
    """The first dim whose size is a multiple of the batch symbol (``b``, ``b*s``)."""
    if not isinstance(spec, TensorSpec):
        return None
    for d, size in enumerate(spec.shape):
        if isinstance(size, sympy.Basic) and size.has(BATCH) and not (size / BATCH).has(BATCH):
            return d
    return None


def build_local_program(gm: torch.fx.GraphModule, tp: int) -> torch.fx.GraphModule:
    """The per-rank GraphModule for a graph whose nodes carry strategies."""
    graph = _Builder(gm, tp).run()
    graph.eliminate_dead_code()
    return new_graph_module(gm, graph)


@graph_property("local_shapes")
def local_shapes(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every parameter, buffer and constant of the per-rank program has its local shape."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and META_KEY in node.meta and info(node).kind in (
                NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT) \
                and info(node).local_value is None:
            return f"{node.name} ({info(node).fqn}) has no local shape"
    return None


@graph_property("collectives")
def no_placement_mismatch(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """The per-rank program: every op that runs under a sharding strategy gets each tensor
    input in the placement its strategy requires (a collective converts it where the producer's
    differs). Ops rewritten into several local ops (vocab-parallel embedding and loss) are
    checked by their own tests."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or META_KEY not in node.meta:
            continue
        meta = info(node)
        s = meta.strategy
        if s is None or meta.collective is not None or s.rewrite is not Rewrite.NONE:
            continue
        inputs = node.all_input_nodes
        if len(inputs) != len(s.inputs):
            continue  # a fused bias or an emitted helper: not the op the strategy was for
        for u, want in zip(inputs, s.inputs):
            if want is None or isinstance(want, Item) or not is_tensor_node(u) \
                    or META_KEY not in u.meta:
                continue
            have = info(u).placement
            if have is not None and have != want:
                return (f"{node.name} needs {u.name} as {placement_str(want)}, gets "
                        f"{placement_str(have)} (no collective in between)")
    return None


@graph_pass(requires=("placements",), ensures=("collectives", "local_shapes"))
def insert_collectives(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace the global graph by the per-rank program (ctx.options['tp'])."""
    return PassResult(build_local_program(gm, ctx.options["tp"]), True)
