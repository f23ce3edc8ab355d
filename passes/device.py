"""Retarget a captured graph to the device it runs on.

torch.export records device arguments as constants: a model captured on the CPU (autopar
captures where the user built the model, often the CPU or the meta device) has
``arange(..., device=cpu)`` for its position ids, ``full(..., device=cpu)`` for its causal
mask, ``_to_copy(x, device=cpu)``, and so on. Run on a GPU those create tensors on the wrong
device (an ``index_select`` of a cuda embedding by cpu position ids fails). ``retarget_device``
rewrites every such argument to the rank's device; the graph is otherwise unchanged, so on the
capture device it is a no-op.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["retarget_device"]


def _moved(value: object, device: torch.device) -> object:
    if isinstance(value, torch.device) and value != device:
        return device
    if isinstance(value, str) and value in ("cpu", "meta", "cuda") or (
            isinstance(value, str) and value.startswith("cuda:")):
        return device if torch.device(value) != device else value
    return value


def retarget_device(gm: torch.fx.GraphModule, device: torch.device | str) -> int:
    """Point every ``device=`` keyword and ``aten.to.device`` / ``_to_copy`` device argument of
    ``gm`` at ``device``; recompile; return how many arguments changed."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "device" in node.kwargs:
            new = _moved(node.kwargs["device"], device)
            if new is not node.kwargs["device"]:
                node.kwargs = {**node.kwargs, "device": new}
                changed += 1
        if node.target is torch.ops.aten.to.device and len(node.args) > 1:
            new = _moved(node.args[1], device)
            if new is not node.args[1]:
                node.args = (node.args[0], new, *node.args[2:])
                changed += 1
    for node in gm.graph.nodes:  # constants the module holds (get_attr)
        if node.op != "get_attr":
            continue
        owner_name, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        value = getattr(owner, attr, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                and value.device != device:
            if attr in owner._buffers:
                owner._buffers[attr] = value.to(device)
            else:
                setattr(owner, attr, value.to(device))
            changed += 1
    if changed:
        gm.recompile()
    return changed
