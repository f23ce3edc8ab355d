"""The compiler's phases as values: from a captured, planned model to the program one rank runs.

Each phase is a function from the previous artifact to a new, immutable one; nothing is changed
in place once it is produced::

    CapturedGraph                         autopar.frontend.capture (the graph, shapes in b and s)
      -> Planned                          autopar.api (rank 0 decides, every rank agrees)
      -> TPProgram ("sharded program")    shard_program: tensor_parallelize + device retargeting
      -> StagedProgram                    stage_program: stage split, selective recompute, the
                                          schedule's action lists (every rank's)
      -> RankProgram                      lower_to_rank: this rank's stages, the tensors it holds
                                          and their shards, its actions
      -> ParallelModel                    RankProgram.instantiate(mesh, training, tensors)

:func:`compile_program` chains the three compile phases. ``autopar.parallelize`` is then four
steps: capture, agree on the plan, compile, instantiate (``autopar/api.py``).

A :class:`RankProgram` knows exactly which parameters, buffers and constants this rank holds
(:attr:`RankProgram.held`: full shape, placement over the tensor-parallel axis and local shape),
so the values can come from anywhere that can produce those slices: today the full tensors of the
model (:meth:`RankProgram.shards`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from autopar.errors import InvalidPlanError, PlanMismatchError, UntraceableModelError
from autopar.plan_types import Plan, Prediction, RecomputeKind

if TYPE_CHECKING:
    from torch import nn

    from autopar.frontend import CapturedGraph
    from autopar.parallel_model import ParallelModel, TrainingOptions
    from autopar.passes.split_stages import StageSplit
    from autopar.passes.tp_codegen import ParamLayout
    from autopar.planner.search import SearchResult
    from autopar.runtime.hf_checkpoint import SafetensorsCheckpoint
    from autopar.runtime.mesh import ParallelMesh
    from autopar.runtime.schedules import PipelineSchedule
    from autopar.tensor_parallel import TPCostSpec, TPProgram

__all__ = ["Planned", "StagedProgram", "RankProgram", "shard_program", "stage_program",
           "lower_to_rank", "compile_program"]


@dataclass(frozen=True, slots=True, eq=False)
class Planned:
    """A captured model and the plan every rank agreed on."""

    captured: "CapturedGraph"
    plan: Plan
    #: What the cost model predicts (None for a plan given whole or fully pinned).
    prediction: Prediction | None
    #: The dropout seed (rank 0's): masks depend on it, the step and the sample only.
    seed: int
    #: The search that chose the plan (rank 0 only; None elsewhere and for given plans).
    search: "SearchResult | None" = None

    def __post_init__(self) -> None:
        if not self.plan.stages:
            raise PlanMismatchError("a planned model needs its stage cuts",
                                    fix="cut the stages first (autopar.planner.stage_partition."
                                        "stages_for_plan)")


@dataclass(frozen=True, slots=True, eq=False)
class StagedProgram:
    """Every rank's part of the pipeline: the tensor-parallel program cut into stages, and the
    schedule's action lists (with their sends and receives)."""

    planned: Planned
    #: The tensor-parallel program of every tp rank (the per-rank graph before the cut).
    sharded: "TPProgram"
    split: "StageSplit"
    schedule: "PipelineSchedule"

    def source(self, rank: int) -> str:
        """The Python source global rank ``rank`` runs: its tensor-parallel module, then the
        stage graphs of its pipeline coordinate."""
        import torch.fx

        from autopar.errors import InvalidInputError
        from autopar.runtime.mesh import coordinates4

        plan = self.planned.plan
        if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
            raise InvalidInputError(f"rank must be in [0, {plan.world_size})", found=str(rank))
        _, cp_rank, pp_rank, tp_rank = coordinates4(rank, plan.dp, plan.cp, plan.pp, plan.tp,
                                                    plan.cp_innermost)
        if plan.cp > 1:
            mesh = (f"dp x cp x pp x tp = {plan.dp} x {plan.cp} x {plan.pp} x {plan.tp}; "
                    f"context-parallel rank {cp_rank} (tokens of chunks {cp_rank} and "
                    f"{2 * plan.cp - 1 - cp_rank} of {2 * plan.cp}; {plan.cp_attention} "
                    f"attention), ")
        else:
            mesh = f"dp x pp x tp = {plan.dp} x {plan.pp} x {plan.tp}; "
        if plan.ep > 1:
            dp_rank = coordinates4(rank, plan.dp, plan.cp, plan.pp, plan.tp, plan.cp_innermost)[0]
            mesh += (f"expert-parallel rank {dp_rank % plan.ep} of {plan.ep} (experts "
                     f"{dp_rank % plan.ep} x E / {plan.ep} onwards of every block), ")
        parts = [f"# autopar rank {rank}: {mesh}pipeline rank {pp_rank}, tensor-parallel rank "
                 f"{tp_rank}\n", self.sharded.source(tp_rank)]
        for s in self.schedule.stages_of(pp_rank):
            stage = self.split.stages[s]
            parts.append(f"\n# ---- pipeline stage {s} (layers {stage.layers[0]}-"
                         f"{stage.layers[1]}) as run by the executor ----\n{stage.gm.code}")
            for name, module in stage.gm.named_children():  # selective recompute's regions
                body = getattr(module, "body", None)
                if isinstance(body, torch.fx.GraphModule):
                    parts.append(f"\n# ---- stage {s}: self.{name}, {type(module).__name__} "
                                 f"(run under torch.utils.checkpoint: its saved tensors are "
                                 f"recomputed in backward) ----\n{body.code}")
        return "".join(parts)


