"""Stage split: one graph module per pipeline stage, with the metadata of what crosses each cut.

Every op node belongs to a layer (``node.meta["autopar"].layer``) and every layer to one stage
(``StagePlan.layers``, inclusive index ranges), so a node's stage is its layer's. This works on
the captured graph and on a tensor-parallel graph alike: collectives inserted by the sharding
passes keep the layer of the op they serve.

What crosses a cut between stage ``k`` and ``k + 1`` is every tensor made at or before stage
``k`` and read after it. Two kinds are treated differently:

- **Recomputed, not sent**: tensors that carry no gradient and are computed only from the model's
  inputs, buffers, constants and shapes (the causal or padding mask, position ids, rotary tables,
  ``sym_size`` values), by deterministic ops. Each stage that reads one recomputes it from the
  micro-batch's inputs: every rank's data loader provides the inputs and targets (token ids and
  labels, a few bytes per token, as in Megatron-LM), and the recomputation costs a few
  elementwise ops, while sending it would cost a transfer per cut per micro-batch (GPT-2's
  ``[b, 1, s, s]`` mask is larger than the hidden state at s > 4 h).
- **Sent**: everything else (hidden states, and anything that depends on a parameter). A tensor
  read two stages later passes through the stages in between (input and output of each), so every
  transfer is between neighbours; its gradient flows back the same way.

The result, :class:`StageSplit`, holds one :class:`StageGraph` per stage: the graph module (its
placeholders are any other objects it reads, such as a tensor-parallel communicator, bound by
name at run time; the parameters, buffers and constants it reads; the received tensors; the model
inputs and targets it reads), the :class:`CutTensor` s it receives and sends (name,
symbolic shape, dtype, whether a gradient comes back, placement over the tensor-parallel axis),
and which stages read each parameter (a tied weight read by two stages, like GPT-2's embedding
and LM head, is held by both and its gradients must be summed).
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from autopar.errors import PassError, PlanMismatchError
from autopar.ir import META_KEY, Layer, NodeKind, TensorSpec, has_info, info, op_name
from autopar.passes.infra import PassContext, PassResult, graph_pass, graph_property
from autopar.runtime.rng import TORCH_RANDOM_OPS

__all__ = [
    "StageInputKind",
    "StageInput",
    "CutTensor",
    "StageGraph",
    "StageSplit",
    "split_into_stages",
    "split_stages",
    "recomputable_nodes",
    "RANDOM_OPS",
]

#: Ops whose result differs from one call to the next: never recomputed on another stage.
RANDOM_OPS = TORCH_RANDOM_OPS

_SOURCE_KINDS = (NodeKind.INPUT, NodeKind.TARGET, NodeKind.BUFFER, NodeKind.CONSTANT)


class StageInputKind(enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"
    ACTIVATION = "activation"  # received from the previous stage
    INPUT = "input"  # a model input of the micro-batch (key: its index)
    TARGET = "target"  # a loss target of the micro-batch (key: its index)
    #: Any other placeholder (a tensor-parallel communicator object): bound by name at run time.
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class StageInput:
    """One placeholder of a stage module: what to bind to it."""

    name: str
    kind: StageInputKind
    #: FQN (parameter, buffer), constant name, crossing tensor name, or input/target index.
    key: str | int


@dataclass(frozen=True, slots=True)
class CutTensor:
    """A tensor sent from one stage to the next (named after its node in the source graph)."""

    name: str
    spec: TensorSpec
    #: A gradient comes back for it (floating, and computed from something that needs grad).
    requires_grad: bool
    #: The stage that computes it (earlier than the sender for a pass-through tensor).
    producer: int
    #: Its placement over the tensor-parallel axis (``node.meta["autopar"].placement`` of a
    #: tensor-parallel graph: Replicate, Shard(dim), ...; None on a graph without one). ``spec``
    #: is then each rank's shard, so a sharded cut (sequence parallelism) sends 1/tp per rank.
    placement: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, TensorSpec):
            raise ValueError(f"crossing value {self.name} is not a tensor: {self.spec!r}")

    def shape_at(self, **sizes: int) -> tuple[int, ...]:
        """The concrete shape at a micro-batch's sizes (``b=...``, ``s=...``)."""
        return self.spec.concrete_shape(**sizes)


