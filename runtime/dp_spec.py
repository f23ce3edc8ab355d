"""The data-parallel engine's vocabulary (runtime/data_parallel.py): what it is told of each
parameter (:class:`ParamSpec`), the choices it runs with (:class:`DataParallelConfig`), what it
reports (:class:`MemoryReport`) and its default ZeRO-3 units (:func:`default_units`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from autopar.plan_types import OFFLOAD_KINDS
from autopar.runtime.optim import MixedPrecision
from autopar.runtime.zero import ZeroStage

__all__ = ["ParamSpec", "DataParallelConfig", "MemoryReport", "default_units"]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the data-parallel layer must know about one local parameter.

    ``name`` is the parameter's name in its module (prefixed ``"<chunk>."`` when a rank wraps
    several stage chunks). ``replicated_over_tp``: the parameter is the same on every
    tensor-parallel rank (a norm, a bias after a row-parallel GEMM), so its gradient counts once
    in the global norm; False for a tensor-parallel shard. ``sum_grad_over_tp``: its gradient on
    each tp rank is a partial sum to be added over the tp group before the step (layer norms under
    sequence parallelism). ``shared_with``: the global ranks, this one included, holding a copy of
    a tied parameter (embedding on the first stage, LM head on the last); their gradients are
    summed and the copies stay equal. ``tie_id`` tells apart several tied parameters shared by the
    same ranks.
    """

    name: str
    replicated_over_tp: bool = True
    sum_grad_over_tp: bool = False
    shared_with: tuple[int, ...] = ()
    tie_id: str = ""
    #: A mixture-of-experts weight split over the expert-parallel ranks: reduced (and ZeRO
    #: sharded) over the ranks holding the same experts (``mesh.expert_replica_group``).
    expert: bool = False
    #: The parameter's name in the user's model (``transformer.h.0.attn.c_attn.weight``), which
    #: errors name; empty: ``name``, the engine's local one.
    fqn: str = ""

    @property
    def model_name(self) -> str:
        """The name a message gives: the model's where known."""
        return self.fqn or self.name

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ParamSpec needs the parameter's name")
        ranks = tuple(int(r) for r in self.shared_with)
        if ranks and (len(set(ranks)) != len(ranks) or len(ranks) < 2 or min(ranks) < 0):
            raise ValueError(f"shared_with of {self.name} must list at least two distinct global "
                             f"ranks, got {self.shared_with}")
        object.__setattr__(self, "shared_with", tuple(sorted(ranks)))
        if self.sum_grad_over_tp and not self.replicated_over_tp:
            raise ValueError(f"{self.name}: sum_grad_over_tp applies to tensor-parallel "
                             f"replicated parameters; a shard's gradient is already complete")
        if self.sum_grad_over_tp and ranks:
            raise ValueError(f"{self.name}: a parameter is either tied across stages or summed "
                             f"over tp, not both")

    @property
    def tie_key(self) -> tuple[tuple[int, ...], str] | None:
        return (self.shared_with, self.tie_id) if self.shared_with else None


@dataclass(frozen=True, slots=True)
class DataParallelConfig:
    """Data-parallel choices. ``shard_size``: hybrid sharding, data-parallel ranks per shard group
    (one node); None shards over all of them. ``bucket_mb``: gradient bucket size (stages 0-2).
    ``max_grad_norm``: clip in :meth:`DataParallel.step` (None: no clipping). ``prefetch``
    (ZeRO-3): launch the next unit's parameter gather when a unit starts, in forward and in
    backward (the order learnt in the first step: :class:`~autopar.runtime.zero.UnitOrder`)."""

    zero: ZeroStage = ZeroStage.NONE
    bucket_mb: float = 25.0
    shard_size: int | None = None
    mixed_precision: MixedPrecision | None = None
    reshard_after_forward: bool = True
    #: The modules' backward is split into input- and weight-gradient passes (zero-bubble
    #: schedules): ZeRO-3 layers of a stage graph free themselves once their input side has run.
    split_backward: bool = False
    prefetch: bool = True
    sync_module_states: bool = True
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    #: Where the optimizer state lives (ZeRO-Offload / ZeRO-Infinity): "none" (with the
    #: parameters), "optimizer" (master weights and state in host memory, the step on the host),
    #: "disk" (as "optimizer", the element-wise state in files under ``offload_dir``, paged per
    #: bucket: runtime/offload.py).
    offload: str = "none"
    offload_dir: str | None = None
    #: Step each bucket as soon as its reduction is in (:meth:`DataParallel.step`), so the
    #: optimizer runs while the last buckets are still being reduced. None: where it was
    #: measured to pay, CPU processes (gloo); not on CUDA devices, where each bucket's step would
    #: launch its own foreach kernels (not measured yet). It is skipped where the step needs
    #: every gradient first (clipping, offload) or the optimizer may look across parameters.
    step_per_bucket: bool | None = None

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_KINDS:
            raise ValueError(f"offload must be one of {OFFLOAD_KINDS}, got {self.offload!r}")
        if self.offload == "disk" and not self.offload_dir:
            raise ValueError("offload='disk' needs offload_dir (a directory for the optimizer "
                             "state files)")
        try:
            object.__setattr__(self, "zero", ZeroStage(self.zero))
        except ValueError:
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}") from None
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.shard_size is not None:
            if not isinstance(self.shard_size, int) or self.shard_size < 2:
                raise ValueError(f"shard_size must be an integer >= 2 (data-parallel ranks per "
                                 f"shard group), got {self.shard_size!r}; use None to shard over "
                                 f"all data-parallel ranks")
            if self.zero is ZeroStage.NONE:
                raise ValueError("hybrid sharding (shard_size) needs zero >= 1; zero=0 shards "
                                 "nothing")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {self.max_grad_norm}")
        if not (self.norm_type > 0):
            raise ValueError(f"norm_type must be positive (or inf), got {self.norm_type}")

    @staticmethod
    def shard_size_for_node(devices_per_node: int, pp: int, tp: int, dp: int) -> int:
        """Data-parallel ranks in one node of ``devices_per_node`` devices (tp, then pp, inside)."""
        inner = pp * tp
        if devices_per_node % inner and inner % devices_per_node:
            raise ValueError(f"a node of {devices_per_node} devices does not hold whole "
                             f"pp x tp = {inner} blocks")
        return max(1, min(dp, devices_per_node // inner))


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes this rank holds between steps (measured from the tensors' storages)."""

    params: int
    grads: int
    #: Master weights and optimizer state in memory (host memory under offload).
    optimizer: int
    #: Optimizer state in the offload directory's files (offload="disk").
    disk: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def default_units(module: nn.Module) -> list[nn.Module]:
    """ZeRO-3 gather units: the blocks of the outermost ModuleList / Sequential, then the root."""
    queue = [module]
    while queue:
        m = queue.pop(0)
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and m is not module:
            return [*m, module]
        queue.extend(m.children())
    return [module]