@dataclass(frozen=True)
class ShardStream:
    """A rank's tensors produced one at a time: ``stream(sink)`` calls ``sink(fqn, piece)`` once
    for every tensor the rank holds, in the source's order (a checkpoint's, an initializer's)."""

    stream: Callable[[Callable[[str, torch.Tensor], None]], None]

    def __call__(self, sink: Callable[[str, torch.Tensor], None]) -> None:
        self.stream(sink)


@dataclass(frozen=True, slots=True, eq=False)
class RankProgram:
    """What one rank runs: its coordinates, its stages and the tensors those stages read."""

    staged: StagedProgram
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    #: This rank's context-parallel coordinate (0 without context parallelism).
    cp_rank: int
    #: This rank's pipeline stages, in chunk order.
    stages: tuple[int, ...]
    #: Every parameter, buffer and constant this rank's stages read: its FQN, full shape,
    #: placement over the tensor-parallel axis and the local shape this rank keeps.
    held: tuple["ParamLayout", ...]
    device: torch.device
    #: This rank's expert-parallel coordinate (0 without expert parallelism) and the FQNs of
    #: the stacked expert weights, of which it holds experts ``[ep_rank * E / ep, ...)``.
    ep_rank: int = 0
    experts: frozenset[str] = frozenset()

    @property
    def planned(self) -> Planned:
        return self.staged.planned

    @property
    def plan(self) -> Plan:
        return self.staged.planned.plan

    def held_bytes(self) -> int:
        """Bytes of this rank's parameter and buffer shards at their captured dtypes."""
        total = 0
        for layout in self.held:
            n = 1
            for d in layout.local_shape:
                n *= int(d)
            total += n * torch.empty((), dtype=layout.dtype).element_size()
        return total

    def _expert_slice(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked expert weight (the tensor unchanged otherwise)."""
        if fqn not in self.experts or self.plan.ep == 1:
            return value
        local = value.shape[0] // self.plan.ep
        return value.narrow(0, self.ep_rank * local, local).clone()

    def _slice(self, layout: "ParamLayout", value: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor ``value``: its tensor-parallel shard, then its
        experts."""
        from autopar.sharding import shard_tensor

        return self._expert_slice(layout.fqn, shard_tensor(
            layout.to_program(value.to(layout.dtype)), layout.placement, self.plan.tp,
            self.tp_rank, layout.fqn))

    def shards(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors by FQN, sliced from the full model's (tied names accepted),
        on this rank's device."""
        by_attribute = self.staged.sharded.shard_state_dict(full, self.tp_rank)
        return {p.fqn: self._expert_slice(p.fqn, by_attribute[p.attribute]).to(self.device)
                for p in self.held}

    def read_shards(self, checkpoint: "SafetensorsCheckpoint",
                    buffer: Callable[[str], torch.Tensor]) -> "ShardStream":
        """This rank's tensors read from a safetensors checkpoint one at a time, each only the
        slice it holds; a buffer the checkpoint does not hold comes whole from ``buffer(fqn)``
        and is sliced."""
        from autopar.runtime.hf_checkpoint import TensorEntry
        from autopar.sharding import Shard

        names = self._names()

        def stream(sink: Callable[[str, torch.Tensor], None]) -> None:
            for layout in self.held:
                entry = TensorEntry(layout.fqn, names.get(layout.fqn, (layout.fqn,)),
                                    layout.model_shape, layout.dtype)
                held = checkpoint.holds(entry)
                if held and layout.logical_shape is not None:
                    piece = self._slice(layout, checkpoint.read(entry))  # padded: read whole
                elif held and layout.fqn in self.experts \
                        and self.plan.ep > 1:  # whole over tp: read only this rank's experts
                    piece = checkpoint.read(entry, Shard(0), self.plan.ep, self.ep_rank)
                elif held:
                    piece = checkpoint.read(entry, layout.placement, self.plan.tp, self.tp_rank)
                else:
                    piece = self._slice(layout, buffer(layout.fqn))
                sink(layout.fqn, piece)

        return ShardStream(stream)

    def blank_shards(self, buffer: Callable[[str], torch.Tensor]) -> "ShardStream":
        """Zero parameters (for a checkpoint to overwrite: ``ParallelModel.load``) and the
        buffers from ``buffer(fqn)``, sliced; one at a time."""

        params = {p.fqn for p in self.planned.captured.params.values()}

        def stream(sink: Callable[[str, torch.Tensor], None]) -> None:
            for layout in self.held:
                if layout.fqn in params:
                    sink(layout.fqn, torch.zeros(layout.local_shape, dtype=layout.dtype))
                else:
                    sink(layout.fqn, self._slice(layout, buffer(layout.fqn)))

        return ShardStream(stream)

    def init_shards(self, model: "nn.Module", init: Callable[["nn.Module"], None] | None, *,
                    rng_state: torch.Tensor | None = None) -> "ShardStream":
        """This rank's tensors of a model on the meta device, initialized as one device would
        (``init`` applied module by module, None: the model's own initializer; see
        :mod:`autopar.runtime.meta_init`) from ``rng_state`` (None: the CPU random state when
        the stream runs), which it leaves where one device's would be: every tensor is materialized whole for as long as its initializer works on it,
        and only its slice handed on. Tensors the model holds on a real device are sliced
        from it."""
        from autopar.runtime.meta_init import materialize

        aliases = self._names()
        wanted = {name: layout for layout in self.held for name in aliases.get(layout.fqn, ())}
        wanted.update({layout.fqn: layout for layout in self.held})

        def stream(sink: Callable[[str, torch.Tensor], None]) -> None:
            sent: set[str] = set()

            def take(names: list[str], value: torch.Tensor) -> None:
                for name in names:
                    layout = wanted.get(name)
                    if layout is not None and layout.fqn not in sent:
                        sent.add(layout.fqn)
                        sink(layout.fqn, self._slice(layout, value))

            if rng_state is not None:
                torch.set_rng_state(rng_state)
            materialize(model, init, take)
            for name, value in (*model.named_parameters(remove_duplicate=False),
                                *model.named_buffers(remove_duplicate=False)):
                if not value.is_meta:
                    take([name], value.detach())

        return ShardStream(stream)

    def _names(self) -> dict[str, tuple[str, ...]]:
        """FQN -> every name the model holds the tensor under (tied aliases)."""
        captured = self.planned.captured
        return {p.fqn: (p.fqn, *p.aliases) for p in (*captured.params.values(),
                                                     *captured.buffers.values())}

    def source(self) -> str:
        """The Python source this rank runs."""
        return self.staged.source(self.rank)

    def instantiate(self, mesh: "ParallelMesh", training: "TrainingOptions", *,
                    shards: "Mapping[str, torch.Tensor] | ShardStream") -> "ParallelModel":
        """This rank's executor and data-parallel engine on ``mesh`` (collective: every rank
        creates the same process groups), holding ``shards``: FQN -> this rank's piece of every
        tensor in :attr:`held` (:meth:`shards`), taken over, not copied (a dict passed is
        emptied, so that once the data-parallel engine has moved the parameters into its buffers
        no second copy stays alive); or a :class:`ShardStream` (:meth:`read_shards`,
        :meth:`init_shards`) whose pieces are written one at a time straight into the engine's
        buffers, so a rank never holds more than what it keeps plus one piece (under ZeRO-3,
        only its shard of each)."""
        from autopar.parallel_model import ParallelModel

        mine = (self.dp_rank, self.cp_rank, self.pp_rank, self.tp_rank)
        theirs = (mesh.dp_rank, getattr(mesh, "cp_rank", 0), mesh.pp_rank, mesh.tp_rank)
        if mine != theirs:
            raise PlanMismatchError("the mesh does not place this process where the program was "
                                    "compiled for",
                                    expected=f"(dp, cp, pp, tp) = {mine}",
                                    found=f"{theirs}",
                                    fix="compile the program for this process's rank")
        if isinstance(shards, ShardStream):
            return ParallelModel(self, mesh, training, {}, stream=shards)
        wrong = [f"{p.fqn}: expected {tuple(p.local_shape)}, found "
                 f"{tuple(shards[p.fqn].shape) if p.fqn in shards else 'nothing'}"
                 for p in self.held
                 if p.fqn not in shards or tuple(shards[p.fqn].shape) != tuple(p.local_shape)]
        if wrong:
            raise PlanMismatchError("the shards do not match what this rank holds",
                                    expected=f"{len(self.held)} tensors at their local shapes",
                                    found="; ".join(wrong[:5]),
                                    fix="slice them with RankProgram.shards or read_shards")
        owned = dict(shards)
        if isinstance(shards, dict):
            shards.clear()
        return ParallelModel(self, mesh, training, owned)


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------

def shard_program(captured: "CapturedGraph", plan: Plan, *, cost: "TPCostSpec | None",
                  device: torch.device | str = "cpu", sizes: Mapping[str, int] | None = None,
                  strict: bool = True) -> "TPProgram":
    """The tensor-parallel program of ``plan`` (its tp, sequence parallelism and GEMM
    shardings, or the search's at ``sizes``), its device arguments retargeted to ``device``.
    ``strict=False`` runs heads or a vocabulary tp does not divide replicated (what
    ``autopar codegen --no-strict`` asks)."""
    from autopar.passes.device import retarget_device
    from autopar.tensor_parallel import tensor_parallelize

    program = tensor_parallelize(captured, plan.tp, sequence_parallel=plan.sequence_parallel,
                                 cost=cost, sizes=sizes, pins=plan.gemm_sharding or None,
                                 strict=strict, vocab_multiple=plan.vocab_multiple)
    retarget_device(program.gm, device)  # device= arguments recorded at capture (cpu)
    return program


def stage_program(planned: Planned, sharded: "TPProgram", *, device: torch.device
                  ) -> StagedProgram:
    """Cut the sharded program into the plan's stages (selective recompute's regions marked)
    and build the schedule's action lists, lowered for the transport (NCCL on a GPU pairs
    messages by order: ``add_communication(match="order")``); the stages must sit where the
    schedule runs them."""
    from autopar.passes.recompute import recompute_attention_cores
    from autopar.passes.split_stages import split_into_stages
    from autopar.runtime.schedules import add_communication, build_schedule

    plan = planned.plan
    captured = planned.captured
    nccl = torch.device(device).type == "cuda"
    schedule = add_communication(build_schedule(plan.schedule, plan.pp, plan.num_micro_batches,
                                                plan.virtual_stages),
                                 match="order" if nccl else "tag")
    if nccl:  # what the lowering for NCCL guarantees, checked on the lists the ranks run
        problem = schedule.link_order_mismatch() or schedule.rendezvous_deadlock()
        if problem is not None:
            raise InvalidPlanError(f"the {plan.schedule.value} schedule cannot run over NCCL",
                                   expected="every link's messages taken in the order they are "
                                            "sent, and no cycle of waits on the communication "
                                            "streams",
                                   found=problem,
                                   fix="report this schedule: every generated one passes "
                                       "(tests/test_schedules.py); gloo runs it")
    stages = sorted(plan.stages, key=lambda s: s.index)
    from autopar.passes.context_parallel import context_parallel_pass
    from autopar.passes.expert_parallel import expert_parallel_pass, expert_weights
    from autopar.passes.infra import PassContext, PassManager
    from autopar.passes.loss_reduction import loss_scale_pass

    has_experts = bool(expert_weights(sharded.gm, plan.ep))  # raises when ep does not divide them
    if plan.ep > 1 and not has_experts:
        raise InvalidPlanError("ep > 1 but the model has no mixture-of-experts block",
                               expected="experts captured as autopar.moe recognizes them",
                               found=f"ep={plan.ep} and no experts operation",
                               fix="plan with ep=1")
    # cp: every rank runs its tokens, attention exchanges K/V over the cp ranks; experts run on
    # the ep group (of one rank at ep = 1: all local); the loss's token means and batch sums
    # become each part's share of the whole batch's
    passes = [context_parallel_pass] if plan.cp > 1 else []
    passes += [expert_parallel_pass] if has_experts else []
    gm = PassManager([*passes, loss_scale_pass]).run(sharded.gm,
                                                     PassContext(captured=captured, plan=plan))
    valueless = sorted(k for k, v in sharded.captured.constants.items()
                       if isinstance(v, torch.Tensor) and v.is_meta)
    if valueless:
        raise UntraceableModelError(
            "the captured graph holds constants without values",
            expected="constants the model's forward makes from Python data, with their values",
            found=f"{valueless[:4]} on the meta device (the model was captured on meta and a "
                  f"second trace on fake CPU tensors could not recover them)",
            fix="build the model on the CPU (or load it there), or make the value a buffer of "
                "the module that uses it")
    split = split_into_stages(gm, captured.layers, [s.layers for s in stages],
                              constants={k: v.to(device)
                                         for k, v in sharded.captured.constants.items()})
    if plan.recompute is RecomputeKind.SELECTIVE:  # attention cores recomputed in backward
        for stage in split.stages:
            recompute_attention_cores(stage.gm)
    for s in stages:
        if schedule.stage_to_rank[s.index] != s.pp_rank:
            raise PlanMismatchError(f"stage {s.index} is placed on pipeline rank {s.pp_rank}, but "
                                    f"the {plan.schedule.value} schedule runs it on rank "
                                    f"{schedule.stage_to_rank[s.index]}", fix="re-plan")
    return StagedProgram(planned, sharded, split, schedule)


def lower_to_rank(staged: StagedProgram, rank: int, *, device: torch.device) -> RankProgram:
    """Global rank ``rank``'s part of the staged program."""
    from autopar.runtime.mesh import coordinates4

    plan = staged.planned.plan
    dp_rank, cp_rank, pp_rank, tp_rank = coordinates4(rank, plan.dp, plan.cp, plan.pp, plan.tp,
                                                      plan.cp_innermost)
    local = staged.schedule.stages_of(pp_rank)
    read: set[str] = set()
    for s in local:
        stage = staged.split.stages[s]
        read.update(stage.params)
        read.update(stage.buffers)
    from autopar.passes.expert_parallel import expert_weights

    by_placeholder = {p.placeholder: p.fqn for p in staged.sharded.layouts}
    experts = frozenset(by_placeholder[name]
                        for name in expert_weights(staged.sharded.gm, plan.ep))
    held = tuple(p if p.fqn not in experts or plan.ep == 1 else dataclasses.replace(
        p, local_shape=(p.local_shape[0] // plan.ep, *p.local_shape[1:]))
        for p in staged.sharded.layouts if p.fqn in read)
    return RankProgram(staged, rank, dp_rank, pp_rank, tp_rank, cp_rank, tuple(local), held,
                       torch.device(device), dp_rank % plan.ep, experts)


def compile_program(planned: Planned, rank: int, *, cost: "TPCostSpec | None",
                    device: torch.device, sizes: Mapping[str, int] | None = None
                    ) -> RankProgram:
    """shard -> stage -> lower: the program global rank ``rank`` runs under ``planned``."""
    sharded = shard_program(planned.captured, planned.plan, cost=cost, device=device,
                            sizes=sizes)
    staged = stage_program(planned, sharded, device=device)
    return lower_to_rank(staged, rank, device=device)

