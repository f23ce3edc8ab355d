"""Normalize a freshly captured graph into the canonical form every later pass expects.

- ``drop_runtime_asserts``: export's ``_assert_tensor_metadata`` / ``_assert_scalar`` checks
  are no-ops for a training program; removing them keeps generated code readable.
- ``inline_no_grad_regions``: ``wrap_with_set_grad_enabled(False, submod, ...)`` (LLaMA's rotary
  tables) is inlined, its outputs detached: same values, no gradient, and the body becomes visible
  to the analysis and sharding passes.
- ``simplify_attention_masks``: an ``attn_mask`` of ``scaled_dot_product_attention`` that is a
  function of the shapes alone (Hugging Face builds its causal mask from ``arange``; torch.export
  records it as a tensor) and proves causal becomes ``is_causal=True``, and one that masks nothing
  is dropped. Same values; the fused kernels skip the masked half instead of reading a mask
  (measured on an H100: GPT-2 medium's flash backward 7.9 ms with the mask, 3.7 ms causal).
- ``fold_conv1d_into_linear``: the Hugging Face ``Conv1D`` pattern ``view(x, [-1, k]) -> addmm(b,
  ., W) -> view(., [*lead, n])`` becomes ``linear(x, t(W), b)``, so every GEMM of a transformer is
  an ``aten.linear`` over the full activation shape (what the sharding rules and sequence parallel
  reason about).
"""

from __future__ import annotations

import copy

import operator
from typing import Any

import torch
import torch.fx

from autopar.ir import META_KEY, NodeInfo, NodeKind, TensorSpec, info, op_name, spec_from_value
from autopar.passes.infra import PassContext, PassManager, PassResult, graph_pass, graph_property

__all__ = ["normalize_graph", "NORMALIZE_PASSES", "shape_only_value", "erase_unused", "MASK_PROBES"]

aten = torch.ops.aten

_ASSERT_OPS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
               "sym_constrain_range", "_assert_async"}


@graph_property("no_asserts")
def no_asserts(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) in _ASSERT_OPS and not node.users:
            return f"{node.name} is a runtime assert ({op_name(node)})"
    return None