@dataclass(frozen=True, eq=False)
class StageGraph:
    """One pipeline stage: its graph module and what it binds, receives and sends."""

    index: int
    layers: tuple[int, int]
    gm: torch.fx.GraphModule
    placeholders: tuple[StageInput, ...]
    inputs: tuple[CutTensor, ...]
    outputs: tuple[CutTensor, ...]
    #: The last stage returns the loss (a scalar) instead of crossing tensors.
    returns_loss: bool
    #: Source-graph nodes of earlier stages this stage recomputes (masks, positions, sizes).
    recomputed: tuple[str, ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.placeholders if p.kind is StageInputKind.PARAMETER)

    @property
    def buffers(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.placeholders if p.kind is StageInputKind.BUFFER)

    @property
    def reads_inputs(self) -> bool:
        return any(p.kind in (StageInputKind.INPUT, StageInputKind.TARGET)
                   for p in self.placeholders)


@dataclass(frozen=True, eq=False)
class StageSplit:
    """All stages of one pipeline, plus what every rank needs to run its part."""

    stages: tuple[StageGraph, ...]
    #: Specs of the model inputs and loss targets (to bind ``b`` and ``s`` at run time).
    input_specs: tuple[TensorSpec | None, ...]
    target_specs: tuple[TensorSpec | None, ...]
    #: Constant tensors by the placeholder name the stage modules use.
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    #: Parameter FQN -> the stages that read it (in order).
    param_stages: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: Parameter FQN -> whether it is trained.
    param_requires_grad: Mapping[str, bool] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def shared_params(self) -> dict[str, tuple[int, ...]]:
        """Parameters read by more than one stage (tied weights): their gradients add up."""
        return {fqn: stages for fqn, stages in self.param_stages.items() if len(stages) > 1}

    def cut(self, k: int) -> tuple[CutTensor, ...]:
        """What stage k sends to stage k + 1."""
        return self.stages[k].outputs


# ---------------------------------------------------------------------------------------------

def recomputable_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Op nodes that need no gradient and come from inputs, buffers, constants and shapes only,
    through deterministic, out-of-place ops: any stage can recompute them."""
    out: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        meta = info(node)
        name = op_name(node)
        if meta.requires_grad or name in RANDOM_OPS or _mutates(node):
            continue
        if all(a in out or (a.op == "placeholder" and info(a).kind in _SOURCE_KINDS)
               for a in node.all_input_nodes):
            out.add(node)
    return out


def _mutates(node: torch.fx.Node) -> bool:
    """An in-place op, or the program's update of a buffer (runtime/running_stats.py)."""
    from autopar.runtime.running_stats import batch_norm, update_buffer

    if node.target in (batch_norm, update_buffer):
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _stage_of_layers(layer_ranges: Sequence[tuple[int, int]], num_layers: int) -> list[int]:
    ranges = [tuple(r) for r in layer_ranges]
    if not ranges:
        raise PlanMismatchError("no stages given", expected="at least one (first, last) layer range")
    expected_first = 0
    stage_of = [-1] * num_layers
    for k, (first, last) in enumerate(ranges):
        if first != expected_first or last < first:
            raise PlanMismatchError(
                f"stage {k} covers layers {first}..{last}",
                expected=f"contiguous, non-empty ranges starting at layer {expected_first}",
                found=f"stages {ranges}", fix="give each stage the layers after the previous one")
        for layer in range(first, last + 1):
            if layer >= num_layers:
                raise PlanMismatchError(f"stage {k} names layer {layer}",
                                        expected=f"layers 0..{num_layers - 1}",
                                        found=f"stages {ranges}")
            stage_of[layer] = k
        expected_first = last + 1
    if expected_first != num_layers:
        raise PlanMismatchError("the stages do not cover every layer",
                                expected=f"the last stage to end at layer {num_layers - 1}",
                                found=f"stages {ranges}", fix="extend the last stage")
    return stage_of


