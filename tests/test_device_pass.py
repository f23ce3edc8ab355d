"""passes/device.py: a graph captured on the CPU runs on another device.

torch.export bakes ``device=cpu`` into factory calls (position ids, masks); a GPU run of such a
graph mixes devices. The meta device stands in for the GPU here: after ``retarget_device`` the
graph runs on meta inputs and makes only meta tensors (before, its factory calls make CPU ones).
"""

import torch
import torch.nn as nn

import autopar
from autopar.passes.device import retarget_device


class PositionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.pos = nn.Embedding(12, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # baked as device=cpu
        mask = torch.ones(ids.shape[1], ids.shape[1], device=ids.device).tril()
        h = self.tok(ids) + self.pos(positions)
        return (mask @ h).sum()


def _devices(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.kwargs["device"]) for n in gm.graph.nodes
            if n.op == "call_function" and "device" in n.kwargs}


def test_retarget_rewrites_every_device_argument_and_runs_there():
    model = PositionModel()
    ids = torch.randint(0, 16, (2, 10))
    captured = autopar.capture(model, (ids,))
    gm = captured.gm
    assert _devices(gm) == {"cpu"}
    args = [t.detach().to("meta") for t in captured.placeholder_values(model)]
    changed = retarget_device(gm, "meta")
    assert changed >= 2  # arange and ones
    assert _devices(gm) == {"meta"}
    out = gm(*args, ids.to("meta"))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    assert outs and all(t.device.type == "meta" for t in outs if isinstance(t, torch.Tensor))


def test_retarget_to_the_capture_device_changes_nothing():
    captured = autopar.capture(PositionModel(), (torch.randint(0, 16, (2, 10)),))
    code = captured.gm.code
    assert retarget_device(captured.gm, "cpu") == 0
    assert captured.gm.code == code