@graph_pass(ensures=("no_asserts",))
def drop_runtime_asserts(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and op_name(node) in _ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
            modified = True
    return PassResult(gm, modified)


@graph_property("no_hops")
def no_hops(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """No ``torch.no_grad()`` region is left as a higher-order op."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) == "wrap_with_set_grad_enabled" \
                and not node.args[0]:
            return f"{node.name} is a no-grad region (wrap_with_set_grad_enabled)"
    return None


@graph_pass(ensures=("no_hops",))
def inline_no_grad_regions(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    rename = getattr(ctx.captured, "symbol_rename", {}) if ctx.captured is not None else {}
    modified = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "wrap_with_set_grad_enabled":
            continue
        enabled, sub_ref, *operands = node.args
        if enabled:
            continue
        submodule = getattr(gm, sub_ref.target)
        env: dict[torch.fx.Node, Any] = {}
        placeholders = [n for n in submodule.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(placeholders, operands):
            env[ph] = value
        results: list[torch.fx.Node] = []
        with gm.graph.inserting_before(node):
            for inner in submodule.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    outs = inner.args[0]
                    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                    for out in outs:
                        detached = gm.graph.call_function(aten.detach.default, (env[out],))
                        detached.meta.update(env[out].meta)
                        if META_KEY in detached.meta:  # its own annotations, not a shared object
                            detached.meta[META_KEY] = copy.copy(detached.meta[META_KEY])
                        results.append(detached)
                    continue
                copied = gm.graph.node_copy(inner, lambda n: env[n])
                copied.meta.update(inner.meta)
                if META_KEY in copied.meta:
                    copied.meta[META_KEY] = copy.copy(copied.meta[META_KEY])
                copied.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                env[inner] = copied
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not sub_ref.users:
            gm.graph.erase_node(sub_ref)
            delattr(gm, sub_ref.target)
        modified = True
    if modified:
        for n in gm.graph.nodes:
            if META_KEY not in n.meta:
                n.meta[META_KEY] = NodeInfo(NodeKind.OP, spec_from_value(n.meta.get("val"), rename))
    return PassResult(gm, modified)


def _is_param(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and META_KEY in node.meta and \
        info(node).kind is NodeKind.PARAMETER


def _conv1d_gemm(mm: torch.fx.Node) -> tuple[Any, ...] | None:
    """(bias, flattened input, weight, output view, input) when ``mm`` is GPT-2's Conv1D:
    ``view(addmm(b, view(x), W))`` with a parameter W and the leading dims kept."""
    if mm.op != "call_function" or mm.target is not aten.addmm.default:
        return None
    bias, flat_in, weight = mm.args[:3]
    if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
        return None
    if not (_is_param(weight) and isinstance(flat_in, torch.fx.Node)
            and flat_in.target in (aten.view.default, aten.reshape.default)
            and len(mm.users) == 1):
        return None
    (out_view,) = mm.users
    if out_view.target not in (aten.view.default, aten.reshape.default):
        return None
    x = flat_in.args[0]
    x_spec, out_spec = info(x).spec, info(out_view).spec
    if x_spec is None or out_spec is None or x_spec.shape[:-1] != out_spec.shape[:-1]:
        return None
    return bias, flat_in, weight, out_view, x


@graph_property("gemms_are_linear")
def gemms_are_linear(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """Every GEMM with a weight parameter is an ``aten.linear`` (what the analysis and the
    sharding rules read): no Conv1D-shaped ``addmm`` is left."""
    for node in gm.graph.nodes:
        if _conv1d_gemm(node) is not None:
            return f"{node.name} is a Conv1D addmm, not a linear"
    return None


@graph_pass(ensures=("gemms_are_linear",))
def fold_conv1d_into_linear(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for mm in list(gm.graph.nodes):
        match = _conv1d_gemm(mm)
        if match is None:
            continue
        bias, flat_in, weight, out_view, x = match
        out_spec = info(out_view).spec
        w_spec = info(weight).spec
        with gm.graph.inserting_before(mm):
            w_t = gm.graph.call_function(aten.t.default, (weight,))
            linear = gm.graph.call_function(aten.linear.default, (x, w_t, bias))
        for new in (w_t, linear):
            new.meta["nn_module_stack"] = mm.meta.get("nn_module_stack", {})
            new.meta["stack_trace"] = mm.meta.get("stack_trace")
        w_t.meta[META_KEY] = NodeInfo(NodeKind.OP, TensorSpec(w_spec.shape[::-1], w_spec.dtype))
        linear.meta[META_KEY] = NodeInfo(NodeKind.OP, out_spec)
        if "val" in out_view.meta:
            linear.meta["val"] = out_view.meta["val"]
        out_view.replace_all_uses_with(linear)
        gm.graph.erase_node(out_view)
        gm.graph.erase_node(mm)
        if not flat_in.users:
            gm.graph.erase_node(flat_in)
        modified = True
    return PassResult(gm, modified)


_SDPA = aten.scaled_dot_product_attention.default
#: Sizes the mask is evaluated at to prove it causal (b, s): two sequence lengths, so a mask
#: that is causal at one length only is left alone.
MASK_PROBES = ({"b": 2, "s": 5}, {"b": 1, "s": 12})


def shape_only_value(mask: torch.fx.Node, sizes: dict[str, int]) -> torch.Tensor | None:
    """Evaluate ``mask`` from the graph's sizes alone (its ancestors reach no tensor input,
    parameter, buffer or constant except through ``sym_size``), or None when it cannot be."""
    env: dict[torch.fx.Node, Any] = {}
    order: list[torch.fx.Node] = []
    stack, seen = [mask], set()
    while stack:  # the ancestors, stopping at sym_size (the only way sizes enter)
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op != "call_function":
            return None  # a placeholder or attribute read by value: data, not shape
        order.append(node)
        if node.target is not aten.sym_size.int:
            stack.extend(node.all_input_nodes)
    position = {n: i for i, n in enumerate(mask.graph.nodes)}
    try:
        for node in sorted(order, key=position.__getitem__):
            if node.target is aten.sym_size.int:
                value = _at(info(node).value, sizes)
                if value is None:
                    return None
                env[node] = value
                continue
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            if "device" in kwargs:  # evaluated on the CPU (a meta-device capture has no values)
                kwargs = {**kwargs, "device": torch.device("cpu")}
            env[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that needs more than sizes: leave the mask
        return None
    value = env[mask]
    return value if isinstance(value, torch.Tensor) and value.device.type == "cpu" else None


def _mask_kind(mask: torch.Tensor, q_len: int, k_len: int) -> str | None:
    """"causal" (lower-triangular, top-left aligned, as ``is_causal`` means), "none" (masks
    nothing), or None."""
    if mask.dim() < 2 or mask.shape[-2] not in (1, q_len) or mask.shape[-1] not in (1, k_len):
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | blocked).all()):
            return None  # an additive bias, not a mask
        allowed = ~blocked
    else:
        return None
    allowed = allowed.expand(*allowed.shape[:-2], q_len, k_len)
    if bool(allowed.all()):
        return "none"
    tril = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    if q_len == k_len and bool((allowed == tril).all()):
        return "causal"
    return None


def _simplifiable_mask(node: torch.fx.Node) -> str | None:
    """For a fused-attention node with an explicit mask that is a function of shapes only:
    ``"causal"`` or ``"none"`` when it is that mask at every probed size, else None."""
    if node.op != "call_function" or node.target is not _SDPA:
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    q, k, _, mask, _, is_causal = args[:6]
    mask = node.kwargs.get("attn_mask", mask)
    if not isinstance(mask, torch.fx.Node) or node.kwargs.get("is_causal", is_causal):
        return None
    q_spec, k_spec = info(q).spec, info(k).spec
    if q_spec is None or k_spec is None:
        return None
    kinds = set()
    for sizes in MASK_PROBES:
        value = shape_only_value(mask, sizes)
        if value is None:
            return None
        q_len = _at(q_spec.shape[-2], sizes)
        k_len = _at(k_spec.shape[-2], sizes)
        kinds.add(_mask_kind(value, q_len, k_len) if q_len and k_len else None)
    return kinds.pop() if len(kinds) == 1 else None


@graph_property("attention_masks_simplified")
def attention_masks_simplified(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    """No fused attention keeps an explicit mask that is only causal (or nothing) at every
    size: such masks are ``is_causal`` (or dropped), so kernels and the sharding see them."""
    for node in gm.graph.nodes:
        kind = _simplifiable_mask(node)
        if kind is not None:
            return f"{node.name} still takes a {kind} mask as a tensor"
    return None


@graph_pass(ensures=("attention_masks_simplified",))
def simplify_attention_masks(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for node in list(gm.graph.nodes):
        kind = _simplifiable_mask(node)
        if kind is None:
            continue
        args = list(node.args) + [None] * (6 - len(node.args))
        q, k, v, mask, dropout_p, _ = args[:6]
        mask = node.kwargs.get("attn_mask", mask)
        kwargs = {key: val for key, val in node.kwargs.items()
                  if key not in ("attn_mask", "dropout_p", "is_causal")}
        if kind == "causal":
            kwargs["is_causal"] = True
        if dropout_p is not None or "dropout_p" in node.kwargs:
            kwargs["dropout_p"] = node.kwargs.get("dropout_p", dropout_p)
        node.args, node.kwargs = (q, k, v), kwargs
        erase_unused(mask)
        modified = True
    if modified:
        gm.recompile()
    return PassResult(gm, modified)


def _at(expr: Any, sizes: dict[str, int]) -> int | None:
    """A size expression at ``sizes`` (by symbol name), or None if it keeps other symbols."""
    import sympy

    expr = sympy.sympify(expr)
    value = expr.subs({sym: sizes[sym.name] for sym in expr.free_symbols if sym.name in sizes})
    return int(value) if value.is_Integer else None


def erase_unused(node: torch.fx.Node) -> None:
    """Erase ``node`` and then each of its ancestors that is left without users (the mask's
    construction), never a placeholder."""
    graph, stack, erased = node.graph, [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.op != "call_function" or n.users:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


#: Inline first: the inlined regions bring their own asserts for the next pass to drop.
NORMALIZE_PASSES = (inline_no_grad_regions, drop_runtime_asserts, simplify_attention_masks,
                    fold_conv1d_into_linear)


def normalize_graph(captured: Any) -> torch.fx.GraphModule:
    """The normalize passes run on a CapturedGraph's graph: the normalized graph (the caller
    makes the captured graph that holds it)."""
    ctx = PassContext(captured=captured)
    return PassManager(NORMALIZE_PASSES).run(captured.gm, ctx)