def split_into_stages(gm: torch.fx.GraphModule, layers: Sequence[Layer],
                      layer_ranges: Sequence[tuple[int, int]], *,
                      constants: Mapping[str, torch.Tensor] | None = None) -> StageSplit:
    """Cut ``gm`` (a lifted, annotated graph with its loss) into one module per layer range."""
    stage_of_layer = _stage_of_layers(layer_ranges, len(layers))
    layer_index = {layer.name: layer.index for layer in layers}
    num_stages = len(layer_ranges)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    stage: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        layer = info(n).layer
        if layer not in layer_index:
            raise PassError(f"node {n.name} belongs to no known layer ({layer!r})",
                            expected=f"one of {list(layer_index)}",
                            fix="passes that add nodes must set node.meta['autopar'].layer")
        stage[n] = stage_of_layer[layer_index[layer]]
    for n, k in stage.items():
        for a in n.all_input_nodes:
            if a in stage and stage[a] > k:
                raise PassError(f"node {n.name} (stage {k}) reads {a.name} from the later stage "
                                f"{stage[a]}", expected="data to flow from earlier to later layers")

    results = _graph_outputs(output)
    if len(results) != 1 or not isinstance(results[0], torch.fx.Node) \
            or info(results[0]).spec is None or info(results[0]).spec.ndim != 0:
        raise PassError("pipeline training needs the graph to return one scalar loss",
                        found=f"outputs {results}",
                        fix="capture the model with its loss: capture(model, inputs, loss_fn, "
                            "example_targets=targets)")
    loss = results[0]
    recomputable = recomputable_nodes(gm)

    # crossing[k]: non-recomputable tensors made at or before stage k and read after it
    last_reader: dict[torch.fx.Node, int] = {}
    for n, k in stage.items():
        for a in n.all_input_nodes:
            if a in stage and a not in recomputable:
                last_reader[a] = max(last_reader.get(a, -1), k)
    crossing: list[list[torch.fx.Node]] = [[] for _ in range(num_stages)]
    for n in nodes:  # source order: deterministic and the same on every rank
        if n in last_reader:
            for k in range(stage[n], last_reader[n]):
                crossing[k].append(n)
    cut_tensors = {n: _cut_tensor(n, stage[n]) for ns in crossing for n in ns}

    kind_of = {NodeKind.PARAMETER: StageInputKind.PARAMETER,
               NodeKind.BUFFER: StageInputKind.BUFFER,
               NodeKind.CONSTANT: StageInputKind.CONSTANT,
               NodeKind.INPUT: StageInputKind.INPUT,
               NodeKind.TARGET: StageInputKind.TARGET}
    input_index = {n: i for i, n in enumerate(p for p in placeholders
                                              if info(p).kind is NodeKind.INPUT)}
    target_index = {n: i for i, n in enumerate(p for p in placeholders
                                               if info(p).kind is NodeKind.TARGET)}
    param_stages: dict[str, list[int]] = {}
    # A parameter the graph never reads (Dinov2's mask token without a mask input) is kept by the
    # first stage, outside the optimizer: it gets no gradient, and one process's optimizer skips
    # a parameter whose .grad stays None, so it keeps its value; it is still the model's (its
    # state_dict, checkpoints, save_pretrained).
    unread = {p for p in placeholders if info(p).kind is NodeKind.PARAMETER and not p.users}
    stages = []
    for k in range(num_stages):
        own = {n for n, s in stage.items() if s == k}
        received = crossing[k - 1] if k else []
        received_set = set(received)
        # recompute what this stage reads from earlier stages and may recompute
        recompute: set[torch.fx.Node] = set()
        todo = [a for n in own for a in n.all_input_nodes
                if a in stage and stage[a] < k and a not in received_set]
        while todo:
            a = todo.pop()
            if a in recompute:
                continue
            if a not in recomputable:
                raise PassError(f"stage {k} reads {a.name} from stage {stage[a]}, which is "
                                f"neither sent nor recomputable", expected="a crossing tensor")
            recompute.add(a)
            todo += [b for b in a.all_input_nodes if b in stage]
        body = own | recompute
        used_placeholders = {a for n in body for a in n.all_input_nodes if a.op == "placeholder"}
        if k == 0:
            used_placeholders |= unread

        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        specs: list[StageInput] = []

        def add_placeholder(src: torch.fx.Node, kind: StageInputKind, key: str | int) -> None:
            new = graph.placeholder(src.name)
            new.meta = _own_meta(src)
            env[src] = new
            specs.append(StageInput(new.name, kind, key))

        ordered = [p for p in placeholders if p in used_placeholders]
        for p in ordered:
            if info(p).kind not in kind_of:
                add_placeholder(p, StageInputKind.OTHER, p.name)
        for kind in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT):
            for p in ordered:
                if info(p).kind is kind:
                    key = info(p).fqn if kind is not NodeKind.CONSTANT else p.name
                    add_placeholder(p, kind_of[kind], key)
                    if kind is NodeKind.PARAMETER:
                        param_stages.setdefault(info(p).fqn, []).append(k)
        for n in received:
            add_placeholder(n, StageInputKind.ACTIVATION, n.name)
        for kind, index in ((NodeKind.INPUT, input_index), (NodeKind.TARGET, target_index)):
            for p in ordered:
                if info(p).kind is kind:
                    add_placeholder(p, kind_of[kind], index[p])
        for n in nodes:
            if n in body:
                env[n] = graph.node_copy(n, lambda a: env[a])
                env[n].meta = _own_meta(n)
        if k == num_stages - 1:
            out = graph.output(env[loss])
        else:
            out = graph.output(tuple(env[n] for n in crossing[k]))
        out.meta = {}
        stage_gm = torch.fx.GraphModule(gm, graph, class_name=f"Stage{k}")
        stage_gm.graph.lint()
        stages.append(StageGraph(
            index=k, layers=tuple(layer_ranges[k]), gm=stage_gm, placeholders=tuple(specs),
            inputs=tuple(cut_tensors[n] for n in received),
            outputs=tuple(cut_tensors[n] for n in crossing[k]) if k < num_stages - 1 else (),
            returns_loss=k == num_stages - 1,
            recomputed=tuple(n.name for n in nodes if n in recompute)))
    for n, k in stage.items():
        info(n).stage = k
    params_rg = {info(p).fqn: bool(info(p).requires_grad) and p not in unread
                 for p in placeholders if info(p).kind is NodeKind.PARAMETER}
    return StageSplit(
        stages=tuple(stages),
        input_specs=tuple(info(p).spec for p in input_index),
        target_specs=tuple(info(p).spec for p in target_index),
        constants=dict(constants or {}),
        param_stages={fqn: tuple(ks) for fqn, ks in param_stages.items()},
        param_requires_grad=params_rg)


