"""ZeRO over flat buckets: what each data-parallel rank keeps of parameters, gradients and state.

A :class:`FlatBucket` packs some of a rank's parameters into one flat buffer, padded to a multiple
of the shard group size S, so that a collective moves the whole bucket at once and shard ``i`` of
every bucket is the contiguous range ``[i * numel / S, (i + 1) * numel / S)``. What a rank keeps
depends on the ZeRO stage (the names are those of Rajbhandari et al., 2020):

========  =========================  ========================  ================================
stage     parameters (compute dtype)  gradients (grad dtype)    master weights + optimizer state
========  =========================  ========================  ================================
0         full flat buffer            full, all-reduced         full
1         full flat buffer            full local buffer; its    this rank's shard
                                      shard reduce-scattered
                                      in place
2         full flat buffer            shard only (the full      this rank's shard
                                      buffer lives from the
                                      first micro-batch's
                                      gradient to the
                                      reduce-scatter)
3         shard only; the full        shard only                this rank's shard
          buffer is gathered per
          unit (module) for its
          forward and backward
========  =========================  ========================  ================================

With mixed precision (bf16 compute, fp32 master, bf16 gradients) this is 16P, 4P + 12P/S,
2P + 14P/S and 16P/S bytes for P parameters, the accounting of the ZeRO paper.

Hybrid sharding splits the data-parallel ranks into shard groups of S consecutive ranks (one node)
and replicate groups (the same position in every node): gradients are reduce-scattered inside the
shard group and then all-reduced across replicas, parameters are gathered inside the shard group.

Every collective is issued asynchronously where the caller can overlap it (gradient reductions
during backward, parameter gathers after the step) and waited on through :func:`wait_work`, which
turns a timed-out collective into :class:`~autopar.errors.CommunicationTimeoutError`.

Stage 3's per-module gathering (the hooks, the learnt order and its prefetch) is
``runtime/param_units.py``'s.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import InvalidInputError
from autopar.runtime.comm import wait_work  # noqa: F401  (re-exported: the shared helper)
from autopar.runtime.groups import shared_new_groups
from autopar.runtime.optim import MixedPrecision

__all__ = ["ZeroStage", "ShardGroups", "ParamSlot", "FlatBucket", "wait_work",
           "iter_unique_storages"]


#: A stage-3 "gather" with a shard group of one: a local copy, nothing to wait for.
_LOCAL = object()


class ZeroStage(enum.IntEnum):
    """What the data-parallel ranks shard: nothing, + optimizer state, + gradients, + parameters."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


