"""The program one rank runs: tensor-parallel stage modules, the pipeline executor, data parallel.

:class:`ParallelModel` is what :func:`autopar.parallelize` returns on every rank, made by
:meth:`autopar.compiler.RankProgram.instantiate` from the rank's compiled program (its
tensor-parallel stage graphs, schedule and the tensors it holds, ``autopar/compiler.py``):

1. the pipeline executor (``runtime/pipeline.py``) runs this rank's stages on the plan's schedule,
   with this rank's parameter shards;
2. the data-parallel layer (``runtime/data_parallel.py``) syncs gradients (overlapped with the
   last micro-batch's backward), shards optimizer state / gradients / parameters by ZeRO stage,
   sums tied weights across stages, clips the global norm and steps the optimizer.

``train_step(inputs, targets)`` takes the global batch (the same tensors on every rank) and
returns the global-batch mean loss, equal on all ranks. ``verify(inputs, targets)`` checks one
micro-batch against the original model layer by layer (``autopar/verify.py``).

Dropout masks depend on (seed, step, site, global sample row) only (``runtime/rng.py``): before
each stage call the executor says which micro-batch runs, and this class turns it into the
global rows of the batch (data-parallel rank d holds rows ``[d * B/dp, (d + 1) * B/dp)``).

State in and out (``state_dict``, ``save_pretrained``, ``load_state_dict``, ``save``/``load``)
is :class:`autopar.model_state.ModelState`'s, which this class extends.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from autopar.errors import (AutoparError, CommunicationTimeoutError, InvalidInputError,
                            InvalidPlanError, PlanMismatchError)
from autopar.model_state import ModelState
from autopar.ir import LayerKind
from autopar.plan_types import Plan, RecomputeKind
from autopar.runtime.comm import activity, announce_failure, collective, set_activity
from autopar.runtime.optim import MixedPrecision, OptimizerFactory
from autopar.runtime.running_stats import RunningStats, running_statistics
from autopar.runtime.pipeline import ExecutorHooks

if TYPE_CHECKING:
    from autopar.compiler import RankProgram

__all__ = ["ParallelModel", "TrainingOptions"]


@dataclass(frozen=True, slots=True)
class TrainingOptions:
    """How a rank trains its program: the optimizer, clipping, precision, bucket size."""

    optimizer: OptimizerFactory
    #: Clip the global gradient norm (over all ranks) to this value; None: no clipping.
    max_grad_norm: float | None = None
    #: bf16 compute with fp32 master weights and fp32 gradient reduction.
    mixed_precision: bool = False
    #: Data-parallel gradient bucket size.
    bucket_mb: float = 25.0
    #: Where a plan with ``offload="disk"`` keeps the optimizer state (one folder per rank).
    offload_dir: str | None = None
    #: Compile each stage's graph with ``torch.compile`` and this backend ("inductor": fused
    #: kernels for the element-wise work between GEMMs); None runs the graphs as they are.
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, OptimizerFactory):
            raise TypeError(f"optimizer must be an OptimizerFactory, got "
                            f"{type(self.optimizer).__name__}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InvalidInputError("max_grad_norm must be positive",
                                    found=repr(self.max_grad_norm),
                                    fix="pass a positive norm, or None for no clipping")
        if not self.bucket_mb > 0:
            raise InvalidInputError("bucket_mb must be positive", found=repr(self.bucket_mb))
        if self.compile_backend is not None:
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                raise InvalidInputError(f"unknown torch.compile backend {self.compile_backend!r}",
                                        expected=f"one of {sorted(backends)}",
                                        found=repr(self.compile_backend),
                                        fix="parallelize(..., compile=True) for inductor")


class _RankHooks(ExecutorHooks):
    """What this rank does around the executor's actions (:class:`ExecutorHooks`): name the
    activity and set dropout's rows, and drive the data-parallel engine's gradient sync and
    ZeRO-3 gathers."""

    def __init__(self, pm: "ParallelModel") -> None:
        self.pm = pm

    def before_forward(self, stage: int, microbatch: int) -> None:
        self.pm._before_stage(stage, microbatch, "forward")

    def before_backward(self, stage: int, microbatch: int, *, weights: bool = True) -> None:
        self.pm._on_backward(stage, microbatch, weights=weights)

    def before_weight(self, stage: int, microbatch: int) -> None:
        self.pm._on_weight(stage, microbatch)

    def after_weight(self, stage: int, microbatch: int) -> None:
        self.pm._weight_done(stage, microbatch)

    def before_weight_group(self, weights: list[torch.Tensor]) -> None:
        self.pm.data_parallel.gather_weights(weights)

    def after_weight_group(self, weights: list[torch.Tensor], later: set[int]) -> None:
        self.pm.data_parallel.release_weights(weights, later)


class ParallelModel(ModelState):
    """One rank's part of a parallelized model (see the module docstring).

    Built by :meth:`autopar.compiler.RankProgram.instantiate` from the rank's program, the mesh,
    the training options and this rank's tensors (FQN -> its shard; taken over: a dict is
    emptied once the executor holds them)."""

    def __init__(self, program: "RankProgram", mesh: Any, training: TrainingOptions,
                 tensors: Mapping[str, torch.Tensor], *,
                 stream: Callable[[Callable[[str, torch.Tensor], None]], None] | None = None
                 ) -> None:
        from autopar.passes.loss_reduction import PLACEHOLDER
        from autopar.runtime.cp import CPGroup
        from autopar.runtime.loss_scale import LossScale
        from autopar.runtime.moe import EPGroup
        from autopar.runtime.pipeline import PipelineExecutor
        from autopar.runtime.tp import TPGroup

        planned = program.planned
        self.program = program
        self.captured = planned.captured
        self.plan = planned.plan
        self.prediction = planned.prediction
        self.search = planned.search
        self.mesh = mesh
        self.training = training
        self.tp_program = program.staged.sharded
        self.split = program.staged.split
        self.device = program.device
        self.steps = 0
        #: (first global row of this replica's share, micro-batch size) of the running step.
        self._rows = (0, 0)
        #: The tensor-parallel communicator the stage modules run with (its .rng: dropout).
        self.tp_group = TPGroup.from_mesh(mesh)
        self.tp_group.rng.seed = int(planned.seed)
        #: The context-parallel communicator: this rank's tokens of each sequence, attention.
        self.cp_group = CPGroup.from_mesh(mesh, attention=self.plan.cp_attention) \
            if self.plan.cp > 1 else CPGroup()
        self.tp_group.cp = self.cp_group  # dropout masks: the whole sequence's, this rank's part
        #: What the loss's terms read to weigh as one process's (passes/loss_reduction.py): the
        #: parts a step averages, and each token mean's count on the step's whole batch.
        self.loss_scale = LossScale(self.plan.num_micro_batches, self.plan.dp, self.cp_group)
        #: Per input and target: the dims holding tokens, split over the cp ranks.
        self._sequence_dims = [_token_dims(self.captured.node(name)) if self.plan.cp > 1 else ()
                               for name in (*self.captured.input_names,
                                            *self.captured.target_names)]
        self.data_parallel: Any = None
        if training.compile_backend is not None:
            _check_compilable(self.plan)
        if stream is not None:  # the values arrive after the engine exists, one at a time
            tensors = _placeholders(program)
        self.executor = PipelineExecutor(self.split, program.staged.schedule, mesh,
                                         tensors=tensors,
                                         bindings={"tp": self.tp_group, "cp": self.cp_group,
                                                   "ep": EPGroup.from_mesh(mesh),
                                                   PLACEHOLDER: self.loss_scale},
                                         sync_tied=False, hooks=_RankHooks(self),
                                         recompute=self.plan.recompute is RecomputeKind.FULL,
                                         copy_tensors=False,  # the rank's own fresh shards
                                         layer_units=self.plan.zero == 3,
                                         compile_backend=training.compile_backend,
                                         recompute_blocks=frozenset(
                                             layer.name for layer in self.captured.layers
                                             if layer.kind is LayerKind.BLOCK))
        if isinstance(tensors, dict):  # taken over: the parameters are the executor's now
            tensors.clear()
        local = list(self.executor.stage_modules)
        #: Stage -> its chunk index in the data-parallel engine (None: one stage per rank).
        self._chunk = {s: (i if len(local) > 1 else None) for i, s in enumerate(local)}
        #: Parameter FQN -> this rank's DataParallel name for it (stages it holds only).
        self._dp_name = _dp_names(self.executor)
        self.data_parallel = self._build_data_parallel(deferred=stream is not None)
        #: BatchNorm's running statistics, made one process's over the replicas after each step.
        self.running_stats = RunningStats(running_statistics(self.tp_program.gm),
                                          self.executor.buffers, mesh.dp_group, mesh.dp_rank,
                                          self.plan.dp, self.plan.num_micro_batches)
        if stream is not None:
            self._load(stream)

    def _load(self, stream: Callable[[Callable[[str, torch.Tensor], None]], None]) -> None:
        """Write every held tensor from ``stream`` into its place: a parameter into the
        data-parallel engine's buffers (under ZeRO-3, only this rank's shard of it), a buffer
        into the executor's; each piece can be freed as soon as it is written."""
        written: set[str] = set()
        buffers = self.executor.buffers

        def sink(fqn: str, value: torch.Tensor) -> None:
            if fqn in self._dp_name:
                self.data_parallel.load(self._dp_name[fqn], value)
            elif fqn in buffers:
                with torch.no_grad():
                    buffers[fqn].copy_(value)
            written.add(fqn)

        stream(sink)
        missing = [p.fqn for p in self.program.held if p.fqn not in written]
        if missing:
            raise PlanMismatchError("the shards do not cover what this rank holds",
                                    expected=f"{len(self.program.held)} tensors",
                                    found=f"nothing for {', '.join(missing[:5])}",
                                    fix="a source that produces every held tensor")

    def _build_data_parallel(self, deferred: bool = False) -> Any:
        """The data-parallel engine over the executor's stage modules (collective)."""
        from autopar.runtime.data_parallel import DataParallel, DataParallelConfig, ParamSpec
        from autopar.runtime.optim import MixedPrecision
        from autopar.sharding import placement_str

        executor, mesh, plan = self.executor, self.mesh, self.plan
        layouts = {p.fqn: p for p in self.program.held}
        shared = self.split.shared_params()
        specs = []
        for fqn, name in self._dp_name.items():
            pp_ranks = sorted({executor.stage_to_rank[s] for s in shared.get(fqn, ())})
            tied = tuple(mesh.stage_rank(r) for r in pp_ranks) if len(pp_ranks) > 1 else ()
            specs.append(ParamSpec(name,
                                   replicated_over_tp=placement_str(layouts[fqn].placement) == "R",
                                   shared_with=tied, tie_id=fqn if tied else "",
                                   expert=fqn in self.program.experts and plan.ep > 1,
                                   fqn=fqn))
        shard_size = plan.zero_shard_size if plan.zero_shard_size != plan.replicas else None
        training = self.training
        config = DataParallelConfig(
            zero=plan.zero, bucket_mb=training.bucket_mb, shard_size=shard_size,
            reshard_after_forward=plan.reshard_after_forward,
            split_backward=plan.schedule.spec.splits_backward,
            mixed_precision=MixedPrecision() if training.mixed_precision else None,
            max_grad_norm=training.max_grad_norm, offload=plan.offload,
            offload_dir=training.offload_dir)
        # the optimizer's group rules speak of the model's parameter names
        optimizer = training.optimizer.renamed({name: fqn for fqn, name in self._dp_name.items()})
        return DataParallel(list(executor.stage_modules.values()), mesh, optimizer,
                            config, param_specs=specs, deferred=deferred)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's torch optimizer, over the tensors it updates (its shards; fp32 master
        weights under mixed precision): what an LR scheduler takes
        (``torch.optim.lr_scheduler.LambdaLR(pm.optimizer, ...)``). ``load_state_dict`` builds
        a new one (fresh state, as a new optimizer would have): make schedulers after it."""
        return self.data_parallel.optimizer

    # -- training -----------------------------------------------------------------------------
    def train_step(self, inputs: Sequence[Any] | torch.Tensor, targets: Sequence[Any] | torch.Tensor = (),
                   *, local: bool = False) -> float:
        """One optimizer step on a batch; returns the batch's mean loss (equal on every rank).

        ``inputs``/``targets``: the global batch, the same tensors on every rank; with
        ``local=True``, this data-parallel rank's share only: the contiguous rows
        ``[dp_rank * B / dp, (dp_rank + 1) * B / dp)`` of the global batch of B rows (what
        :meth:`local_batch` returns; Megatron-LM's samplers hand out the same contiguous
        slices), which is how large jobs feed data. Both calls give the same step.
        """
        inputs, targets = self._prepare(inputs, targets, local)
        dp = self.data_parallel
        self._set_dropout(training=True)
        # below ZeRO-2 a chunk's buckets reduce once, in its last backward (_on_backward says
        # which); none before, also not a tied weight's bucket that another chunk's backward
        # reaches first (ZB-V: the embedding's chunk and the LM head's on one rank)
        dp.set_requires_gradient_sync(self.plan.zero >= 2)
        self.running_stats.begin_step()
        try:
            loss = self.executor.step(inputs, targets)
        except BaseException:
            self.running_stats.discard()
            raise
        with activity(f"the optimizer step {self.steps}"):
            try:
                self.running_stats.end_step()
                dp.finish_gradient_sync()
                dp.step()  # clips first when the plan's max_grad_norm is set
                dp.zero_grad()
            except BaseException as exc:
                # out of memory, a lost peer: the job is broken and its peers are told; a named
                # refusal of the step's input leaves it usable
                if isinstance(exc, CommunicationTimeoutError) or \
                        not isinstance(exc, AutoparError):
                    announce_failure(exc)
                raise
        self.steps += 1
        return self._global_loss(loss)

    def eval_step(self, inputs: Sequence[Any] | torch.Tensor, targets: Sequence[Any] | torch.Tensor = (),
                  *, local: bool = False) -> float:
        """The batch's mean loss, no gradients, no update (equal on every rank)."""
        inputs, targets = self._prepare(inputs, targets, local)
        gathered = self.data_parallel.gather_for_eval() if hasattr(
            self.data_parallel, "gather_for_eval") else None
        self._set_dropout(training=False)
        try:
            loss = self.executor.evaluate(inputs, targets)
        finally:
            self._set_dropout(training=True)
            if gathered is not None:
                gathered()
        return self._global_loss(loss)

    __call__ = eval_step

    def verify(self, inputs: Sequence[Any] | torch.Tensor, targets: Sequence[Any] | torch.Tensor = (),
               *, tolerance: float | None = None, raise_on_failure: bool = True,
               local: bool = False) -> Any:
        """Run one micro-batch through this parallel program and through the original model;
        return the largest difference per layer (:class:`autopar.verify.VerificationReport`) and
        raise :class:`autopar.VerificationError` naming the first layer beyond ``tolerance``.
        Collective; the same report on every rank."""
        from autopar.verify import verify

        return verify(self, inputs, targets, tolerance=tolerance,
                      raise_on_failure=raise_on_failure, local=local)

    # -- hooks the executor calls -----------------------------------------------------------------
    def _set_dropout(self, *, training: bool) -> None:
        self.tp_group.rng.training = training
        self.tp_group.rng.step = self.steps

    def _on_backward(self, stage: int, microbatch: int, *, weights: bool = True) -> None:
        """ZeRO-0/1: gradients stay local until a stage's last micro-batch, whose backward then
        overlaps the data-parallel reduction. ZeRO-2/3 reduce-scatter every micro-batch's
        gradients into the shard (as DeepSpeed's ZeRO-2 does), so that no full gradient buffer
        outlives a backward: the memory of Rajbhandari et al. 2020's accounting, and the m
        reduce-scatters per step the cost model prices."""
        self._before_stage(stage, microbatch, "backward")
        self.data_parallel.begin_backward(weights=weights)
        self.data_parallel.set_requires_gradient_sync(
            self._syncs_after(stage, microbatch, self.executor.is_last_backward),
            chunk=self._chunk[stage])

    def _syncs_after(self, stage: int, microbatch: int,
                     is_last: Callable[[int, int], bool]) -> bool:
        return self.plan.zero >= 2 or is_last(stage, microbatch)

    def _on_weight(self, stage: int, microbatch: int) -> None:
        """Before a split backward's weight-gradient action (zero-bubble schedules)."""
        self._before_stage(stage, microbatch, "weight gradient")
        self.data_parallel.begin_weight_gradients(self._chunk[stage])

    def _weight_done(self, stage: int, microbatch: int) -> None:
        self.data_parallel.end_weight_gradients(
            self._chunk[stage],
            last=self._syncs_after(stage, microbatch, self.executor.is_last_weight))

    def _before_stage(self, stage: int, microbatch: int, direction: str) -> None:
        """Before each stage call: name the activity (errors say it) and tell dropout which
        global rows this micro-batch holds."""
        set_activity(f"pipeline stage {stage} {direction} of micro-batch {microbatch}")
        first, size = self._rows
        self.tp_group.rng.set_rows(first + microbatch * size, size)

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's share of a global batch (dim 0), as train_step takes it:
        the ``dp_rank``-th of ``dp`` contiguous chunks (rows ``[dp_rank * B / dp, (dp_rank + 1)
        * B / dp)``), split in turn into the plan's micro-batches in order."""
        if batch.shape[0] % self.plan.dp:
            raise InvalidInputError("the global batch does not split over data-parallel ranks",
                                    expected=f"a batch divisible by dp={self.plan.dp}",
                                    found=f"batch {batch.shape[0]}",
                                    fix="use a global batch that is a multiple of dp x micro-batches")
        return batch.chunk(self.plan.dp, dim=0)[self.mesh.dp_rank]

    def _prepare(self, inputs: Any, targets: Any, local: bool, *,
                 whole_sequence: bool = False) -> tuple[tuple, tuple]:
        """The step's inputs and targets checked and cut to this rank's part: its replica's rows
        and, under context parallelism, its tokens of each sequence (``whole_sequence``: not
        cut along the sequence, what :func:`autopar.verify.verify`'s reference reads)."""
        if isinstance(inputs, Mapping):  # keyword inputs, as captured
            names = self.captured.input_kwargs
            if set(inputs) != set(names):
                raise InvalidInputError("the keyword inputs differ from the captured ones",
                                        expected=f"keys {sorted(names)}",
                                        found=f"keys {sorted(inputs)}",
                                        fix="pass the same keys as the example inputs")
            inputs = tuple(inputs[k] for k in names)
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        targets = (targets,) if isinstance(targets, torch.Tensor) else tuple(targets)
        n_in, n_tg = len(self.captured.input_names), len(self.captured.target_names)
        if len(inputs) != n_in or len(targets) != n_tg:
            raise InvalidInputError("wrong number of inputs or targets",
                                    expected=f"{n_in} input(s) and {n_tg} target(s), as captured",
                                    found=f"{len(inputs)} and {len(targets)}")
        m = self.plan.num_micro_batches
        out = []
        names = list(self.captured.input_names) + list(self.captured.target_names)
        sizes = self._batch_sizes(names, inputs + targets)
        self._check_sizes(sizes)
        self._check_ranges(sizes)
        compute = MixedPrecision().param_dtype if self.training.mixed_precision else None
        for i, t in enumerate(inputs + targets):
            if not isinstance(t, torch.Tensor):
                out.append(t)
                continue
            if compute is not None and i < n_in and t.dtype == torch.float32:
                t = t.to(compute)  # as captured (autopar.api._capture)
            self._check_input(names[i], i, t, local)
            self._check_indices(names[i], i, t, sizes)
            if not local:
                t = self.local_batch(t)
            for dim in () if whole_sequence else self._sequence_dims[i]:
                t = self.cp_group.split(t, dim)  # this rank's tokens (head-tail layout)
            if t.shape[0] % m:
                raise InvalidInputError(
                    "the batch does not split into the plan's micro-batches",
                    expected=f"a per-replica batch divisible by {m} micro-batches "
                             f"(global batch a multiple of dp x micro-batches = {self.plan.dp * m})",
                    found=f"per-replica batch {t.shape[0]}",
                    fix="change the batch size, or re-plan with another micro-batch count")
            out.append(t.to(self.device))
        self._check_computed(names, inputs + targets, local)
        self.loss_scale.totals = self._loss_totals(names, inputs + targets, local)
        rows = next((t.shape[0] for t in out if isinstance(t, torch.Tensor) and t.dim()), 0)
        if rows == 0 and any(isinstance(t, torch.Tensor) and t.dim() for t in out):
            raise InvalidInputError("the batch is empty", expected="at least dp x micro-batches "
                                    f"= {self.plan.dp * m} rows", found="0 rows",
                                    fix="skip empty batches")
        self._check_tp_splits(sizes, rows // m)
        self._rows = (self.mesh.dp_rank * rows, rows // m)
        return tuple(out[:n_in]), tuple(out[n_in:])

    def _check_tp_splits(self, sizes: dict[str, int], micro_rows: int) -> None:
        """The sizes the tensor-parallel program splits over its ranks, at this batch: a
        sequence under sequence parallelism (``s`` split tp ways, on each cp rank's part), a
        batch-sized dim a layout splits. One that does not divide is refused by name before the
        step, the model left usable (inside a stage it would end the step, and the executor
        with it)."""
        from autopar.ir import BATCH, META_KEY, SEQ, info
        from autopar.sharding import is_sharded, num_blocks

        splits = getattr(self, "_tp_splits", None)
        if splits is None:
            found: dict[tuple[Any, int], str] = {}
            if self.plan.tp > 1:
                for n in self.tp_program.gm.graph.nodes:
                    if META_KEY not in n.meta:
                        continue
                    placement, spec = info(n).placement, info(n).spec
                    if not is_sharded(placement) or spec is None:
                        continue
                    size = spec.shape[placement.dim]
                    if getattr(size, "free_symbols", None):
                        found.setdefault((size, self.plan.tp * num_blocks(placement)), n.name)
            splits = self._tp_splits = found
        if not splits:
            return
        values = {sym: sizes[sym.name] for sym in self.captured.symbols.values()
                  if sym.name in sizes}
        if SEQ in values:
            values[SEQ] //= self.plan.cp  # each cp rank's part of the sequence
        values[BATCH] = micro_rows
        for (size, divisor), node in splits.items():
            if not size.free_symbols <= values.keys():
                continue
            got = int(size.subs(values))
            if got % divisor:
                shown = ", ".join(f"{k.name}={v}" for k, v in sorted(values.items(),
                                                                     key=lambda kv: kv[0].name))
                raise InvalidInputError(
                    f"the batch's sizes ({shown}) do not split over the {self.plan.tp} "
                    f"tensor-parallel ranks",
                    expected=f"{size} divisible by {divisor} (the plan splits it"
                             + (": sequence parallelism" if self.plan.sequence_parallel
                                and SEQ in size.free_symbols else "") + f", at {node})",
                    found=f"{size} = {got}",
                    fix=f"pad the batch so that {size} is a multiple of {divisor} (masking the "
                        "padding out of the loss), or re-plan without that split")

    def _batch_sizes(self, names: list[str], batch: tuple) -> dict[str, int]:
        """The capture's size symbols (``s``, an encoder-decoder's other lengths) at this batch,
        read from the tensors passed (a sequence split over cp ranks: the whole sequence). The
        batch symbol is left out: the batch passed holds every micro-batch (and replica)."""
        from autopar.ir import BATCH, info

        sizes: dict[str, int] = {}
        for name, t in zip(names, batch):
            spec = info(self.captured.node(name)).spec if isinstance(t, torch.Tensor) else None
            if spec is None or spec.ndim != t.dim():
                continue  # _check_input names a tensor of another form
            for want, got in zip(spec.shape, t.shape):
                if getattr(want, "is_Symbol", False):
                    sizes.setdefault(want.name, int(got))
        sizes.pop(BATCH.name, None)  # passed global or local: no computed index reads it here
        return sizes

    def _check_sizes(self, sizes: dict[str, int]) -> None:
        """The indexes the model computes from the batch's sizes within the tables they read
        (passes/index_checks.size_bounds: GPT-2's positions, ``arange(s)``, in its position
        table). A sequence longer than the table fails one process's lookup; here it is refused
        before the step, the model left usable (inside a stage it would end the step, and the
        executor with it)."""
        from autopar.ir import SEQ
        from autopar.passes.index_checks import size_bounds

        bounds = getattr(self, "_size_bounds", None)
        if bounds is None:
            bounds = self._size_bounds = size_bounds(self.captured)
        if not bounds:
            return
        for bound in bounds:
            outside = bound.outside(sizes)
            if outside is None:
                continue
            shown = ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))
            longest = bound.longest(SEQ.name)
            raise InvalidInputError(
                f"the batch's sizes ({shown}) index beyond {bound.table} ({bound.rows} rows)",
                expected=f"indexes in [0, {bound.rows})"
                         + (f": a sequence of at most {longest} tokens" if longest else ""),
                found=f"indexes {outside[0]} to {outside[1]} ({bound.low} to {bound.high})",
                fix="shorten the sequence to what the model was built for, or build it with a "
                    "larger table (GPT-2: config.n_positions)")

    def _check_ranges(self, sizes: dict[str, int]) -> None:
        """The sizes the captured graph holds for (``CapturedGraph.size_ranges``: a model that
        slices ``ids[:, 2:]`` was traced for ``s >= 4``, BERT's for ``s <= 512``): a size outside
        would run a graph traced for other sizes. Refused by name before the step. Under
        context parallelism the least size holds for each rank's part, ``s / cp`` (the graph's
        slices run on it), the most for the whole sequence (the positions are the whole's)."""
        from autopar.ir import SEQ

        empty = sorted(name for name, size in sizes.items() if size < 1)
        if empty:
            raise InvalidInputError(
                f"the batch has an empty dim ({', '.join(f'{k}=0' for k in empty)})",
                expected="at least one token (one element along every dim the model traced as "
                         "a size symbol)", found=", ".join(f"{k}={sizes[k]}" for k in empty),
                fix="skip empty batches")
        for symbol, (low, high) in self.captured.size_ranges.items():
            if symbol.name not in sizes:
                continue  # the batch: the batch passed holds every micro-batch (and replica)
            split = self.plan.cp if symbol == SEQ else 1
            size = sizes[symbol.name]
            if low <= size // split and (high is None or size <= high):
                continue
            model = type(self.captured.model).__name__ if self.captured.model is not None \
                else "the model"
            raise InvalidInputError(
                f"{symbol.name}={size} lies outside the sizes {model} was captured for",
                expected=self.captured.size_range(symbol) if split == 1 else
                f"{symbol.name} from {low * split}" + (f" to {high}" if high is not None else
                                                       " up")
                + f" ({low} or more on each of {split} context-parallel ranks)",
                found=f"{symbol.name}={size}",
                fix="pass a size in that range: torch.export proved the graph for it (a slice "
                    "of the sequence, ids[:, 2:], needs 2 tokens left, s >= 4; a model's own "
                    "bound on its positions). To train at another size, parallelize with "
                    "example inputs of that size")

    def _check_indices(self, name: str, index: int, t: torch.Tensor,
                       sizes: dict[str, int]) -> None:
        """Token ids and targets within the table they index (passes/index_checks.index_bounds):
        one process's lookup refuses one outside; a vocabulary-parallel or padded lookup would
        read zeros for it silently. Each lookup's part of the input is checked (the model's
        ``ids[:, :-1]``: not the last column, which one process never reads). On a CPU the
        refusal is this named error, before the step; on a GPU ``_assert_async`` checks on the
        device without the host waiting (a failed check is CUDA's device-side assert, which
        ends the process)."""
        bounds = getattr(self, "_index_bounds", None)
        if bounds is None:
            from autopar.passes.index_checks import index_bounds

            bounds = self._index_bounds = index_bounds(self.captured)
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            return
        what = "input" if index < len(self.captured.input_names) else "target"
        for bound in bounds.get(name, ()):
            outside = bound.outside(t, sizes, f"{what} {name}")
            if outside is not None:
                count, low, high = outside
                allowed = f"[0, {bound.rows})" + (f" or {bound.ignore}"
                                                  if bound.ignore is not None else "")
                number = index if what == "input" else index - len(self.captured.input_names)
                raise InvalidInputError(
                    f"{what} {number} indexes outside {bound.table} ({bound.rows} rows)",
                    expected=f"values in {allowed}, as one process's lookup requires",
                    found=f"{count} value(s) outside, from {low} to {high}",
                    fix="check the batch: token ids below the vocabulary size, targets below "
                        "the number of classes")

    def _check_computed(self, names: list[str], batch: tuple, local: bool) -> None:
        """The indexes the model computes from the batch's values within their tables
        (passes/index_checks.computed_bounds: OPT's positions, a cumsum of the attention mask):
        the part of the graph that computes each, run on every micro-batch of every replica
        before the step (at once where no op mixes the batch's rows), as the stages would; an
        index outside is refused by name, the model left usable (inside a stage it would end
        the step, and the executor with it). A program that does not run on the batch as passed
        leaves the check to the stage."""
        from autopar.passes.index_checks import computed_bounds

        bounds = getattr(self, "_computed_bounds", None)
        if bounds is None:
            bounds = self._computed_bounds = computed_bounds(self.captured)
        if not bounds:
            return
        whole = dict(zip(names, batch))
        parts = self._micro_batches(names, batch, local)
        for bound in bounds:
            if bound.row_wise:  # the whole batch at once is every micro-batch
                try:
                    if bound.outside({n: whole[n] for n in bound.reads}) is None:
                        continue
                except Exception:  # noqa: BLE001 - a size the capture fixed: each apart
                    pass
            try:  # each micro-batch apart (after a refusal: which one)
                found = next(((k, outside) for k, part in enumerate(parts)
                              if (outside := bound.outside(part)) is not None), None)
            except Exception:  # noqa: BLE001 - the stage's own lookup still checks it
                continue
            if found is not None:
                k, (count, low, high) = found
                allowed = f"[0, {bound.rows})" + (f" or {bound.ignore}"
                                                  if bound.ignore is not None else "")
                sources = ", ".join(f"{'input' if n in self.captured.input_names else 'target'}"
                                    f" {self._position(n)}" for n in bound.reads)
                raise InvalidInputError(
                    f"an index the model computes from {sources} ({', '.join(bound.ops)}) "
                    f"lies outside {bound.table} ({bound.rows} rows)",
                    expected=f"indexes in {allowed}, as one process's lookup requires",
                    found=f"{count} index(es) outside in micro-batch {k}, from {low} to {high}",
                    fix="check the batch (one process's lookup fails on it the same way): "
                        "an attention mask of 0s and 1s, sequences no longer than the model's "
                        "positions")

    def _loss_totals(self, names: list[str], batch: tuple, local: bool) -> list[int | None]:
        """Every token mean's counted targets over the step's whole batch, in graph order
        (passes/loss_reduction.target_counts; None where they cannot be counted before the
        step). With ``local=True`` each replica counts its rows and the counts are added."""
        counts = getattr(self, "_target_counts", None)
        if counts is None:
            from autopar.passes.loss_reduction import target_counts

            counts = self._target_counts = target_counts(self.captured)
        if not counts:
            return []
        whole = dict(zip(names, batch))
        parts = self._micro_batches(names, batch, local)
        totals: list[int | None] = []
        for count in counts:
            try:
                totals.append(count.count(whole, parts) if count is not None else None)
            except Exception:  # noqa: BLE001 - a form _check_input names, or a size the graph fixed
                totals.append(None)
        if local and self.plan.dp > 1:  # every replica's rows: added over the world
            known = torch.tensor([[t if t is not None else 0, t is None] for t in totals],
                                 dtype=torch.int64, device=self.device)
            collective(dist.all_reduce, known, what="the all-reduce of every replica's "
                                                    "counted targets")
            per_replica = dist.get_world_size() // self.plan.dp  # its pp x cp x tp ranks
            totals = [None if unknown else int(total) // per_replica
                      for total, unknown in known.cpu().tolist()]
        return totals

    def _micro_batches(self, names: list[str], batch: tuple, local: bool) -> list[dict[str, Any]]:
        """The batch passed as every replica's micro-batches in order (each a dict by
        placeholder name), as the stages will see them: the batch-major tensors split by rows,
        the others whole in each."""
        from autopar.ir import BATCH, info

        parts = self.plan.num_micro_batches * (1 if local else self.plan.dp)
        static_batch = BATCH not in self.captured.example_sizes
        chunks: dict[str, Any] = {}
        for name, t in zip(names, batch):
            spec = info(self.captured.node(name)).spec if isinstance(t, torch.Tensor) else None
            batched = spec is not None and spec.ndim and t.dim() and \
                (static_batch or spec.shape[0] == BATCH) and t.shape[0] % parts == 0
            chunks[name] = t.tensor_split(parts) if batched else [t] * parts
        return [{name: chunks[name][k] for name in names} for k in range(parts)]

    def _position(self, name: str) -> int:
        """An input's or target's index among the inputs or the targets."""
        if name in self.captured.input_names:
            return self.captured.input_names.index(name)
        return self.captured.target_names.index(name)

    def _check_input(self, name: str, index: int, t: torch.Tensor, local: bool = False) -> None:
        """dtype, number of dims and fixed sizes as captured (b and s may vary). A batch
        captured static is the micro-batch's: the batch passed holds m (x dp) of them."""
        from autopar.ir import BATCH, info

        spec = info(self.captured.node(name)).spec
        if spec is None:
            return
        n_in = len(self.captured.input_names)
        what = f"input {index}" if index < n_in else f"target {index - n_in}"
        problem = None
        if t.dtype != spec.dtype:
            problem = f"dtype {str(t.dtype).removeprefix('torch.')}"
        elif t.dim() != spec.ndim:
            problem = f"{t.dim()} dims, shape {tuple(t.shape)}"
        else:
            rows = self.plan.num_micro_batches * (1 if local else self.plan.dp)
            static_batch = BATCH not in self.captured.example_sizes
            for d, (want, got) in enumerate(zip(spec.shape, t.shape)):
                if getattr(want, "is_Integer", False) and d == 0 and static_batch:
                    want = want * rows
                if getattr(want, "is_Integer", False) and int(want) != int(got):
                    problem = f"shape {tuple(t.shape)} (dim {d} is {got})"
                    break
        if problem:
            raise InvalidInputError(f"{what} does not have the captured form",
                                    expected=f"{spec} (b, s: any batch and sequence size)",
                                    found=problem,
                                    fix="pass tensors shaped like the example inputs")

    def _global_loss(self, loss: torch.Tensor | None) -> float:
        """Each replica's last stage holds its mean loss: average over replicas, share with all."""
        last_stage_rank = self.executor.stage_to_rank[-1]  # the last pp rank, or the first (V)
        holder = self.mesh.pp_rank == last_stage_rank and self.mesh.tp_rank == 0
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        if holder:
            if loss is None:
                raise PlanMismatchError("the last pipeline stage returned no loss",
                                        fix="capture the model with its loss_fn")
            value += loss.detach().double()
        set_activity("the loss average over replicas")
        collective(dist.all_reduce, value, what="the all-reduce of the batch loss")
        return float(value.item()) / self.plan.replicas  # dp x cp ranks hold a mean each

    # -- inspection -----------------------------------------------------------------------------
    def generated_code(self, rank: int | None = None) -> str:
        """The Python source this rank's modules run: the tensor-parallel module of its tp
        coordinate, then the stage graphs of its pipeline coordinate (``rank``: any global rank,
        default this one)."""
        return self.program.staged.source(dist.get_rank() if rank is None else rank)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters, gradients, master weights and
        optimizer state (in host memory under ``offload``), and with ``offload="disk"`` the
        optimizer state in the offload directory's files."""
        report = self.data_parallel.memory_bytes()
        out = {"params": report.params, "grads": report.grads, "optimizer": report.optimizer}
        if report.disk:
            out["disk"] = report.disk
        return out

    def fingerprint(self) -> str:
        """A hash of what this rank was built from (equal on every rank: the plan and the
        per-rank graph before tensor-parallel slicing)."""
        h = hashlib.sha256(self.plan.dumps().encode())
        h.update(self.tp_program.gm.code.encode())
        for stage in self.split.stages:
            h.update(f"{stage.index}:{stage.layers}".encode())
        return h.hexdigest()[:16]

    def close(self) -> None:
        """Release the data-parallel engine's hooks (ZeRO-3 parameters are not gathered first:
        the model is done). The process groups stay for the process's next model of the same
        layout (runtime/groups.py), which reuses them instead of creating more."""
        self.data_parallel.close(gather=False)


