"""The device mesh: process groups over (dp, pp, cp, tp), tp innermost, a timeout on every group.

``ParallelMesh(dp, pp, tp, cp=1)`` is called on every rank after ``init_process_group``. Ranks
are laid out ``((d * pp + p) * cp + c) * tp + t``: tensor-parallel peers are adjacent ranks
(one node, NVLink), context-parallel peers next (stride tp: inside the node while tp x cp fits
it, as Megatron-LM places cp), pipeline stages stride by cp x tp, data-parallel replicas are
outermost. With ``cp_innermost=True`` the two inner axes swap (cp peers adjacent, tp peers
stride cp): the planner picks it when the ring's traffic outweighs tensor parallelism's.
Without context parallelism (cp = 1) this is ``(r // (pp*tp), (r // tp) % pp, r % tp)``.

A *replica* is a data-parallel rank, or with context parallelism one of a data-parallel rank's
``cp`` ranks: replica ``d * cp + c`` holds data-parallel coordinate ``d`` and context-parallel
coordinate ``c``. Gradients are reduced, and ZeRO shards, over the replicas (``replica_group``:
dp x cp ranks); the batch splits over dp (``dp_rank``) and each sequence over cp
(``cp_group``). Code that needs another rank's global rank asks the mesh
(:meth:`ParallelMesh.rank_at`): nothing outside this module assumes an order.

The groups come from one ``torch.distributed.device_mesh.DeviceMesh`` with dims named
``("dp", "pp", "tp")`` (``("dp", "pp", "cp", "tp")``, or ``("dp", "pp", "tp", "cp")``, with
``dp_cp`` flattened from dp and cp under context parallelism): ``mesh.tp_group`` is
``mesh.device_mesh.get_group("tp")``, so DTensor,
FSDP2 and autopar's own collectives run on the same groups. Every dim is given backend options
carrying the mesh's timeout (``backend_override``; DeviceMesh passes the options' ``_timeout`` to
``new_group``), because a group created without one waits torch's default 30 minutes (10 for
NCCL), whatever ``init_process_group`` was given, and a DeviceMesh dim that spans the whole world
would otherwise be the default group itself. An axis of size 1 has no group here (``None``; the
collectives are then skipped), although DeviceMesh creates a one-rank group for it.

Expert parallelism (``ep``, dividing dp) adds two axes inside the data-parallel one, created with
``new_group`` under the same timeout: ``ep`` (``ep`` consecutive data-parallel ranks, which
exchange tokens) and ``expert_replica`` (the ``dp / ep`` ranks holding the same experts, which
reduce their gradients). Nothing else changes: the world stays dp x cp x pp x tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import PlanMismatchError
from autopar.runtime.comm import (DEFAULT_TIMEOUT_S, blocking, default_timeout,
                                  set_rank_label, set_stream_waits)
from autopar.runtime.groups import shared, shared_new_groups

__all__ = ["ParallelMesh", "DEFAULT_TIMEOUT_S", "default_timeout", "coordinates", "coordinates4",
           "rank_grid"]


def coordinates(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of ``rank`` in a dp x pp x tp mesh, tp innermost (with context
    parallelism pass the replicas, dp x cp, as ``dp``: the first coordinate is the replica)."""
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def rank_grid(dp: int, cp: int, pp: int, tp: int, cp_innermost: bool = False) -> torch.Tensor:
    """Global rank at each (dp, cp, pp, tp) coordinate: the one place the layout is decided."""
    if cp_innermost:
        return torch.arange(dp * pp * tp * cp).reshape(dp, pp, tp, cp).permute(0, 3, 1, 2)
    return torch.arange(dp * pp * cp * tp).reshape(dp, pp, cp, tp).permute(0, 2, 1, 3)


def coordinates4(rank: int, dp: int, cp: int, pp: int, tp: int,
                 cp_innermost: bool = False) -> tuple[int, int, int, int]:
    """(dp, cp, pp, tp) coordinates of ``rank`` (:func:`rank_grid`'s layout)."""
    if cp == 1:
        d, p, t = coordinates(rank, dp, pp, tp)
        return d, 0, p, t
    where = (rank_grid(dp, cp, pp, tp, cp_innermost) == rank).nonzero()[0]
    return tuple(int(x) for x in where)  # type: ignore[return-value]


@dataclass(frozen=True)
class _Axis:
    name: str
    size: int
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int  # this process's coordinate on the axis