def _own_meta(node: torch.fx.Node) -> dict[str, Any]:
    """The node's meta for a stage graph, with its own copy of the autopar annotation."""
    meta = dict(node.meta)
    if has_info(node):
        meta[META_KEY] = copy.copy(info(node))
    return meta


def _graph_outputs(output: torch.fx.Node) -> list[Any]:
    value = output.args[0]
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _cut_tensor(node: torch.fx.Node, producer: int) -> CutTensor:
    # a tensor-parallel graph records each rank's shard as local_value (the p2p buffer's shape)
    spec = getattr(info(node), "local_value", None) or info(node).value
    if not isinstance(spec, TensorSpec):
        raise PassError(f"{node.name} ({op_name(node)}) crosses a stage cut but is not a tensor "
                        f"({spec})", expected="only tensors between stages",
                        fix="move the cut, or make the value recomputable from the inputs")
    return CutTensor(node.name, spec, bool(info(node).requires_grad and spec.is_float), producer,
                     info(node).placement)


@graph_property("stages_split")
def stages_split(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every op belongs to a stage."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and has_info(node) and info(node).stage is None:
            return f"{node.name} is in no stage"
    return None


@graph_pass(ensures=("stages_split",))
def split_stages(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """The pass form: cut ``ctx.captured`` by ``ctx.plan.stages``; the :class:`StageSplit` is
    its result. Nodes get ``meta["autopar"].stage``; the graph is unchanged."""
    plan = ctx.plan
    if plan is None or not plan.stages:
        raise PlanMismatchError("the stage split needs a plan with stages",
                                fix="run the stage partitioner first (autopar.planner."
                                    "stage_partition) or give Plan(stages=...)")
    captured = ctx.captured
    split = split_into_stages(gm, captured.layers, [s.layers for s in plan.stages],
                              constants=captured.constants)
    return PassResult(gm, False, split)
