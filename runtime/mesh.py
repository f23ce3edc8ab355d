"""The device mesh: process groups over (dp, pp, tp), tp innermost, a timeout on every group.

``ParallelMesh(dp, pp, tp)`` is called on every rank after ``init_process_group``. Rank r has
coordinates ``(r // (pp*tp), (r // tp) % pp, r % tp)``: tensor-parallel peers are adjacent ranks
(one node, NVLink), pipeline stages stride by tp, data-parallel replicas are outermost. The groups
are created with an explicit timeout (torch's subgroups default to 30 minutes otherwise) and are
also exposed as a ``torch.distributed.device_mesh.DeviceMesh`` for DTensor and FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.errors import PlanMismatchError
from autopar.runtime.comm import DEFAULT_TIMEOUT_S, default_timeout, set_rank_label

__all__ = ["ParallelMesh", "DEFAULT_TIMEOUT_S", "default_timeout", "coordinates"]


def coordinates(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of ``rank`` in a dp x pp x tp mesh, tp innermost."""
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


@dataclass(frozen=True)
class _Axis:
    name: str
    size: int
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int  # this process's coordinate on the axis


class ParallelMesh:
    """Process groups for one dp x pp x tp layout of the current world."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *,
                 timeout: timedelta | None = None, device_type: str | None = None) -> None:
        if not dist.is_initialized():
            raise PlanMismatchError("torch.distributed is not initialized",
                                    fix="call torch.distributed.init_process_group first, or "
                                        "launch with `autopar run` / torchrun")
        world = dist.get_world_size()
        if dp * pp * tp != world:
            raise PlanMismatchError("the plan's mesh does not match the world size",
                                    expected=f"dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp} ranks",
                                    found=f"a world of {world} ranks",
                                    fix="launch with --nproc matching the plan, or re-plan for "
                                        "this world")
        self.dp, self.pp, self.tp = dp, pp, tp
        self.timeout = timeout or default_timeout()
        self.rank = dist.get_rank()
        self.world_size = world
        self.device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        self.dp_rank, self.pp_rank, self.tp_rank = coordinates(self.rank, dp, pp, tp)
        # errors from any collective name this process by its coordinates (runtime/comm.py)
        set_rank_label(f"rank {self.rank} (dp {self.dp_rank}, pp {self.pp_rank}, "
                       f"tp {self.tp_rank})")
        grid = torch.arange(world).reshape(dp, pp, tp)
        self._grid = grid
        self.axes = {
            "dp": self._axis("dp", [grid[:, p, t].tolist() for p in range(pp) for t in range(tp)]),
            "pp": self._axis("pp", [grid[d, :, t].tolist() for d in range(dp) for t in range(tp)]),
            "tp": self._axis("tp", [grid[d, p, :].tolist() for d in range(dp) for p in range(pp)]),
        }
        self._device_mesh = None

    def _axis(self, name: str, rank_lists: Sequence[Sequence[int]]) -> _Axis:
        mine = None
        group = None
        for ranks in rank_lists:  # every rank must create every group, in the same order
            g = dist.new_group(list(ranks), timeout=self.timeout) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine, group = tuple(ranks), g
        assert mine is not None
        return _Axis(name, len(mine), group, mine, mine.index(self.rank))

    # -- groups ---------------------------------------------------------------------------------
    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.axes["tp"].group

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.axes["pp"].group

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.axes["dp"].group

    def ranks(self, axis: str) -> tuple[int, ...]:
        """Global ranks of this process's group along ``axis`` (in coordinate order)."""
        return self.axes[axis].ranks

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank holding pipeline coordinate ``pp_rank`` in this rank's (dp, tp) column."""
        return int(self._grid[self.dp_rank, pp_rank, self.tp_rank])

    @property
    def device_mesh(self):
        """The same layout as a torch DeviceMesh (dims named dp, pp, tp), built on first use."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh(self.device_type, self._grid,
                                           mesh_dim_names=("dp", "pp", "tp"))
        return self._device_mesh

    def __repr__(self) -> str:
        return (f"ParallelMesh(dp={self.dp}, pp={self.pp}, tp={self.tp}; rank {self.rank} at "
                f"dp={self.dp_rank} pp={self.pp_rank} tp={self.tp_rank})")
