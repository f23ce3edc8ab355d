"""What the search prices and what it gets back: a candidate plan, its per-stage costs, its
evaluation, and the training setup they are priced at (the vocabulary of
:mod:`autopar.planner.cost_model` and :mod:`autopar.planner.search`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from autopar.plan_types import OptimizerProfile, Plan, Prediction, RecomputeKind, ScheduleKind
from autopar.planner.kernels import PRECISION_BYTES
from autopar.planner.memory import RankMemory

__all__ = ["Candidate", "OFFLOAD_ORDER", "StageCost", "RankSums", "HeldParams", "Staging", "Evaluation", "TrainingSetup"]


# ---------------------------------------------------------------------------------------------
# Candidates and their evaluation
# ---------------------------------------------------------------------------------------------

#: Offload choices in the order the search tries them (cheapest first).
OFFLOAD_ORDER = ("none", "optimizer", "disk")


class Candidate(NamedTuple):
    dp: int
    tp: int
    pp: int
    virtual_stages: int
    micro_batch_size: int
    schedule: ScheduleKind
    recompute: RecomputeKind
    zero: int
    sequence_parallel: bool
    #: Context parallelism: ranks each sequence is split over.
    cp: int = 1
    #: cp peers adjacent ranks, tp strided by cp (runtime/mesh.py).
    cp_innermost: bool = False
    #: The K/V exchange ("ring", "allgather"); None: the cheaper.
    cp_attention: str | None = None
    #: Expert parallelism: data-parallel ranks each block's experts are split over.
    ep: int = 1
    #: ZeRO-3: free each layer's weights after its forward (gather again for the backward).
    reshard_after_forward: bool = True
    #: Where the optimizer state lives (Plan.offload): "none", "optimizer" (host) or "disk".
    offload: str = "none"

    def key(self) -> tuple:
        """Deterministic order for ties."""
        return (self.tp, self.pp, self.dp, self.virtual_stages, self.micro_batch_size,
                self.schedule.value, self.recompute.value, self.zero, self.sequence_parallel,
                self.cp, self.cp_innermost, self.cp_attention or "", self.ep,
                not self.reshard_after_forward, OFFLOAD_ORDER.index(self.offload))

    def label(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        cp = (f" cp={self.cp}{' (inner)' if self.cp_innermost else ''}"
              f"{' ' + self.cp_attention if self.cp_attention else ''}" if self.cp > 1 else "")
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"dp={self.dp}{cp}{ep} tp={self.tp} pp={self.pp}{v} mbs={self.micro_batch_size} "
                f"{self.schedule.value} recompute={self.recompute.value} zero={self.zero}{sp}"
                f"{'' if self.reshard_after_forward or self.zero < 3 else ' kept-gathered'}"
                f"{'' if self.offload == 'none' else ' offload=' + self.offload}")


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage, one micro-batch (what the schedule model and `simulate` consume)."""

    index: int
    layers: tuple[int, int]
    pp_rank: int
    chunk: int
    forward_s: float  # compute + TP communication
    backward_s: float  # input gradients + recomputation + TP communication
    weight_s: float
    recompute_s: float
    tp_comm_s: float
    p2p_s: float  # send to the next stage
    activation_bytes: float  # per micro-batch

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "layers": list(self.layers), "pp_rank": self.pp_rank,
                "chunk": self.chunk, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "weight_s": self.weight_s, "recompute_s": self.recompute_s,
                "tp_comm_s": self.tp_comm_s, "p2p_s": self.p2p_s,
                "activation_bytes": self.activation_bytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StageCost":
        return cls(index=d["index"], layers=tuple(d["layers"]), pp_rank=d["pp_rank"],
                   chunk=d["chunk"], forward_s=d["forward_s"], backward_s=d["backward_s"],
                   weight_s=d["weight_s"], recompute_s=d["recompute_s"],
                   tp_comm_s=d["tp_comm_s"], p2p_s=d["p2p_s"],
                   activation_bytes=d["activation_bytes"])