class ParallelMesh:
    """Process groups for one dp x cp x pp x tp layout of the current world."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *, cp: int = 1, ep: int = 1,
                 cp_innermost: bool = False, timeout: timedelta | None = None,
                 device_type: str | None = None) -> None:
        if not dist.is_initialized():
            raise PlanMismatchError("torch.distributed is not initialized",
                                    fix="call torch.distributed.init_process_group first, or "
                                        "launch with `autopar run` / torchrun")
        world = dist.get_world_size()
        if dp * cp * pp * tp != world:
            raise PlanMismatchError("the plan's mesh does not match the world size",
                                    expected=f"dp x cp x pp x tp = {dp} x {cp} x {pp} x {tp} = "
                                             f"{dp * cp * pp * tp} ranks",
                                    found=f"a world of {world} ranks",
                                    fix="launch with --nproc matching the plan, or re-plan for "
                                        "this world")
        self.dp, self.cp, self.pp, self.tp = dp, cp, pp, tp
        self.cp_innermost = bool(cp_innermost and cp > 1)
        self.replicas = dp * cp
        self.timeout = timeout or default_timeout()
        self.rank = dist.get_rank()
        self.world_size = world
        self.device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        self.dp_rank, self.cp_rank, self.pp_rank, self.tp_rank = coordinates4(
            self.rank, dp, cp, pp, tp, self.cp_innermost)
        self.replica_rank = self.dp_rank * cp + self.cp_rank
        # errors from any collective name this process by its coordinates (runtime/comm.py)
        cp_label = f", cp {self.cp_rank}" if cp > 1 else ""
        set_rank_label(f"rank {self.rank} (dp {self.dp_rank}{cp_label}, pp {self.pp_rank}, "
                       f"tp {self.tp_rank})")
        # NCCL's collectives are waited on the stream, never by blocking the host (comm.py)
        set_stream_waits("nccl" in str(dist.get_backend()))
        grid = rank_grid(dp, cp, pp, tp, self.cp_innermost)  # [d, c, p, t] -> global rank
        self._grid = grid.reshape(dp * cp, pp, tp)  # [replica, p, t] -> global rank
        # collective: every rank creates every group
        # one DeviceMesh per layout in a process, reused by every model of it (runtime/groups.py)
        layout = (self.device_type, dp, cp, pp, tp, self.cp_innermost,
                  self.timeout.total_seconds())
        def make() -> Any:
            with blocking("the creation of the device mesh's process groups", self.timeout):
                return _device_mesh(self.device_type, dp, cp, pp, tp, self.cp_innermost,
                                    self.timeout)

        self._device_mesh = shared(("mesh", *layout), make, self.timeout)
        d, c, p, t = self.dp_rank, self.cp_rank, self.pp_rank, self.tp_rank
        r = self.replica_rank
        axes = [("dp", "dp", grid[:, c, p, t]), ("pp", "pp", grid[d, c, :, t]),
                ("tp", "tp", grid[d, c, p, :])]
        if cp > 1:
            axes += [("cp", "cp", grid[d, :, p, t]),
                     ("replica", "dp_cp", self._grid[:, p, t])]
        self.axes = {name: self._axis(name, tuple(int(x) for x in ranks), dim)
                     for name, dim, ranks in axes}
        if cp == 1:  # one replica per data-parallel rank: the same group
            self.axes["cp"] = _Axis("cp", 1, None, (self.rank,), 0)
            self.axes["replica"] = self.axes["dp"]
        assert self.axes["replica"].rank == r
        self.ep = ep
        self._expert_axes(grid)

    def _expert_axes(self, grid: torch.Tensor) -> None:
        """Expert parallelism borrows ``ep`` of the data-parallel ranks: data-parallel
        coordinate ``d`` is expert-parallel rank ``d % ep`` of the expert group ``d // ep``, and
        the ranks holding the same experts (``expert_replica``: dp / ep of them, the same
        ``d % ep``) reduce their gradients together. Collective: every rank creates every group,
        in the same order."""
        ep, dp = self.ep, self.dp
        if ep < 1 or dp % ep:
            raise PlanMismatchError("expert parallelism borrows its ranks from data parallelism",
                                    expected=f"ep dividing dp={dp}", found=f"ep={ep}")
        if ep > 1 and self.cp > 1:
            raise PlanMismatchError("expert parallelism with context parallelism is not "
                                    "supported", found=f"ep={ep}, cp={self.cp}")
        self.ep_rank, self.expert_replica_rank = self.dp_rank % ep, self.dp_rank // ep
        if ep == 1:
            self.axes["ep"] = _Axis("ep", 1, None, (self.rank,), 0)
            self.axes["expert_replica"] = self.axes["replica"]
            return
        blocks = {"ep": [[d for d in range(dp) if d // ep == g] for g in range(dp // ep)],
                  "expert_replica": [[d for d in range(dp) if d % ep == e] for e in range(ep)]}
        lists = [(name, tuple(int(grid[d, 0, p, t]) for d in ds))
                 for name, of_name in blocks.items() for p in range(self.pp)
                 for t in range(self.tp) for ds in of_name]
        groups = shared_new_groups("expert", [ranks for _, ranks in lists], self.timeout)
        for (name, ranks), group in zip(lists, groups):
            if self.rank in ranks:
                self.axes[name] = _Axis(name, len(ranks), group, ranks, ranks.index(self.rank))

    def _axis(self, name: str, ranks: tuple[int, ...], dim: str | None = None) -> _Axis:
        group = self._device_mesh.get_group(dim or name) if len(ranks) > 1 else None
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
        """The data-parallel ranks with this rank's cp, pp and tp coordinates."""
        return self.axes["dp"].group

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel ranks sharing this rank's sequences (None: cp = 1)."""
        return self.axes["cp"].group

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel ranks exchanging tokens with this one (None: ep = 1)."""
        return self.axes["ep"].group

    @property
    def expert_replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts as this one (dp / ep of them): experts'
        gradients are reduced, and ZeRO shards them, over it."""
        return self.axes["expert_replica"].group

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """Every rank holding the same parameters as this one (dp x cp ranks): gradients are
        reduced, and ZeRO shards, over it."""
        return self.axes["replica"].group

    def ranks(self, axis: str) -> tuple[int, ...]:
        """Global ranks of this process's group along ``axis`` (in coordinate order)."""
        return self.axes[axis].ranks

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank holding pipeline coordinate ``pp_rank`` in this rank's (replica, tp)
        column."""
        return int(self._grid[self.replica_rank, pp_rank, self.tp_rank])

    def rank_at(self, replica: int, pp_rank: int, tp_rank: int) -> int:
        """The global rank at (replica, pp, tp) coordinates."""
        return int(self._grid[replica, pp_rank, tp_rank])

    def replica_of(self, rank: int) -> int:
        """The replica coordinate (dp x cp) of global rank ``rank``."""
        return int((self._grid == rank).nonzero()[0][0])

    def replica_rank_lists(self) -> list[list[int]]:
        """The global ranks of every replica group (one per (pp, tp) coordinate), in replica
        order: what every rank must create, in the same order."""
        return [[int(r) for r in self._grid[:, p, t]] for p in range(self.pp)
                for t in range(self.tp)]

    @property
    def device_mesh(self):
        """The torch DeviceMesh (dims named dp, pp, tp; dp, cp, pp, tp and the flattened dp_cp
        under context parallelism) whose groups this mesh uses."""
        return self._device_mesh

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        at = f" cp={self.cp_rank}" if self.cp > 1 else ""
        return (f"ParallelMesh(dp={self.dp}{cp}, pp={self.pp}, tp={self.tp}; rank {self.rank} at "
                f"dp={self.dp_rank}{at} pp={self.pp_rank} tp={self.tp_rank})")


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


def _device_mesh(device_type: str, dp: int, cp: int, pp: int, tp: int, cp_innermost: bool,
                 timeout: timedelta):
    """A DeviceMesh of the layout (dims dp, pp, tp; or dp, pp, cp, tp / dp, pp, tp, cp, with dp
    and cp flattened into dp_cp) whose every group has ``timeout``. Collective: every rank
    creates every group, in the same order."""
    from torch.distributed.device_mesh import DeviceMesh

    if cp == 1:
        names: tuple[str, ...] = ("dp", "pp", "tp")
        shape: tuple[int, ...] = (dp, pp, tp)
    elif cp_innermost:
        names, shape = ("dp", "pp", "tp", "cp"), (dp, pp, tp, cp)
    else:
        names, shape = ("dp", "pp", "cp", "tp"), (dp, pp, cp, tp)
    world = dp * cp * pp * tp
    mesh = DeviceMesh(device_type, torch.arange(world).reshape(shape), mesh_dim_names=names,
                      backend_override=tuple((None, _group_options(timeout)) for _ in names))
    if cp > 1:
        mesh["dp", "cp"]._flatten("dp_cp", backend_override=(None, _group_options(timeout)))
    return mesh
