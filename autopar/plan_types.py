"""The plan: every parallelization decision, serialisable, validated on construction.

A :class:`Plan` is what the planner decides and what the passes and the runtime carry out; a
:class:`Prediction` is what the cost model says the plan costs. Both are frozen dataclasses that
check themselves in ``__post_init__`` and round-trip through JSON (never pickle).

Bad values raise :class:`autopar.errors.InvalidPlanError` (an ``InvalidInputError`` and a
``ValueError``) saying what was expected, what was found and the fix; a plan written by another
plan format or autopar version raises :class:`autopar.errors.PlanMismatchError`.

This is a leaf module (it imports only :mod:`autopar.errors` and the version), so passes and the
runtime use it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autopar._version import __version__, major_minor
from autopar.errors import InvalidInputError, InvalidPlanError, PlanMismatchError
from autopar.runtime.schedules import ScheduleKind, schedule_spec

__all__ = ["ScheduleKind", "RecomputeKind", "GemmSharding", "OptimizerKernel", "OptimizerStep",
           "OptimizerProfile", "StagePlan", "Plan", "Prediction", "PLAN_FORMAT_VERSION"]

#: Bumped when the JSON form of a plan changes incompatibly.
PLAN_FORMAT_VERSION = 1
#: Context-parallel attention algorithms (autopar/runtime/cp.py).
CP_ATTENTION_KINDS = ("ring", "allgather")
#: Where a plan keeps the optimizer state (Plan.offload).
OFFLOAD_KINDS = ("none", "optimizer", "disk")


class RecomputeKind(str, enum.Enum):
    """Activation recomputation: none, selective (attention core only), full (whole layer)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class OptimizerKernel(str, enum.Enum):
    """How torch runs an optimizer's step (``torch.optim.AdamW(fused=..., foreach=...)``): one
    fused kernel over every tensor, its ops batched over the tensors (foreach), or its ops one
    tensor at a time (the for-loop). torch's default is foreach on a GPU, the for-loop on a CPU;
    what the step moves and how long it takes follows (autopar/planner/kernels.py)."""

    FUSED = "fused"
    FOREACH = "foreach"
    FOR_LOOP = "for-loop"

    @classmethod
    def of_options(cls, options: "Mapping[str, object]") -> "OptimizerKernel | None":
        """The kernel a torch optimizer's ``fused`` / ``foreach`` options ask for; None: torch's
        default for the device."""
        if options.get("fused"):
            return cls.FUSED
        if options.get("foreach") is True:
            return cls.FOREACH
        if options.get("foreach") is False:
            return cls.FOR_LOOP
        return None

    @classmethod
    def default_on(cls, gpu: bool) -> "OptimizerKernel":
        """torch's choice when the options leave it open (``_default_to_fused_or_foreach``)."""
        return cls.FOREACH if gpu else cls.FOR_LOOP


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """What one optimizer step moves, runs and allocates, counted on a probe by the runtime
    (``runtime.optim.OptimizerFactory.step_cost``): bytes read and written per parameter element
    (torch's for-loop AdamW 84, its fused kernel 28, SGD with momentum 32, plain SGD 12) and ATen
    calls per parameter tensor (8, 1, 3, 1), priced by ``planner.kernels.optimizer_time``; and
    the temporaries it holds at its peak (``planner.memory.optimizer_step_bytes``): bytes per
    element of every tensor it steps (foreach AdamW's square roots of all its moments at once,
    4) and per element of the largest tensor it steps (the for-loop AdamW's square root and
    quotient of one tensor while the previous tensor's denominator is still bound, 12). None:
    not counted (the kernel's AdamW figures)."""

    bytes_per_param: float
    ops_per_tensor: float
    temporary_bytes: float | None = None
    tensor_temporary_bytes: float | None = None

    def __post_init__(self) -> None:
        counts = (self.bytes_per_param, self.ops_per_tensor,
                  *(t for t in (self.temporary_bytes, self.tensor_temporary_bytes)
                    if t is not None))
        if not all(x >= 0 for x in counts):
            raise InvalidPlanError("an optimizer step moves, runs and holds what it counts",
                                   expected="bytes_per_param, ops_per_tensor and temporaries "
                                            ">= 0",
                                   found=f"{self.bytes_per_param}, {self.ops_per_tensor}, "
                                         f"{self.temporary_bytes}, "
                                         f"{self.tensor_temporary_bytes}",
                                   fix="count them with OptimizerFactory.step_cost()")


