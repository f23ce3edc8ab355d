"""Attention written out by hand, as one ``scaled_dot_product_attention``.

Many models spell attention out: ``softmax(q @ k.transpose(-1, -2) * scale + causal_mask) @ v``
(Hugging Face's eager attention, nanoGPT's manual path, most research code). A pass that must
see attention as one operation (context parallelism: its ring exchanges keys and values between
the two matmuls) cannot split that chain token-wise. :func:`fuse_written_attention` replaces
each such core by ``aten.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)``:

- the cores are found by structure (:func:`autopar.passes.recompute.attention_cores`: the two
  attention GEMMs ``Q K^T`` and ``P V`` and every node between them);
- what they compute is **measured**, not pattern-matched: the core runs on random float64
  ``q``, ``k^T`` and ``v`` at two sizes (``b, s`` = 2, 5 and 1, 12), its mask evaluated from the
  graph's sizes alone (``passes/normalize.py``'s ``shape_only_value``: the mask Hugging Face
  builds from ``arange``). The softmax's input gives the scale (its ratio to ``q k^T`` where
  nothing is masked) and the mask (the entries pushed to the dtype's minimum: none, or exactly
  the causal upper triangle); then the core's output must equal ``scaled_dot_product_attention``
  with that scale and causality (in float64: the core's casts are taken as rounding, not as
  what it computes; rtol 1e-6);
- a core that does anything else is left as it is: a mask from the data (padding), an additive
  bias (ALiBi), dropout with p > 0 (random), a mask causal at one size only, a softmax over
  another dim. The pass that needed attention then refuses it by name, as before.

The fused op computes the same function up to rounding (fp32 softmax vs the kernel's); only
context parallelism applies it (``passes/context_parallel.py``), where the written-out core
could not run at all. Selective recompute keeps recomputing written-out cores as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map

from autopar.ir import META_KEY, NodeInfo, NodeKind, TensorSpec, has_info, info, op_name
from autopar.passes.normalize import MASK_PROBES, erase_unused, shape_only_value
from autopar.passes.recompute import attention_cores

__all__ = ["fuse_written_attention", "written_attention"]

aten = torch.ops.aten

_SOFTMAX = frozenset({"softmax", "_softmax", "_safe_softmax"})
#: Scores at or below this were masked (Hugging Face adds the dtype's minimum; nanoGPT -inf).
_MASKED = -1e30


def written_attention(gm: torch.fx.GraphModule) -> list[tuple[list[torch.fx.Node], bool, float]]:
    """The cores of ``gm`` that compute ``scaled_dot_product_attention(q, k, v, is_causal,
    scale)``: (the core's nodes, Q K^T first and P V last; is_causal; scale), in graph order.
    ``gm`` is not changed."""
    by_name = {n.name: n for n in gm.graph.nodes}
    found = []
    for core in attention_cores(gm):
        nodes = [by_name[n] for n in core.nodes]
        if len(nodes) < 3 or any(op_name(n) not in ("matmul", "bmm")
                                 for n in (nodes[0], nodes[-1])):
            continue  # a fused attention with dropout is a core of its own
        measured = _measure(nodes)
        if measured is not None:
            found.append((nodes, *measured))
    return found


def fuse_written_attention(gm: torch.fx.GraphModule) -> int:
    """Replace each core :func:`written_attention` finds by one ``scaled_dot_product_attention``
    (in place; the core's nodes and its mask's construction are erased when nothing else
    reads them). Returns the number of cores fused."""
    graph = gm.graph
    fused = 0
    for nodes, is_causal, scale in written_attention(gm):
        qk, pv = nodes[0], nodes[-1]
        q, kt = qk.args[:2]
        v = pv.args[1]
        with graph.inserting_before(pv):
            k = graph.call_function(aten.transpose.int, (kt, -2, -1))
            k.meta[META_KEY] = _like(kt, value=_transposed(info(kt).spec))
            attention = graph.call_function(aten.scaled_dot_product_attention.default,
                                            (q, k, v), {"is_causal": is_causal, "scale": scale})
            attention.meta[META_KEY] = _like(pv)
            for key in ("val", "tensor_meta", "stack_trace", "nn_module_stack"):
                if key in pv.meta:
                    attention.meta[key] = pv.meta[key]
        pv.replace_all_uses_with(attention)
        erase_unused(pv)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def _measure(nodes: list[torch.fx.Node]) -> tuple[bool, float] | None:
    """(is_causal, scale) when the core computes that attention at every probed size, else
    None."""
    qk, pv = nodes[0], nodes[-1]
    softmax = [n for n in nodes if op_name(n) in _SOFTMAX]
    operands = (qk.args[0], qk.args[1], pv.args[1])
    if len(softmax) != 1 or not all(isinstance(a, torch.fx.Node) and has_info(a)
                                    and isinstance(info(a).spec, TensorSpec) for a in operands):
        return None
    inside = set(nodes)
    seen: set[tuple[bool, float]] = set()
    gen = torch.Generator().manual_seed(0)
    for sizes in MASK_PROBES:
        shapes = [info(a).spec.concrete_shape(**sizes) for a in operands]
        env: dict[torch.fx.Node, Any] = {a: torch.randn(shape, generator=gen, dtype=torch.float64)
                                        for a, shape in zip(operands, shapes)}
        try:
            for n in nodes:
                args = torch.fx.node.map_arg(n.args, lambda a: _value(a, env, inside, sizes))
                kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: _value(a, env, inside, sizes))
                env[n] = n.target(*tree_map(_in_float64, args), **tree_map(_in_float64, kwargs))
        except _NotShapeOnly:
            return None
        except Exception:  # noqa: BLE001 - an op that cannot run on these values: not fused
            return None
        q, kt, v = (env[a] for a in operands)
        scores = (q @ kt).to(torch.float64)
        logits = env[softmax[0].args[0]]
        if not isinstance(logits, torch.Tensor) or logits.shape != scores.shape:
            return None
        logits = logits.to(torch.float64)
        masked = logits <= _MASKED
        s_q, s_k = scores.shape[-2:]
        causal = torch.ones(s_q, s_k, dtype=torch.bool).triu(1).expand_as(masked)
        if bool(masked.any()) and not (s_q == s_k and bool((masked == causal).all())):
            return None  # masks something other than the future
        kept, raw = logits[~masked], scores[~masked]
        scale = float((kept * raw).sum() / (raw * raw).sum())
        if not torch.allclose(kept, scale * raw, rtol=1e-5, atol=1e-6):
            return None  # not a scaling of q k^T (a bias, another function)
        is_causal = bool(masked.any())
        want = torch.nn.functional.scaled_dot_product_attention(
            q, kt.transpose(-2, -1), v, is_causal=is_causal, scale=scale)
        got = env[pv]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or \
                not torch.allclose(got.to(torch.float64), want, rtol=1e-6, atol=1e-9):
            return None
        seen.add((is_causal, round(scale, 12)))
    return seen.pop() if len(seen) == 1 else None


def _in_float64(x: Any) -> Any:
    """The core runs in float64: its casts (an fp32 softmax, ``.to(value.dtype)``) are rounding,
    not what it computes."""
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch.float64)
    return x


class _NotShapeOnly(Exception):
    """A core input that is neither an operand nor a function of the sizes alone."""


def _value(a: Any, env: dict[torch.fx.Node, Any], inside: set[torch.fx.Node],
           sizes: dict[str, int]) -> Any:
    if not isinstance(a, torch.fx.Node):
        return a
    if a in env:
        return env[a]
    if a in inside:
        raise _NotShapeOnly(a.name)
    value = shape_only_value(a, sizes)  # the mask, built from the sizes
    if value is None:
        raise _NotShapeOnly(a.name)
    env[a] = value
    return value


def _transposed(spec: TensorSpec) -> TensorSpec:
    shape = list(spec.shape)
    shape[-2], shape[-1] = shape[-1], shape[-2]
    return TensorSpec(tuple(shape), spec.dtype)


def _like(node: torch.fx.Node, value: Any = None) -> NodeInfo:
    meta = info(node) if has_info(node) else NodeInfo(NodeKind.OP)
    return NodeInfo(NodeKind.OP, value=value if value is not None else meta.value,
                    module_path=meta.module_path, layer=meta.layer,
                    requires_grad=meta.requires_grad, placement=meta.placement,
                    local_value=meta.local_value)
