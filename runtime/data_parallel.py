"""Data parallelism for one rank's modules: bucketed gradient sync overlapped with backward, ZeRO.

:class:`DataParallel` wraps the *local* modules of a rank (a plain model, a generated
tensor-parallel module, or the pipeline stage chunks a rank runs) given a
:class:`~autopar.runtime.mesh.ParallelMesh`, and owns everything between ``loss.backward()`` and
the next forward:

- Gradients are moved, as autograd finishes each parameter (``register_post_accumulate_grad_hook``),
  into flat buckets of about ``bucket_mb``; a bucket's all-reduce (ZeRO-0) or reduce-scatter
  (ZeRO-1/2/3) starts asynchronously as soon as its last gradient arrives, so communication
  overlaps the rest of the backward, as in PyTorch DDP. Buckets are launched in a fixed order on
  every rank, so the collectives match even when a backward finishes them in another order; a
  callback at the end of each backward launches the buckets whose parameters got no gradient.
- Gradient accumulation: :meth:`no_sync` (or :meth:`set_requires_gradient_sync`, per stage
  chunk) keeps micro-batch gradients local; the pipeline executor enables sync for the last
  micro-batch's backward of each chunk, whose reductions then overlap that backward.
- ZeRO-1/2/3 and hybrid sharding (``runtime/zero.py``), mixed precision and the optimizer
  factory (``runtime/optim.py``).
- Gradients that must be summed over other ranks before the step: tied weights whose copies live
  on different pipeline stages (an embedding and the LM head), and tensor-parallel-replicated
  parameters whose gradients are partial sums (sequence-parallel norms).
- Global gradient-norm clipping over the whole mesh, counting each element of the model once.
- The step bucket by bucket, each as soon as its reduction is in, overlapping the optimizer with
  the last reductions (on CPU processes, where it was measured: ``step_per_bucket``).
- Per-rank memory of parameters, gradients and optimizer state, measured from the tensors held.

Why not torch's DDP or FSDP2 (``fully_shard``)? DDP must own the forward call (its reducer is
prepared in ``DDP.forward``), which a pipeline executor calling stage chunks per micro-batch does
not go through, and it has no ZeRO. FSDP2 shards through DTensor parameters, has no ZeRO-1/2,
keeps fp32 sharded parameters and casts at every gather, and lays out each module's shards
independently, so a tied weight's shards on two stages are not known to line up. One flat-bucket
design covers stages 0-3, hybrid sharding and tied weights uniformly and plugs into per-rank
generated modules with plain tensors. Both torch implementations are kept as references: the
tests compare parameters after training steps against DDP and FSDP2, and
``benchmarks/dp_vs_ddp.py`` measures this DP's step time against DDP's.

ZeRO-3 and micro-batches: parameters are gathered for each micro-batch's forward and again for
its backward (and freed after each), so a step with m micro-batches gathers 2m times per unit;
``reshard_after_forward=False`` keeps a unit gathered from its forward to the end of the next
backward instead (m + 1 gathers per step with 1F1B-like interleavings, full parameters of every
unit with a micro-batch in flight held meanwhile).

The constructor is collective over the world (it creates process groups and broadcasts the
initial parameters); so are :meth:`finish_gradient_sync`, :meth:`clip_grad_norm_`, :meth:`step`
and :meth:`full_parameters`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import InvalidInputError, PlanMismatchError
from autopar.runtime.dp_spec import DataParallelConfig, MemoryReport, ParamSpec, default_units
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.offload import StatePager
from autopar.runtime.optim import OptimizerFactory, clip_coefficient, global_grad_norm
from autopar.runtime.tied import TiedGroups
from autopar.runtime.param_units import ParamUnit, UnitOrder
from autopar.runtime.zero import (FlatBucket, ShardGroups, ZeroStage, iter_unique_storages,
                                  wait_work)

__all__ = ["ParamSpec", "DataParallelConfig", "DataParallel", "MemoryReport", "TiedGroups",
           "default_units", "ZeroStage"]


class DataParallel:
    """Data-parallel training of this rank's modules; see the module docstring.

    ``modules``: one module, or the stage chunks this rank runs. ``param_specs``: by parameter name
    (required when the mesh has tp > 1, where sharded and replicated parameters differ).
    ``units``: ZeRO-3 gather units (submodules); default :func:`default_units` of each module.
    """

    def __init__(self, modules: nn.Module | Sequence[nn.Module], mesh: ParallelMesh,
                 optimizer: OptimizerFactory, config: DataParallelConfig = DataParallelConfig(), *,
                 param_specs: Mapping[str, ParamSpec] | Sequence[ParamSpec] | None = None,
                 units: Sequence[nn.Module] | None = None, deferred: bool = False) -> None:
        if not isinstance(mesh, ParallelMesh):
            raise InvalidInputError("DataParallel needs a ParallelMesh", found=type(mesh).__name__,
                                    fix="build autopar.runtime.mesh.ParallelMesh(dp, pp, tp)")
        if not isinstance(optimizer, OptimizerFactory):
            raise InvalidInputError("optimizer must be an OptimizerFactory",
                                    found=type(optimizer).__name__,
                                    fix="OptimizerFactory(torch.optim.AdamW, {'lr': 1e-3})")
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not self.modules or not all(isinstance(m, nn.Module) for m in self.modules):
            raise InvalidInputError("DataParallel needs nn.Module(s)", found=repr(modules)[:80])
        self.mesh = mesh
        self.config = config
        stage = config.zero
        if stage >= ZeroStage.OPTIMIZER and not optimizer.is_elementwise:
            raise InvalidInputError(
                f"{optimizer.optimizer_class.__name__} cannot run on ZeRO shards",
                expected="an element-wise optimizer (Adam, AdamW, SGD, ...) under zero >= 1",
                found=f"zero={int(stage)} with an optimizer that looks at whole tensors",
                fix="use zero=0, or pass elementwise=True to OptimizerFactory if its update is "
                    "element-wise")
        if not optimizer.is_elementwise and mesh.tp > 1 and param_specs:
            specs = param_specs.values() if isinstance(param_specs, Mapping) else param_specs
            split = sorted(s.model_name for s in specs if not s.replicated_over_tp)
            if split:  # its statistics of a shard are not those of the whole matrix
                raise PlanMismatchError(
                    f"{optimizer.optimizer_class.__name__} cannot update tensor-parallel shards",
                    expected="an element-wise optimizer (Adam, AdamW, SGD, ...) where tp > 1 "
                             "splits parameters",
                    found=f"tp={mesh.tp} splits {len(split)} parameters ({', '.join(split[:3])}"
                          f"{', ...' if len(split) > 3 else ''}) and the optimizer looks at "
                          f"whole tensors (Adafactor's row and column statistics)",
                    fix="use tp=1 (plan='auto' does for such an optimizer), or pass "
                        "elementwise=True to OptimizerFactory if its update is element-wise")
        if config.shard_size is not None and config.shard_size > mesh.replicas:
            raise PlanMismatchError("hybrid shard group larger than the data-parallel group",
                                    expected=f"shard_size <= dp x cp = {mesh.replicas}",
                                    found=f"shard_size = {config.shard_size}",
                                    fix="use the number of data-parallel ranks in one node")
        self.groups = ShardGroups.build(mesh, config.shard_size, mesh.timeout)
        #: The groups of expert weights: the ranks holding the same experts (no hybrid split).
        self.expert_groups = ShardGroups.of_group(mesh.expert_replica_group) \
            if getattr(mesh, "ep", 1) > 1 else self.groups

        named = self._named_parameters()
        specs = self._resolve_specs(param_specs, named)
        self.specs = specs
        self.tied = TiedGroups(specs, {n: p.shape for n, p in named}, mesh)
        self._deferred = deferred
        self._build_buckets(named, specs, units)
        #: Parameter name -> (its bucket, its slot there): where :meth:`load` writes.
        self._slot_of = {slot.name: (b, i) for b in self.buckets for i, slot in enumerate(b.slots)}
        #: Parameter id -> (its bucket, its slot), and -> the ZeRO-3 units that gather it (its
        #: own and any sharing it): what a weight-gradient pass looks up for each group.
        self._slot_of_param = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._units_of_param: dict[int, list[ParamUnit]] = {}
        for unit in self.units:
            for b in unit.buckets:
                for p in b.params:
                    self._units_of_param.setdefault(id(p), []).append(unit)
        self._hooks = []
        for bucket in self.buckets:
            if not bucket.requires_grad:
                continue
            owner = self._unit_of_bucket.get(bucket.index)
            for i, p in enumerate(bucket.params):
                units = ([owner] if owner is not None else []) + self._sharers.get(id(p), [])
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._make_grad_hook(bucket, i, units)))
        self.optimizer = optimizer.build(
            [(name, piece) for b in self.buckets for name, piece, _, _ in b.pieces])
        self.pager: StatePager | None = None
        if config.offload == "disk":
            assert config.offload_dir is not None
            self.pager = StatePager(config.offload_dir, dist.get_rank(), self.optimizer,
                                    self.buckets)
        self._bucketwise = self._steps_per_bucket(optimizer)
        #: An offloaded (host) optimizer steps bucket by bucket after the reductions, its copies
        #: down and up overlapping the host's steps (:meth:`_host_step`): element-wise ones.
        self._host_bucketwise = config.offload == "optimizer" and optimizer.is_elementwise
        n_chunks = len(self.modules)
        self._sync = [True] * n_chunks
        self._unsynced = [False] * n_chunks
        self._next_launch = [0] * n_chunks
        self._touched: set[int] = set()
        self._callback_queued = False
        self._grads_final = False
        #: Inside a split backward's weight-gradient pass: its autograd call's end (which may
        #: reach a unit's output hook) must not free the parameters the pass still assigns to.
        self._weight_pass = False
        #: The backward running is a split backward's input-gradient pass (its weights'
        #: gradients come in a later weight-gradient pass): :meth:`begin_backward` says, for
        #: each backward action; under a split backward that is the rule.
        self._inputs_only = True
        #: ZeRO-2/3: the bucket whose reduce-scatter was launched last and not waited yet.
        self._in_flight: FlatBucket | None = None

    # -- construction ---------------------------------------------------------------------------
    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        out = []
        multi = len(self.modules) > 1
        self._chunk_of: dict[str, int] = {}
        for c, module in enumerate(self.modules):
            for name, p in module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                qual = f"{c}.{name}" if multi else name
                out.append((qual, p))
                self._chunk_of[qual] = c
        # none at all is a rank whose stages hold only parameter-free layers (a pipeline stage
        # of ALBERT's embeddings' views, the loss): no buckets, an optimizer over nothing, and
        # still every collective the other ranks reach (the global norm's all-reduce)
        return out

    def _resolve_specs(self, param_specs: Any, named: list[tuple[str, nn.Parameter]]
                       ) -> dict[str, ParamSpec]:
        names = [n for n, _ in named]
        if param_specs is None:
            if self.mesh.tp > 1:
                raise InvalidInputError(
                    "param_specs are needed with tensor parallelism",
                    expected="a ParamSpec per parameter saying whether it is replicated over tp",
                    found=f"tp = {self.mesh.tp} and no param_specs",
                    fix="pass the specs the tensor-parallel code generator emits")
            return {n: ParamSpec(n) for n in names}
        if not isinstance(param_specs, Mapping):
            param_specs = {s.name: s for s in param_specs}
        unknown = sorted(set(param_specs) - set(names))
        if unknown:
            raise InvalidInputError("param_specs name parameters the modules do not have",
                                    expected=f"names among {names[:6]}...", found=str(unknown[:6]),
                                    fix="use the names of named_parameters() (chunk-prefixed when "
                                        "several modules are wrapped)")
        return {n: param_specs.get(n, ParamSpec(n)) for n in names}

    def _assign_units(self, named: list[tuple[str, nn.Parameter]],
                      units: Sequence[nn.Module] | None) -> dict[str, tuple[int, nn.Module]]:
        """ZeRO-3: parameter name -> (unit index, unit module), the innermost unit holding it."""
        unit_modules: list[nn.Module] = []
        if units is None:
            for m in self.modules:
                unit_modules.extend(u for u in default_units(m) if u not in unit_modules)
        else:
            unit_modules = list(units)
            for m in self.modules:
                if not any(u is m for u in unit_modules):
                    unit_modules.append(m)
            inside = {id(x) for m in self.modules for x in m.modules()}
            stray = [type(u).__name__ for u in unit_modules if id(u) not in inside]
            if stray:
                raise InvalidInputError("ZeRO-3 units must be submodules of the wrapped modules",
                                        found=str(stray), fix="pass submodules (e.g. the blocks)")
        param_sets = [{id(p) for p in u.parameters()} for u in unit_modules]
        order = sorted(range(len(unit_modules)), key=lambda i: -len(param_sets[i]))
        owner: dict[int, int] = {}
        #: unit -> the wrapped module (stage) it lies in
        root_of = {id(x): r for r, m in enumerate(self.modules) for x in m.modules()}
        #: Unit index -> parameters (ids) it gathers although another unit owns them.
        self._unit_shares: dict[int, set[int]] = {}
        for i in order:  # larger units first, so the innermost unit wins
            for pid in param_sets[i]:
                j = owner.get(pid)
                if j is not None and not param_sets[i] <= param_sets[j]:
                    if root_of[id(unit_modules[i])] != root_of[id(unit_modules[j])]:
                        # Units of two wrapped modules sharing a weight (ZB-V's tied embedding
                        # and LM head, two chunks on one rank: the stages, or their layers'
                        # units): the first keeps it, the other gathers its bucket too.
                        self._unit_shares.setdefault(i, set()).add(pid)
                        continue
                    raise InvalidInputError(
                        "a parameter belongs to two ZeRO-3 units that do not nest",
                        found=f"{type(unit_modules[j]).__name__} and "
                              f"{type(unit_modules[i]).__name__}",
                        fix="make the unit holding the shared parameter contain the other, or "
                            "merge the units")
                owner[pid] = i
        self._unit_modules = unit_modules
        return {n: (owner[id(p)], unit_modules[owner[id(p)]]) for n, p in named}

    def _build_buckets(self, named: list[tuple[str, nn.Parameter]], specs: dict[str, ParamSpec],
                       units: Sequence[nn.Module] | None) -> None:
        stage = self.config.zero
        mp = self.config.mixed_precision
        mesh = self.mesh
        unit_of = self._assign_units(named, units) if stage is ZeroStage.PARAMETERS else {}
        grad_dtype_size = torch.tensor([], dtype=mp.grad_dtype).element_size() if mp else None
        # Reverse registration order approximates the order gradients arrive in.
        groups: list[tuple[tuple, list[tuple[str, nn.Parameter]]]] = []
        open_group: dict[tuple, int] = {}
        sizes: dict[int, int] = {}
        for name, p in reversed(named):
            spec = specs[name]
            sum_key = ("tie", spec.tie_key) if spec.tie_key else (
                ("tp",) if spec.sum_grad_over_tp and mesh.tp > 1 else None)
            unit = unit_of[name][0] if unit_of else -1
            key = (self._chunk_of[name], unit, p.dtype, p.requires_grad,
                   spec.replicated_over_tp, sum_key, spec.expert)
            elem = grad_dtype_size or p.element_size()
            cap = int(self.config.bucket_mb * 2 ** 20) // elem
            i = open_group.get(key)
            if i is not None and (sum_key and sum_key[0] == "tie"):
                i = None  # a tied parameter gets a bucket of its own, laid out alike on its copies
            if i is not None and stage is not ZeroStage.PARAMETERS and sizes[i] + p.numel() > cap:
                i = None
            if i is None:
                groups.append((key, []))
                i = len(groups) - 1
                open_group[key] = i
                sizes[i] = 0
            groups[i][1].append((name, p))
            sizes[i] += p.numel()
        # deferred: every rank loads the same values itself, nothing to broadcast
        sync = self.config.sync_module_states and not self._deferred
        # A tied bucket is broadcast from its tie's first rank as it is built: those broadcasts,
        # which pair ranks of different stages, run in one global order (by tie key) after the
        # rest, or two ties whose buckets two stages build in opposite orders would each wait
        # on the other's group (DeBERTa-v2's word embeddings and relative positions at pp 2).
        built: dict[int, FlatBucket] = {}
        for index in sorted(range(len(groups)), key=lambda i: (
                (1, groups[i][0][5][1]) if groups[i][0][5] and groups[i][0][5][0] == "tie"
                else (0, i))):
            key, params = groups[index]
            chunk, unit, _, requires_grad, replicated, sum_key, expert = key
            groups_of = self.expert_groups if expert else self.groups
            src = mesh.ranks("expert_replica" if expert else "replica")[0] if sync else None
            params = list(reversed(params))  # registration order inside the bucket
            tie = sum_group = None
            counts = True
            if sum_key and sum_key[0] == "tie":
                tie = self.tied.group_of(params[0][0])
                sum_group = tie[0]
                counts = mesh.rank == tie[1]
            elif sum_key:
                sum_group = mesh.tp_group
            if replicated and mesh.tp_rank != 0:
                counts = False
            if groups_of.replicate_rank != 0:
                counts = False
            built[index] = FlatBucket(
                index, params, stage=stage, groups=groups_of, mixed_precision=mp,
                requires_grad=requires_grad, chunk=chunk, broadcast_src=src,
                tie=tie if sync else None, sum_group=sum_group, deferred=self._deferred,
                counts_in_norm=counts, host_optimizer=self.config.offload != "none")
        self.buckets: list[FlatBucket] = [built[i] for i in range(len(groups))]
        self._chunk_buckets = [[b for b in self.buckets if b.chunk == c and b.requires_grad]
                               for c in range(len(self.modules))]
        # Shared-gradient sums run in one global order: tp-partial first (by parameter name, the
        # same on every tp rank, unlike bucket indices), then ties by key.
        order = []
        for b, (key, _) in zip(self.buckets, groups):
            if b.sum_group is not None:
                order.append(((1, key[5][1]) if key[5][0] == "tie" else (0, b.slots[0].name), b))
        self._sum_buckets = [b for _, b in sorted(order, key=lambda kb: kb[0])]
        self.units: list[ParamUnit] = []
        self._unit_of_bucket: dict[int, ParamUnit] = {}
        #: Parameter id -> the units that gather it although another owns it (a tied weight
        #: in two chunks' units): its gradient counts towards their end of backward as well, so
        #: none frees it before autograd has accumulated it.
        self._sharers: dict[int, list[ParamUnit]] = {}
        #: ZeRO-3: the units' running order and the prefetch it drives (None: no prefetch).
        self.unit_order = UnitOrder() if stage is ZeroStage.PARAMETERS and self.config.prefetch \
            else None
        if stage is ZeroStage.PARAMETERS:
            roots = {id(m) for m in self.modules}
            for u_index, module in enumerate(self._unit_modules):
                buckets = [b for b, (key, _) in zip(self.buckets, groups) if key[1] == u_index]
                if not buckets:
                    continue
                shares = self._unit_shares.get(u_index, set())
                shared = [b for b in self.buckets
                          if b not in buckets and any(id(p) in shares for p in b.params)]
                early = (lambda: self._inputs_only and not self._weight_pass) \
                    if self.config.split_backward and \
                    hasattr(module, "bind_unit") else None
                shared_grads = sum(1 for b in shared if b.requires_grad
                                   for p in b.params if id(p) in shares)
                unit = ParamUnit(f"unit{u_index}:{type(module).__name__}", module, buckets,
                                 reshard_after_forward=self.config.reshard_after_forward,
                                 is_root=id(module) in roots or getattr(module, "root", False),
                                 on_backward_start=self._note_backward,
                                 order=self.unit_order, shared=shared, free_after_inputs=early,
                                 shared_grads=shared_grads)
                self.units.append(unit)
                for b in buckets:
                    self._unit_of_bucket[b.index] = unit
                for pid in shares:
                    self._sharers.setdefault(pid, []).append(unit)

    # -- deferred values ------------------------------------------------------------------------
    def load(self, name: str, value: torch.Tensor) -> None:
        """Built with ``deferred=True``: write parameter ``name``'s full (local) value into
        what this rank keeps of it (under ZeRO-3 only its shard's part), one at a time."""
        bucket, slot = self._slot_of[name]
        bucket.load(slot, value)

    def full_parameter(self, name: str) -> torch.Tensor | None:
        """Parameter ``name`` whole, from the master weights (collective over the shard group;
        one tensor at a time, unlike :meth:`full_parameters`); None for a name it does not
        hold."""
        if name not in self._slot_of:
            return None
        bucket, slot = self._slot_of[name]
        return bucket.full_slot(slot)

    def unloaded(self) -> list[str]:
        """The parameters :meth:`load` has not written yet."""
        return [b.slots[i].name for b in self.buckets for i, done in enumerate(b.loaded)
                if not done]

    # -- backward hooks -------------------------------------------------------------------------
    def _make_grad_hook(self, bucket: FlatBucket, slot_index: int, units: list[ParamUnit]):
        def hook(param: torch.Tensor) -> None:
            self._note_backward()
            bucket.accumulate(slot_index, param)
            chunk = bucket.chunk
            self._touched.add(chunk)
            if self._sync[chunk]:
                bucket.fired += 1
                if bucket.fired == len(bucket.slots):
                    self._launch_in_order(chunk, all_remaining=False)
            for unit in units:
                unit.on_param_grad()
        return hook

    def _note_backward(self) -> None:
        if self._callback_queued:
            return
        if self._grads_final:
            raise InvalidInputError(
                "a backward started after this step's gradients were finalized",
                expected="zero_grad() between step() (or clip_grad_norm_ / finish_gradient_sync) "
                         "and the next backward",
                found="gradients already reduced and summed for the step",
                fix="call zero_grad() after step()")
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _launch_in_order(self, chunk: int, all_remaining: bool) -> None:
        """Launch the ready buckets of ``chunk`` strictly in bucket order (or all the rest)."""
        buckets = self._chunk_buckets[chunk]
        i = self._next_launch[chunk]
        while i < len(buckets):
            b = buckets[i]
            if not all_remaining and b.fired < len(b.slots):
                break
            b.launch_reduce()
            b.launched = True
            if self.config.zero >= ZeroStage.GRADIENTS:
                # one reduce-scatter in flight: finishing the previous one frees its full
                # gradient buffer while the backward goes on (FSDP frees each unit's likewise)
                if self._in_flight is not None and self._in_flight is not b:
                    self._in_flight.wait_reduce()
                self._in_flight = b
            i += 1
        self._next_launch[chunk] = i

    def _end_of_backward(self) -> None:
        try:
            for chunk in sorted(self._touched):
                if self._sync[chunk]:
                    self._launch_in_order(chunk, all_remaining=True)  # buckets with unused parameters
                    self._unsynced[chunk] = False  # every local gradient is now being reduced
                    self._release_full_gradients(chunk)
                else:
                    self._unsynced[chunk] = True
                self._next_launch[chunk] = 0
                for b in self._chunk_buckets[chunk]:
                    b.fired = 0
                    b.launched = False
            if not self._weight_pass:  # the pass's end frees them (end_weight_gradients)
                for unit in self.units:
                    unit.end_backward()
        finally:
            self._touched = set()
            self._callback_queued = False

    # -- gradient sync --------------------------------------------------------------------------
    def set_requires_gradient_sync(self, sync: bool, chunk: int | None = None) -> None:
        """Reduce gradients in the coming backwards (True) or only accumulate them (False)."""
        chunks = range(len(self.modules)) if chunk is None else [chunk]
        for c in chunks:
            self._sync[c] = bool(sync)

    @contextlib.contextmanager
    def no_sync(self, chunk: int | None = None) -> Iterator[None]:
        """Accumulate gradients locally inside the block (all micro-batches but the last)."""
        before = list(self._sync)
        self.set_requires_gradient_sync(False, chunk)
        try:
            yield
        finally:
            self._sync = before

    def _launch_remaining(self) -> None:
        """Take assigned gradients into their buckets, and launch every reduction the backwards
        left: buckets with local gradients not reduced yet, or never reduced this step."""
        self._sweep_assigned_grads()
        for chunk, buckets in enumerate(self._chunk_buckets):
            for b in buckets:
                if self._unsynced[chunk] or not (b.reduced or b.pending_wait):
                    b.launch_reduce()
            self._unsynced[chunk] = False

    def finish_gradient_sync(self) -> None:
        """Wait for the reductions; reduce what is still local; sum tied / tp-partial gradients."""
        if self._grads_final:
            return
        self._launch_remaining()
        for b in self.buckets:
            if b.requires_grad:
                b.wait_reduce()
        for b in self._sum_buckets:
            if b.requires_grad:
                wait_work(dist.all_reduce(b.reduced_grad(), group=b.sum_group, async_op=True),
                          f"sum of shared gradient bucket {b.index}")
        self._grads_final = True

    # -- a split backward's weight gradients (zero-bubble schedules) ------------------------------
    def begin_backward(self, *, weights: bool) -> None:
        """Before a backward action. ``weights`` False: a split backward's input-gradient pass,
        whose weights' gradients a later weight-gradient pass computes: ZeRO-3 frees each layer
        once the gradients of its inputs exist (that pass gathers it again). True: a whole
        backward (a plain one; or an input-gradient action that computes the weights' gradients
        too, as a stage under full recompute does, runtime/pipeline.py): each layer stays
        gathered until its gradients are accumulated."""
        self._inputs_only = not weights

    def begin_weight_gradients(self, chunk: int | None = None) -> None:
        """Before a weight-gradient pass of a split backward on ``chunk`` (None: every chunk).
        The pass assigns ``.grad`` (``torch.autograd.grad`` on the weights) instead of
        accumulating through autograd, so no hook fires. ZeRO-3 gathers the weights of each
        group the pass computes (:meth:`gather_weights`, the input-gradient pass's end freed
        them) and frees them after (:meth:`release_weights`); :meth:`end_weight_gradients` takes
        what is left."""
        self._weight_pass = True

    def gather_weights(self, params: Sequence[torch.Tensor]) -> None:
        """Inside a weight-gradient pass, before a group of weights: ZeRO-3 gathers the units
        that hold them (nothing to do below ZeRO-3)."""
        for unit in self._units_holding(params):
            unit.gather()

    def release_weights(self, params: Sequence[torch.Tensor], later: set[int]) -> None:
        """Inside a weight-gradient pass, after a group: take the gradients just assigned to
        ``params`` into their buckets; ZeRO-3 frees every unit none of whose parameters the pass
        still reads (``later``: their ids)."""
        for p in params:
            self._take_assigned(p)
        for unit in self._units_holding(params):
            if not any(id(p) in later for b in unit.buckets for p in b.params):
                unit.free()

    def _units_holding(self, params: Sequence[torch.Tensor]) -> list[ParamUnit]:
        units = {id(u): u for p in params for u in self._units_of_param.get(id(p), ())}
        return list(units.values())

    def _take_assigned(self, param: torch.Tensor) -> None:
        """Move ``param``'s assigned ``.grad`` into its bucket. ZeRO-0/1 reduce once per step:
        a reduced bucket takes no more (the sweep at the step names it); ZeRO-2/3 reduce every
        micro-batch and accumulate into the shard."""
        slot = self._slot_of_param.get(id(param))
        if slot is None or param.grad is None:
            return
        b, i = slot
        if b.requires_grad and (b.stage >= ZeroStage.GRADIENTS or
                                not (b.reduced or b.pending_wait)):
            b.accumulate(i, param)
            self._unsynced[b.chunk] = True

    def end_weight_gradients(self, chunk: int | None = None, *, last: bool) -> None:
        """After a weight-gradient pass: move the assigned gradients into the chunk's buckets;
        after the chunk's ``last`` pass of the step (and unless inside :meth:`no_sync`), launch
        their reduction, which then overlaps the passes still to run; ZeRO-3 frees the chunk's
        parameters again."""
        chunks = range(len(self.modules)) if chunk is None else [chunk]
        for b in self.buckets:  # a weight shared with another chunk lives in that one's bucket
            for p in b.params:
                self._take_assigned(p)
        for c in chunks:
            buckets = self._chunk_buckets[c]
            if last and self._sync[c]:
                self._launch_in_order(c, all_remaining=True)
                self._unsynced[c] = False
                self._release_full_gradients(c)
                self._next_launch[c] = 0
                for b in buckets:
                    b.fired = 0
                    b.launched = False
            else:
                self._unsynced[c] = True
        self._weight_pass = False
        for unit in self._units_of(chunk):
            unit.end_backward()

    def _release_full_gradients(self, chunk: int) -> None:
        """ZeRO-2/3 after a synced backward: wait for the chunk's reduce-scatters, whose end
        frees each bucket's full gradient buffer (only the shard stays), so that it does not
        live on into the next micro-batch's forward."""
        if self.config.zero >= ZeroStage.GRADIENTS:
            for b in self._chunk_buckets[chunk]:
                b.wait_reduce()
            self._in_flight = None

    def _units_of(self, chunk: int | None) -> list[ParamUnit]:
        return [u for u in self.units if chunk is None or any(b.chunk == chunk for b in u.buckets)]

    def _sweep_assigned_grads(self) -> None:
        """Gradients set on parameters without going through autograd's accumulation (an
        executor that computes weight gradients with torch.autograd.grad and assigns ``.grad``)
        never fire the hooks; take them into the buckets here rather than reduce zeros."""
        for b in self.buckets:
            if not b.requires_grad:
                continue
            for i, p in enumerate(b.params):
                if p.grad is None:
                    continue
                if b.pending_wait or b.reduced:
                    raise InvalidInputError(
                        f"parameter {b.slots[i].name} got a gradient after its bucket was reduced",
                        expected="gradients accumulated by backward() (or assigned) before the "
                                 "reduction of the step",
                        found="a .grad set outside the backward hooks",
                        fix="assign weight gradients before the last synced backward, or run "
                            "that backward inside no_sync()")
                b.accumulate(i, p)
                self._unsynced[b.chunk] = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient of the whole model (all ranks) to ``max_norm``; return its norm."""
        self.finish_gradient_sync()
        total = self.grad_norm(norm_type)
        coef = clip_coefficient(total, float(max_norm))
        for b in self.buckets:
            if b.requires_grad:
                b.reduced_grad().mul_(coef.to(b.grad_dtype))
        return total

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm (after finish_gradient_sync), each element counted once."""
        self.finish_gradient_sync()
        parts = [b.norm_part() for b in self.buckets if b.requires_grad and b.counts_in_norm]
        return global_grad_norm(parts, norm_type, [self.groups.dp_group, self.mesh.tp_group,
                                                   self.mesh.pp_group])

    # -- step -----------------------------------------------------------------------------------
    def step(self) -> torch.Tensor | None:
        """Finish the sync, clip if configured, update, and refresh the compute parameters.

        On CPU processes, unless clipping or offload needs every gradient first, bucket by
        bucket as each reduction comes in (:meth:`_overlapped_step`; the same numbers, the
        optimizer running while the last reductions are still under way). Returns the gradient
        norm when clipping is configured, else None.
        """
        if self._bucketwise and not self._grads_final:
            self._overlapped_step()
            return None  # no clipping on this path
        self.finish_gradient_sync()
        norm = None
        if self.config.max_grad_norm is not None:
            norm = self.clip_grad_norm_(self.config.max_grad_norm, self.config.norm_type)
        if self.pager is not None:
            self._paged_step(self.pager)
        elif self._host_bucketwise:
            self._host_step()
        else:
            stepped = [b for b in self.buckets if b.requires_grad]
            for b in stepped:  # a host optimizer's copies all launched, then waited for
                b.set_optimizer_grads()
            for b in stepped:
                b.wait_host_grads()
            self.optimizer.step()
            for b in self.buckets:
                if b.requires_grad:
                    b.after_step()
        for b in self.buckets:
            b.wait_gather()
            b.clear_optimizer_grads()
        return norm

    def _steps_per_bucket(self, optimizer: OptimizerFactory) -> bool:
        """Whether :meth:`step` steps bucket by bucket (``DataParallelConfig.step_per_bucket``),
        decided once: with reductions to overlap (more than one bucket, gradients reduced over
        other ranks), an element-wise optimizer (its update of a parameter reads that parameter
        alone, so stepping a subset gives the same numbers), no clipping (it needs the global
        norm of every gradient first) and no offload (its copies are launched for all buckets at
        once). :meth:`step` also steps once after :meth:`finish_gradient_sync` (or clipping
        called by hand) already waited for everything."""
        wanted = self.config.step_per_bucket
        if wanted is None:
            wanted = all(b.device.type == "cpu" for b in self.buckets)
        reduced = self.groups.dp_size > 1 or bool(self._sum_buckets)
        return (wanted and reduced and optimizer.is_elementwise
                and sum(b.requires_grad for b in self.buckets) > 1
                and self.config.max_grad_norm is None and self.config.offload == "none")

    def _overlapped_step(self) -> None:
        """:meth:`finish_gradient_sync` and the step, bucket by bucket: each bucket is stepped
        (its pieces alone hold gradients, so the optimizer updates those alone) as soon as its
        reduction, and its sum over the ranks sharing it, are in, while the later buckets'
        reductions go on. The shared buckets come last, in the order every rank sums them."""
        self._launch_remaining()
        sums = {id(b) for b in self._sum_buckets}
        order = [b for b in self.buckets if b.requires_grad and id(b) not in sums] + \
            [b for b in self._sum_buckets if b.requires_grad]
        for b in order:
            b.wait_reduce()
            if id(b) in sums:
                wait_work(dist.all_reduce(b.reduced_grad(), group=b.sum_group, async_op=True),
                          f"sum of shared gradient bucket {b.index}")
            b.set_optimizer_grads()
            self.optimizer.step()
            b.clear_optimizer_grads()
            b.after_step()
        self._grads_final = True
        for b in self.buckets:
            b.wait_gather()
            b.clear_optimizer_grads()

    def _host_step(self) -> None:
        """An offloaded optimizer's step, bucket by bucket (ZeRO-Offload's pipeline, Ren et al.
        2021): every bucket's gradient copy to the host is launched first, in order; then each
        bucket steps as soon as its own copy has landed (only its pieces have gradients, so an
        element-wise optimizer updates those alone: the numbers of one step) and its updated
        weights start back to the device, so the copies down, the host's steps and the copies
        up overlap one another. Where the device is the host nothing moves."""
        order = [b for b in self.buckets if b.requires_grad]
        for b in order:
            b.launch_host_grads()
        for b in order:
            b.wait_host_grads()
            b.set_optimizer_grads()
            self.optimizer.step()
            b.clear_optimizer_grads()
            b.after_step()

    def _paged_step(self, pager: StatePager) -> None:
        """The step one bucket at a time, its optimizer state read from disk ahead of it and
        written back behind it (runtime/offload.py): only the stepping bucket's pieces have
        gradients, so the optimizer updates those alone. Every bucket's gradient copy to the
        host is launched first (CUDA), as in :meth:`_host_step`."""
        order = [b for b in self.buckets if b.requires_grad]
        for b in order:
            b.launch_host_grads()
        ahead = pager.read_ahead(order[0]) if order else None
        for k, b in enumerate(order):
            pager.install(b, ahead)
            ahead = pager.read_ahead(order[k + 1]) if k + 1 < len(order) else None
            b.set_optimizer_grads()
            b.wait_host_grads()
            self.optimizer.step()
            b.clear_optimizer_grads()
            b.after_step()
            pager.page_out(b)
        pager.wait_writes()

    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.requires_grad:
                b.zero_grad()
        for m in self.modules:
            for p in m.parameters():
                p.grad = None
        self._unsynced = [False] * len(self.modules)
        self._grads_final = False

    # -- inspection -----------------------------------------------------------------------------
    def memory_bytes(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state (master weights included) held."""
        kinds: dict[str, dict] = {"params": {}, "grads": {}, "master": {}}
        for b in self.buckets:
            for kind, storages in b.storages().items():
                kinds[kind].update(storages)
        state = iter_unique_storages(
            t for s in self.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor))
        held = set(kinds["params"]) | set(kinds["grads"]) | set(kinds["master"])
        state = {k: v for k, v in state.items() if k not in held}
        return MemoryReport(params=sum(kinds["params"].values()),
                            grads=sum(kinds["grads"].values()),
                            optimizer=sum(kinds["master"].values()) + sum(state.values()),
                            disk=self.pager.on_disk_bytes() if self.pager is not None else 0)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every local parameter, whole, from the master weights (collective over the shard
        group): for tests and checkpoints."""
        out = {}
        for b in self.buckets:
            flat = b.full_master()
            for slot in b.slots:
                out[slot.name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return out

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_layouts(self) -> dict[str, Any]:
        """How each local parameter is stored when nothing else is said: under its name
        (``pp<p>.tp<t>.<name>`` when the mesh has pp or tp > 1), as a whole tensor.
        :class:`~autopar.parallel_model.ParallelModel` passes the model's FQNs and
        tensor-parallel placements instead, which makes the checkpoint layout-independent."""
        from autopar.runtime.checkpoint import TensorLayout

        prefix = (f"pp{self.mesh.pp_rank}.tp{self.mesh.tp_rank}."
                  if self.mesh.pp * self.mesh.tp > 1 else "")
        return {s.name: TensorLayout(prefix + s.name, tuple(s.shape))
                for b in self.buckets for s in b.slots}

    def save_checkpoint(self, path: str, layouts: Mapping[str, Any] | None = None,
                        sidecar: Mapping[str, Any] | None = None,
                        buffers: Sequence[tuple[Any, torch.Tensor]] = ()) -> None:
        """Save the master weights and optimizer state (collective; between steps) in the format
        of ``runtime/checkpoint.py``: each rank writes the elements it holds, as boxes of the
        full tensors, so :meth:`load_checkpoint` works under another data-parallel size, ZeRO
        stage, hybrid split or bucket size (and, with ``layouts`` naming tensors by model FQN
        and tp placement, under another pp x tp layout)."""
        from autopar.runtime import checkpoint

        info = {"optimizer": {"class": self.optimizer.__class__.__name__}, **(sidecar or {})}
        if self.pager is not None:
            self.pager.page_in_all()
        try:
            checkpoint.save(path, self, layouts or self.checkpoint_layouts(), info, buffers)
        finally:
            if self.pager is not None:
                self.pager.page_out_all()

    def load_checkpoint(self, path: str, layouts: Mapping[str, Any] | None = None,
                        buffers: Sequence[tuple[Any, torch.Tensor]] = ()) -> dict:
        """Load what :meth:`save_checkpoint` wrote (collective; between steps), refresh the
        compute parameters, and return the checkpoint's JSON sidecar (``"absent_buffers"``:
        those of ``buffers`` it does not hold)."""
        from autopar.runtime import checkpoint

        sidecar = checkpoint.read_sidecar(path)
        saved = sidecar.get("optimizer", {}).get("class")
        if saved and saved != self.optimizer.__class__.__name__ and (
                sidecar["optimizer_state"]["elementwise"] or sidecar["optimizer_state"]["scalar"]):
            raise PlanMismatchError("the checkpoint holds another optimizer's state",
                                    expected=f"{self.optimizer.__class__.__name__} state",
                                    found=f"{saved} state",
                                    fix=f"train with {saved}, or load the weights alone with "
                                        f"load_state_dict")
        if self.pager is not None:
            self.pager.page_in_all()
        try:
            sidecar = {**sidecar, "absent_buffers": checkpoint.load(
                path, self, layouts or self.checkpoint_layouts(), sidecar, buffers)}
        finally:
            if self.pager is not None:
                self.pager.page_out_all()
        return sidecar

    def remove(self, gather: bool = True) -> None:
        """Remove the hooks; ZeRO-3 parameters are left gathered (full) in the modules, unless
        ``gather=False`` (nothing will use the modules again: a large model's parameters are
        never whole on one rank)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for unit in self.units:
            if gather:
                unit.gather()
            else:  # a prefetch in flight is waited for: it writes into storage about to go
                unit.free()
            unit.remove()
        self.units = []

    def close(self, gather: bool = True) -> None:
        """Remove the hooks (see :meth:`remove`) and close the offload pager. The process
        groups stay for the process's next model of this layout (runtime/groups.py)."""
        self.remove(gather)
        if self.pager is not None:
            self.pager.close()

    def __repr__(self) -> str:
        return (f"DataParallel(zero={int(self.config.zero)}, buckets={len(self.buckets)}, "
                f"shard={self.groups.shard_size}x{self.groups.replicate_size}, "
                f"mp={self.config.mixed_precision})")