@dataclass(frozen=True, slots=True)
class RankSums:
    params: float
    largest_layer_params: float
    layers: int
    activations: float  # per micro-batch, at the recompute setting
    working: float  # while one layer's backward runs: its rematerialized block, transients
    forward: float
    backward: float
    backward_chunk0: float
    recompute: float
    tp_comm: float
    #: Of ``params``: the experts this rank holds (already divided by ep), whose ZeRO shards
    #: span the dp / ep ranks holding the same experts.
    expert_params: float = 0.0
    #: Parameter tensors this rank holds (what an optimizer's per-tensor cost multiplies).
    tensors: int = 0
    #: The largest tensor this rank receives from another pipeline rank per micro-batch (a
    #: stage's input, or its output's gradient; per tp rank): what each receive posted ahead of
    #: its compute holds (``ScheduleSpec.receives_ahead``).
    received_bytes: float = 0.0
    #: The largest trainable parameter this rank holds (per tp rank, experts over ep): the
    #: largest tensor an optimizer steps at a time, bucket permitting
    #: (memory.optimizer_step_bytes).
    largest_param: float = 0.0
    #: Of ``params``, ``expert_params`` and ``tensors``: the frozen ones (``requires_grad=False``:
    #: weights without gradients, reductions or optimizer state).
    frozen_params: float = 0.0
    frozen_expert_params: float = 0.0
    frozen_tensors: int = 0
    #: The trainable parameters of the layer with the most (ZeRO-3's unsharded gradients are
    #: one layer's at a time; a frozen layer has none).
    largest_layer_trainable: float = 0.0

    @property
    def trainable_params(self) -> float:
        """The parameters with a gradient: what is reduced over the replicas and stepped."""
        return self.params - self.frozen_params


@dataclass(frozen=True, slots=True)
class HeldParams:
    """What one tensor-parallel rank holding some layers holds of the parameters
    (:meth:`autopar.planner.stage_sums.StageSums.rank_params`): elements per tp rank, experts
    over ep, a tied table once."""

    params: float
    largest_layer: float  # the layer with the most
    experts: float  # of params
    tensors: int
    largest_param: float  # the largest trainable tensor
    frozen: float = 0.0  # of params: without gradient
    frozen_experts: float = 0.0  # of experts
    frozen_tensors: int = 0
    largest_layer_trainable: float = 0.0  # the layer with the most trainable ones


@dataclass(frozen=True, slots=True)
class Staging:
    stages: tuple[StageCost, ...]
    ranks: tuple[RankSums, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    p2p: tuple[float, ...]
    recompute_flops: float  # per micro-batch
    cuts: tuple[tuple[int, int], ...] = ()
    #: per stage, the part of forward / backward waiting on tensor-parallel peers (a0 per call)
    forward_wait: tuple[float, ...] = ()
    backward_wait: tuple[float, ...] = ()
    #: per stage, whether it runs its whole backward in its I, its W empty
    #: (``schedule_model.backward_whole_at_input``); empty: none
    whole_at_input: tuple[bool, ...] = ()


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    #: None when the candidate fits; else why not (kept by the search).
    infeasible: str | None
    plan: Plan | None = None
    prediction: Prediction | None = None
    ranks: tuple[RankMemory, ...] = ()
    stages: tuple[StageCost, ...] = ()
    extra: Mapping[str, float] = field(default_factory=dict)
    #: Priced by :meth:`CostModel.refine` (stage ILP + simulator), not the first pass.
    refined: bool = False

    @property
    def feasible(self) -> bool:
        return self.infeasible is None

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s if self.prediction else math.inf


@dataclass(frozen=True, slots=True)
class TrainingSetup:
    """What the user fixed: the global batch (sequences), the sequence length, precision."""

    global_batch: int
    seq: int
    dtype: str = "bf16"
    #: Mixture-of-experts: rows of the busiest expert-parallel rank over the mean (1: uniform
    #: routing, what the load-balancing loss aims at). An assumption the user may change.
    moe_imbalance: float = 1.0
    #: The optimizer as the planner prices it: its kernel, its own state per parameter and
    #: what its step moves, runs and holds (``OptimizerFactory.profile`` measures the one
    #: ``parallelize`` is given); the default: AdamW on torch's default kernel.
    optimizer: OptimizerProfile = OptimizerProfile()

    def __post_init__(self) -> None:
        if not self.moe_imbalance >= 1.0:
            raise ValueError(f"moe_imbalance must be >= 1 (the busiest rank over the mean), got "
                             f"{self.moe_imbalance}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.seq < 1:
            raise ValueError(f"seq must be >= 1, got {self.seq}")
        if self.dtype not in PRECISION_BYTES:
            raise ValueError(f"dtype must be one of {sorted(PRECISION_BYTES)}, got {self.dtype!r}")
