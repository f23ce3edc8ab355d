"""``autopar.parallelize``: from an ordinary model to the program every rank runs.

Called on every rank of a job (``torchrun`` / ``autopar run``; a single process works too)::

    pm = autopar.parallelize(model, example_inputs=(tokens,), example_targets=(targets,),
                             loss_fn=loss_fn, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                             plan="auto")            # or a Plan, or pins: {"tp": 2, "pp": 2, ...}
    loss = pm.train_step(tokens, targets)             # the global batch; the same loss everywhere

Steps: start the process group if needed (NCCL with CUDA, gloo otherwise; a timeout on every
group); check the pins; give every rank rank 0's weights (or, with ``checkpoint=``, check the
checkpoint against the model); capture the model with its loss; rank 0
decides the plan (the search over the cost model, or the pins, or the given Plan or plan file,
whose model fingerprint must match) and sends it to the others as JSON, or its error, which every
rank then raises with the same class and message (:mod:`autopar.agreement`); every rank compiles its program
(:mod:`autopar.compiler`) and instantiates it with its shards, sliced from the model's weights or
read from the checkpoint (:class:`autopar.parallel_model.ParallelModel`); the ranks check they
built the same program; with
``verify=True`` one micro-batch is checked against the original model, layer by layer.

Every collective here and in the runtime waits through :mod:`autopar.runtime.comm` with the
job's timeout (``timeout_s``, else ``AUTOPAR_TIMEOUT_S``, else 300 s): a stuck or dead peer
makes every rank raise :class:`~autopar.errors.CommunicationTimeoutError`, never hang.
"""

from __future__ import annotations

import functools
import gc
import os
import tempfile
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.agreement import PINNABLE, agree_on_plan, agree_on_success, plan_argument
from autopar.compiler import Planned, compile_program
from autopar.errors import (
    InvalidInputError,
    PlanMismatchError,
)
from autopar.ir import SEQ
from autopar.plan_types import Plan
from autopar.parallel_model import ParallelModel, TrainingOptions
from autopar.runtime.comm import (announce_failure, broadcast_object, check_world, collective,
                                  new_failure_scope, rank_device, set_activity,
                                  set_default_timeout)
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.optim import OptimizerFactory

__all__ = ["parallelize", "PINNABLE"]


def _announced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose failure on this rank is announced to its peers before it propagates
    (runtime/comm.announce_failure): a rank that fails alone anywhere in ``parallelize`` (its
    capture, a cluster file only it cannot read, its program, its mesh) stops the peers waiting
    for it in a collective within about a second, naming its error, instead of at their
    timeout. Every rank announces an error all of them raise; the first is the one named."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            announce_failure(exc)
            raise

    return call