#: Bytes per parameter of Adam's two fp32 moments (Kingma and Ba 2015): AdamW's optimizer state
#: beyond the fp32 master weights, the default :class:`OptimizerProfile` prices, and what
#: ``offload="disk"`` keeps in files.
MOMENT_BYTES = 8.0


@dataclass(frozen=True, slots=True)
class OptimizerProfile:
    """What the planner prices of the optimizer, one value the runtime measures on probes
    (``runtime.optim.OptimizerFactory.profile``) and ``autopar.plan`` takes: the ``kernel`` its
    step runs (None: torch's default on the device, foreach on a GPU, the for-loop on a CPU),
    its own ``state_bytes`` per parameter beyond the fp32 master weights (Adam's two fp32
    moments 8, SGD with momentum 4, plain SGD 0), what its ``step`` moves, runs and holds
    (None: AdamW's), and whether its update is ``elementwise`` (an element's update reads that
    element alone: what ZeRO's flat shards and tensor-parallel shards need; Adafactor's row and
    column statistics are not). The default is AdamW's on torch's default kernel."""

    kernel: OptimizerKernel | None = None
    state_bytes: float = MOMENT_BYTES
    step: OptimizerStep | None = None
    elementwise: bool = True

    def __post_init__(self) -> None:
        if not self.state_bytes >= 0:
            raise InvalidInputError("an optimizer keeps no negative state",
                                    expected="state bytes >= 0 per parameter",
                                    found=str(self.state_bytes),
                                    fix="pass --optimizer-state-bytes >= 0, or count it with "
                                        "OptimizerFactory.state_bytes_per_param()")
        if self.kernel is not None:
            try:
                kernel = OptimizerKernel(self.kernel)
            except ValueError:
                raise InvalidInputError(
                    "unknown optimizer kernel",
                    expected=" or ".join(repr(k.value) for k in OptimizerKernel),
                    found=repr(self.kernel),
                    fix="pass one of them, or None for torch's default") from None
            object.__setattr__(self, "kernel", kernel)

    def document(self) -> dict[str, object]:
        """The fields that differ from the default, for a plan document."""
        out: dict[str, object] = {}
        if self.kernel is not None:
            out["kernel"] = self.kernel.value
        if self.state_bytes != MOMENT_BYTES:
            out["state_bytes"] = self.state_bytes
        if self.step is not None:
            out["step"] = dataclasses.asdict(self.step)
        if not self.elementwise:
            out["elementwise"] = False
        return out


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
            raise InvalidPlanError(f"stage {self.index} has layers {self.layers}",
                                   expected="0 <= first <= last (inclusive layer indices)",
                                   found=str(self.layers), fix="re-plan, or fix the stage list")

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0] + 1


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidPlanError(f"{name} must be a positive integer, got {value!r}",
                               expected=f"{name} >= 1 (an int)", found=repr(value),
                               fix=f"set {name} to a positive integer, or leave it to the search")


