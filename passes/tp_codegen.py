"""Code generation: a per-rank tensor-parallel program as readable, deterministic Python source.

The source defines one ``nn.Module`` per rank: its parameters are this rank's shards (their
shapes and placements listed in ``LAYOUT``), ``load_full_state_dict`` slices them out of the
full model's tensors with the rank's own index ranges, and ``forward`` is the per-rank graph
(passes/tp_transform.py) written out op by op, grouped by layer, each line annotated with its
placement and local shape; collectives are named calls on the ``tp`` group
(``tp.all_reduce(x)``), commented with what they do forward and backward.

The text depends only on the graph, the placements and the rank: no addresses, timestamps or
set orders, so two runs give byte-identical files. It imports torch and autopar's error and
needs an :class:`autopar.runtime.tp.TPGroup`; exec it (or import the written file) to run it.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from autopar.errors import UnsupportedOpError
from autopar.ir import META_KEY, NodeKind, TensorSpec, info
from autopar.sharding import Replicate, crop_to, is_sharded, pad_to, placement_str, shard_slices
from autopar.runtime.cp import FUNCTIONS as CP_FUNCTIONS
from autopar.runtime.tp import FUNCTIONS

__all__ = ["emit_rank_source", "attribute_name", "ParamLayout"]

_RESERVED = {"self", "tp", "cp", "device", "torch", "nn", "aten", "operator", "full", "math"}


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One tensor of the full model as this program holds it."""

    placeholder: str
    fqn: str
    attribute: str
    kind: NodeKind
    placement: Any
    #: The program's global shape (the vocabulary padded: passes/pad_vocab.py).
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    #: The model's own shape where the program pads the tensor (None: ``full_shape``).
    logical_shape: tuple[int, ...] | None = None

    @property
    def model_shape(self) -> tuple[int, ...]:
        """The tensor's shape in the user's model (state dicts, checkpoints)."""
        return self.logical_shape if self.logical_shape is not None else self.full_shape

    def to_program(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor of the model's shape zero-padded to the program's (itself when equal)."""
        return pad_to(value, self.full_shape) if self.logical_shape is not None else value

    def to_model(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor of the program's shape cut to the model's (itself when equal)."""
        return crop_to(value, self.logical_shape) if self.logical_shape is not None else value


def attribute_name(fqn: str, taken: set[str]) -> str:
    """A Python identifier for a parameter FQN ('h.0.attn.c_attn.weight' -> 'h_0_attn_c_attn_weight')."""
    name = re.sub(r"\W", "_", fqn)
    if not name or name[0].isdigit() or keyword.iskeyword(name) or name in _RESERVED:
        name = "p_" + name
    base, i = name, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def param_layouts(gm: torch.fx.GraphModule,
                  logical: Mapping[str, tuple[int, ...]] | None = None) -> list[ParamLayout]:
    """Parameters, buffers and constants of a per-rank graph, in placeholder order; ``logical``:
    FQN -> the model's shape of each tensor the program pads."""
    logical = logical or {}
    taken: set[str] = set()
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        meta = info(n)
        if meta.kind not in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT):
            continue
        spec, local = meta.spec, meta.local_value
        out.append(ParamLayout(n.name, meta.fqn or n.name, attribute_name(meta.fqn or n.name, taken),
                               meta.kind, meta.placement if meta.placement is not None else Replicate(),
                               tuple(int(d) for d in spec.shape), tuple(int(d) for d in local.shape),
                               spec.dtype, logical.get(meta.fqn or n.name)))
    return out


def _fmt(value: Any, names: dict[torch.fx.Node, str]) -> str:
    if isinstance(value, torch.fx.Node):
        return names[value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        if math.isnan(value):
            return "float('nan')"
        return repr(value)
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, names) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_fmt(v, names) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise UnsupportedOpError(f"cannot write the argument {value!r} ({type(value).__name__}) as "
                             f"Python source", fix="report the op that takes it")


def _call(node: torch.fx.Node, names: dict[torch.fx.Node, str]) -> str:
    target = node.target
    args = [_fmt(a, names) for a in node.args]
    kwargs = [f"{k}={_fmt(v, names)}" for k, v in node.kwargs.items()]
    if target is operator.getitem:
        return f"{args[0]}[{args[1]}]"
    if target is operator.floordiv:
        return f"{args[0]} // {args[1]}"
    if target is operator.mul:
        return f"{args[0]} * {args[1]}"
    if FUNCTIONS.get(getattr(target, "__name__", None)) is target:
        return f"tp.{target.__name__}({', '.join(args[1:] + kwargs)})"
    if CP_FUNCTIONS.get(getattr(target, "__name__", None)) is target:
        return f"cp.{target.__name__}({', '.join(args[1:] + kwargs)})"
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        packet = target._schema.name.split("::")[-1]
        prefix = "aten" if ns == "aten" else f"torch.ops.{ns}"
        return f"{prefix}.{packet}.{target._overloadname}({', '.join(args + kwargs)})"
    raise UnsupportedOpError(f"cannot generate code for {node.format_node()}",
                             expected="ATen ops, getitem/arithmetic on sizes, TPGroup collectives",
                             fix="normalize the op away before tensor parallelization")


def _spec_str(value: Any) -> str:
    if isinstance(value, TensorSpec):
        return str(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_spec_str(v) for v in value) + ")"
    return "" if value is None else str(value)