@_announced
def parallelize(model: nn.Module, cluster: Any = None, *, example_inputs: Any, loss_fn: Callable,
                optimizer: Any, plan: Plan | Mapping[str, Any] | str | os.PathLike = "auto",
                example_targets: Any = (), global_batch: int | None = None,
                max_grad_norm: float | None = None, mixed_precision: bool = False,
                bucket_mb: float = 25.0, timeout_s: float | None = None, tp_cost: Any = None,
                seq: int | None = None, seed: int | None = None, verify: bool = False,
                verify_tolerance: float | None = None,
                checkpoint: str | os.PathLike | None = None,
                init: Callable[[nn.Module], None] | None = None,
                offload_dir: str | os.PathLike | None = None,
                compile: bool | str = False) -> ParallelModel:
    """Parallelize ``model`` for this job; call on every rank. See the module docstring.

    Args:
        model: an ordinary single-device module with real weights (every rank builds it; rank
            0's weights are used), or one on the meta device (built under ``with
            torch.device("meta"):``), initialized by ``init`` or loaded from ``checkpoint``: no
            rank ever holds its full weights.
        cluster: a :class:`autopar.Cluster`, a preset name or file, or None for this job's world
            (the ``cpu`` preset for gloo processes).
        example_inputs / example_targets: one batch of the model's inputs and the loss targets;
            their batch size is the global batch unless ``global_batch`` is given.
        loss_fn: ``loss_fn(model(*inputs), *targets) -> scalar``, traced with the model.
        optimizer: how each rank builds its optimizer over the tensors it updates: a torch
            optimizer class, ``functools.partial(torch.optim.AdamW, lr=...)``, any callable
            taking the parameters and returning a ``torch.optim.Optimizer`` (``lambda params:
            AdamW(params, lr=...)``, or a function splitting them into groups, e.g. no weight
            decay where ``p.ndim < 2``: the groups are read by parameter name and kept under
            every plan), or an :class:`autopar.runtime.optim.OptimizerFactory`.
        plan: ``"auto"`` (search), a dict of pins (see :data:`PINNABLE`), a :class:`Plan`, or
            the path of a plan file (``Plan.save``'s JSON/YAML or ``autopar plan --out``'s
            document). A plan made for another model (its ``model_fingerprint``) or another
            autopar version is refused (PlanMismatchError). ``zero_shard_size=k`` (with
            zero >= 1) shards ZeRO state over groups of k data-parallel ranks and replicates
            across them (hybrid sharding; k = the data-parallel ranks of one node).
        max_grad_norm: clip the global gradient norm (over all ranks) to this value.
        mixed_precision: bf16 compute with fp32 master weights and fp32 gradient reduction;
            pipeline stages exchange activations and their gradients in bf16.
        timeout_s: the deadline of every collective and transfer (default AUTOPAR_TIMEOUT_S or
            300 s); a peer that does not answer in time makes every rank raise
            CommunicationTimeoutError naming itself and the collective.
        tp_cost: hardware numbers for the tensor-parallel sharding search (TPCostSpec; default:
            the cluster's, as the planner prices plans, so a plan without per-GEMM choices gets
            the layout its prediction assumed).
        seed: the dropout seed (default: rank 0's ``torch.initial_seed()``); masks depend on the
            seed, the step and the sample, never on the plan.
        verify: check one micro-batch of the example batch against the original model, layer by
            layer (:meth:`ParallelModel.verify`): VerificationError beyond the tolerance.
        verify_tolerance: the largest relative difference per layer accepted by ``verify``
            (default 1e-4, or 5e-2 with mixed precision).
        checkpoint: a Hugging Face safetensors directory (``save_pretrained``'s
            ``model.safetensors``, or shards and ``model.safetensors.index.json``) to take the
            weights from: each rank reads only the slices it holds. Or a directory
            ``ParallelModel.save`` wrote (a ``torch.distributed.checkpoint`` with autopar's
            sidecar, saved under any plan and world size): parameters, optimizer state and step
            count are restored, as :meth:`ParallelModel.load` does. Checked against the model
            (names, tied names, shapes, dtypes) on every rank before anything else runs.
            Buffers the checkpoint does not hold come from the model, computed by its
            ``_init_weights`` when they are on the meta device (transformers models).
        init: how a model on the meta device without ``checkpoint`` is initialized: a function
            applied to every module as ``model.apply(init)`` would (children first); default
            the model's own: transformers' ``init_weights`` for transformers models, otherwise
            each module's ``reset_parameters``. It draws from rank 0's CPU random state as of
            this call, so every shard holds what the same model initialized on one device from
            that state would hold there, on every plan (see :mod:`autopar.runtime.meta_init`).
        offload_dir: where a plan with ``offload="disk"`` keeps the optimizer state (each rank
            in a folder of its own, removed by ``close``); checked writable before any training
            (OffloadError). A plan pinned to ``offload="disk"`` needs it.
        compile: run each stage's graph through ``torch.compile`` (True: the inductor backend,
            which fuses the element-wise work between GEMMs; a string: that backend). Compiles on
            the first step (and again for inference). Under ZeRO-3 (per-layer gathers) and
            full recompute (per-block checkpoints) each captured layer is compiled on its own,
            with the gathers and checkpoints around it. Not with the zero-bubble schedules
            (InvalidPlanError): their backward is split into input and weight gradients.
    """
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise InvalidInputError("timeout_s must be a positive number of seconds",
                                found=repr(timeout_s))
    _init_distributed(timeout_s)
    set_default_timeout(timeout_s)  # None: AUTOPAR_TIMEOUT_S or 300 s
    # every rank calls parallelize alike: a failure announced before (by the last model's
    # ranks) is not this one's, and nothing this rank did before is what it does now
    new_failure_scope()
    set_activity("")
    check_world()  # a collective a failed peer left unfinished would pair with this model's
    world = dist.get_world_size()
    plan = plan_argument(plan, world)  # bad pins fail here, on every rank, before any work
    device = rank_device()
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    if verify and on_meta:
        raise InvalidInputError("verify=True compares with the original model, which lives on "
                                "the meta device", fix="verify with a model that fits one process")
    if init is not None and (checkpoint is not None or not on_meta):
        raise InvalidInputError("init= initializes a model built on the meta device",
                                expected="a meta-device model and no checkpoint=",
                                found="a checkpoint=" if checkpoint is not None else
                                      "a model with real weights",
                                fix="drop init=, or build the model under "
                                    "`with torch.device('meta'):`")
    if init is not None and not callable(init):
        raise InvalidInputError("init= must be a function taking a module",
                                found=type(init).__name__, fix="pass e.g. init=model._init")
    source = None
    init_rng = None
    resume = _autopar_checkpoint(checkpoint)
    if resume is not None:  # pm.save's directory: parameters, optimizer state and step
        pass
    elif checkpoint is not None:  # every rank reads the same headers: the same error everywhere
        from autopar.hf_names import checkpoint_keys
        from autopar.runtime.hf_checkpoint import SafetensorsCheckpoint

        # under the model's names, or under those transformers renames or converts on load
        source = SafetensorsCheckpoint(checkpoint, functools.partial(checkpoint_keys, model))
        entries, other_names = _checkpoint_entries(model)
        source.check(entries, other_names=other_names)
    elif on_meta:  # initialized from rank 0's random state as of now, on every rank
        init_rng = _rank0_rng_state()

    if loss_fn is None:
        raise InvalidInputError("parallelize needs a loss", fix="pass loss_fn=...")
    cl = _resolve_cluster(cluster, world, device)  # a bad cluster file fails before the capture
    pinned_offload = plan.offload if isinstance(plan, Plan) else \
        plan.get("offload") if isinstance(plan, dict) else None
    if pinned_offload == "disk" and offload_dir is None:
        raise InvalidInputError("offload='disk' keeps the optimizer state in files",
                                expected="parallelize(..., offload_dir=<a writable directory>)",
                                found="no offload_dir", fix="pass offload_dir, or pin "
                                                            "offload='optimizer' or 'none'")
    training = TrainingOptions(OptimizerFactory.of(optimizer, model.named_parameters()),
                               max_grad_norm=max_grad_norm,
                               mixed_precision=mixed_precision, bucket_mb=bucket_mb,
                               offload_dir=os.fspath(offload_dir) if offload_dir else None,
                               compile_backend=_compile_backend(compile))
    if source is None:  # with a checkpoint every rank reads the same weights
        _broadcast_model(model)
    captured = _capture(model, example_inputs, loss_fn, example_targets, mixed_precision)
    global_batch = global_batch or _batch_size(example_inputs)
    # the length the capture made symbolic; else the first token-like input's (as it marks them)
    seq = seq or captured.example_sizes.get(SEQ) or _seq_len(example_inputs)
    _check_planned_length(captured, seq)
    # the search offloads only where memory requires it; to disk only with a directory
    planned = agree_on_plan(plan, captured, cl, world, global_batch, seq, mixed_precision, seed,
                            offload_choices=("optimizer", "disk") if offload_dir is not None
                            else ("optimizer",),
                            # priced as it runs, its state as it keeps it, its step as it
                            # steps (what it moves, calls and holds, counted on probes)
                            optimizer=training.optimizer.profile(gpu=cl.gpu))
    if planned.plan.offload == "disk" and offload_dir is None:  # a Plan (file) given whole
        raise InvalidInputError("the plan keeps the optimizer state on disk",
                                expected="parallelize(..., offload_dir=<a writable directory>)",
                                found="no offload_dir", fix="pass offload_dir")
    # Each rank compiles its own program, makes its own shards and checks its own offload
    # directory, without collectives: a rank that fails there (an op its stage cannot shard, no
    # memory for its weights, a disk it cannot write) tells the others before the mesh's
    # collectives, which it would never join
    failure: Exception | None = None
    try:
        planned = _at_micro_batch(planned, model, example_inputs, example_targets, loss_fn,
                                  mixed_precision)
        chosen = planned.plan
        if tp_cost is None:  # the numbers the planner priced the plan with: the same layout
            from autopar.planner.tp_layout import tp_cost_spec

            tp_cost = tp_cost_spec(cl, "bf16" if mixed_precision else "fp32")
        program = compile_program(planned, dist.get_rank(), cost=tp_cost, device=device,
                                  sizes={"b": chosen.micro_batch_size,
                                         "s": max(1, seq // chosen.cp)})  # as planned
        # the capture and the compile leave cyclic garbage (fx graphs, fake tensors): free it
        # before this rank allocates its weights, so loading a large model does not peak on it
        gc.collect()
        if source is not None:
            shards = program.read_shards(source, functools.partial(_buffer_value, model))
        elif resume is not None and on_meta:  # the parameters come from the checkpoint below
            shards = program.blank_shards(functools.partial(_buffer_value, model))
        elif init_rng is not None:  # the random state ends where one device's init leaves it
            shards = program.init_shards(model, init, rng_state=init_rng)
        else:
            shards = program.shards(program.staged.sharded.full_tensors(model))
        if chosen.offload == "disk" and offload_dir is not None:  # (None refused above)
            from autopar.runtime.offload import state_directory

            state_directory(offload_dir, dist.get_rank(), keep=False)  # this rank's disk
    except Exception as exc:  # noqa: BLE001 - every rank must learn that this one failed
        failure = exc
    agree_on_success(failure, "building its program and shards")
    # collective from here: a rank that fails announces it (_announced, runtime/comm.py)
    mesh = ParallelMesh(chosen.dp, chosen.pp, chosen.tp, cp=chosen.cp, ep=chosen.ep,
                        cp_innermost=chosen.cp_innermost,
                        timeout=timedelta(seconds=timeout_s) if timeout_s else None,
                        device_type=device.type)
    pm = program.instantiate(mesh, training, shards=shards)
    if resume is not None:  # each rank reads only the blocks its layout needs
        pm.load(resume)
    _check_agreement(pm)
    if verify:
        pm.verify(example_inputs, example_targets, tolerance=verify_tolerance)
    return pm


# ---------------------------------------------------------------------------------------------
# Process group, devices, model
# ---------------------------------------------------------------------------------------------

def _compile_backend(compile: bool | str) -> str | None:
    """``parallelize(compile=...)`` as a torch.compile backend name (None: not compiled)."""
    if compile is True:
        return "inductor"
    if compile is False:
        return None
    if isinstance(compile, str):
        return compile
    raise InvalidInputError("compile must be a bool or a torch.compile backend name",
                            found=repr(compile), fix="compile=True (inductor) or compile=False")


def _init_distributed(timeout_s: float | None) -> None:
    if dist.is_initialized():
        return
    from autopar.runtime.mesh import default_timeout

    timeout = timedelta(seconds=timeout_s) if timeout_s else default_timeout()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # a plain single process: a world of one
        store = os.path.join(tempfile.mkdtemp(prefix="autopar-"), "rendezvous")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timeout)


def _broadcast_model(model: nn.Module) -> None:
    """Every rank starts from rank 0's weights (a model built unseeded differs per rank)."""
    if dist.get_world_size() == 1:
        return
    seen: set[int] = set()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in seen or t.is_meta:  # a meta tensor's values come from init= or a file
                continue
            seen.add(id(t))
            what = "the broadcast of rank 0's weights"
            if dist.get_backend() == "nccl":
                moved = t.detach().cuda()
                collective(dist.broadcast, moved, src=0, what=what)
                t.copy_(moved.to(t.device))
            else:
                collective(dist.broadcast, t.data, src=0, what=what)


def _rank0_rng_state() -> torch.Tensor:
    """Rank 0's CPU random state (every rank initializes a meta model from it)."""
    return broadcast_object(torch.get_rng_state() if dist.get_rank() == 0 else None, 0,
                            "the broadcast of rank 0's random state")


def _autopar_checkpoint(path: str | os.PathLike | None) -> str | None:
    """``path`` when it is a directory :meth:`ParallelModel.save` wrote (its sidecar names
    it), else None."""
    from autopar.runtime.checkpoint import SIDECAR

    if path is None or not os.path.isfile(os.path.join(path, SIDECAR)):
        return None
    return os.fspath(path)


def _checkpoint_entries(model: nn.Module) -> tuple[list[Any], list[str]]:
    """What a checkpoint of ``model`` holds: every parameter (under each of its tied names) and
    every persistent buffer (required only when it is on the meta device); and the names of the
    non-persistent buffers (no checkpoint holds them)."""
    from autopar.runtime.hf_checkpoint import TensorEntry

    persistent = set(model.state_dict().keys())
    groups: dict[int, tuple[torch.Tensor, list[str], bool]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, [], True))[1].append(name)
    other = []
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            groups.setdefault(id(b), (b, [], b.is_meta))[1].append(name)
        else:
            other.append(name)
    entries = [TensorEntry(names[0], tuple(names), tuple(t.shape), t.dtype, required)
               for t, names, required in groups.values()]
    return entries, other


def _buffer_value(model: nn.Module, fqn: str) -> torch.Tensor:
    """The value of buffer ``fqn``: the model's, or, on the meta device, what the model's own
    ``_init_weights`` (transformers) computes for a materialized copy of its module."""
    import copy

    buf = model.get_buffer(fqn)
    if not buf.is_meta:
        return buf.detach()
    owner_name, _, attr = fqn.rpartition(".")
    init_weights = getattr(model, "_init_weights", None)
    if init_weights is not None:
        owner = copy.deepcopy(model.get_submodule(owner_name))
        owner.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            init_weights(owner)
        value = getattr(owner, attr)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            return value.detach()
    raise InvalidInputError(f"buffer {fqn} lives on the meta device and the checkpoint does not "
                            f"hold it", expected="a buffer with a value",
                            found="a meta tensor and no _init_weights that computes it",
                            fix="register the buffer on a real device when the model is built, "
                                "or save it in the checkpoint")


def _capture(model: nn.Module, example_inputs: Any, loss_fn: Callable, example_targets: Any,
             mixed_precision: bool) -> Any:
    """Capture the model as it will compute. Under mixed precision its floating parameters are
    cast to the compute dtype for the trace (and restored after): torch.export records every
    dtype, so ``.to(x.dtype)``, ``.to(device)`` (a cast to the traced dtype) or a rotary table
    cast to the activations' dtype would otherwise stay fp32 casts in a bf16 run, and the
    tensors crossing pipeline stages would be recorded as fp32. Buffers keep their dtype, as
    the data-parallel layer leaves them. The parameters' specs then get their stored dtype back
    (fp32: master weights, state dicts and checkpoints hold that). Floating fp32 inputs (images,
    embeddings) are cast to the compute dtype, as FSDP's ``cast_forward_inputs`` casts them and
    as torch.autocast's first GEMM or convolution would: a convolution of fp32 pixels by bf16
    weights fails; each step casts them likewise (``ParallelModel._prepare``)."""
    import dataclasses

    from autopar.frontend import capture
    from autopar.ir import NodeKind, TensorSpec, info
    from autopar.runtime.optim import MixedPrecision

    if not mixed_precision:
        return capture(model, example_inputs, loss_fn, example_targets=example_targets)
    if loss_fn is not None:
        loss_fn = _fp32_loss(loss_fn)
    compute = MixedPrecision().param_dtype
    example_inputs = compute_inputs(example_inputs, compute)
    stored = {}
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and id(p) not in stored:
                stored[id(p)] = (p, p.data)
                p.data = p.data.to(compute)
    try:
        captured = capture(model, example_inputs, loss_fn, example_targets=example_targets)
    finally:
        for p, data in stored.values():
            p.data = data
    dtypes = {fqn: t.dtype for fqn, t in model.named_parameters(remove_duplicate=False)}
    for key, pinfo in list(captured.params.items()):
        dtype = dtypes.get(pinfo.fqn, pinfo.spec.dtype)
        if pinfo.spec.dtype != dtype:
            spec = TensorSpec(pinfo.spec.shape, dtype)
            captured.params[key] = dataclasses.replace(pinfo, spec=spec)
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder" and info(node).kind is NodeKind.PARAMETER:
            value = info(node).value
            dtype = dtypes.get(info(node).fqn)
            if isinstance(value, TensorSpec) and dtype is not None and value.dtype != dtype:
                info(node).value = TensorSpec(value.shape, dtype)
    return captured


def compute_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    """``inputs`` (a tensor, tuple or dict) with their fp32 tensors cast to ``dtype``."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                           and t.dtype == torch.float32 else t, inputs)


def _check_planned_length(captured: Any, seq: int) -> None:
    """A plan for a sequence the captured graph was not traced for (``parallelize(seq=...)``
    outside ``CapturedGraph.size_ranges``) would price steps that are refused: say so now."""
    span = captured.size_ranges.get(SEQ)
    if span is None or span[0] <= seq and (span[1] is None or seq <= span[1]):
        return
    raise InvalidInputError(
        f"seq={seq} lies outside the sequence lengths {type(captured.model).__name__} was "
        f"captured for", expected=captured.size_range(SEQ), found=f"seq={seq}",
        fix="plan for a length in that range, or parallelize with example inputs of the "
            "length you train at (torch.export proved the graph for the range around it)")


def _fp32_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` on the model's floating outputs cast to fp32: under mixed precision the loss
    (softmax and cross-entropy over the vocabulary) is computed in fp32, as torch.autocast and
    Megatron-LM compute it; in bf16 a loss near 6.24 reads 6.25 (8 bits of mantissa)."""
    import torch.utils._pytree as pytree

    def upcast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
            return t.float()
        return t

    @functools.wraps(loss_fn)
    def fp32_loss(outputs: Any, *targets: Any) -> torch.Tensor:
        return loss_fn(pytree.tree_map(upcast, outputs), *targets)

    return fp32_loss


def _at_micro_batch(planned: Planned, model: nn.Module, example_inputs: Any,
                    example_targets: Any, loss_fn: Callable, mixed_precision: bool) -> Planned:
    """A graph captured with a static batch (the symbolic attempt failed) computes only at that
    batch, and stages run micro-batches: capture it again at the plan's micro-batch size, from
    the example batch's first rows. Nothing to do when the batch is symbolic."""
    import dataclasses

    from autopar.ir import BATCH

    captured, mbs = planned.captured, planned.plan.micro_batch_size
    if BATCH in captured.example_sizes:
        return planned
    batch = _batch_size(example_inputs)
    if batch == mbs:
        return planned
    if batch < mbs:
        raise InvalidInputError(
            f"{type(model).__name__} was captured with a static batch of {batch}, smaller than "
            f"the plan's micro-batch", expected=f"example inputs of at least {mbs} rows",
            found=f"{batch} rows", fix="pass the whole global batch as example inputs")

    def rows(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[:mbs] if value.dim() and value.shape[0] == batch else value
        if isinstance(value, Mapping):
            return {k: rows(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(rows(v) for v in value)
        return value

    again = _capture(model, rows(example_inputs), loss_fn, rows(example_targets),
                     mixed_precision)
    if len(again.layers) != len(captured.layers):
        raise PlanMismatchError(
            f"{type(model).__name__} captured at the micro-batch has other layers than at the "
            f"example batch", expected=f"{len(captured.layers)} layers",
            found=f"{len(again.layers)} layers at batch {mbs}",
            fix="make the model's layers independent of the batch size, or pin "
                "num_micro_batches=1")
    return dataclasses.replace(planned, captured=again)


def _batch_size(inputs: Any) -> int:
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else [t for t in (
        inputs.values() if isinstance(inputs, Mapping) else inputs) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise InvalidInputError("example_inputs need a batch dimension",
                                expected="tensors of shape [batch, ...]")
    return int(tensors[0].shape[0])


def _seq_len(inputs: Any) -> int:
    """Dim 1 of the first input holding a sequence (token ids, rank 2 and above; embeddings,
    rank 3), as the capture marks them; 1 for inputs without one (images)."""
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else [t for t in (
        inputs.values() if isinstance(inputs, Mapping) else inputs) if isinstance(t, torch.Tensor)]
    for t in tensors:
        if (t.dim() >= 2 and not t.is_floating_point()) or (t.dim() == 3 and t.is_floating_point()):
            return int(t.shape[1])
    return 1


def _resolve_cluster(cluster: Any, world: int, device: torch.device) -> Any:
    from autopar.cluster import Cluster

    if isinstance(cluster, Cluster):
        base = cluster
    elif isinstance(cluster, str):
        base = Cluster.load(cluster)
    elif cluster is None:
        base = Cluster.load(_preset_for(device))
    else:
        raise InvalidInputError("cluster has an unexpected type",
                                expected="an autopar.Cluster, a preset name or file, or None",
                                found=type(cluster).__name__)
    if base.num_devices == world:
        return base
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return base.with_devices(world, devices_per_node=min(per_node, world))


def _preset_for(device: torch.device) -> str:
    from autopar.cluster import preset_for_device

    return preset_for_device("cpu" if device.type != "cuda" else torch.cuda.get_device_name(device))


# ---------------------------------------------------------------------------------------------
# The plan: decided on rank 0, sent as JSON, checked
# ---------------------------------------------------------------------------------------------

def _check_agreement(pm: Any) -> None:
    """Every rank must have built from the same plan and graph; a mismatch would hang or give
    wrong numbers later, so it is an error now."""
    mine = int(pm.fingerprint(), 16) & ((1 << 62) - 1)
    gathered = [torch.zeros(1, dtype=torch.int64, device=pm.device)
                for _ in range(dist.get_world_size())]
    collective(dist.all_gather, gathered,
               torch.tensor([mine], dtype=torch.int64, device=pm.device),
               what="the all-gather of every rank's program fingerprint")
    values = [int(t.item()) for t in gathered]
    if len(set(values)) > 1:
        bad = [r for r, v in enumerate(values) if v != values[0]]
        raise PlanMismatchError("ranks built different programs",
                                expected="the same plan and graph on every rank",
                                found=f"rank(s) {bad} differ from rank 0",
                                fix="build the same model with the same example inputs on every rank")
