"""The pipeline executor: runs one rank's action list of a schedule on its stage modules.

``PipelineExecutor(split, schedule, mesh, tensors=...)`` holds the stages the schedule puts on
this rank (``schedule.stages_of(mesh.pp_rank)``; v of them when interleaved) as graph modules
from the stage split, and the parameters and buffers they read (one ``nn.Parameter`` per name on
a rank, shared by its stages). ``step(inputs, targets)`` splits the global batch into the
schedule's m micro-batches and walks the rank's actions:

- ``F``: run the stage on the received tensors (detached leaves that record their gradient) and
  the micro-batch's inputs; the last stage computes the loss, scaled by 1/m so the accumulated
  gradients are those of the mean loss over the batch.
- ``B``: backward from the received output gradients; parameter gradients accumulate over the
  micro-batches, the input gradients go to the previous stage.
- ``I`` / ``W`` (zero-bubble): the input gradients, keeping the gradients the weights still
  need at the nodes where the two parts of the graph meet, then later the weight gradients from
  there (``autopar.runtime.split_backward``): together one backward's work. A stage that
  recomputes its blocks (full recompute) runs its whole backward at ``I`` and nothing at ``W``
  (:meth:`PipelineExecutor.runs_whole_at_input`).
- runs of ``SEND``/``RECV`` actions: one ``dist.batch_isend_irecv`` on the executor's own
  group over its pipeline column, every message tagged with (sending stage, direction,
  micro-batch, tensor) so that messages cannot be confused. Receives are waited (with the
  mesh's timeout) at the end of their batch; sends are waited at the end of the step, or, on
  NCCL, dropped with their tensors once completed (:func:`reap_completed`, at each run of
  transfers). NCCL ignores tags and pairs the messages of a link by their order: there
  (``match="order"``) the lists are lowered with each receive posted where its send is
  (``add_communication(match="order")``: every link taken in the order it is sent), each
  transfer is issued on its own on a two-rank group of its pair of ranks (a NCCL stream per
  pair, so that a receive waiting for one neighbour holds back no send to another; no cycle of
  waits forms: :meth:`PipelineSchedule.rendezvous_deadlock`), and each receive is waited by the
  compute that needs it. Receive buffers take the crossing tensors' shapes with ``b``
  and ``s`` evaluated at the micro-batch's sizes, and their captured dtype (under mixed
  precision the model is captured with its parameters in the compute dtype, so the hidden state
  and its gradient cross in bf16, as they are computed); a stage whose output has another dtype
  than the split recorded is an error, not a garbled transfer. Tensors between two stages of one
  rank are handed over in memory.

A failure on one pipeline rank (an exception in a stage, a lost peer) shuts down the executor's
own point-to-point group before the exception propagates: on gloo the neighbours' pending
receives then fail at once ("connection closed") instead of waiting for the timeout, and they
do the same, so the error travels down the pipeline in seconds. The executor is unusable
afterwards (the step was left half done); rebuild it. On NCCL the peers still wait for the
timeout unless the launcher stops them (torchrun does when this process exits).

After the last action, parameters read by stages on several ranks (tied weights: GPT-2's
embedding on the first stage and LM head on the last) get their gradients summed over those
ranks (an all-reduce in a group of just those ranks, as Megatron-LM's embedding group), so every
copy takes the same optimizer step. The executor knows nothing of tensor parallelism: on a
tp x pp mesh each rank runs its own (sharded) stage modules and exchanges activations with the
rank of the next stage in its tp column (``mesh.stage_rank``).

The stage modules come from ``autopar.passes.split_stages`` (the runtime does not import the
passes; the expected attributes are spelled out by :class:`StageProgram`); each runs as a
:class:`StageModule` (``runtime/stage_module.py``, re-exported here).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import linecache
from datetime import timedelta
from typing import Callable, Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

from autopar.errors import (
    AutoparError,
    InvalidInputError,
    PlanMismatchError,
    ScheduleError,
    StageExecutionError,
)
from autopar.runtime.layer_recompute import recompute_region
from autopar.runtime.running_stats import replaying
from autopar.runtime.tp import saved_gathers
from autopar.runtime.comm import announce_failure, blocking, note_failure, wait_work
from autopar.runtime.groups import forget, forgotten, shared_new_groups
from autopar.runtime.schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    add_communication,
    comm_batches,
)
from autopar.runtime.stage_module import (
    StageCut,
    StageModule,
    StageProgram,
    bind_sizes,
    module_attribute,
    placeholder_kind,
    split_microbatches,
    stage_params,
)
from autopar.runtime.split_backward import (
    PendingWeightGradients,
    backward_input,
    weight_gradient_groups,
    weight_groups,
)

__all__ = ["PipelineExecutor", "ExecutorHooks", "StageProgram", "StageModule", "bind_sizes", "split_microbatches", "reap_completed",
           "module_attribute"]


class ExecutorHooks:
    """What the executor tells the layer above it (the data-parallel engine) around its
    actions; every method does nothing here. ``stage`` and ``microbatch`` name the action.

    - :meth:`before_forward` runs right before each stage forward, inside the recomputed region,
      so a recompute in backward calls it again (the program's dropout masks depend on it);
    - :meth:`before_backward` before each backward (or input-gradient) action: the data-parallel
      layer decides there whether this backward's gradients are reduced; ``weights`` says whether
      the action computes the weights' gradients too (through autograd's accumulation, as ``B``
      does): False for an ``I`` whose ``W`` computes them later;
    - :meth:`before_weight` and :meth:`after_weight` bracket each weight-gradient action of a
      split backward (zero-bubble schedules), whose gradients are assigned to ``.grad`` rather
      than accumulated by autograd: ZeRO-3 gathers parameters before, and the gradients are
      taken into the buckets after;
    - :meth:`before_weight_group` and :meth:`after_weight_group` go finer, around each group of
      weights such an action computes (``later``: ids of the weights its later groups read), so
      ZeRO-3 holds one layer at a time there too.
    """

    def before_forward(self, stage: int, microbatch: int) -> None:
        pass

    def before_backward(self, stage: int, microbatch: int, *, weights: bool = True) -> None:
        pass

    def before_weight(self, stage: int, microbatch: int) -> None:
        pass

    def after_weight(self, stage: int, microbatch: int) -> None:
        pass

    def before_weight_group(self, weights: list[torch.Tensor]) -> None:
        pass

    def after_weight_group(self, weights: list[torch.Tensor], later: set[int]) -> None:
        pass


class PipelineExecutor:
    """One pipeline rank: its stages, parameters and action list."""

    def __init__(self, split: Any, schedule: PipelineSchedule, mesh: Any, *,
                 tensors: Mapping[str, torch.Tensor], bindings: Mapping[str, Any] | None = None,
                 timeout: timedelta | None = None, sync_tied: bool = True,
                 hooks: ExecutorHooks | None = None, recompute: bool = False,
                 copy_tensors: bool = True, layer_units: bool = False,
                 compile_backend: str | None = None,
                 recompute_blocks: frozenset[str] = frozenset(),
                 match: str | None = None) -> None:
        """``tensors``: this rank's parameters and buffers by FQN (shards, under tensor
        parallelism); ``bindings``: values for the stage modules' other placeholders, by name
        (e.g. ``{"tp": tp_group}`` for a tensor-parallel program). ``sync_tied=False`` leaves the
        gradient sum of tied weights to the caller (the data-parallel layer does it on its
        buckets); ``hooks`` (:class:`ExecutorHooks`) are told of each action as it runs.
        ``layer_units=True`` (ZeRO-3) gives each stage module one gather unit per captured
        layer (:class:`StageModule`); ``compile_backend`` compiles each stage's graph with
        ``torch.compile`` (each layer on its own under ZeRO-3 or full recompute). With
        ``recompute``, ``recompute_blocks`` names the layers checkpointed one at a time (the
        repeated blocks; a stage holding none runs as it is; an empty set checkpoints each stage
        whole). ``copy_tensors=False`` takes ``tensors`` as they are (fresh shards nobody else holds: a
        rank then never keeps two copies of its parameters). ``match``: how the transport pairs
        messages, ``"tag"`` (gloo) or ``"order"`` (NCCL; the lists are then lowered in send
        order and every message carries tag 0); None takes the process group's backend's."""
        self.split = split
        #: Full activation recompute: each repeated block keeps only its inputs and runs again in
        #: its backward (runtime/layer_recompute.py; under compile around each block's compiled
        #: code).
        self.recompute = recompute
        #: ZeRO-3's gather units: a first stage's weight gradients then go one layer at a time
        #: (runtime/split_backward.py), else in one call
        self.layer_units = layer_units
        self.sync_tied = sync_tied
        self.hooks = hooks
        self.bindings = dict(bindings or {})
        if match is None:
            match = "order" if mesh.pp > 1 and dist.is_initialized() and \
                dist.get_backend() == dist.Backend.NCCL else "tag"
        #: How the transport pairs messages: by the executor's tags (gloo) or by their order on
        #: each link (NCCL). Under ``"order"`` the lists are lowered for it
        #: (``add_communication(match="order")``: each receive posted where its send is, every
        #: link's messages in one order on both ends), each transfer goes on its own on its pair
        #: of ranks' group (:meth:`_make_groups`), and each receive is waited by the compute
        #: that needs it.
        self.match = match
        self.schedule = add_communication(schedule, match=match)
        self.mesh = mesh
        self.timeout = timeout or mesh.timeout
        self.m = schedule.num_microbatches
        stages = tuple(split.stages)
        if schedule.num_ranks != mesh.pp:
            raise PlanMismatchError("the schedule does not match the pipeline size",
                                    expected=f"{mesh.pp} ranks (the mesh's pp)",
                                    found=f"a schedule for {schedule.num_ranks} ranks")
        if schedule.num_stages != len(stages):
            raise PlanMismatchError("the schedule and the stage split disagree on the stages",
                                    expected=f"{len(stages)} stages (the split)",
                                    found=f"{schedule.num_stages} in the schedule",
                                    fix="split into pp x virtual_stages stages")
        self.stage_to_rank = self.schedule.stage_to_rank
        self.pp_rank = mesh.pp_rank
        self.local = {s: stages[s] for s in self.schedule.stages_of(self.pp_rank)}
        self.num_stages = len(stages)
        self.actions = self.schedule.ranks[self.pp_rank]

        self.params: dict[str, nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        for stage in self.local.values():
            for ph in stage.placeholders:
                kind = placeholder_kind(ph)
                if kind == "parameter" and ph.key not in self.params:
                    if ph.key not in tensors:
                        raise InvalidInputError(f"no value for parameter {ph.key}",
                                                fix="pass tensors=dict(model.named_parameters("
                                                    "remove_duplicate=False))")
                    rg = bool(split.param_requires_grad.get(ph.key, True))
                    value = tensors[ph.key].detach()
                    self.params[ph.key] = nn.Parameter(value.clone() if copy_tensors else value,
                                                       requires_grad=rg)
                elif kind == "other" and ph.key not in self.bindings:
                    raise InvalidInputError(f"stage {stage.index} needs a value for its input "
                                            f"{ph.key!r}",
                                            fix=f"pass bindings={{{ph.key!r}: ...}}")
                elif kind == "buffer" and ph.key not in self.buffers:
                    if ph.key not in tensors:
                        raise InvalidInputError(f"no value for buffer {ph.key}",
                                                fix="include model.named_buffers() in tensors")
                    value = tensors[ph.key].detach()
                    self.buffers[ph.key] = value.clone() if copy_tensors else value
        self.device = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor)),
                           torch.device("cpu"))
        self._tied = self._make_tied_groups() if sync_tied else []
        #: The group each peer's messages go on, by the peer's global rank: the pipeline
        #: column's one group (gloo, tags), or under ``"order"`` one two-rank group per pipeline
        #: link, so that on NCCL each pair of ranks has a stream of its own (:meth:`_make_groups`).
        self._groups = self._make_groups()
        #: Post each compute's receives before the compute ahead of it, so the transfer overlaps
        #: that compute (torch.distributed.pipelining places receives ahead likewise). Only where
        #: point-to-point operations are matched by tag and progress independently (gloo): on
        #: NCCL, sends and receives to one peer share a stream in issue order, and a receive
        #: posted early could hold back a send the peer is waiting for.
        backends = {dist.get_backend(g) for g in self._groups.values()}
        gloo = backends == {dist.Backend.GLOO}
        self._early_receives = gloo and match == "tag"
        #: Drop completed sends at each run of transfers (:func:`reap_completed`); gloo
        #: reports a send completed only once it is waited, so there the poll would find none.
        self._reap_sends = bool(backends) and not gloo
        self._broken: str | None = None
        #: One module per local stage, owning its parameters: stage calls go through it, so
        #: module hooks (ZeRO-3 gathers) wrap every forward. In chunk order.
        self.stage_modules = {s: StageModule(stage, self.params, layer_units=layer_units,
                                             compile_backend=compile_backend,
                                             recompute_blocks=recompute_blocks if recompute
                                             else None)
                              for s, stage in self.local.items()}
        #: The local stages whose I runs their whole backward (:meth:`runs_whole_at_input`),
        #: fixed with the stage modules rather than looked up per action.
        self._whole_at_input = frozenset(
            s for s, own in self.stage_modules.items()
            if recompute and (own.recomputes_layers or own.checkpoints_whole))
        self._last_backward = self._final_microbatch(ActionKind.BACKWARD,
                                                     ActionKind.BACKWARD_INPUT)
        self._last_weight = self._final_microbatch(ActionKind.BACKWARD_WEIGHT)
        self._inference = False
        self.peak_held = 0
        self._reset()

    def _final_microbatch(self, *kinds: ActionKind) -> dict[int, int]:
        """For each local stage, the micro-batch of its last action of ``kinds`` on this rank."""
        last: dict[int, int] = {}
        for a in self.actions:
            if a.kind in kinds:
                last[a.stage] = a.microbatch
        return last

    def is_last_backward(self, stage: int, microbatch: int) -> bool:
        """Whether ``(stage, microbatch)`` is that stage's final backward in a step."""
        return self._last_backward.get(stage) == microbatch

    def is_last_weight(self, stage: int, microbatch: int) -> bool:
        """Whether ``(stage, microbatch)`` is that stage's final weight-gradient action."""
        return self._last_weight.get(stage) == microbatch

    # -- parameters ---------------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.params.items())

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    # -- groups ---------------------------------------------------------------------------------
    def _make_groups(self) -> dict[int, Any]:
        """The groups for the activations and their gradients, by peer (global rank), every
        rank creating every group in the same order; kept for the process's next model of this
        layout (runtime/groups.py). Holding the only reference is what lets a failing rank close
        them (:meth:`_shut_down`).

        Matched by tag (gloo): one group over the pipeline column. Matched by order (NCCL): one
        two-rank group per pair of pipeline ranks that exchange tensors, each operation issued
        on its own (:meth:`_communicate`). NCCL runs a group's operations on one stream, in issue
        order, and a receive posted ahead of its data blocks that stream until the data comes:
        on one stream per rank (batched, or point-to-point operations on a communicator shared
        by every peer, as an eagerly initialized process group shares it), a receive waiting
        for one neighbour holds back the sends another waits for. A stream per pair of ranks
        does not (docs/pipeline.md, "Lowering for NCCL")."""
        mesh = self.mesh
        if mesh.pp == 1:
            return {}
        where = self.stage_to_rank
        columns = [(d, t) for d in range(mesh.replicas) for t in range(mesh.tp)]
        if self.match == "order":
            pairs = sorted({(min(where[s], where[s + 1]), max(where[s], where[s + 1]))
                            for s in range(len(where) - 1) if where[s] != where[s + 1]})
        else:
            pairs = [tuple(range(mesh.pp))]
        lists = [tuple(mesh.rank_at(d, q, t) for q in pair) for d, t in columns for pair in pairs]
        groups = shared_new_groups("p2p" if self.match == "tag" else "p2p-pairs", lists,
                                   self.timeout)
        out: dict[int, Any] = {}
        for ranks, group in zip(lists, groups):
            if mesh.rank in ranks:
                out.update({r: group for r in ranks if r != mesh.rank})
        return out

    def _shut_down(self, exc: BaseException) -> None:
        """After a failure: drop the point-to-point groups (on gloo the last reference going
        closes its connections, so the neighbours' pending receives fail now rather than at the
        timeout) and refuse further steps. Its data-parallel and tensor-parallel peers, whose
        groups stay open, learn of it from the failure it announces (runtime/comm.py)."""
        announce_failure(exc)
        text = str(exc)
        self._broken = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        # Every transfer still in flight holds its group's connections open (a gloo receive's
        # buffer keeps the context alive): dropped with the rest of the step's state.
        self._reset()
        note_failure()  # the shared groups are created anew for the next model
        groups = list({id(g): g for g in self._groups.values()}.values())
        self._groups = {}
        for group in groups:
            forget(group)
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
        del groups
        gc.collect()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PlanMismatchError("this pipeline executor failed in an earlier step and was shut "
                                    "down", found=self._broken,
                                    fix="rebuild the parallel model (autopar.parallelize) to go on")
        if any(forgotten(g) for g in self._groups.values()):
            raise PlanMismatchError("this pipeline executor's point-to-point group was closed by "
                                    "another model of the same layout, which failed",
                                    expected="groups shared with live models only",
                                    found="its group destroyed after that model's failure",
                                    fix="rebuild the parallel model (autopar.parallelize) to go on")

    # -- tied weights ---------------------------------------------------------------------------
    def _make_tied_groups(self) -> list[tuple[tuple[str, ...], Any]]:
        """A process group per set of pipeline ranks sharing parameters, in every (dp, tp)
        column (every rank creates every group, in the same order, as new_group requires)."""
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for fqn, stages in sorted(self.split.shared_params().items()):
            ranks = tuple(sorted({self.stage_to_rank[s] for s in stages}))
            if len(ranks) > 1:
                by_ranks.setdefault(ranks, []).append(fqn)
        mesh = self.mesh
        sets = [(fqns, tuple(mesh.rank_at(d, q, t) for q in pp_ranks))
                for pp_ranks, fqns in sorted(by_ranks.items())
                for d in range(mesh.replicas) for t in range(mesh.tp)]
        if not sets:
            return []
        groups = shared_new_groups("tied", [ranks for _, ranks in sets], self.timeout)
        return [(tuple(f for f in fqns if f in self.params), group)
                for (fqns, ranks), group in zip(sets, groups) if mesh.rank in ranks]

    def _sync_tied_gradients(self) -> None:
        for fqns, group in self._tied:
            for fqn in fqns:
                p = self.params[fqn]
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                work = dist.all_reduce(p.grad, group=group, async_op=True)
                self._wait(work, f"the gradient sum of tied parameter {fqn}")

    # -- the step -------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._received: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._forward: dict[tuple[int, int], tuple[list[torch.Tensor], Any]] = {}
        self._grad_out: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._to_send: dict[tuple[int, str, int], list[torch.Tensor]] = {}
        self._weight_todo: dict[tuple[int, int], PendingWeightGradients | None] = {}
        self._pending_sends: list[tuple[Any, str, torch.Tensor]] = []
        #: Receives posted ahead of their compute (``_early_receives``): action -> ((work, what)
        #: per tensor, buffers), waited and handed over when the compute needs them.
        self._posted: dict[Action, tuple[list[tuple[Any, str]], list[torch.Tensor]]] = {}
        self._loss_sum: torch.Tensor | None = None

    def step(self, inputs: Sequence[Any], targets: Sequence[Any] = ()) -> torch.Tensor | None:
        """Forward and backward of one global batch; gradients accumulate into ``.grad``.

        Returns the batch's mean loss on the rank that holds the last stage, None elsewhere.
        """
        loss = self._run(self.actions, inputs, targets, inference=False)
        if self.sync_tied:
            self._sync_tied_gradients()
        return loss

    def evaluate(self, inputs: Sequence[Any], targets: Sequence[Any] = ()) -> torch.Tensor | None:
        """Forward only, without gradients: the batch's mean loss on the rank holding the last
        stage, None elsewhere. Runs this rank's forward actions (and their transfers) in the
        schedule's order, which is deadlock-free because forwards depend only on forwards."""
        keep = (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F)
        with torch.no_grad():
            return self._run([a for a in self.actions if a.kind in keep], inputs, targets,
                             inference=True)

    def _run(self, actions: Sequence[Action], inputs: Sequence[Any], targets: Sequence[Any], *,
             inference: bool) -> torch.Tensor | None:
        """Walk ``actions`` on one batch: computes alone, runs of transfers as one batch; every
        send waited at the end. A failure shuts the executor down (:meth:`_shut_down`)."""
        self._check_usable()
        self._begin(inputs, targets)
        self._inference = inference
        try:
            batches = comm_batches(actions)
            for i, batch in enumerate(batches):
                if batch[0].kind.is_comm:
                    self._communicate(batch)
                    continue
                if self._early_receives and i + 1 < len(batches) and batches[i + 1][0].kind.is_comm:
                    self._communicate([a for a in batches[i + 1]
                                       if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)])
                try:
                    self._compute(batch[0])
                except (AutoparError, torch.OutOfMemoryError):
                    raise
                except Exception as exc:  # noqa: BLE001 - named, the cause kept
                    raise stage_failure(batch[0], self.mesh.rank, exc) from exc
            for work, what, _ in self._pending_sends:
                self._wait(work, what)
        except BaseException as exc:
            self._shut_down(exc)
            raise
        finally:
            self._inference = False
        leftovers = [d for d in (self._received, self._forward, self._grad_out, self._to_send,
                                 self._weight_todo, self._posted) if d]
        if leftovers:
            raise ScheduleError(f"rank {self.pp_rank} finished its actions with state left over",
                                found=str([list(d)[:4] for d in leftovers]))
        loss = self._loss_sum
        self._reset()
        return loss

    def _begin(self, inputs: Sequence[Any], targets: Sequence[Any]) -> None:
        inputs, targets = tuple(inputs), tuple(targets)
        if len(inputs) != len(self.split.input_specs) or \
                len(targets) != len(self.split.target_specs):
            raise InvalidInputError("wrong number of inputs or targets",
                                    expected=f"{len(self.split.input_specs)} inputs and "
                                             f"{len(self.split.target_specs)} targets",
                                    found=f"{len(inputs)} and {len(targets)}")
        self._reset()
        #: The most stage-micro-batches whose autograd graphs (activations) this rank held at
        #: once in the last step: forward run, backward not yet (B; W, or I where it runs
        #: whole). What the cost model's in-flight counts stand for
        #: (``PipelineSchedule.in_flight``).
        self.peak_held = 0
        self._micro_inputs = split_microbatches(inputs, self.m)
        self._micro_targets = split_microbatches(targets, self.m)
        self._sizes = [bind_sizes(tuple(self.split.input_specs) + tuple(self.split.target_specs),
                                  i + t) for i, t in zip(self._micro_inputs, self._micro_targets)]

    # -- compute ----------------------------------------------------------------------------------
    def _args(self, stage: StageProgram, mb: int, acts: list[torch.Tensor]) -> list[Any]:
        args: list[Any] = []
        act = iter(acts)
        for ph in stage.placeholders:
            kind = placeholder_kind(ph)
            if kind == "parameter":
                args.append(self.params[ph.key])
            elif kind == "buffer":
                args.append(self.buffers[ph.key])
            elif kind == "constant":
                args.append(self.split.constants[ph.key])
            elif kind == "activation":
                args.append(next(act))
            elif kind == "input":
                args.append(self._micro_inputs[mb][ph.key])
            elif kind == "target":
                args.append(self._micro_targets[mb][ph.key])
            elif kind == "other":
                args.append(self.bindings[ph.key])
            else:
                raise PlanMismatchError(f"unknown stage input kind {kind!r}")
        return args

    def _compute(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        stage = self.local[s]
        if a.kind is ActionKind.FORWARD:
            self._land(Action(s, ActionKind.RECV_F, mb))
            received = self._received.pop((s, mb), []) if s > 0 else []
            if len(received) != len(stage.inputs):
                raise ScheduleError(f"{a} runs without its inputs on rank {self.pp_rank}",
                                    expected=f"{len(stage.inputs)} received tensors",
                                    found=str(len(received)))
            leaves = [t.detach().requires_grad_(c.requires_grad)
                      for t, c in zip(received, stage.inputs)]
            module, args = self.stage_modules[s], self._args(stage, mb, leaves)
            own = self.stage_modules[s]
            recomputing = self.recompute and not self._inference
            if self.hooks is not None:
                module = _announced(module, self.hooks.before_forward, s, mb)
            with torch.enable_grad():
                if recomputing and own.checkpoints_whole:
                    out = torch.utils.checkpoint.checkpoint(replaying(module), *args,
                                                            use_reentrant=False)
                else:
                    with contextlib.ExitStack() as scope:
                        if recomputing and own.recomputes_layers:
                            announce = (functools.partial(self.hooks.before_forward, s, mb)
                                        if self.hooks is not None else None)
                            scope.enter_context(recompute_region(announce))
                        if own.regathers:  # SP's gathered GEMM inputs kept as shards
                            scope.enter_context(saved_gathers())
                        out = module(*args)
            if stage.returns_loss:
                # summed in fp32: a bf16 loss (mixed precision) would lose its low bits here;
                # 1 / m is one process's weight once the loss's terms read their share of the
                # whole batch (passes/loss_reduction.py)
                self._loss_sum = out.detach().float() / self.m + (
                    self._loss_sum if self._loss_sum is not None else 0.0)
                outs: Any = out / self.m
            else:
                outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if not self._inference:
                self._forward[(s, mb)] = (leaves, outs)
                self.peak_held = max(self.peak_held, len(self._forward))
            if not stage.returns_loss:
                sent = [o.detach() for o in outs]
                self._check_dtypes(s, sent, stage.outputs)
                if self.stage_to_rank[s + 1] == self.pp_rank:
                    self._received[(s + 1, mb)] = sent
                else:
                    self._to_send[(s, "F", mb)] = sent
            return
        if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            self._land(Action(s, ActionKind.RECV_B, mb))
            whole = a.kind is ActionKind.BACKWARD or self.runs_whole_at_input(s)
            leaves, outs = (self._forward.pop((s, mb)) if whole else self._forward[(s, mb)])
            if self.hooks is not None:
                self.hooks.before_backward(s, mb, weights=whole)
            roots, grads = self._roots(stage, s, mb, outs)
            wanted = [x for x, c in zip(leaves, stage.inputs) if c.requires_grad]
            if whole:
                if roots:
                    torch.autograd.backward(roots, grads)
                input_grads = [x.grad if x.grad is not None else torch.zeros_like(x)
                               for x in wanted]
            else:
                found: Sequence[torch.Tensor | None] = [None] * len(wanted)
                pending = None
                if roots:
                    found, pending = backward_input(roots, grads, wanted,
                                                    self._trained_params(stage),
                                                    by_layer=self.layer_units)
                input_grads = [g if g is not None else torch.zeros_like(x)
                               for x, g in zip(wanted, found)]
                self._weight_todo[(s, mb)] = pending
            if s > 0:
                if self.stage_to_rank[s - 1] == self.pp_rank:
                    prev = self.local[s - 1]
                    it = iter(input_grads)
                    self._grad_out[(s - 1, mb)] = [next(it) if c.requires_grad else None
                                                   for c in prev.outputs]
                else:
                    self._to_send[(s, "B", mb)] = input_grads
            return
        # BACKWARD_WEIGHT
        if self.runs_whole_at_input(s):
            return  # its I computed the weights' gradients
        pending = self._weight_todo.pop((s, mb))
        self._forward.pop((s, mb))
        hooks = self.hooks or ExecutorHooks()
        hooks.before_weight(s, mb)
        if pending is not None:
            groups = weight_groups(pending)
            # after group i, the weights no later group of this action reads
            later: list[set[int]] = [set() for _ in groups]
            for i in range(len(groups) - 2, -1, -1):
                later[i] = later[i + 1] | {id(p) for p in groups[i + 1]}
            for i, pairs in enumerate(weight_gradient_groups(pending,
                                                             hooks.before_weight_group)):
                for p, g in pairs:
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad.add_(g)
                hooks.after_weight_group([p for p, _ in pairs], later[i])
        hooks.after_weight(s, mb)

    def runs_whole_at_input(self, stage: int) -> bool:
        """Whether local ``stage``'s input-gradient action (``I``) runs its whole backward, the
        weights' gradients included, leaving its ``W`` empty: so under full recompute, where the
        stage's blocks are checkpointed. torch's non-reentrant checkpoint recomputes a block
        once per autograd call that reaches it, and a split ``W`` makes one call per weight
        group (six per GPT block: docs/recompute.md counted 64 block forwards a step against
        1F1B's 16); one call recomputes once. The stage then steps as under 1F1B, which is how
        the cost model prices it (planner/stage_sums.py)."""
        return stage in self._whole_at_input

    def _trained_params(self, stage: StageProgram) -> list[nn.Parameter]:
        return [self.params[f] for f in dict.fromkeys(stage_params(stage))
                if self.params[f].requires_grad]

    def _roots(self, stage: StageProgram, s: int, mb: int, outs: Any
               ) -> tuple[list[torch.Tensor], list[Any]]:
        """The tensors to differentiate and their incoming gradients."""
        if stage.returns_loss:
            return ([outs], [None]) if outs.requires_grad else ([], [])
        grads = self._grad_out.pop((s, mb))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    # -- communication ------------------------------------------------------------------------
    @staticmethod
    def _check_dtypes(stage: int, tensors: Sequence[torch.Tensor], cuts: Sequence[StageCut]) -> None:
        """The receiver allocates each crossing tensor at the dtype the split recorded."""
        for t, c in zip(tensors, cuts):
            if t.dtype != c.spec.dtype:
                raise PlanMismatchError(
                    f"stage {stage} produced {c.name} as {t.dtype}, but the stage split "
                    f"recorded {c.spec.dtype} (the receiving rank allocates that)",
                    expected=f"{c.spec}", found=f"{t.dtype}{list(t.shape)}",
                    fix="capture the model with its parameters in the dtype the stages compute "
                        "in (autopar.parallelize(mixed_precision=True) captures in bf16)")

    def _tag(self, sender: int, direction: str, mb: int, i: int) -> int:
        if self.match == "order":
            return 0  # what NCCL does with any tag: messages pair by their order on the link
        return ((((0 if direction == "F" else 1) * self.num_stages + sender) * self.m + mb)
                * 64 + i)

    def _peer(self, stage: int) -> int:
        return self.mesh.stage_rank(self.stage_to_rank[stage])

    def _communicate(self, batch: list[Action]) -> None:
        """Post one run of transfers: as one ``batch_isend_irecv`` on the column's group
        (matched by tag), or each on its own on its pair of ranks' group, in list order
        (matched by order: :meth:`_make_groups`). Sends are waited at the end of the step (on
        NCCL dropped once completed). Receives are waited here, or, with ``_early_receives``
        (posted one compute ahead) or lists lowered in send order, by the compute that needs
        them (:meth:`_land`)."""
        if self._reap_sends:
            self._pending_sends = reap_completed(self._pending_sends, self._wait)
        ops: list[tuple[Callable[..., Any], torch.Tensor, int, int]] = []
        kinds: list[tuple[bool, str]] = []
        landing: list[tuple[Action, list[torch.Tensor]]] = []
        for a in batch:
            s, mb = a.stage, a.microbatch
            if a in self._posted:
                continue  # posted ahead
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                direction = "F" if a.kind is ActionKind.SEND_F else "B"
                tensors = self._to_send.pop((s, direction, mb))
                peer = self._peer(s + 1 if direction == "F" else s - 1)
                for i, t in enumerate(tensors):
                    ops.append((dist.isend, t.contiguous(), peer, self._tag(s, direction, mb, i)))
                    kinds.append((True, f"{a} to rank {peer}"))
            else:
                sizes = self._sizes[mb]
                if a.kind is ActionKind.RECV_F:
                    cuts = list(self.local[s].inputs)
                    sender, direction = s - 1, "F"
                else:
                    cuts = [c for c in self.local[s].outputs if c.requires_grad]
                    sender, direction = s + 1, "B"
                peer = self._peer(sender)
                buffers = [torch.empty(c.shape_at(**sizes), dtype=c.spec.dtype,
                                       device=self.device) for c in cuts]
                for i, buf in enumerate(buffers):
                    ops.append((dist.irecv, buf, peer, self._tag(sender, direction, mb, i)))
                    kinds.append((False, f"{a} from rank {peer}"))
                landing.append((a, buffers))
        # posting fails at once where a peer already closed the group (it failed): named too
        with blocking(", ".join(what for _, what in kinds) or "a pipeline transfer",
                      self.timeout):
            if self.match == "order":  # one operation at a time, on its pair of ranks' stream
                works = [fn(t, peer, group=self._groups[peer], tag=tag)
                         for fn, t, peer, tag in ops]
            else:
                works = dist.batch_isend_irecv([dist.P2POp(fn, t, peer, self._groups[peer],
                                                           tag=tag)
                                                for fn, t, peer, tag in ops]) if ops else []
                if works and len(works) != len(ops):  # a coalescing backend (NCCL): one for all
                    works = [works[0]] * len(ops)
        # Receives posted ahead of their compute (gloo's early receives, or the lists lowered in
        # send order) are waited by that compute (:meth:`_land`), the rest here.
        later = self._early_receives or self.match == "order"
        receives: list[tuple[Any, str]] = []
        for work, (_, tensor, _, _), (is_send, what) in zip(works, ops, kinds):
            if is_send:  # keep the sent tensor alive until its send is waited
                self._pending_sends.append((work, what, tensor))
            elif later:
                receives.append((work, what))
            else:
                self._wait(work, what)
        it = iter(receives)
        for a, buffers in landing:
            if later:
                self._posted[a] = ([next(it) for _ in buffers], buffers)
            else:
                self._deliver(a, buffers)

    def _land(self, a: Action) -> None:
        """Wait for the receive ``a`` if it was posted ahead, and hand its tensors over."""
        posted = self._posted.pop(a, None)
        if posted is None:
            return
        works, buffers = posted
        for work, what in works:
            self._wait(work, what)
        self._deliver(a, buffers)

    def _deliver(self, a: Action, buffers: list[torch.Tensor]) -> None:
        if a.kind is ActionKind.RECV_F:
            self._received[(a.stage, a.microbatch)] = buffers
        else:
            it = iter(buffers)
            self._grad_out[(a.stage, a.microbatch)] = [
                next(it) if c.requires_grad else None for c in self.local[a.stage].outputs]

    def _wait(self, work: Any, what: str) -> None:
        # CommunicationTimeoutError naming rank and action; a transfer, not sliced (comm.py)
        wait_work(work, what, self.timeout, sliced=False)


def stage_failure(action: Action, rank: int, exc: Exception) -> AutoparError:
    """The named error for ``exc``, raised by the generated program while running ``action``:
    the line of that program it came from (the innermost frame of fx's generated code; none when
    it came from inside autograd's engine) and torch's message."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        source = tb.tb_frame.f_code.co_filename
        if source.startswith("<eval_with_key>"):
            line = linecache.getline(source, tb.tb_lineno).strip() or line
        tb = tb.tb_next
    text = str(exc).strip()
    found = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]
    where = f" at `{line[:200]}`" if line else ""
    if line and _indexes_beyond_a_table(line, exc):  # the inputs' fault, as in one process
        return InvalidInputError(
            f"rank {rank}'s step indexes beyond a table of the model in {action}{where}",
            expected="token ids in [0, rows of the embedding), targets in [0, classes) (or the "
                     "loss's ignore_index), sequences no longer than the model's positions",
            found=found,
            fix="check the batch (one process raises the same error on it); this model must "
                "be parallelized again, a failed step leaves its pipeline state behind")
    return StageExecutionError(
        f"rank {rank}'s generated program failed in {action}{where}",
        expected="each stage to run as the captured graph runs in one process",
        found=found,
        fix="an op that does not run under this plan's placements: an autopar fault (report it "
            "with pm.generated_code(rank) and the plan); to go on, pin another plan (tp=1 "
            "replicates every op)")


def _indexes_beyond_a_table(line: str, exc: Exception) -> bool:
    """Whether ``exc``, raised at the generated program's ``line``, is torch's refusal of an
    index outside a table: an embedding's token id or position (``IndexError: index out of
    range in self``, also the vocabulary-parallel lookups' own check, runtime/tp.py) or a
    loss's target (``Target 9 is out of bounds``)."""
    lookup = any(op in line for op in ("embedding", ".index_select."))  # vocab-parallel too
    loss = any(op in line for op in ("cross_entropy", "nll_loss"))
    text = str(exc)
    return ((lookup or loss) and "index out of range" in text) or \
        (loss and "out of bounds" in text)


def reap_completed(pending: list[tuple[Any, str, torch.Tensor]],
                   wait: Callable[[Any, str], None]) -> list[tuple[Any, str, torch.Tensor]]:
    """The sends of ``pending`` (work, what, tensor) still in flight. Each completed one is
    waited (at once: it raises its failure, if it failed) and dropped with its tensor, so a rank
    holds the tensors of the sends in flight, not of every send of the step until its end (2 m
    boundary tensors per stage). ``is_completed`` does not block (NCCL: a CUDA event query).
    gloo reports a send completed only once it is waited, so there every send stays to the end
    of the step (host memory, where the boundary tensors are small next to the activations)."""
    still = []
    for entry in pending:
        work = entry[0]
        if work is None or work.is_completed():
            wait(work, entry[1])
        else:
            still.append(entry)
    return still


def _announced(module: Callable[..., Any], hook: Callable[[int, int], None], stage: int,
               microbatch: int) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        hook(stage, microbatch)
        return module(*args)

    return run