def _slice_expr(source: str, layout: ParamLayout, tp: int, rank: int) -> str:
    p = layout.placement
    if not is_sharded(p):
        return source
    ranges = shard_slices(layout.full_shape[p.dim], p, tp, rank)
    parts = [source + "[" + ", ".join([":"] * p.dim + [f"{a}:{b}"]) + "]" for a, b in ranges]
    if len(parts) == 1:
        return parts[0]
    return f"torch.cat([{', '.join(parts)}], dim={p.dim})"


def emit_rank_source(gm: torch.fx.GraphModule, *, tp: int, rank: int, title: str,
                     summary: Sequence[str] = ()) -> str:
    """The Python source of rank ``rank``'s module for the per-rank graph ``gm``."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    layouts = param_layouts(gm)
    by_placeholder = {p.placeholder: p for p in layouts}
    names: dict[torch.fx.Node, str] = {}
    inputs: list[str] = []
    taken = {p.attribute for p in layouts} | _RESERVED
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if info(n).kind is NodeKind.COMMUNICATOR:
                names[n] = "cp" if n.name == "cp" else "tp"
            elif n.name in by_placeholder:
                names[n] = f"self.{by_placeholder[n.name].attribute}"
            else:
                names[n] = n.name if n.name not in taken else f"{n.name}_"
                inputs.append(names[n])
        else:
            names[n] = n.name if n.name not in taken else f"{n.name}_"
    cls = f"TensorParallelRank{rank}"
    has_cp = any(n.op == "placeholder" and n.name == "cp" for n in gm.graph.nodes)
    out: list[str] = []
    w = out.append
    w(f'"""{title}: tensor-parallel rank {rank} of {tp}.')
    w("")
    w("Generated by autopar (passes/tp_codegen.py) from the captured training graph; do not edit.")
    for line in summary:
        w(line)
    w("Parameters are this rank's shards (LAYOUT); fill them with")
    w("load_full_state_dict(full_model_tensors) or TPProgram.shard_state_dict(full, rank).")
    w('"""')
    w("import operator")
    w("")
    w("import torch")
    w("from torch import nn")
    w("")
    w("from autopar.errors import PlanMismatchError")
    w("")
    w("aten = torch.ops.aten")
    w("")
    w(f"TP_SIZE = {tp}")
    w(f"TP_RANK = {rank}")
    w("")
    w("#: Tensors of the full model this rank holds:")
    w("#: FQN -> (attribute, placement, full shape, local shape).")
    w("LAYOUT = {")
    for p in layouts:
        w(f"    {p.fqn!r}: ({p.attribute!r}, {placement_str(p.placement)!r}, {p.full_shape!r}, "
          f"{p.local_shape!r}),")
    w("}")
    w("")
    w("")
    w(f"class {cls}(nn.Module):")
    w(f'    """Rank {rank} of {tp}: this rank\'s shards and its share of every step."""')
    w("")
    w("    def __init__(self, tp, device=None" + (", cp=None):" if has_cp else "):"))
    w("        super().__init__()")
    w("        if (tp.size, tp.rank) != (TP_SIZE, TP_RANK):")
    w("            raise PlanMismatchError(\"this module is one rank of a tensor-parallel program\",")
    w(f"                                    expected=\"a tp group of size {tp}, rank {rank}\",")
    w("                                    found=f\"size {tp.size}, rank {tp.rank}\",")
    w("                                    fix=\"load the source generated for this rank\")")
    w("        self.tp = tp")
    if has_cp:
        w("        self.cp = cp  # autopar.runtime.cp.CPGroup: this rank's tokens, its attention")
    for p in layouts:
        shape = ", ".join(str(d) for d in p.local_shape) + ("," if len(p.local_shape) == 1 else "")
        empty = f"torch.empty(({shape}), dtype={p.dtype}, device=device)"
        comment = f"  # {placement_str(p.placement)} of {list(p.full_shape)}"
        if p.kind is NodeKind.PARAMETER:
            w(f"        self.{p.attribute} = nn.Parameter({empty}){comment}")
        else:
            w(f"        self.register_buffer({p.attribute!r}, {empty}){comment}")
    w("")
    w("    @torch.no_grad()")
    w("    def load_full_state_dict(self, full):")
    w('        """Copy this rank\'s pieces of the full model\'s tensors (by FQN) into the module."""')
    for p in layouts:
        w(f"        self.{p.attribute}.copy_({_slice_expr(f'full[{p.fqn!r}]', p, tp, rank)})")
    if not layouts:
        w("        pass")
    w("")
    w(f"    def forward(self, {', '.join(inputs)}):")
    w("        tp = self.tp")
    if has_cp:
        w("        cp = self.cp")
    if inputs:
        w(f"        device = {inputs[0]}.device")
    layer = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            result = n.args[0]
            if isinstance(result, (tuple, list)) and len(result) == 1:
                result = result[0]
            w(f"        return {_fmt(result, names)}")
            continue
        meta = info(n) if META_KEY in n.meta else None
        if meta is not None and meta.layer and meta.layer != layer:
            layer = meta.layer
            w(f"        # ---- {layer} ----")
        line = f"        {names[n]} = {_call(n, names)}"
        comment = ""
        if meta is not None and meta.collective is not None:
            comment = f"  # {meta.collective.note}"
        elif meta is not None and meta.placement is not None:
            comment = f"  # {placement_str(meta.placement)} {_spec_str(meta.local_value)}"
        w(line + comment)
    return "\n".join(out) + "\n"
