"""The device mesh: process groups over (dp, pp, tp), tp innermost, a timeout on every group.

``ParallelMesh(dp, pp, tp)`` is called on every rank after ``init_process_group``. Rank r has
coordinates ``(r // (pp*tp), (r // tp) % pp, r % tp)``: tensor-parallel peers are adjacent ranks
(one node, NVLink), pipeline stages stride by tp, data-parallel replicas are outermost.

The groups come from one ``torch.distributed.device_mesh.DeviceMesh`` with dims named
``("dp", "pp", "tp")``: ``mesh.tp_group`` is ``mesh.device_mesh.get_group("tp")``, so DTensor,
FSDP2 and autopar's own collectives run on the same groups. Every dim is given backend options
carrying the mesh's timeout (``backend_override``; DeviceMesh passes the options' ``_timeout`` to
``new_group``), because a group created without one waits torch's default 30 minutes (10 for
NCCL), whatever ``init_process_group`` was given, and a DeviceMesh dim that spans the whole world
would otherwise be the default group itself. An axis of size 1 has no group here (``None``; the
collectives are then skipped), although DeviceMesh creates a one-rank group for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

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
        self._device_mesh = _device_mesh(self.device_type, grid, self.timeout)  # collective
        d, p, t = self.dp_rank, self.pp_rank, self.tp_rank
        self.axes = {name: self._axis(name, tuple(int(r) for r in ranks)) for name, ranks in (
            ("dp", grid[:, p, t]), ("pp", grid[d, :, t]), ("tp", grid[d, p, :]))}

    def _axis(self, name: str, ranks: tuple[int, ...]) -> _Axis:
        group = self._device_mesh.get_group(name) if len(ranks) > 1 else None
        if group is not None and tuple(dist.get_process_group_ranks(group)) != ranks:
            raise PlanMismatchError(f"the DeviceMesh's {name} group does not hold this rank's "
                                    f"{name} peers", expected=str(ranks),
                                    found=str(dist.get_process_group_ranks(group)))
        return _Axis(name, len(ranks), group, ranks, ranks.index(self.rank))

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
        """The torch DeviceMesh (dims named dp, pp, tp) whose groups this mesh uses."""
        return self._device_mesh

    def __repr__(self) -> str:
        return (f"ParallelMesh(dp={self.dp}, pp={self.pp}, tp={self.tp}; rank {self.rank} at "
                f"dp={self.dp_rank} pp={self.pp_rank} tp={self.tp_rank})")


def _group_options(timeout: timedelta):
    """Backend options carrying ``timeout`` for the default group's backend (NCCL needs its own
    options class; gloo and the rest take the base one)."""
    from torch._C._distributed_c10d import Backend as C10dBackend

    backend = str(dist.get_backend())
    if "nccl" in backend and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return C10dBackend.Options(backend.split(":")[-1], timeout)


def _device_mesh(device_type: str, grid: torch.Tensor, timeout: timedelta):
    """A DeviceMesh over ``grid`` (dims dp, pp, tp) whose every group has ``timeout``.
    Collective: every rank creates every group, in the same order."""
    from torch.distributed.device_mesh import DeviceMesh

    names = ("dp", "pp", "tp")
    return DeviceMesh(device_type, grid, mesh_dim_names=names,
                      backend_override=tuple((None, _group_options(timeout)) for _ in names))
