"""Process groups shared by the models of one process: created once per layout, reused after.

A parallel model needs groups: its DeviceMesh's (one per mesh dimension, size-1 dimensions
included), the pipeline's point-to-point groups, its tied-weight groups, the expert-parallel
groups, the data-parallel engine's hybrid-shard and tie groups. On gloo each group keeps
a thread per peer and two work threads until it is destroyed, and torch keeps every group in its
registry until then; a process that parallelizes one model after another (a notebook, ``autopar
verify`` across plans, a test pool) would gather them without bound (12 threads per closed dp 2 x
pp 2 model). Destroying them when a model closes is not safe: a peer may still be using a group
(gloo closes the connection under it), and DTensor caches its redistribution plans by mesh
*equality*, so a new mesh of the same layout would be handed the destroyed one's groups.

So the groups are kept, by what they are (the layout, the ranks, the timeout), and the next model
that needs the same ones gets them: one DeviceMesh per layout per process, as torchtitan keeps
one mesh per job. The set stays bounded by the layouts a process uses.

Reuse must be decided identically on every rank (``new_group`` is collective: a rank that creates
a group while a peer reuses one would hang both). Each :func:`shared` call is therefore collective
too: the ranks first agree, with one small all-reduce over the world, that every rank's set is
intact and the same (a digest of the keys). A set is not intact after a failed transfer or
collective of this process (runtime/comm.py counts them: a group that saw one may hold a
half-finished operation) or after the default group changed (``destroy_process_group`` and a new
``init_process_group``). When any rank's is not, every rank drops its set and creates the groups
anew; the dropped groups are left to their holders, not destroyed (a model still alive may use
them), so a process leaks groups only after failures.
"""

from __future__ import annotations

import atexit
import gc
import weakref
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Hashable, Sequence, TypeVar

import torch
import torch.distributed as dist

from autopar.runtime.comm import (blocking, collective, failure_count, new_failure_scope,
                                  rank_device)

__all__ = ["shared", "shared_new_groups", "shared_keys", "forget", "forgotten"]

T = TypeVar("T")


@dataclass
class _Registry:
    #: The default group the entries were created under.
    world: Any = None
    #: failure_count() when the ranks last agreed.
    failures: int = -1
    entries: dict[Hashable, Any] = field(default_factory=dict)


_REGISTRY = _Registry()
#: Groups dropped by :func:`forget` (and destroyed by the executor that failed).
_FORGOTTEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _release_at_exit() -> None:
    """Drop the held groups while the interpreter is still whole: a group whose last reference
    goes during the interpreter's teardown (a module global outliving ``destroy_process_group``)
    can end with its threads still joinable, which aborts the process ("terminate called
    without an active exception", seen once in a restarted ``autopar run`` job)."""
    _REGISTRY.entries = {}
    _REGISTRY.world = None
    gc.collect()


atexit.register(_release_at_exit)


def shared_keys() -> list[Hashable]:
    """The keys of the groups this process holds for reuse, in creation order."""
    return list(_REGISTRY.entries)


_device = rank_device


def _agree(timeout: timedelta) -> None:
    """Collective over the world: keep this process's entries only if every rank's are intact
    and have the same keys; else every rank drops its own."""
    reg = _REGISTRY
    intact = (reg.world is dist.group.WORLD and reg.failures == failure_count())
    digest = zlib.crc32(repr(list(reg.entries)).encode())
    flags = torch.tensor([0 if intact else 1, digest, -digest], dtype=torch.int64,
                         device=_device())
    collective(dist.all_reduce, flags, op=dist.ReduceOp.MAX, timeout=timeout,
               what="the agreement on which process groups to reuse")
    if int(flags[0]) != 0 or int(flags[1]) != -int(flags[2]):
        reg.entries = {}
    reg.world = dist.group.WORLD
    reg.failures = failure_count()
    new_failure_scope()  # every rank alike: a failure announced before is not this model's


def shared(key: Hashable, make: Callable[[], T], timeout: timedelta) -> T:
    """The groups ``make()`` creates for ``key``, created once per process and reused after
    (see the module docstring). Collective over the world, like ``new_group``: every rank calls
    it with the same keys in the same order. ``key`` must hold what the groups depend on (ranks,
    layout, timeout) as ints, strings, floats and tuples (its ``repr`` is compared across
    ranks)."""
    _agree(timeout)
    entries = _REGISTRY.entries
    if key not in entries:
        entries[key] = make()
    return entries[key]


def shared_new_groups(kind: str, rank_lists: Sequence[Sequence[int]], timeout: timedelta
                      ) -> list[Any]:
    """One group per rank list (None for a list of one rank), every rank creating every group in
    list order, through :func:`shared`: created once per process for these lists and this
    timeout. The result is in the order of ``rank_lists``."""
    lists = tuple(tuple(int(r) for r in ranks) for ranks in rank_lists)

    def make() -> list[Any]:
        with blocking(f"the creation of the {kind} process groups", timeout):
            return [dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
                    for ranks in lists]

    return shared((kind, lists, timeout.total_seconds()), make, timeout)


def forget(group: Any) -> None:
    """Drop this process's reference to ``group`` (an executor that failed destroys its
    point-to-point group, and on gloo the last reference going is what closes the connections,
    so that its neighbours fail now rather than at their timeout). Local: the failure it follows
    has made every rank drop its set at the next :func:`shared`. Another live model of the same
    layout that shares the group sees :func:`forgotten` and refuses its next step by name."""
    reg = _REGISTRY
    reg.entries = {k: v for k, v in reg.entries.items()
                   if not (v is group or (isinstance(v, list) and any(g is group for g in v)))}
    _FORGOTTEN.add(group)


def forgotten(group: Any) -> bool:
    """Whether ``group`` was dropped by :func:`forget`: a model of the same layout that failed
    closed it, and a model still holding it must be rebuilt."""
    return group is not None and group in _FORGOTTEN
