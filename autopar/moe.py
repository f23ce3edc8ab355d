"""Capturing mixture-of-experts blocks: the experts as one operation, the router as a graph.

An experts module is recognized by its layout, the one transformers' experts modules share
(``MixtralExperts``, ``Qwen2MoeExperts``, ``OlmoeExperts``... and any module written the same
way, such as ``examples/moe.py``):

- a parameter ``gate_up_proj`` of shape ``[E, 2I, H]`` (gate rows first, then up; ``up_proj``
  ``[E, I, H]`` for experts without a gate) and ``down_proj`` ``[E, H, I]``;
- an activation module ``act_fn``;
- ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

While autopar captures a model, each such module's ``forward`` is the operation
``torch.ops.autopar.moe_experts`` (``runtime/moe.py``), so the data-dependent loop over experts
is one node and everything else (the router's linear layer, softmax, top-k and normalization,
the load-balancing loss) stays an ordinary graph. The activation is recognized by what it
computes on a probe, not by its class. transformers' layout variants autopar does not implement
(interleaved or transposed weights, biases, a norm after each expert, a custom gate) and a model
whose MoE loop cannot be traced otherwise are named errors (:class:`UnsupportedMoEError`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from autopar.errors import UnsupportedMoEError
from autopar.runtime.moe import ACTIVATIONS, moe_experts

__all__ = ["ExpertsModule", "UnsupportedMoEError", "find_experts", "experts_as_operations",
           "MOE_OP", "moe_error"]

#: The captured operation (an ATen-level custom op: one node in the exported graph).
MOE_OP = torch.ops.autopar.moe_experts.default


@dataclass(frozen=True)
class ExpertsModule:
    """One recognized experts module."""

    path: str
    num_experts: int
    hidden: int
    intermediate: int
    gated: bool
    act: str
    #: The parameter names (in the module) of the two stacked weights.
    gate_up: str
    down: str


_HF_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_post_expert_norm")


def _activation(module: nn.Module, act_fn: object) -> str:
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        got = act_fn(probe)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - any failure means "not recognized"
        got = exc
    for name, fn in ACTIVATIONS.items():
        if isinstance(got, torch.Tensor) and torch.allclose(got, fn(probe), rtol=0, atol=1e-12):
            return name
    raise UnsupportedMoEError(
        f"the experts module {module.__class__.__name__} uses an activation autopar's experts "
        f"operation does not implement", expected=f"one of {sorted(ACTIVATIONS)}",
        found=repr(act_fn), fix="use one of those activations, or add it to "
                                "autopar.runtime.moe.ACTIVATIONS")


def _recognize(path: str, module: nn.Module) -> ExpertsModule | None:
    params = dict(module.named_parameters(recurse=False))
    gated = "gate_up_proj" in params
    gate_up = "gate_up_proj" if gated else "up_proj"
    if gate_up not in params or "down_proj" not in params or not hasattr(module, "act_fn"):
        return None
    w, d = params[gate_up], params["down_proj"]
    if w.dim() != 3 or d.dim() != 3:
        return None
    name = module.__class__.__name__
    if hasattr(module, "has_gate"):  # transformers' @use_experts_implementation
        wrong = [f"{flag}={getattr(module, flag)}" for flag in _HF_FLAGS
                 if getattr(module, flag, None) is not (flag == "is_concatenated")]
        if getattr(module, "has_gate") is not gated:
            wrong.append(f"has_gate={getattr(module, 'has_gate')} with {gate_up}")
        apply_gate = getattr(type(module), "_apply_gate", None)
        if gated and apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
            wrong.append(f"a custom _apply_gate ({apply_gate.__qualname__})")
        if wrong:
            raise UnsupportedMoEError(
                f"the experts module {path} ({name}) has a layout autopar's experts operation "
                f"does not implement", found=", ".join(wrong),
                expected="concatenated [gate; up] weights [E, 2I, H], down [E, H, I], no bias, "
                         "no norm after each expert, the default gate",
                fix="train this family without expert capture, or extend "
                    "autopar.runtime.moe for the layout")
    experts, rows, hidden = w.shape
    inner = rows // 2 if gated else rows
    if (gated and rows % 2) or tuple(d.shape) != (experts, hidden, inner):
        raise UnsupportedMoEError(
            f"the experts module {path} ({name}) has weights that do not fit together",
            expected=f"{gate_up} [E, {'2I' if gated else 'I'}, H] and down_proj [E, H, I]",
            found=f"{gate_up} {list(w.shape)}, down_proj {list(d.shape)}")
    return ExpertsModule(path, experts, hidden, inner, gated,
                         _activation(module, getattr(module, "act_fn")), gate_up, "down_proj")


def find_experts(model: nn.Module) -> list[ExpertsModule]:
    """Every experts module of ``model`` (module docstring), in module order."""
    found = []
    modules = dict(model.named_modules())
    for path, module in modules.items():
        hit = _recognize(path, module)
        if hit is None:
            continue
        k = _top_k(modules.get(path.rpartition(".")[0]) if path else None)
        if k is not None and k > hit.num_experts:
            raise UnsupportedMoEError(
                f"the router of {path} picks more experts per token than there are",
                expected=f"top-k <= {hit.num_experts} experts", found=f"top-k = {k}",
                fix="lower the experts per token (num_experts_per_tok)")
        found.append(hit)
    return found


def _top_k(block: nn.Module | None) -> int | None:
    """The experts per token of a mixture-of-experts block: its ``top_k`` (transformers' blocks,
    examples/moe.py) or its router's."""
    for holder in (block, *(getattr(block, name, None) for name in ("gate", "router"))):
        k = getattr(holder, "top_k", None) if holder is not None else None
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    return None


