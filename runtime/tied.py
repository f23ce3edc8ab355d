"""Tied parameters whose copies live on several ranks (an embedding on the first pipeline stage
and the LM head on the last): one process group per tie, agreed on by every rank."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from autopar.errors import InvalidInputError
from autopar.runtime.dp_spec import ParamSpec
from autopar.runtime.groups import shared_new_groups
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.comm import all_gather_object
from autopar.runtime.zero import wait_work

__all__ = ["TiedGroups"]


class TiedGroups:
    """Process groups of the ranks sharing each tied parameter, agreed on by every rank.

    Building is collective over the world: each rank declares its tied parameters (by
    :class:`ParamSpec`), the declarations are exchanged and checked (every listed rank declares
    the parameter, with one shape), and one group per tie is created in a global order.
    """

    def __init__(self, specs: Mapping[str, ParamSpec], shapes: Mapping[str, torch.Size],
                 mesh: ParallelMesh) -> None:
        rank = dist.get_rank()
        mine = []
        for name, spec in specs.items():
            if spec.tie_key is None:
                continue
            if rank not in spec.shared_with:
                raise InvalidInputError(f"tied parameter {name} does not list this rank",
                                        expected=f"rank {rank} in shared_with",
                                        found=str(spec.shared_with),
                                        fix="list every rank holding a copy, this one included")
            mine.append((spec.tie_key, name, tuple(shapes[name])))
        gathered: list[Any] = all_gather_object(mine, "the exchange of the tied parameters' "
                                                      "layout", mesh.timeout)
        declared: dict[tuple, list[tuple[int, str, tuple]]] = {}
        for r, items in enumerate(gathered):
            for key, name, shape in items:
                declared.setdefault(key, []).append((r, name, shape))
        self.groups: dict[tuple, dist.ProcessGroup] = {}
        self.by_name: dict[str, tuple] = {}
        keys = sorted(declared)
        for key in keys:
            ranks, tie_id = key
            holders = declared[key]
            found = sorted(r for r, _, _ in holders)
            if found != list(ranks):
                raise InvalidInputError(
                    f"tied parameter group {ranks} (tie_id {tie_id!r}) is declared inconsistently",
                    expected=f"exactly ranks {list(ranks)} to declare it once each",
                    found=f"declared by ranks {found}",
                    fix="give every copy the same shared_with and tie_id")
            shapes_seen = {shape for _, _, shape in holders}
            if len(shapes_seen) != 1:
                raise InvalidInputError(f"tied parameter copies {[n for _, n, _ in holders]} differ "
                                        f"in shape", expected="one shape",
                                        found=str(sorted(shapes_seen)),
                                        fix="tie only parameters of the same shape")
            dps = {mesh.replica_of(r) for r in ranks}
            if len(dps) != 1:
                raise InvalidInputError(f"tied copies on ranks {ranks} belong to different "
                                        f"data-parallel replicas",
                                        expected="ranks with one data-parallel coordinate",
                                        found=f"dp coordinates {sorted(dps)}",
                                        fix="tie the copies within one replica (one pipeline)")
        # one group per tie, every rank creating every group in one order; kept for the
        # process's next model with the same ties (runtime/groups.py), not destroyed
        groups = shared_new_groups("tied-dp", [ranks for ranks, _ in keys], mesh.timeout)
        for key, group in zip(keys, groups):
            if rank in key[0]:
                self.groups[key] = group
        for _, name, _ in [m for m in mine]:
            self.by_name[name] = specs[name].tie_key

    def group_of(self, name: str) -> tuple[dist.ProcessGroup, int] | None:
        """(group, source rank) of a tied parameter of this rank, else None."""
        key = self.by_name.get(name)
        return None if key is None else (self.groups[key], key[0][0])

    def all_reduce_grads(self, params: Mapping[str, torch.Tensor]) -> None:
        """Sum ``.grad`` of each tied parameter over its copies (for use without DataParallel)."""
        for name in sorted(self.by_name, key=lambda n: self.by_name[n]):
            grad = params[name].grad
            if grad is None:
                raise InvalidInputError(f"tied parameter {name} has no gradient",
                                        fix="run backward before summing tied gradients")
            wait_work(dist.all_reduce(grad, group=self.groups[self.by_name[name]], async_op=True),
                      f"sum of tied gradient {name}")

    def broadcast_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Make every copy equal to the copy on the group's first rank."""
        with torch.no_grad():
            for name in sorted(self.by_name, key=lambda n: self.by_name[n]):
                key = self.by_name[name]
                wait_work(dist.broadcast(params[name].data, src=key[0][0], group=self.groups[key],
                                         async_op=True), f"broadcast of tied parameter {name}")
