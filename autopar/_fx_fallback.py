"""Capture fallback for models ``torch.export`` cannot take: ``torch.fx.symbolic_trace`` + lowering.

The typical case is an op fake tensors cannot run (a custom kernel with no fake/meta
implementation): export traces with fake tensors and fails on it, while ``symbolic_trace`` records
the call without running it. The fallback then

1. traces the model and its loss with ``symbolic_trace`` (module-level graph);
2. runs it once on the example inputs with real tensors, keeping every intermediate value (so the
   model must not be on the meta device);
3. lowers each node to ATen with ``make_fx`` on those values, splicing the ATen nodes in, and lifts
   every parameter and buffer to a placeholder, giving the same lifted form as the export path;
4. keeps a node that cannot be lowered as one opaque call (its shape from the real run): later
   passes treat it as replicated and say so.

Shapes are static (the example's); the caller warns. Data-dependent control flow fails here too.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.errors import UntraceableModelError
from autopar.ir import META_KEY, NodeInfo, NodeKind, spec_from_value

__all__ = ["capture_with_fx"]


def _fixed_arity(step: nn.Module, n: int) -> nn.Module:
    """A module whose forward takes exactly n positional tensors (fx cannot trace ``*args``)."""
    names = ", ".join(f"arg{i}" for i in range(n))
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {names}):\n    return self.step({names}{',' if n == 1 else ''})",
         namespace)

    class FixedArity(nn.Module):
        forward = namespace["forward"]

    wrapper = FixedArity()
    wrapper.step = step
    return wrapper


def _lower(fn, values: list[Any]) -> torch.fx.GraphModule | None:
    try:
        return make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*values)
    except Exception:  # noqa: BLE001 - not lowerable: the node stays opaque
        return None


def _module_call(module: nn.Module, names: list[str]):
    def call(*flat):
        state = dict(zip(names, flat[: len(names)]))
        return torch.func.functional_call(module, state, flat[len(names):])
    return call


def capture_with_fx(step: nn.Module, args: tuple[Any, ...]):
    from autopar.captured import MODEL_ATTR, CapturedGraph, CaptureMethod, ParamInfo, strip_model_prefix

    if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        raise UntraceableModelError("the fx fallback runs the model once and cannot on the meta device",
                                    fix="capture a small instance on the CPU, or give the op a fake kernel")
    root = _fixed_arity(step, len(args))
    try:
        traced = torch.fx.symbolic_trace(root)
    except Exception as exc:  # noqa: BLE001
        raise UntraceableModelError(f"{type(exc).__name__}: {exc}") from exc

    # 1. real values of every node
    values: dict[torch.fx.Node, Any] = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n] = out
            return out

    with torch.no_grad():
        Record(traced).run(*args)

    tensors = dict(root.named_parameters(remove_duplicate=True))
    tensors.update({k: v for k, v in root.named_buffers(remove_duplicate=True)})
    prefix = "step." + MODEL_ATTR + "."

    def fqn(name: str) -> str:
        return strip_model_prefix(name[len("step."):]) if name.startswith("step.") else name

    graph = torch.fx.Graph()
    lifted: dict[str, torch.fx.Node] = {}
    param_names = [n for n in tensors if n.startswith(prefix) or n.startswith("step.")]
    for name in param_names:  # parameters and buffers first, as export orders them
        ph = graph.placeholder("p_" + fqn(name).replace(".", "_"))
        ph.meta["val"] = tensors[name]
        lifted[name] = ph
    env: dict[torch.fx.Node, Any] = {}
    user_inputs: list[torch.fx.Node] = []
    opaque: list[str] = []

    for node in traced.graph.nodes:
        if node.op == "placeholder":
            ph = graph.placeholder(node.name)
            ph.meta["val"] = values[node]
            env[node] = ph
            user_inputs.append(ph)
            continue
        if node.op == "get_attr":
            env[node] = lifted[node.target] if node.target in lifted else graph.get_attr(node.target)
            continue
        if node.op == "output":
            graph.output(torch.fx.node.map_arg(node.args[0], lambda a: env[a]))
            continue
        if node.target is operator.getitem and isinstance(env[node.args[0]], (list, tuple)):
            env[node] = env[node.args[0]][node.args[1]]  # an item of a lowered multi-output op
            continue
        # call_module / call_function / call_method: lower with make_fx on the real values
        flat_inputs = node.all_input_nodes
        if node.op == "call_module":
            module = traced.get_submodule(node.target)
            names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
            full = [f"{node.target}.{n}" for n in names]
            call = _module_call(module, names)
            extra = [lifted[f] for f in full]
            extra_vals = [tensors[f] for f in full]
        else:
            call, extra, extra_vals = None, [], []

        def rebuild(*flat, _node=node, _call=call, _k=len(extra), _inputs=tuple(flat_inputs)):
            mapping = dict(zip(_inputs, flat[_k:]))
            a = torch.fx.node.map_arg(_node.args, lambda x: mapping[x])
            kw = torch.fx.node.map_arg(_node.kwargs, lambda x: mapping[x])
            if _node.op == "call_module":
                return _call(*flat[:_k], *a, **kw)
            if _node.op == "call_method":
                return getattr(a[0], _node.target)(*a[1:], **kw)
            return _node.target(*a, **kw)

        inputs_now = extra_vals + [values[a] for a in flat_inputs]
        sub = _lower(rebuild, inputs_now) if all(
            isinstance(v, (torch.Tensor, int, float)) for v in inputs_now) else None
        operands = extra + [env[a] for a in flat_inputs]
        if sub is None:  # opaque: one call, shape from the real run
            opaque.append(f"{node.name} ({node.target})")
            rebuild.__name__ = rebuild.__qualname__ = "opaque_" + "".join(
                ch if ch.isalnum() else "_" for ch in str(node.target))
            out = graph.call_function(rebuild, tuple(operands))
            out.meta["val"] = values[node]
            out.meta["autopar_opaque"] = str(node.target)
            if node.op == "call_module":
                out.meta["nn_module_stack"] = {"fx": (node.target.removeprefix("step."), "")}
            env[node] = out
            continue
        sub_env: dict[torch.fx.Node, Any] = {}
        sub_phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, operand in zip(sub_phs, operands):
            sub_env[ph] = operand
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = torch.fx.node.map_arg(inner.args[0], lambda a: sub_env[a])
                break
            if inner.op == "get_attr":  # a constant make_fx lifted: keep as a module attribute
                raise UntraceableModelError(f"{node.name}: lowering produced a tensor constant")
            copied = graph.node_copy(inner, lambda a: sub_env[a])
            path = node.target.removeprefix("step.") if node.op == "call_module" else MODEL_ATTR
            copied.meta["nn_module_stack"] = {"fx": (path, "")}
            sub_env[inner] = copied
        if isinstance(result, (list, tuple)) and not isinstance(values[node], (list, tuple)):
            result = result[0]
        env[node] = result if not isinstance(result, (list, tuple)) else \
            _pack(graph, result, values[node])

    gm = torch.fx.GraphModule(root, graph)
    params: dict[str, ParamInfo] = {}
    buffers: dict[str, ParamInfo] = {}
    param_ids = {id(p) for p in root.parameters()}
    for name, ph in lifted.items():
        value = spec_from_value(tensors[name])
        kind = NodeKind.PARAMETER if id(tensors[name]) in param_ids else NodeKind.BUFFER
        info_ = ParamInfo(ph.name, fqn(name), (), value, kind is NodeKind.PARAMETER)
        (params if kind is NodeKind.PARAMETER else buffers)[ph.name] = info_
        ph.meta[META_KEY] = NodeInfo(kind, value, fqn=fqn(name), reads=(fqn(name),))
    for ph in user_inputs:
        ph.meta[META_KEY] = NodeInfo(NodeKind.INPUT, spec_from_value(ph.meta["val"]))
    for n in gm.graph.nodes:
        if META_KEY not in n.meta:
            kind = NodeKind.OUTPUT if n.op == "output" else NodeKind.OP
            n.meta[META_KEY] = NodeInfo(kind, spec_from_value(n.meta.get("val")))
        if "autopar_opaque" in n.meta:
            n.meta[META_KEY].extra["opaque"] = n.meta["autopar_opaque"]
    gm.recompile()
    captured = CapturedGraph(gm=gm, method=CaptureMethod.FX, params=params, buffers=buffers,
                             constants={}, input_names=[p.name for p in user_inputs],
                             target_names=[], example_sizes={}, layers=[], has_loss=False)
    if opaque:
        captured.warnings.append(f"opaque (not lowered to ATen): {', '.join(opaque)}")
    return captured


def _pack(graph: torch.fx.Graph, items, value):
    """A tuple-valued node (split): re-expose the ATen results through getitem-compatible tuple."""
    return type(value)(items) if isinstance(value, (list, tuple)) else items