def _forward_as_operation(module: nn.Module, spec: ExpertsModule):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if top_k_index.shape[-1] > spec.num_experts:
            raise UnsupportedMoEError(
                f"the router of {spec.path} picks more experts per token than there are",
                expected=f"top-k <= {spec.num_experts} experts",
                found=f"k = {top_k_index.shape[-1]}", fix="lower num_experts_per_tok")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        index = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(x.shape[0], -1).to(x.dtype)
        out = moe_experts(x, index, weights, getattr(module, spec.gate_up),
                          getattr(module, spec.down), spec.act, spec.gated)
        return out.reshape(shape)

    return forward


@contextlib.contextmanager
def experts_as_operations(model: nn.Module) -> Iterator[list[ExpertsModule]]:
    """While active, every experts module of ``model`` computes through the experts operation
    (one traceable node); yields what was recognized."""
    found = find_experts(model)
    modules = dict(model.named_modules())
    patched = []
    try:
        for spec in found:
            module = modules[spec.path]
            had = "forward" in module.__dict__
            old = module.__dict__.get("forward")
            module.forward = _forward_as_operation(module, spec)  # type: ignore[method-assign]
            patched.append((module, had, old))
        yield found
    finally:
        for module, had, old in patched:
            if had:
                module.forward = old  # type: ignore[method-assign]
            else:
                del module.forward


def moe_error(model: nn.Module, found: str) -> UnsupportedMoEError | None:
    """The error for a model that failed to trace (``found``: the tracer's words) when it holds
    mixture-of-experts experts autopar does not recognize (a ModuleList of expert MLPs walked
    by a loop that depends on the router's values); None when it holds none."""
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if "expert" in leaf.lower() and isinstance(module, nn.ModuleList):
            return UnsupportedMoEError(
                f"could not capture {type(model).__name__}: {path} looks like mixture-of-experts "
                f"experts in a ModuleList, whose routing loop depends on tensor values",
                expected="experts stored as transformers' experts modules store them: stacked "
                         "weights gate_up_proj [E, 2I, H] and down_proj [E, H, I], act_fn, and "
                         "forward(hidden_states, top_k_index, top_k_weights)",
                found=found,
                fix="store the experts in that layout (see examples/moe.py): autopar captures "
                    "them as one operation and keeps the router as a graph")
    return None
