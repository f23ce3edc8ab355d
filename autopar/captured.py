"""The captured model: what :func:`autopar.frontend.capture` produces and every later phase reads.

:class:`CapturedGraph` is the first artifact of the compiler (docs/architecture.md): the lifted
ATen graph with shapes in the symbolic batch ``b`` and sequence ``s``, the parameters, buffers and
constants it reads, the layers, and the model it came from. :func:`plan_fingerprint` hashes what
a plan depends on. Both capture paths (``torch.export`` in ``frontend.py``, the fx fallback in
``_fx_fallback.py``) build it from here.
"""

from __future__ import annotations

import enum
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx
import torch.nn as nn
from torch.export import ExportedProgram

from autopar.errors import InvalidInputError
from autopar.ir import Layer, LayerKind, NodeKind, TensorSpec, info, op_name

__all__ = ["CapturedGraph", "CaptureMethod", "ParamInfo", "plan_fingerprint", "MODEL_ATTR",
           "strip_model_prefix"]

#: Attribute name of the user's model inside the traced wrapper; stripped from every FQN.
MODEL_ATTR = "model"


#: CapturedGraph -> its analysis (held as long as the graph is alive).
_PROFILES: "weakref.WeakKeyDictionary[CapturedGraph, Any]" = weakref.WeakKeyDictionary()


