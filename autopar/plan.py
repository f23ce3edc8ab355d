"""The plan: every parallelization decision, serialisable, validated on construction.

A :class:`Plan` is what the planner decides and what the passes and the runtime carry out; a
:class:`Prediction` is what the cost model says the plan costs. Both are frozen dataclasses that
check themselves in ``__post_init__`` and round-trip through JSON (never pickle).

This is a leaf module (it imports only :mod:`autopar.errors`), so passes and the runtime use it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ScheduleKind", "RecomputeKind", "GemmSharding", "StagePlan", "Plan", "Prediction",
           "PLAN_FORMAT_VERSION"]

#: Bumped when the JSON form of a plan changes incompatibly.
PLAN_FORMAT_VERSION = 1


class ScheduleKind(str, enum.Enum):
    """Pipeline schedules (the value is the CLI spelling)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZB_H1 = "zb-h1"

    @property
    def interleaved(self) -> bool:
        return self is ScheduleKind.INTERLEAVED_1F1B


class RecomputeKind(str, enum.Enum):
    """Activation recomputation: none, selective (attention core only), full (whole layer)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class GemmSharding(str, enum.Enum):
    """How one GEMM's weight is split across the tensor-parallel group."""

    COLUMN = "column"  # output features split: y = x W_r^T, output sharded on its last dim
    ROW = "row"  # input features split: partial sums, reduced afterwards
    REPLICATE = "replicate"


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage: a contiguous run of the captured graph's layers.

    ``layers`` are inclusive indices into ``CapturedGraph.layers`` (the embedding "pre" layer is
    index 0). With interleaving a pipeline rank owns several stages (``chunk`` 0..v-1).
    """

    index: int
    layers: tuple[int, int]
    pp_rank: int
    chunk: int = 0

    def __post_init__(self) -> None:
        first, last = self.layers
        if not 0 <= first <= last:
            raise ValueError(f"stage {self.index} has layers {self.layers}; expected "
                             f"0 <= first <= last")

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0] + 1


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete parallelization plan for one model on one cluster.

    world size = dp x pp x tp; global batch = micro_batch_size x num_micro_batches x dp.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    recompute: RecomputeKind = RecomputeKind.NONE
    zero: int = 0
    sequence_parallel: bool = False
    #: Stage cuts (empty: not decided yet; the stage partitioner fills them).
    stages: tuple[StagePlan, ...] = ()
    #: Tensor-parallel choice per GEMM, by the node name in the captured graph (empty: decided
    #: by the sharding search when the plan is applied).
    gemm_sharding: Mapping[str, GemmSharding] = field(default_factory=dict)
    #: Fingerprint of the model the plan was made for (see autopar.plan_fingerprint); None for a
    #: plan made from pins alone.
    model_fingerprint: str | None = None
    format_version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "virtual_stages", "micro_batch_size", "num_micro_batches"):
            _positive(name, getattr(self, name))
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        object.__setattr__(self, "recompute", RecomputeKind(self.recompute))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule.interleaved:
            if self.virtual_stages < 2:
                raise ValueError("interleaved-1f1b needs virtual_stages >= 2; use 1f1b for one "
                                 "stage per rank")
            if self.num_micro_batches % self.pp:
                raise ValueError(f"interleaved-1f1b needs num_micro_batches ({self.num_micro_batches}) "
                                 f"divisible by pp ({self.pp})")
        elif self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs the interleaved-1f1b "
                             f"schedule (got {self.schedule.value})")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.stages:
            if len(self.stages) != self.pp * self.virtual_stages:
                raise ValueError(f"{len(self.stages)} stages given; expected pp x virtual_stages = "
                                 f"{self.pp * self.virtual_stages}")
            for prev, nxt in zip(self.stages, self.stages[1:]):
                if nxt.layers[0] != prev.layers[1] + 1:
                    raise ValueError(f"stages {prev.index} and {nxt.index} are not contiguous: "
                                     f"{prev.layers} then {nxt.layers}")
        gemm = {k: GemmSharding(v) for k, v in dict(self.gemm_sharding).items()}
        object.__setattr__(self, "gemm_sharding", gemm)

    # -- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "dp": self.dp, "tp": self.tp, "pp": self.pp,
            "virtual_stages": self.virtual_stages,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule.value,
            "recompute": self.recompute.value,
            "zero": self.zero,
            "sequence_parallel": self.sequence_parallel,
            "stages": [{"index": s.index, "layers": list(s.layers), "pp_rank": s.pp_rank,
                        "chunk": s.chunk} for s in self.stages],
            "gemm_sharding": {k: v.value for k, v in sorted(self.gemm_sharding.items())},
            "model_fingerprint": self.model_fingerprint,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Plan":
        data = dict(data)
        version = data.pop("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format version {version} is not supported by this autopar "
                             f"(expected {PLAN_FORMAT_VERSION}); re-plan with this version")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown plan field(s) {sorted(unknown)}; expected some of "
                             f"{sorted(known)}")
        stages = tuple(StagePlan(index=s["index"], layers=tuple(s["layers"]),
                                 pp_rank=s["pp_rank"], chunk=s.get("chunk", 0))
                       for s in data.pop("stages", ()))
        return cls(stages=stages, **data)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the cost model predicts for a plan (one training step)."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: int
    #: compute_s, tp_comm_s, pp_comm_s, dp_comm_s, bubble_s, recompute_s (+ anything else).
    breakdown: Mapping[str, float] = field(default_factory=dict)
    #: Per-rank memory: weights, gradients, optimizer, activations, ... (bytes).
    memory: Mapping[str, int] = field(default_factory=dict)
    #: How the stages were cut and priced: method, the stage ILP's status, objective and LP
    #: bound (seconds of modelled pipeline) and their gap, the simulated pipeline time.
    stage_partition: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step_time_s <= 0:
            raise ValueError(f"step_time_s must be positive, got {self.step_time_s}")

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "peak_memory_bytes": int(self.peak_memory_bytes),
            "breakdown": dict(self.breakdown),
            "memory": {k: int(v) for k, v in self.memory.items()},
            "stage_partition": dict(self.stage_partition),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Prediction":
        return cls(**dict(data))