@dataclass(frozen=True, slots=True)
class ShardGroups:
    """This rank's data-parallel groups: all replicas, its shard group, its replicate group.

    Without hybrid sharding the shard group is the whole data-parallel group and there is no
    replicate group (size 1).
    """

    dp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    shard_group: dist.ProcessGroup | None
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    replicate_rank: int

    def __post_init__(self) -> None:
        if self.shard_size * self.replicate_size != self.dp_size:
            raise ValueError(f"shard size {self.shard_size} x replicate size "
                             f"{self.replicate_size} must equal the data-parallel size "
                             f"{self.dp_size}")

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None) -> "ShardGroups":
        """One group both reduced and sharded over (no hybrid split): expert weights' ranks."""
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        return cls(group, size, rank, group, size, rank, None, 1, 0)

    @classmethod
    def build(cls, mesh: Any, shard_size: int | None, timeout: timedelta) -> "ShardGroups":
        """Create the groups for ``mesh`` (a ParallelMesh). Collective over the whole world."""
        dp = mesh.replicas  # data- x context-parallel ranks hold the same parameters
        shard_size = dp if shard_size is None else shard_size
        if shard_size < 1 or dp % shard_size:
            raise InvalidInputError(
                "bad hybrid shard size", expected=f"a divisor of the data-parallel size {dp}",
                found=f"shard_size={shard_size}",
                fix="pick the number of data-parallel ranks in one node (dp must be a multiple)")
        replicate = dp // shard_size
        if replicate == 1:
            return cls(mesh.replica_group, dp, mesh.replica_rank, mesh.replica_group, dp,
                       mesh.replica_rank, None, 1, 0)
        shard_group = replicate_group = None
        rank = mesh.rank
        blocks = [tuple(ranks[r * shard_size:(r + 1) * shard_size])
                  for ranks in mesh.replica_rank_lists() for r in range(replicate)]
        columns = [tuple(ranks[s::shard_size])
                   for ranks in mesh.replica_rank_lists() for s in range(shard_size)]
        # kept for the process's next model of this layout (runtime/groups.py), not destroyed
        groups = shared_new_groups("hybrid", blocks + columns, timeout)
        for block, g in zip(blocks, groups[:len(blocks)]):
            if rank in block:
                shard_group = g
        for column, g in zip(columns, groups[len(blocks):]):
            if rank in column:
                replicate_group = g
        r = mesh.replica_rank
        return cls(mesh.replica_group, dp, r, shard_group, shard_size, r % shard_size,
                   replicate_group, replicate, r // shard_size)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives in its bucket's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class FlatBucket:
    """A flat buffer of parameters with its gradients, master weights and shard bookkeeping.

    ``params`` are ``(name, parameter)`` pairs of one dtype and device. After construction the
    parameters' ``.data`` are views into the bucket's flat buffer (stages 0-2) or empty
    placeholders until :meth:`gather` (stage 3); the parameter objects themselves stay the ones
    the module holds.
    """

    def __init__(self, index: int, params: Sequence[tuple[str, nn.Parameter]], *,
                 stage: ZeroStage, groups: ShardGroups, mixed_precision: MixedPrecision | None,
                 requires_grad: bool, chunk: int = 0, broadcast_src: int | None = None,
                 tie: tuple[dist.ProcessGroup, int] | None = None,
                 sum_group: dist.ProcessGroup | None = None, counts_in_norm: bool = True,
                 deferred: bool = False, host_optimizer: bool = False) -> None:
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.chunk = chunk
        self.stage = ZeroStage(stage)
        self.groups = groups
        self.mp = mixed_precision
        self.requires_grad = requires_grad
        self.sum_group = sum_group
        self.counts_in_norm = counts_in_norm
        self.params = [p for _, p in params]
        slots, offset = [], 0
        for name, p in params:
            slots.append(ParamSlot(name, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        # Stage 0 does not shard, but its padding and "shards" say which part of the (replicated)
        # gradient each rank counts in the global norm.
        self.shard_count = groups.dp_size if self.stage is ZeroStage.NONE else groups.shard_size
        self.shard_numel = -(-self.numel // self.shard_count)
        self.padded_numel = self.shard_numel * self.shard_count
        own = (groups.dp_rank if self.stage is ZeroStage.NONE else groups.shard_rank)
        self.own = slice(own * self.shard_numel, (own + 1) * self.shard_numel)

        first = self.params[0]
        self.device = first.device
        self.orig_dtype = first.dtype
        self.param_dtype = mixed_precision.param_dtype if mixed_precision else first.dtype
        #: A frozen bucket (``requires_grad=False``) is never stepped, so it keeps no master copy:
        #: its compute parameters are what ``state_dict`` and checkpoints read, as Megatron-LM's
        #: distributed optimizer keeps fp32 main weights only for the parameters it steps.
        self.master_dtype = mixed_precision.master_dtype if mixed_precision and requires_grad \
            else self.param_dtype
        self.grad_dtype = mixed_precision.grad_dtype if mixed_precision else first.dtype
        #: The average's 1 / dp applied as gradients are written into the bucket (as PyTorch DDP
        #: divides while copying into its buckets), saving a pass over the reduced buffer;
        #: where they arrive in the bucket's dtype, so that the scaling rounds once, as the
        #: division would. None: divided after the reduction.
        self._prescale = (1.0 / groups.dp_size
                          if groups.dp_size > 1 and self.grad_dtype == self.param_dtype else None)
        #: Offloaded optimizer (ZeRO-Offload, Ren et al. 2021): the master weights the optimizer
        #: updates live in host memory (pinned under CUDA), a copy of their own even in fp32;
        #: the reduced gradients go to the host for the step and the updated weights come back.
        #: Where the device is the host (CPU processes) nothing moves.
        self.host_optimizer = host_optimizer and requires_grad
        self.master_device = torch.device("cpu") if self.host_optimizer else self.device
        #: The master weights are a tensor of their own (not a view of the compute parameters).
        self.separate_master = requires_grad and (mixed_precision is not None
                                                  or self.master_device != self.device)

        for p in self.params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError("parameters of one bucket must share dtype and device")
        with torch.no_grad():
            if deferred:  # the values arrive one parameter at a time through load()
                self._init_empty_storage()
            else:
                self._init_storage(self._filled(broadcast_src, tie))
        #: Which parameters hold their values (all, unless deferred and not loaded yet).
        self.loaded = [not deferred] * len(slots)

        # gradient state
        self.local_grad: torch.Tensor | None = None  # full size, this rank's (micro-)batch sum
        self._written = [False] * len(slots)
        self._has_local = False  # local gradients accumulated since the last reduction
        self.reduced = False  # reduced at least once since zero_grad
        #: ZeRO-0: a gradient was written into the reduced buffer since its last reduction
        self._reopened = False
        self.grad_shard: torch.Tensor | None = None  # stages 2, 3: the reduced shard
        self._grad_shard_stale = True
        self._works: list[Any] = []
        self._rs_out: torch.Tensor | None = None
        self._gather_work: Any = None
        self._prefetch: Any = None  # stage 3: a parameter all-gather launched ahead of use
        self._grad32: torch.Tensor | None = None
        #: Offloaded to a CUDA device's host: a pinned host buffer the reduced gradients are
        #: copied into each step (kept: allocating and freeing pageable memory per step, and
        #: copying into it, ran at 1.5 GB/s on an H100's host), and the event that copy ends on.
        self._grad_host: torch.Tensor | None = None
        self._grad_copied: Any = None
        if requires_grad and self.stage <= ZeroStage.OPTIMIZER:
            self.local_grad = torch.zeros(self.padded_numel, dtype=self.grad_dtype,
                                          device=self.device)
        if requires_grad and self.stage >= ZeroStage.GRADIENTS:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=self.grad_dtype,
                                          device=self.device)
        self.pieces = self._make_pieces() if requires_grad else []
        self.pending_wait = False  # a reduction was launched and not yet waited on
        self.fired = 0  # parameters whose gradient arrived in the current backward
        self.launched = False  # reduction launched in the current backward (kept by the engine)

    # -- storage --------------------------------------------------------------------------------
    def _filled(self, broadcast_src: int | None,
                tie: tuple[dist.ProcessGroup, int] | None) -> torch.Tensor:
        """The full flat buffer of the parameters' values (dp rank 0's, or the tie owner's)."""
        full = torch.zeros(self.padded_numel, dtype=self.master_dtype, device=self.device)
        for slot, p in zip(self.slots, self.params):
            full[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        if broadcast_src is not None and self.groups.dp_size > 1:
            wait_work(dist.broadcast(full, src=broadcast_src, group=self.groups.dp_group,
                                     async_op=True), f"broadcast of bucket {self.index}")
        if tie is not None:
            wait_work(dist.broadcast(full, src=tie[1], group=tie[0], async_op=True),
                      f"broadcast of tied bucket {self.index}")
        return full

    def _master_zeros(self, numel: int) -> torch.Tensor:
        pin = self.host_optimizer and self.device.type == "cuda"
        return torch.zeros(numel, dtype=self.master_dtype, device=self.master_device,
                           pin_memory=pin)

    def _master_copy(self, value: torch.Tensor) -> torch.Tensor:
        out = self._master_zeros(value.numel())
        out.copy_(value)
        return out

    def _init_empty_storage(self) -> None:
        """The stage's buffers, zero, for :meth:`load` to fill: no full buffer under ZeRO-3."""
        mp = self.separate_master
        zeros = functools.partial(torch.zeros, device=self.device)
        self.param_shard = None
        if self.stage is ZeroStage.PARAMETERS:
            self.param_shard = zeros(self.shard_numel, dtype=self.param_dtype)
            self.master = self._master_zeros(self.shard_numel) if mp else self.param_shard
            self.flat_param = torch.empty(self.padded_numel, dtype=self.param_dtype,
                                          device=self.device)
            self._free_storage()
            self.gathered = False
            self._unbind()
            return
        self.flat_param = zeros(self.padded_numel, dtype=self.param_dtype)
        if self.stage is ZeroStage.NONE:
            self.master = self._master_zeros(self.padded_numel) if mp else self.flat_param
        else:
            self.master = self._master_zeros(self.shard_numel) if mp \
                else self.flat_param[self.own]
        self.gathered = True
        self._bind()

    @torch.no_grad()
    def load(self, slot_index: int, value: torch.Tensor) -> None:
        """Write parameter ``slot_index``'s value (its full local tensor) into what this rank
        keeps of it: the flat buffer (stages 0-2) or the part inside this rank's shard (stage
        3), and the master copy under mixed precision. ``value`` can be dropped afterwards."""
        slot = self.slots[slot_index]
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(f"{slot.name}: expected {tuple(slot.shape)}, got "
                             f"{tuple(value.shape)}")
        flat = value.detach().reshape(-1).to(self.device)
        a, b = slot.offset, slot.offset + slot.numel
        lo, hi = max(a, self.own.start), min(b, self.own.stop)  # the part in this rank's shard
        mine = slice(lo - self.own.start, hi - self.own.start)
        if self.stage is ZeroStage.PARAMETERS:
            if lo < hi:
                self.param_shard[mine].copy_(flat[lo - a:hi - a])  # type: ignore[index]
        else:
            self.flat_param[a:b].copy_(flat)
        if self.separate_master:
            if self.stage is ZeroStage.NONE:
                self.master[a:b].copy_(flat)
            elif lo < hi:
                self.master[mine].copy_(flat[lo - a:hi - a])
        self.loaded[slot_index] = True

    def _init_storage(self, full: torch.Tensor) -> None:
        mp = self.separate_master
        stage = self.stage
        self.param_shard: torch.Tensor | None = None
        if stage is ZeroStage.PARAMETERS:
            shard = full[self.own]
            self.param_shard = shard.to(self.param_dtype).clone()
            self.master = self._master_copy(shard) if mp else self.param_shard
            self.flat_param = torch.empty(self.padded_numel, dtype=self.param_dtype,
                                          device=self.device)
            self._free_storage()
            self.gathered = False
            self._unbind()
        else:
            self.flat_param = full.to(self.param_dtype)
            if stage is ZeroStage.NONE:
                self.master = self._master_copy(full) if mp else self.flat_param
            else:
                self.master = self._master_copy(full[self.own]) if mp \
                    else self.flat_param[self.own]
            self.gathered = True
            self._bind()

    def _bind(self) -> None:
        for slot, p in zip(self.slots, self.params):
            p.data = self.flat_param[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _unbind(self) -> None:
        # An empty placeholder: touching a freed parameter fails with a shape error, not garbage.
        empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def _free_storage(self) -> None:
        # Resizing the storage (rather than dropping the tensor) also frees the memory that views
        # saved for backward (the transposed weight of a linear) still point at; gather restores
        # it in place, so those views see the gathered values again.
        self.flat_param.untyped_storage().resize_(0)

    def start_gather(self) -> None:
        """Stage 3: launch the all-gather of the full parameters and return at once (a
        prefetch); :meth:`gather` waits for it and points the parameters at the result."""
        if self.gathered or self._prefetch is not None:
            return
        storage = self.flat_param.untyped_storage()
        storage.resize_(self.padded_numel * self.flat_param.element_size())
        if self.groups.shard_size > 1:
            self._prefetch = dist.all_gather_single(self.flat_param, self.param_shard,
                                                    group=self.groups.shard_group,
                                                    async_op=True)
        else:
            self.flat_param.copy_(self.param_shard)
            self._prefetch = _LOCAL

    @property
    def prefetching(self) -> bool:
        """A gather was launched and not waited for yet."""
        return self._prefetch is not None

    def gather(self) -> None:
        """Stage 3: all-gather the full parameters (or finish the prefetch that started it) and
        point the module's parameters at them."""
        if self.gathered:
            return
        self.start_gather()
        work, self._prefetch = self._prefetch, None
        if work is not _LOCAL:
            wait_work(work, f"all-gather of parameter bucket {self.index}")
        self._bind()
        self.gathered = True

    def free(self) -> None:
        """Stage 3: drop the full parameters (the shard stays); a prefetch in flight is waited
        for first (it writes into the storage being freed)."""
        if self.stage is not ZeroStage.PARAMETERS:
            return
        if self._prefetch is not None:
            self.gather()
        if not self.gathered:
            return
        self._unbind()
        self._free_storage()
        self.gathered = False

    # -- gradients ------------------------------------------------------------------------------
    def accumulate(self, slot_index: int, param: nn.Parameter) -> None:
        """Move ``param.grad`` (just accumulated by autograd) into the flat gradient buffer. A
        hook that finds no gradient (a compiled backward returns None for a parameter it
        computes no gradient for; autograd still runs the hook) adds nothing: the slot reads as
        zero, as an eager backward that never reached the parameter leaves it."""
        if param.grad is None:
            return
        if self.stage is ZeroStage.OPTIMIZER and (self.reduced or self.pending_wait):
            raise InvalidInputError(
                "a gradient arrived after this step's ZeRO-1 reduction",
                expected="one gradient reduction per optimizer step under ZeRO-1",
                found=f"another backward with gradient sync for bucket {self.index}",
                fix="run all but the last micro-batch's backward inside no_sync() "
                    "(or call zero_grad() after step())")
        if self.stage >= ZeroStage.GRADIENTS and self.pending_wait:
            self.wait_reduce()  # the buffer in flight is the reduction's input: finish it first
        if self.stage is ZeroStage.NONE and (self.reduced or self.pending_wait) and \
                not self._reopened:
            # a backward after this step's reduction (gradient accumulation with every backward
            # synced, as DDP allows): finish the reduction before writing into its buffer, and
            # take the prescale's 1/dp on the average it holds, which the next reduction sums
            # over the ranks again (else that average came back dp times)
            self.wait_reduce()
            if self._prescale is not None:
                self.local_grad.mul_(self._prescale)
            self._reopened = True
        grad = param.grad
        param.grad = None
        if self.local_grad is None:  # stages 2, 3: allocated per reduction
            self.local_grad = torch.empty(self.padded_numel, dtype=self.grad_dtype,
                                          device=self.device)
            self.local_grad[self.numel:].zero_()
            self._written = [False] * len(self.slots)
        slot = self.slots[slot_index]
        region = self.local_grad[slot.offset:slot.offset + slot.numel]
        flat = grad.reshape(-1)
        scale = self._prescale
        if self._written[slot_index]:
            if scale is None:
                region.add_(flat)
            else:
                region.add_(flat, alpha=scale)
        else:
            if scale is None:
                region.copy_(flat)
            else:
                torch.mul(flat, scale, out=region)
            self._written[slot_index] = True
        self._has_local = True

    def _fill_unwritten(self) -> None:
        if self.local_grad is None:
            self.local_grad = torch.zeros(self.padded_numel, dtype=self.grad_dtype,
                                          device=self.device)
            self._written = [True] * len(self.slots)
            return
        for i, slot in enumerate(self.slots):
            if not self._written[i]:
                self.local_grad[slot.offset:slot.offset + slot.numel].zero_()
                self._written[i] = True

    def launch_reduce(self) -> None:
        """Start this bucket's gradient reduction over the data-parallel ranks (async)."""
        if self.pending_wait:  # a second synced backward before the step: finish the first
            self.wait_reduce()
        self._fill_unwritten()
        g = self.groups
        if self.stage is ZeroStage.NONE:
            if g.dp_size > 1:
                self._works.append(dist.all_reduce(self.local_grad, group=g.dp_group,
                                                   async_op=True))
        elif self.stage is ZeroStage.OPTIMIZER:  # reduce-scatter into our own shard, in place
            if g.shard_size > 1:
                self._works.append(dist.reduce_scatter_single(
                    self.local_grad[self.own], self.local_grad, group=g.shard_group,
                    async_op=True))
        else:
            self._rs_out = (torch.empty(self.shard_numel, dtype=self.grad_dtype, device=self.device)
                            if g.shard_size > 1 else self.local_grad[self.own])
            if g.shard_size > 1:
                self._works.append(dist.reduce_scatter_single(
                    self._rs_out, self.local_grad, group=g.shard_group, async_op=True))
        self._has_local = False
        self._reopened = False
        self.pending_wait = True

    def wait_reduce(self) -> None:
        """Finish the reduction: replicas summed, divided by the data-parallel size."""
        if not self.pending_wait:
            return
        for work in self._works:
            wait_work(work, f"gradient reduction of bucket {self.index}")
        self._works = []
        g = self.groups
        if self.stage is ZeroStage.NONE:
            if self._prescale is None:
                self.local_grad.div_(g.dp_size)
        else:
            out = self.local_grad[self.own] if self.stage is ZeroStage.OPTIMIZER else self._rs_out
            if g.replicate_size > 1:
                wait_work(dist.all_reduce(out, group=g.replicate_group, async_op=True),
                          f"replica all-reduce of bucket {self.index}")
            if self._prescale is None:
                out.div_(g.dp_size)
            if self.stage >= ZeroStage.GRADIENTS:
                if self._grad_shard_stale:
                    self.grad_shard.copy_(out)
                    self._grad_shard_stale = False
                else:
                    self.grad_shard.add_(out)
                self._rs_out = None
                self.local_grad = None  # the point of ZeRO-2: no full gradient between steps
        self.reduced = True
        self.pending_wait = False

    @property
    def has_local_grads(self) -> bool:
        return self._has_local

    def reduced_grad(self) -> torch.Tensor:
        """The reduced gradient this rank's optimizer reads (full for stage 0, else its shard)."""
        if self.stage is ZeroStage.NONE:
            return self.local_grad
        if self.stage is ZeroStage.OPTIMIZER:
            return self.local_grad[self.own]
        return self.grad_shard

    def norm_part(self) -> torch.Tensor:
        """The reduced gradient elements this rank counts in the global norm."""
        if self.stage is ZeroStage.NONE:
            return self.local_grad[self.own]
        return self.reduced_grad()

    def zero_grad(self) -> None:
        self.wait_reduce()  # never leave a collective behind
        self._written = [False] * len(self.slots)
        self._has_local = False
        self.reduced = False
        self._reopened = False
        self._grad_shard_stale = True
        if self.stage >= ZeroStage.GRADIENTS:
            self.local_grad = None
            if self.grad_shard is not None:
                self.grad_shard.zero_()

    # -- optimizer ------------------------------------------------------------------------------
    def _make_pieces(self) -> list[tuple[str, nn.Parameter, int, int]]:
        """(name, tensor the optimizer updates, start, end in reduced_grad()) per parameter."""
        pieces = []
        if self.stage is ZeroStage.NONE:
            for slot in self.slots:
                view = self.master[slot.offset:slot.offset + slot.numel].view(slot.shape)
                pieces.append((slot.name, nn.Parameter(view), slot.offset,
                               slot.offset + slot.numel))
            return pieces
        lo, hi = self.own.start, self.own.stop
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                pieces.append((slot.name, nn.Parameter(self.master[a - lo:b - lo]), a - lo, b - lo))
        return pieces

    def launch_host_grads(self) -> None:
        """A host optimizer on a CUDA device: start copying the reduced gradient into the pinned
        host buffer (asynchronous, on the stream, after what the stream holds: the reduction;
        :meth:`wait_host_grads` before the step reads it). Elsewhere nothing moves."""
        if not (self.host_optimizer and self.device.type == "cuda") or \
                self._grad_copied is not None:
            return
        grad = self.reduced_grad()
        if self._grad_host is None or self._grad_host.numel() != grad.numel():
            self._grad_host = self._master_zeros(grad.numel())
        self._grad_host.copy_(grad, non_blocking=True)
        self._grad_copied = torch.cuda.Event()
        self._grad_copied.record()

    def set_optimizer_grads(self) -> None:
        """Give the optimizer's pieces their gradients: views of the reduced gradient, or, for
        a host optimizer on a CUDA device, of the pinned host copy (launched here unless
        :meth:`launch_host_grads` did; :meth:`wait_host_grads` before the step reads it)."""
        grad = self.reduced_grad()
        if self.host_optimizer and self.device.type == "cuda":
            if self._grad_copied is None:
                self.launch_host_grads()
            assert self._grad_host is not None
            grad = self._grad_host
        elif grad.dtype != self.master_dtype or grad.device != self.master_device:
            self._grad32 = grad.to(self.master_device, self.master_dtype)
            grad = self._grad32
        for _, piece, a, b in self.pieces:
            piece.grad = grad[a:b].view(piece.shape)

    def wait_host_grads(self) -> None:
        """Block until the gradients :meth:`set_optimizer_grads` copied to the host landed."""
        if self._grad_copied is not None:
            self._grad_copied.synchronize()
            self._grad_copied = None

    def clear_optimizer_grads(self) -> None:
        for _, piece, _, _ in self.pieces:
            piece.grad = None
        self._grad32 = None

    def after_step(self) -> None:
        """Carry the updated master weights to the compute parameters (async gather, 1-2)."""
        mp = self.separate_master
        # from pinned host masters the copy is asynchronous: the stream orders it before the
        # next forward, and the masters change only in the next step, after that forward
        async_copy = self.host_optimizer and self.device.type == "cuda"
        with torch.no_grad():
            if self.stage is ZeroStage.NONE:
                if mp:
                    self.flat_param.copy_(self.master, non_blocking=async_copy)
            elif self.stage is ZeroStage.PARAMETERS:
                if mp:
                    self.param_shard.copy_(self.master, non_blocking=async_copy)
            else:
                if mp:
                    self.flat_param[self.own].copy_(self.master, non_blocking=async_copy)
                if self.groups.shard_size > 1:
                    self._gather_work = dist.all_gather_single(
                        self.flat_param, self.flat_param[self.own],
                        group=self.groups.shard_group, async_op=True)

    def wait_gather(self) -> None:
        wait_work(self._gather_work, f"parameter all-gather of bucket {self.index}")
        self._gather_work = None

    def full_master(self) -> torch.Tensor:
        """The whole flat master buffer (gathered for stages 1-3). Collective over the shard group."""
        if self.stage is ZeroStage.NONE or self.groups.shard_size == 1:
            return self.master.detach().to(self.device, copy=True)
        out = torch.empty(self.padded_numel, dtype=self.master_dtype, device=self.device)
        wait_work(dist.all_gather_single(out, self.master.to(self.device).contiguous(),
                                         group=self.groups.shard_group, async_op=True),
                  f"gather of master bucket {self.index}")
        return out

    def full_slot(self, slot_index: int) -> torch.Tensor:
        """Parameter ``slot_index`` whole, from the master weights: under ZeRO 1-3 each rank of
        the shard group broadcasts the part of it inside its shard (collective over the shard
        group), so only this one tensor is ever whole here."""
        slot = self.slots[slot_index]
        a, b = slot.offset, slot.offset + slot.numel
        if self.stage is ZeroStage.NONE or self.groups.shard_size == 1:
            return self.master[a:b].detach().view(slot.shape).to(self.device, copy=True)
        out = torch.empty(slot.numel, dtype=self.master_dtype, device=self.device)
        size = self.shard_numel
        for r in range(self.shard_count):
            lo, hi = max(a, r * size), min(b, (r + 1) * size)
            if lo >= hi:
                continue
            piece = out[lo - a:hi - a]
            if r == self.groups.shard_rank:
                piece.copy_(self.master[lo - r * size:hi - r * size])
            src = dist.get_global_rank(self.groups.shard_group, r)
            wait_work(dist.broadcast(piece, src=src, group=self.groups.shard_group,
                                     async_op=True), f"gather of {slot.name}")
        return out.view(slot.shape)

    # -- memory ---------------------------------------------------------------------------------
    def storages(self) -> dict[str, dict[tuple[int, int], int]]:
        """Storages held persistently, by kind: {'params'|'grads'|'master': {key: bytes}}."""
        out: dict[str, dict[tuple[int, int], int]] = {"params": {}, "grads": {}, "master": {}}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is not None and t.untyped_storage().nbytes():
                out[kind][_storage_key(t)] = t.untyped_storage().nbytes()

        add("params", self.flat_param)
        add("params", self.param_shard)
        add("grads", self.local_grad)
        add("grads", self.grad_shard)
        if not any(_storage_key(self.master) in out[k] for k in ("params",)):
            add("master", self.master)
        return out


def iter_unique_storages(tensors: Iterable[torch.Tensor]) -> dict[tuple[int, int], int]:
    """{storage key: bytes} of the tensors, each storage once."""
    out: dict[tuple[int, int], int] = {}
    for t in tensors:
        if t.untyped_storage().nbytes():
            out[_storage_key(t)] = t.untyped_storage().nbytes()
    return out