class CaptureMethod(enum.Enum):
    EXPORT = "torch.export (dynamic batch/seq)"
    EXPORT_STATIC = "torch.export (static shapes)"
    FX = "torch.fx.symbolic_trace (static shapes)"


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter or buffer of the captured model, by the placeholder that carries it."""

    placeholder: str
    fqn: str
    #: Other names of the same tensor in the model (tied weights), besides ``fqn``.
    aliases: tuple[str, ...]
    spec: TensorSpec
    requires_grad: bool


@dataclass(frozen=True, eq=False)
class CapturedGraph:
    """A traced model: lifted ATen graph + what autopar knows about it.

    Frozen: capture builds it in steps (each a new value, ``dataclasses.replace``) and no later
    phase reassigns its fields; the analysis a phase derives from it is remembered beside it
    (:attr:`profile`), not written into it. Identity is its hash (one capture, one object)."""

    gm: torch.fx.GraphModule
    method: CaptureMethod
    #: Placeholders in call order: parameters, buffers, constants, inputs, targets.
    params: dict[str, ParamInfo]
    buffers: dict[str, ParamInfo]
    constants: dict[str, torch.Tensor]
    input_names: list[str]
    target_names: list[str]
    #: Symbol -> size used in the example inputs (e.g. {b: 2, s: 16}).
    example_sizes: dict[sympy.Symbol, int]
    layers: list[Layer]
    has_loss: bool
    #: The user's model (not copied; capture never mutates it).
    model: nn.Module | None = None
    exported: ExportedProgram | None = None
    warnings: list[str] = field(default_factory=list)
    #: Export's own shape symbols -> b / s (for nodes created after capture from fake values).
    symbol_rename: dict[sympy.Symbol, sympy.Expr] = field(default_factory=dict)
    #: The names of the inputs given by keyword (the example inputs were a dict), in order:
    #: the last ``len(input_kwargs)`` of ``input_names``.
    input_kwargs: tuple[str, ...] = ()
    #: Size symbols the graph holds for only in a range, ``(least, most or None)``: a model
    #: that slices ``ids[:, 2:]`` is traced for ``s >= 4`` (export specializes a size of 0 or
    #: 1); a bound the model states (positions <= 512). Others: any size.
    size_ranges: dict[sympy.Symbol, tuple[int, int | None]] = field(default_factory=dict)

    @property
    def profile(self) -> Any:
        """The analysis of this graph (autopar.passes.analyze.ModelProfile) once a phase has
        derived it (``autopar.passes.analyze.analyze``), else None."""
        return _PROFILES.get(self)

    def remember_profile(self, profile: Any) -> None:
        """Keep ``profile`` as this graph's analysis (what :attr:`profile` returns)."""
        _PROFILES[self] = profile

    # -- lookups --------------------------------------------------------------------------
    def node(self, name: str) -> torch.fx.Node:
        return self._nodes_by_name()[name]

    def _nodes_by_name(self) -> dict[str, torch.fx.Node]:
        cache = getattr(self, "_node_cache", None)
        if cache is None or len(cache) != len(self.gm.graph.nodes):
            cache = {n.name: n for n in self.gm.graph.nodes}
            object.__setattr__(self, "_node_cache", cache)
        return cache

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def size_range(self, symbol: sympy.Symbol) -> str:
        """``size_ranges[symbol]`` in words: ``"s from 4 to 33"``, ``"s from 4 up"``."""
        low, high = self.size_ranges[symbol]
        return f"{symbol.name} from {low}" + (f" to {high}" if high is not None else " up")

    @property
    def num_params(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(int(p.spec.numel) for p in self.params.values())

    @property
    def symbols(self) -> dict[str, sympy.Symbol]:
        return {sym.name: sym for sym in self.example_sizes}

    def example_size_kwargs(self) -> dict[str, int]:
        return {sym.name: size for sym, size in self.example_sizes.items()}

    # -- running the captured program ------------------------------------------------------
    def placeholder_values(self, model: nn.Module | None = None) -> list[torch.Tensor]:
        """Parameters, buffers and constants in placeholder order, read from ``model``."""
        model = model if model is not None else self.model
        if model is None:
            raise InvalidInputError("the captured graph holds no model to read weights from",
                                    fix="pass the model explicitly")
        tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        values = [tensors[p.fqn] for p in self.params.values()]
        values += [tensors[b.fqn] for b in self.buffers.values()]
        values += list(self.constants.values())
        return values

    def run(self, *inputs: Any, model: nn.Module | None = None) -> Any:
        """Run the captured graph (single device): the reference for every parallel check."""
        out = self.gm(*self.placeholder_values(model), *inputs)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    def fingerprint(self, depth: int | None = None) -> str:
        """What a plan for this model depends on, hashed: see :func:`plan_fingerprint`."""
        return plan_fingerprint(self, depth=depth)


def strip_model_prefix(fqn: str) -> str:
    prefix = MODEL_ATTR + "."
    return fqn[len(prefix):] if fqn.startswith(prefix) else fqn


# ---------------------------------------------------------------------------------------------
# Fingerprint: which model a plan was made for
# ---------------------------------------------------------------------------------------------

def plan_fingerprint(captured: CapturedGraph, *, depth: int | None = None) -> str:
    """A fingerprint of the captured model, written into every plan autopar makes and checked
    when a plan is applied (``parallelize(plan=...)``): ``"<autopar major.minor>:<16 hex>"``.

    It hashes the graph's structure layer by layer (ops, their wiring and arguments, symbolic
    shapes and dtypes; devices ignored, so a meta-device capture matches the real model),
    every parameter's and buffer's name, shape, dtype and trainability, the symbolic shapes of
    the example inputs and targets (``b``, ``s``: the batch size and sequence length do not
    matter) and autopar's minor version. Consecutive equal blocks are counted rather than
    listed, so ``depth`` gives the fingerprint of the same model with ``depth`` blocks (the last
    captured block repeated, as the cost model extends a shallow capture); ``autopar plan``
    captures two blocks of a deep model and fingerprints it at its real depth this way.
    """
    from autopar._version import major_minor

    rows: list[tuple[str, int]] = []  # (layer description, repeat count), run-length encoded
    by_fqn = {p.fqn: p for p in captured.params.values()}
    for layer in captured.layers:
        prefix = layer.name + "." if layer.kind is LayerKind.BLOCK else ""
        nodes = [captured.node(n) for n in layer.nodes]
        params = []
        for fqn in layer.params:
            p = by_fqn[fqn]
            names = [_relative(n, prefix) for n in (p.fqn, *p.aliases)]
            params.append(f"{'/'.join(names)}:{p.spec}:{int(p.requires_grad)}")
        text = f"{layer.kind.value}|{_structure(nodes, prefix)}|{';'.join(params)}"
        if rows and rows[-1][0] == text:
            rows[-1] = (text, rows[-1][1] + 1)
        else:
            rows.append((text, 1))
    if depth is not None:
        blocks = [i for i, (text, _) in enumerate(rows) if text.startswith(LayerKind.BLOCK.value)]
        have = sum(rows[i][1] for i in blocks)
        if not blocks or depth < have:
            raise InvalidInputError(f"cannot fingerprint {depth} blocks from a capture of {have}",
                                    expected=f"depth >= {have} captured blocks",
                                    found=f"depth={depth}")
        last = blocks[-1]
        rows[last] = (rows[last][0], rows[last][1] + depth - have)
    h = hashlib.sha256()
    for name in (*captured.input_names, *captured.target_names):
        h.update(f"io:{info(captured.node(name)).value}\n".encode())
    for b in sorted(captured.buffers.values(), key=lambda b: b.fqn):
        h.update(f"buffer:{b.fqn}:{b.spec}\n".encode())
    for text, count in rows:
        h.update(f"{count}x {text}\n".encode())
    h.update(f"loss:{int(captured.has_loss)}".encode())
    return f"{major_minor()}:{h.hexdigest()[:16]}"


_LAYOUT_ONLY = frozenset({"contiguous", "alias", "detach", "lift_fresh_copy"})


def _relative(fqn: str, prefix: str) -> str:
    return fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn


def _structure(nodes: list[torch.fx.Node], prefix: str) -> str:
    """The ops of one layer, their wiring, arguments and symbolic shapes (block-relative
    parameter names, no devices, no node names), hashed. Layout-only ops (``contiguous``,
    ``alias``) are looked through: export records them or not depending on the example's
    strides, which differ between the meta device and real tensors."""
    transparent = {n for n in nodes if n.op == "call_function"
                   and op_name(n) in _LAYOUT_ONLY and isinstance(n.args[0], torch.fx.Node)}
    kept = [n for n in nodes if n not in transparent]
    local = {n: i for i, n in enumerate(kept)}
    h = hashlib.sha1()

    def ref(a: Any) -> str:
        while isinstance(a, torch.fx.Node) and a in transparent:
            a = a.args[0]
        if isinstance(a, torch.fx.Node):
            if a in local:
                return f"%{local[a]}"
            meta = info(a)
            if meta.kind in (NodeKind.PARAMETER, NodeKind.BUFFER) and meta.fqn:
                return f"{meta.kind.value}:{_relative(meta.fqn, prefix)}"
            return f"ext:{meta.kind.value}:{meta.value}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(ref(x) for x in a) + "]"
        if isinstance(a, torch.device):
            return "device"
        return repr(a)

    for n in kept:
        kwargs = sorted((k, v) for k, v in n.kwargs.items() if k != "device")
        h.update(f"{n.target}|{ref(n.args)}|{ref(kwargs)}|{info(n).value}\n".encode())
    return h.hexdigest()[:16]
