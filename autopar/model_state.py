"""A rank's model state in and out: full tensors, Hugging Face checkpoints, sharded checkpoints.

:class:`ModelState` is the half of :class:`autopar.parallel_model.ParallelModel` that moves
state across the ranks; the other half runs the step. Every method here is collective (each rank
calls it alike) and works from what the rank holds:

- :meth:`~ModelState.state_dict` / :meth:`~ModelState.save_pretrained`: each parameter gathered
  over its ZeRO shard group (``DataParallel.full_parameter``), over the tensor-parallel group
  where the plan splits it (``sharding.unshard_tensors``; a padded vocabulary cut back to the
  model's), and broadcast from the pipeline rank holding it, one tensor at a time, so a rank
  never holds more than one full tensor beyond its own shards;
- :meth:`~ModelState.load_state_dict`: full tensors in, this rank's shards kept
  (``RankProgram.shards``), the data-parallel engine rebuilt around them;
- :meth:`~ModelState.save` / :meth:`~ModelState.load`: ``torch.distributed.checkpoint`` through
  ``runtime/checkpoint.py``, each rank writing and reading only its elements under the original
  names and shapes, so a checkpoint loads under any other plan; the model's fingerprint and
  tensor table travel beside it and are checked on load.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import CheckpointError, InvalidInputError, PlanMismatchError
from autopar.runtime.comm import agree_on_success, announce_failure, collective
from autopar.sharding import unshard_tensors

if TYPE_CHECKING:
    from autopar.compiler import RankProgram
    from autopar.plan_types import Plan

__all__ = ["ModelState"]


class ModelState:
    """State I/O of a rank's model (mixed into ``ParallelModel``, whose constructor sets the
    attributes below)."""

    program: "RankProgram"
    plan: "Plan"
    mesh: Any
    device: torch.device
    captured: Any
    split: Any
    tp_program: Any
    executor: Any
    data_parallel: Any
    running_stats: Any
    training: Any
    steps: int
    _dp_name: dict[str, str]

    def _build_data_parallel(self, deferred: bool = False) -> Any:
        raise NotImplementedError  # ParallelModel's

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original model's keys (tied names included), on every rank.

        Collective. Parameters come from the data-parallel master weights (whole even under
        ZeRO-3), are gathered over the tensor-parallel group and broadcast from the pipeline rank
        that holds them.
        """
        out: dict[str, torch.Tensor] = {}
        aliases = {p.fqn: p.aliases for p in self.captured.params.values()}
        for fqn, full in self._full_parameters():
            out[fqn] = full
            for alias in aliases[fqn]:
                out[alias] = full
        for fqn, full in self._full_buffers():
            out[fqn] = full
        return out

    def _persistent_buffers(self) -> list[tuple[str, Any]]:
        """(FQN, spec) of the buffers a state dict holds: those the model's own ``state_dict``
        lists (persistent) and some stage reads, in FQN order."""
        model = self.captured.model
        read = {fqn for stage in self.split.stages for fqn in stage.buffers}
        persistent = set(model.state_dict().keys()) if model is not None else read
        return sorted((b.fqn, b.spec) for b in self.captured.buffers.values()
                      if b.fqn in persistent and b.fqn in read)

    def _full_buffers(self):
        """(FQN, full tensor on the CPU) of every persistent buffer, one at a time (collective):
        from the first pipeline rank reading it, gathered over the tensor-parallel group where
        the plan splits it (a bias added to vocabulary-split logits)."""
        layouts = {p.fqn: p for p in self.program.staged.sharded.layouts}
        for fqn, spec in self._persistent_buffers():
            owner = self.executor.stage_to_rank[next(
                k for k, stage in enumerate(self.split.stages) if fqn in stage.buffers)]
            local = self.executor.buffers[fqn].detach() if self.mesh.pp_rank == owner else None
            yield fqn, self._assemble(fqn, local, owner, spec, layouts.get(fqn))

    def _full_parameters(self):
        """(FQN, full tensor on the CPU) of every parameter, one at a time, in FQN order
        (collective: every rank iterates alike)."""
        dp = self.data_parallel
        params = self.executor.params
        layouts = {p.fqn: p for p in self.tp_program.layouts}
        for fqn, pinfo in sorted((p.fqn, p) for p in self.captured.params.values()):
            owner = self._owner_pp_rank(fqn)
            shard = None
            if self.mesh.pp_rank == owner:  # gathered over the shard group alone (ZeRO)
                name = self._dp_name[fqn]
                shard = dp.full_parameter(name)
                if shard is None:
                    shard = params[fqn].detach()
                shard = shard.to(pinfo.spec.dtype)
                if fqn in self.program.experts and self.plan.ep > 1:  # every rank's experts
                    shard = shard.contiguous()
                    pieces = [torch.empty_like(shard) for _ in range(self.plan.ep)]
                    collective(dist.all_gather, pieces, shard, group=self.mesh.ep_group,
                               what=f"the expert-parallel gather of {fqn}")
                    shard = torch.cat(pieces)
            yield fqn, self._assemble(fqn, shard, owner, pinfo.spec, layouts[fqn])

    def _assemble(self, fqn: str, local: torch.Tensor | None, owner: int, spec: Any,
                  layout: Any) -> torch.Tensor:
        """The full tensor ``fqn`` on the CPU at the model's shape (a padded vocabulary cut
        back), from ``local`` (this rank's piece on pipeline rank ``owner``, None elsewhere):
        gathered over the tensor-parallel group where the piece is a shard, then broadcast from
        ``owner`` (collective over tp and pp)."""
        full_shape = tuple(int(d) for d in spec.shape)
        if layout is not None:
            full_shape = layout.model_shape
        if local is not None:
            local = local.contiguous()
            if self.plan.tp > 1 and layout is not None \
                    and tuple(local.shape) != tuple(layout.full_shape):
                pieces = [torch.empty_like(local) for _ in range(self.plan.tp)]
                collective(dist.all_gather, pieces, local, group=self.mesh.tp_group,
                           what=f"the tensor-parallel gather of {fqn}")
                local = unshard_tensors(pieces, layout.placement)
            full = layout.to_model(local).contiguous() if layout is not None else local
        else:
            full = torch.empty(full_shape, dtype=spec.dtype, device=self.device)
        if self.plan.pp > 1:
            collective(dist.broadcast, full, src=self.mesh.stage_rank(owner),
                       group=self.mesh.pp_group, what=f"the pipeline broadcast of {fqn}")
        return full.cpu()

    def save_pretrained(self, path: str, *, max_shard_size: int | str = "5GB") -> None:
        """Write a Hugging Face safetensors checkpoint of the current weights to the directory
        ``path`` (collective; rank 0 writes): the names transformers' ``save_pretrained`` writes
        (a tied weight once, under the name its ties keep; the names it renames or converts on
        save, ``autopar/hf_names.py``) and full shapes at the stored dtype, persistent
        buffers included, ``model.safetensors`` or shard files of at most ``max_shard_size``
        plus ``model.safetensors.index.json``, and the model's ``config.json`` for transformers
        models, so ``from_pretrained(path)`` loads it. Each tensor is gathered and written on
        its own; the files go to a hidden directory renamed onto ``path`` at the end, so a
        crash leaves nothing at ``path``. ``path`` must not exist or be empty."""
        from autopar.hf_names import saved_layout, saved_name, saved_tensors
        from autopar.runtime.hf_checkpoint import SafetensorsWriter, parse_size

        model = self.captured.model
        # under the names transformers' save_pretrained writes (autopar/hf_names.py): a tied
        # weight under the name its ties keep, renamed and converted as transformers saves
        named = {p.fqn: saved_name(model, (p.fqn, *sorted(p.aliases)))
                 for p in self.captured.params.values()}
        params = sorted((p.fqn, p.spec) for p in self.captured.params.values())
        buffers = self._persistent_buffers()
        named.update((fqn, fqn) for fqn, _ in buffers)
        layout = saved_layout(model, [(named[fqn], tuple(int(d) for d in spec.shape), spec.dtype)
                                      for fqn, spec in params + buffers])
        order = [entry for _, saved in layout for entry in saved]
        writer, problem = None, None
        what = "a safetensors checkpoint"
        if dist.get_rank() == 0:
            try:
                writer = SafetensorsWriter(path, order, parse_size(max_shard_size))
            except OSError as exc:
                problem = CheckpointError.unwritable(path, exc, what)
                problem.__cause__ = exc
            except InvalidInputError as exc:  # a non-empty directory
                problem = exc
        # every rank raises rank 0's refusal, none waits in the gathers below for it
        agree_on_success(problem, "opening the checkpoint directory")
        try:
            for fqn, full in itertools.chain(self._full_parameters(), self._full_buffers()):
                if writer is not None:
                    for name, value in saved_tensors(model, named[fqn], full).items():
                        writer.write(name, value)
            if writer is not None:
                config = getattr(self.captured.model, "config", None)
                writer.commit(config.save_pretrained if hasattr(config, "save_pretrained")
                              else None)
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            announce_failure(exc)  # the disk filled up on rank 0: the others wait in a gather
            if isinstance(exc, OSError):
                raise CheckpointError.unwritable(path, exc, what) from exc
            raise
        collective(dist.barrier, what="the end of save_pretrained")

    def load_state_dict(self, state: Mapping[str, torch.Tensor] | nn.Module) -> None:
        """Replace the parameters with ``state`` (full tensors, original keys, or a model).

        Collective. The optimizer state is reset (use :meth:`load` to restore a checkpoint with
        it: parameters, optimizer state and step count)."""
        if isinstance(state, nn.Module):
            state = self.tp_program.full_tensors(state)
        shards = self.program.shards(state)
        missing = sorted(set(self.executor.params) - set(shards))
        if missing:
            raise InvalidInputError(f"the state dict has no {missing[0]!r}"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                                    expected="every parameter of the model")
        # Undo the old engine first (it owns the parameters' storage: flat buckets, bf16 views
        # under mixed precision, ZeRO-3 shards), then give the parameters their new values at the
        # stored dtype, so the new engine's fp32 master weights are exact.
        self.data_parallel.close(gather=False)  # every parameter gets its new value below
        self.data_parallel = None
        stored = {p.fqn: p.spec.dtype for p in self.captured.params.values()}
        with torch.no_grad():
            for fqn, p in self.executor.params.items():
                p.data = shards[fqn].to(device=p.device, dtype=stored.get(fqn, p.dtype)).clone()
        self.data_parallel = self._build_data_parallel()

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Save a sharded checkpoint to the directory ``path`` (collective; between steps).

        Every rank writes only the elements it holds (torch.distributed.checkpoint), keyed by the
        original model's parameter names in their full shapes: fp32 master weights, every
        optimizer state tensor, the step count, the plan and the model fingerprint (JSON). A
        ``COMPLETE`` marker is written last, so an interrupted save is never loaded. The
        checkpoint loads under any other plan and world size: see ``runtime/checkpoint.py``.
        """
        self.data_parallel.save_checkpoint(path, self._checkpoint_layouts(),
                                           sidecar=self._checkpoint_sidecar(),
                                           buffers=self._checkpoint_buffers())

    def load(self, path: str, *, strict: bool = True) -> None:
        """Restore what :meth:`save` wrote, under this model's plan (collective; between steps).

        Each rank reads only what its own layout needs. Raises :class:`InvalidInputError` when
        ``path`` is not a complete checkpoint, :class:`PlanMismatchError` when it is one of
        another model (parameter names or shapes differ; with ``strict``, also when the model's
        graph fingerprint differs while names and shapes agree)."""
        from autopar.runtime import checkpoint

        sidecar = checkpoint.read_sidecar(path)
        self._check_checkpoint_model(sidecar, path, strict)
        loaded = self.data_parallel.load_checkpoint(path, self._checkpoint_layouts(),
                                                    buffers=self._checkpoint_buffers())
        if loaded.get("absent_buffers"):
            warnings.warn(f"the checkpoint at {path} holds no running statistics (saved before "
                          f"autopar kept them): {', '.join(loaded['absent_buffers'][:3])} keep "
                          f"their present values", stacklevel=2)
        self.steps = int(sidecar.get("steps", 0))

    def load_latest(self, root: str) -> int | None:
        """Load the newest complete checkpoint under ``root`` (``root/step-<N>``, as
        ``save(autopar.runtime.checkpoint.step_dir(root, pm.steps))`` writes them) and return
        its step count; None (nothing loaded) when there is none. Collective: rank 0 picks the
        checkpoint, so every rank loads the same one."""
        from autopar.runtime import checkpoint

        found = checkpoint.latest_step(root) if dist.get_rank() == 0 else None
        step = torch.tensor([-1 if found is None else found], dtype=torch.int64,
                            device=self.device)
        dist.broadcast(step, src=0)
        if int(step.item()) < 0:
            return None
        self.load(checkpoint.complete_step_dir(root, int(step.item())))
        return self.steps

    def model_fingerprint(self) -> str:
        """A hash of the model alone (its parameter table and its graph's structure, devices and
        layout-only ops ignored, as in plans: a model built on meta matches the real one), the
        same under every plan: what a checkpoint is checked against."""
        h = hashlib.sha256(json.dumps(self._tensor_table(), sort_keys=True).encode())
        h.update(self.captured.fingerprint().encode())
        return h.hexdigest()[:16]

    def _tensor_table(self) -> dict[str, dict[str, Any]]:
        return {p.fqn: {"shape": [int(d) for d in p.spec.shape],
                        "dtype": str(p.spec.dtype).removeprefix("torch."),
                        "aliases": sorted(p.aliases)}
                for p in self.captured.params.values()}

    def _checkpoint_layouts(self) -> dict[str, Any]:
        """This rank's parameters as the checkpoint stores them: DataParallel name -> the FQN,
        full shape and tensor-parallel placement, and whether this copy is the one written."""
        from autopar.runtime.checkpoint import TensorLayout
        from autopar.sharding import Replicate, Shard

        layouts = {p.fqn: p for p in self.tp_program.layouts}
        out = {}
        for fqn, name in self._dp_name.items():
            layout = layouts[fqn]
            replicated = isinstance(layout.placement, Replicate)
            writes = self.mesh.pp_rank == self._owner_pp_rank(fqn) and (
                not replicated or self.mesh.tp_rank == 0)
            if fqn in self.program.experts and self.plan.ep > 1:
                # whole over tp, split over the experts: a shard along dim 0 over the ep ranks
                out[name] = TensorLayout(fqn, tuple(layout.full_shape), Shard(0), self.plan.ep,
                                         self.mesh.ep_rank, writes)
                continue
            out[name] = TensorLayout(fqn, tuple(layout.full_shape), layout.placement,
                                     self.plan.tp, self.mesh.tp_rank, writes,
                                     tuple(layout.model_shape))
        return out

    def _checkpoint_buffers(self) -> list[tuple[Any, torch.Tensor]]:
        """The running statistics this rank holds (BatchNorm's; runtime/running_stats.py) as
        the checkpoint stores them: whole tensors, written by the first replica (every replica
        holds the same after a step)."""
        from autopar.runtime.checkpoint import TensorLayout
        from autopar.sharding import Replicate

        layouts = {p.fqn: p for p in self.program.staged.sharded.layouts}
        specs = {b.fqn: b.spec for b in self.captured.buffers.values()}
        first_replica = self.mesh.replica_rank == 0
        out = []
        for stat in self.running_stats.stats:
            tensor = self.executor.buffers[stat.fqn]
            layout = layouts.get(stat.fqn)
            placement = layout.placement if layout is not None else Replicate()
            full = tuple(layout.full_shape) if layout is not None else \
                tuple(int(d) for d in specs[stat.fqn].shape)
            writes = first_replica and (not isinstance(placement, Replicate)
                                        or self.mesh.tp_rank == 0)
            out.append((TensorLayout(stat.fqn, full, placement, self.plan.tp, self.mesh.tp_rank,
                                     writes), tensor))
        return out

    def _checkpoint_sidecar(self) -> dict[str, Any]:
        from autopar import __version__

        options = {k: v for k, v in self.training.optimizer.options.items()
                   if isinstance(v, (int, float, bool, str, list, tuple))}
        return {"steps": self.steps, "model_fingerprint": self.model_fingerprint(),
                "tensors": self._tensor_table(), "plan": self.plan.to_json(),
                "world_size": self.plan.world_size,
                "mixed_precision": self.training.mixed_precision,
                "optimizer": {"class": self.data_parallel.optimizer.__class__.__name__,
                              "options": options},
                "autopar_version": __version__, "torch_version": torch.__version__}

    def _check_checkpoint_model(self, sidecar: Mapping[str, Any], path: str, strict: bool) -> None:
        saved, mine = sidecar.get("tensors", {}), self._tensor_table()
        missing = sorted(set(mine) - set(saved))
        extra = sorted(set(saved) - set(mine))
        reshaped = [f"{k} {tuple(saved[k]['shape'])} in the checkpoint, {tuple(mine[k]['shape'])} "
                    f"here" for k in sorted(set(saved) & set(mine))
                    if saved[k]["shape"] != mine[k]["shape"]]
        if missing or extra or reshaped:
            parts = []
            if missing:
                parts.append(f"parameters not in the checkpoint: {missing[:5]}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
            if extra:
                parts.append(f"checkpoint tensors this model lacks: {extra[:5]}"
                             + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
            if reshaped:
                parts.append("shapes differ: " + "; ".join(reshaped[:5]))
            raise PlanMismatchError(f"the checkpoint at {path} is of another model",
                                    expected=f"the {len(mine)} parameters of this model",
                                    found="; ".join(parts),
                                    fix="load a checkpoint saved from this model")
        fingerprint = self.model_fingerprint()
        if strict and sidecar.get("model_fingerprint") != fingerprint:
            raise PlanMismatchError(f"the checkpoint at {path} was saved from another model graph",
                                    expected=f"model fingerprint {fingerprint}",
                                    found=f"{sidecar.get('model_fingerprint')} (same parameter "
                                          f"names and shapes)",
                                    fix="load(path, strict=False) to take its weights anyway")

    def _owner_pp_rank(self, fqn: str) -> int:
        stages = self.split.param_stages.get(fqn)
        if not stages:
            raise PlanMismatchError(f"parameter {fqn} is read by no stage")
        return self.executor.stage_to_rank[stages[0]]