def _enum(kind: type[enum.Enum], value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(k.value) for k in kind)
        raise InvalidPlanError(f"{value!r} is not a valid {kind.__name__} ({name})",
                               expected=f"{name} one of {choices}", found=repr(value),
                               fix=f"use one of {choices}") from None


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete parallelization plan for one model on one cluster.

    world size = dp x cp x pp x tp; global batch = micro_batch_size x num_micro_batches x dp.
    Context parallelism (``cp``) splits every sequence over ``cp`` ranks (they hold the same
    parameters, like data-parallel replicas, and see the same samples); ``cp_attention`` is how
    their attention exchanges keys and values: ``ring`` (p2p, overlapped) or ``allgather``.
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
    #: Fingerprint of the model the plan was made for (:func:`autopar.plan_fingerprint`);
    #: ``parallelize`` refuses a plan whose fingerprint differs from its model's. None: not
    #: checked (a plan written by hand).
    model_fingerprint: str | None = None
    format_version: int = PLAN_FORMAT_VERSION
    #: Hybrid sharding: ZeRO shards over groups of this many data-parallel ranks (one node) and
    #: replicates across the groups; None shards over the whole data-parallel group.
    zero_shard_size: int | None = None
    #: Context parallelism: ranks each sequence is split over (runtime/cp.py).
    cp: int = 1
    #: How context-parallel attention exchanges K/V: "ring" or "allgather".
    cp_attention: str = "ring"
    #: Rank layout of the two inner axes: False, tp peers adjacent and cp peers strided by tp
    #: (Megatron-LM's order); True, cp peers adjacent and tp strided by cp (runtime/mesh.py).
    cp_innermost: bool = False
    #: Expert parallelism: ranks the experts of every mixture-of-experts block are split over,
    #: borrowed from the data-parallel ones (ep divides dp; runtime/moe.py). Each rank holds
    #: E / ep experts; tokens travel to their experts' ranks and back by all-to-all.
    ep: int = 1
    #: ZeRO-3: free each layer's gathered parameters after its forward and gather them again for
    #: its backward (True, FSDP's default), or keep them from the forward to the end of the
    #: backward (False: one all-gather per layer and micro-batch fewer, the stage's weights whole
    #: in memory meanwhile). Ignored below ZeRO-3.
    reshard_after_forward: bool = True
    #: Pad the vocabulary (word embedding, LM head, loss) to a multiple of
    #: ``vocab_multiple * tp`` with the padded classes masked (Megatron-LM's
    #: ``--make-vocab-size-divisible-by``, default 128): the vocabulary splits over tp and the LM
    #: head's GEMM is aligned. 0 pads only where tp does not divide the vocabulary.
    vocab_multiple: int = 128
    #: Where the optimizer state lives: "none" (with the parameters), "optimizer" (ZeRO-Offload,
    #: Ren et al. 2021: master weights and state in host memory, the step on the host) or
    #: "disk" (ZeRO-Infinity, Rajbhandari et al. 2021: as "optimizer", with the element-wise
    #: state in files under ``parallelize(offload_dir=...)``, paged per bucket).
    offload: str = "none"

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_KINDS:
            raise InvalidPlanError(f"offload must be one of {OFFLOAD_KINDS}",
                                   expected=str(OFFLOAD_KINDS), found=repr(self.offload),
                                   fix="set offload='none', 'optimizer' or 'disk'")
        for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch_size",
                     "num_micro_batches"):
            _positive(name, getattr(self, name))
        if not isinstance(self.reshard_after_forward, bool):
            raise InvalidPlanError("reshard_after_forward must be True or False",
                                   expected="a bool", found=repr(self.reshard_after_forward),
                                   fix="set reshard_after_forward=True or False")
        if isinstance(self.vocab_multiple, bool) or not isinstance(self.vocab_multiple, int) \
                or self.vocab_multiple < 0:
            raise InvalidPlanError("vocab_multiple must be a non-negative integer",
                                   expected="e.g. 128 (Megatron-LM's default) or 0",
                                   found=repr(self.vocab_multiple),
                                   fix="set vocab_multiple=128, or 0 to pad only for tp")
        if not isinstance(self.cp_innermost, bool):
            raise InvalidPlanError("cp_innermost must be True or False", expected="a bool",
                                   found=repr(self.cp_innermost), fix="set it to True or False")
        if self.cp_attention not in CP_ATTENTION_KINDS:
            raise InvalidPlanError(f"cp_attention must be one of {CP_ATTENTION_KINDS}, got "
                                   f"{self.cp_attention!r}", expected=str(CP_ATTENTION_KINDS),
                                   found=repr(self.cp_attention),
                                   fix="use 'ring' (p2p, overlapped) or 'allgather'")
        object.__setattr__(self, "schedule", _enum(ScheduleKind, self.schedule, "schedule"))
        object.__setattr__(self, "recompute", _enum(RecomputeKind, self.recompute, "recompute"))
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise InvalidPlanError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}",
                                   expected="a ZeRO stage: 0 (none), 1 (optimizer state), "
                                            "2 (+ gradients) or 3 (+ parameters)",
                                   found=repr(self.zero), fix="pick a stage in 0..3")
        if not isinstance(self.sequence_parallel, bool):
            raise InvalidPlanError("sequence_parallel must be True or False",
                                   expected="a bool", found=repr(self.sequence_parallel),
                                   fix="set sequence_parallel=True or False")
        problem = schedule_spec(self.schedule).shape_problem(self.pp, self.virtual_stages,
                                                             self.num_micro_batches)
        if problem is not None:
            summary, expected, fix = problem
            raise InvalidPlanError(summary, expected=expected,
                                   found=f"schedule={self.schedule.value}, pp={self.pp}, "
                                         f"virtual_stages={self.virtual_stages}, "
                                         f"num_micro_batches={self.num_micro_batches}",
                                   fix=fix)
        if self.dp % self.ep:
            raise InvalidPlanError("expert parallelism borrows its ranks from data parallelism",
                                   expected=f"ep dividing dp={self.dp}",
                                   found=f"ep={self.ep}",
                                   fix="pick ep among the divisors of dp, or raise dp")
        if self.ep > 1 and self.cp > 1:
            raise InvalidPlanError("expert parallelism with context parallelism is not supported "
                                   "yet", expected="ep = 1 or cp = 1",
                                   found=f"ep={self.ep}, cp={self.cp}",
                                   fix="drop one of them")
        if self.sequence_parallel and self.tp == 1:
            raise InvalidPlanError("sequence_parallel needs tp > 1",
                                   expected="tp >= 2 with sequence_parallel", found="tp=1",
                                   fix="drop sequence_parallel or raise tp")
        if self.stages:
            if len(self.stages) != self.pp * self.virtual_stages:
                raise InvalidPlanError(
                    f"{len(self.stages)} stages given; expected pp x virtual_stages = "
                    f"{self.pp * self.virtual_stages}",
                    expected=f"{self.pp * self.virtual_stages} stages", found=str(len(self.stages)),
                    fix="give one stage per pipeline rank and chunk, or none (balanced cuts)")
            for prev, nxt in zip(self.stages, self.stages[1:]):
                if nxt.layers[0] != prev.layers[1] + 1:
                    raise InvalidPlanError(f"stages {prev.index} and {nxt.index} are not "
                                           f"contiguous: {prev.layers} then {nxt.layers}",
                                           expected="contiguous layer ranges",
                                           found=f"{prev.layers} then {nxt.layers}",
                                           fix="each stage starts at the layer after the "
                                               "previous stage's last")
        if not isinstance(self.gemm_sharding, Mapping):
            raise InvalidPlanError("gemm_sharding must map GEMM node names to column / row / "
                                   "replicate", expected="a mapping",
                                   found=type(self.gemm_sharding).__name__,
                                   fix="give a dict, or leave it empty for the search")
        gemm = {k: _enum(GemmSharding, v, f"gemm_sharding[{k!r}]")
                for k, v in dict(self.gemm_sharding).items()}
        object.__setattr__(self, "gemm_sharding", gemm)
        if self.zero_shard_size is not None:
            k = self.zero_shard_size
            if not isinstance(k, int) or isinstance(k, bool) or k < 2 or self.dp % k:
                raise ValueError(f"zero_shard_size must be an integer >= 2 that divides dp "
                                 f"({self.dp}), got {k!r}; use None to shard over all "
                                 f"data-parallel ranks")
            if self.zero == 0:
                raise ValueError(f"zero_shard_size={k} needs zero >= 1 (zero=0 shards nothing)")

    # -- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters: data- times context-parallel (gradients are
        reduced, and ZeRO shards, over them)."""
        return self.dp * self.cp

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
            "autopar_version": __version__,
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
            # written only when set, so plans without hybrid sharding read as before
            **({"zero_shard_size": self.zero_shard_size} if self.zero_shard_size else {}),
            **({"cp": self.cp, "cp_attention": self.cp_attention,
                "cp_innermost": self.cp_innermost} if self.cp > 1 else {}),
            **({"ep": self.ep} if self.ep > 1 else {}),
            **({"reshard_after_forward": False} if not self.reshard_after_forward else {}),
            **({"vocab_multiple": self.vocab_multiple} if self.vocab_multiple != 128 else {}),
            **({"offload": self.offload} if self.offload != "none" else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan of :meth:`to_json` (or of an ``autopar plan --out`` document's ``plan``).

        Another plan format, or a plan written by another autopar minor version, is a
        PlanMismatchError; a malformed one an InvalidPlanError."""
        if not isinstance(data, Mapping):
            raise InvalidPlanError("a plan must be a JSON object", expected="{'dp': ..., ...}",
                                   found=type(data).__name__,
                                   fix="regenerate it with Plan.save or autopar plan --out")
        data = dict(data)
        version = data.pop("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise PlanMismatchError(f"plan format version {version} is not supported by this "
                                    f"autopar (expected {PLAN_FORMAT_VERSION})",
                                    expected=f"format_version {PLAN_FORMAT_VERSION}",
                                    found=f"format_version {version}",
                                    fix="re-plan with this version (autopar plan ... --out)")
        written_by = data.pop("autopar_version", None)
        if written_by is not None and major_minor(str(written_by)) != major_minor():
            raise PlanMismatchError(f"the plan was written by autopar {written_by}",
                                    expected=f"a plan from autopar {major_minor()}.x",
                                    found=f"autopar {written_by}",
                                    fix="re-plan with this version (autopar plan ... --out)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidPlanError(f"unknown plan field(s) {sorted(unknown)}",
                                   expected=f"some of {sorted(known - {'format_version'})}",
                                   found=str(sorted(unknown)), fix="remove or rename them")
        try:
            stages = tuple(StagePlan(index=s["index"], layers=tuple(s["layers"]),
                                     pp_rank=s["pp_rank"], chunk=s.get("chunk", 0))
                           for s in data.pop("stages", ()) or ())
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidPlanError):
                raise
            raise InvalidPlanError("a plan stage is malformed",
                                   expected="{'index': i, 'layers': [first, last], 'pp_rank': r, "
                                            "'chunk': c}", found=f"{type(exc).__name__}: {exc}",
                                   fix="re-plan, or fix the stage list") from None
        return cls(stages=stages, **data)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    # -- files --------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (``.json``) or YAML (``.yaml`` / ``.yml``)."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_json(), sort_keys=False))
        else:
            path.write_text(self.dumps() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """A plan file: :meth:`save`'s JSON or YAML, or an ``autopar plan --out`` document (its
        ``plan``). Parsed with ``json`` / ``yaml.safe_load`` only, never pickle."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidPlanError(f"cannot read the plan file {str(path)!r}",
                                   expected="a plan written by Plan.save or `autopar plan --out`",
                                   found=f"{type(exc).__name__}: {exc.strerror or exc}",
                                   fix="check the path") from None
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - JSONDecodeError, yaml.YAMLError
            raise InvalidPlanError(f"{path} is not a valid plan file",
                                   expected="JSON (.json) or YAML (.yaml, .yml)",
                                   found=str(exc).splitlines()[0] if str(exc) else "",
                                   fix="regenerate it with autopar plan --out") from None
        if isinstance(data, Mapping) and "autopar_plan_document" in data:
            data = data.get("plan")
        return cls.from_json(data)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the cost model predicts for a plan (one training step)."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: int
    #: compute_s, tp_comm_s, pp_comm_s, dp_comm_s, bubble_s, recompute_s, optimizer_s,
    #: loss_comm_s (+ cp_comm_s, ep_comm_s where those apply); they sum to the step.
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