def _check_compilable(plan: Plan) -> None:
    """Compiled graphs run whole forward and backward passes: a plan that takes a backward
    apart is refused by name. ZeRO-3 and full recompute compile each captured layer on its own
    (``runtime/layer_recompute.py``'s ``layer_regions``), with the gathers, frees and
    checkpoints around them."""
    if plan.schedule.spec.splits_backward:
        raise InvalidPlanError(f"compile=True does not run the {plan.schedule.value} schedule",
                               expected="a schedule whose backward is one action (1f1b, "
                                        "interleaved, gpipe)",
                               found=f"{plan.schedule.value}, which splits each backward into "
                                     "input and weight gradients",
                               fix="pin schedule='1f1b', or drop compile")


def _dp_names(executor: Any) -> dict[str, str]:
    """FQN -> the name the data-parallel layer gives the parameter (chunk-prefixed when a rank
    runs several stages), for the first local stage that holds it."""
    from autopar.runtime.pipeline import module_attribute

    modules = list(executor.stage_modules.values())
    out: dict[str, str] = {}
    for i, module in enumerate(modules):
        prefix = f"{i}." if len(modules) > 1 else ""
        for name, _ in module.named_parameters():
            fqn = next(f for f in executor.params if module_attribute(f) == name)
            out.setdefault(fqn, prefix + name)
    return out


def _token_dims(node: Any) -> tuple[int, ...]:
    """The dims of an input whose captured size is the sequence length ``s``."""
    from autopar.ir import SEQ, info

    spec = info(node).spec
    return () if spec is None else tuple(d for d, e in enumerate(spec.shape) if e == SEQ)


def _placeholders(program: "RankProgram") -> dict[str, torch.Tensor]:
    """Stand-ins for a rank's tensors before their values stream in: each parameter a single
    element broadcast to its local shape (the right shape, dtype and device, no memory; the
    data-parallel engine points it at its buffers), each buffer zeros to be written."""
    params = {p.fqn for p in program.planned.captured.params.values()}
    out = {}
    for layout in program.held:
        if layout.fqn in params:
            out[layout.fqn] = torch.empty((), dtype=layout.dtype,
                                          device=program.device).expand(*layout.local_shape)
        else:
            out[layout.fqn] = torch.zeros(layout.local_shape, dtype=layout.dtype,
                                          device=program.device)
    return out
