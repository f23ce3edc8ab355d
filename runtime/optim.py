"""Optimizers, mixed precision and global gradient-norm clipping for the data-parallel layer.

Three pieces the ZeRO engine (``runtime/data_parallel.py``) is built from:

- :class:`OptimizerFactory`: any ``torch.optim`` class plus its keyword arguments, and an optional
  per-parameter override of the group options (no weight decay on biases and norms); or, with
  :meth:`OptimizerFactory.from_callable`, any callable that builds an optimizer from parameters
  (a lambda, a function, a ``functools.partial``), whose parameter groups are read once on
  stand-ins of the model's parameters and kept by name. The engine calls it with the tensors
  this rank updates: whole parameters under ZeRO-0, flat 1-D pieces of parameters under
  ZeRO-1/2/3. A flat piece is only correct for an *element-wise* update rule
  (Adam, SGD, ...), so the factory says whether its optimizer is one; Adafactor, Muon or LBFGS
  look at a whole matrix and are refused under sharding instead of silently computing something
  else.
- :class:`MixedPrecision`: bf16 (or fp16) compute copies of the parameters, fp32 master weights
  that the optimizer updates, and the dtype gradients are accumulated and reduced in. It runs on
  CPU as well as GPU: nothing here needs a GPU kernel.
- :func:`global_grad_norm`: the norm of the gradient of the *whole* model when every rank holds
  a different part of it. Each rank contributes the gradient elements it alone is responsible for
  (a tensor-parallel-replicated parameter only on tp rank 0, a tied parameter only on the first
  rank of its group, a ZeRO shard only on its owner), so one sum over the mesh counts every
  element of the model exactly once.

This module imports only torch and the leaf vocabulary (``autopar.errors``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.errors import InvalidInputError
from autopar.plan_types import OptimizerKernel, OptimizerProfile, OptimizerStep

__all__ = ["OptimizerFactory", "OptimizerCallableError", "MixedPrecision", "ELEMENTWISE_OPTIMIZERS", "global_grad_norm",
           "clip_coefficient"]

#: torch optimizers whose update of an element depends only on that element's gradient and state
#: (scalars such as the step count aside): they give the same result on a flat shard of a
#: parameter as on the whole parameter, which ZeRO-1/2/3 relies on.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.ASGD,
)

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _StepTraffic(TorchDispatchMode):
    """Counts what an optimizer step moves: every ATen call on tensors of a parameter's
    ``numel`` (the probe's own tensors: its weight, gradient and states; scalar state such as a
    step count left out) reads each such argument (but an ``out=`` and the destination of
    ``copy_`` / ``fill_`` / ``zero_``) and writes each it mutates (its schema's ``!``
    annotation) and each fresh output. torch's fused kernels declare their gradients mutable
    (they unscale them in place under a grad scaler); without a ``grad_scale`` they only read
    them.

    It also follows the step's temporaries: each fresh output of a parameter's ``numel`` (in
    storage no argument holds) is alive from its call until Python drops it (a weak reference's
    finalizer), and ``peak`` is the most bytes of them alive at once: torch's for-loop AdamW
    holds ``exp_avg_sq.sqrt()`` and its quotient by the bias correction together, its foreach
    path ``_foreach_sqrt`` of every moment at once."""

    _OVERWRITES = frozenset({"copy_", "fill_", "zero_"})

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.bytes = 0
        self.calls = 0
        self.live = 0
        self.peak = 0

    def _release(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        scaled = kwargs.get("grad_scale") is not None
        moved = 0
        inputs = set()
        storages = set()
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write and not (
                name.startswith("_fused_") and arg.name == "grads" and not scaled)
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    inputs.add(id(t))
                    storages.add(t.untyped_storage().data_ptr())
                    if t.numel() == self.numel:
                        size = t.numel() * t.element_size()
                        read = not written or not (arg.name == "out" or (
                            arg.name == "self" and name in self._OVERWRITES))
                        moved += size * (read + written)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and id(t) not in inputs:
                size = t.numel() * t.element_size()
                moved += size
                if t.untyped_storage().data_ptr() not in storages:
                    self.live += size
                    weakref.finalize(t, self._release, size)
        self.peak = max(self.peak, self.live)
        if moved:
            self.bytes += moved
            self.calls += 1
        return out


class OptimizerCallableError(InvalidInputError):
    """An optimizer callable that does not build an optimizer over the parameters it is given."""


@dataclass(frozen=True, slots=True)
class OptimizerFactory:
    """How to build the optimizer: ``OptimizerFactory(torch.optim.AdamW, {"lr": 3e-4})``.

    ``group_options(name)`` returns option overrides for the parameter called ``name`` (its name
    in the wrapped module), e.g. ``{"weight_decay": 0.0}`` for biases; parameters with equal
    overrides share a param group. ``elementwise`` says whether the update rule is element-wise
    (None: known for the torch optimizers in :data:`ELEMENTWISE_OPTIMIZERS`, False otherwise).
    """

    optimizer_class: type[torch.optim.Optimizer]
    options: Mapping[str, Any] = field(default_factory=dict)
    group_options: Callable[[str], Mapping[str, Any]] | None = None
    elementwise: bool | None = None
    #: The user's callable (``params -> Optimizer``) when built by :meth:`from_callable`: it
    #: builds the optimizer, whose groups are then re-made from ``group_options``.
    make: Callable[[Any], torch.optim.Optimizer] | None = None
    #: The kernel a callable's optimizer was built with (its ``fused`` / ``foreach`` defaults);
    #: None: read from ``options``.
    built_kernel: OptimizerKernel | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.optimizer_class, type)
                and issubclass(self.optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                             f"{self.optimizer_class!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping of keyword arguments, got "
                             f"{type(self.options).__name__}")
        if self.optimizer_class is torch.optim.LBFGS:
            raise ValueError("LBFGS needs a closure that re-evaluates the model; it cannot be "
                             "driven by a training step. Pick a first-order optimizer")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def from_callable(cls, make: Callable[[Any], torch.optim.Optimizer],
                      named_parameters: Sequence[tuple[str, torch.Tensor]]) -> "OptimizerFactory":
        """A factory from any callable taking the parameters (a list of tensors) and returning a
        ``torch.optim.Optimizer``: ``lambda params: torch.optim.AdamW(params, lr=3e-4)``, a
        function that splits them into groups (``p.ndim < 2``: no weight decay), a
        ``functools.partial``.

        The callable is called once here on meta stand-ins of ``named_parameters`` (the
        model's own, same names, shapes and order; no memory): that gives the optimizer's class
        (whether it may run on ZeRO shards) and, per parameter name, the options of its group
        that differ from the optimizer's defaults. On a rank, :meth:`build` calls it on the
        rank's tensors and re-makes the groups by name, so a split made on whole parameters
        survives tensor-parallel shards and ZeRO's flat pieces. Raises
        :class:`OptimizerCallableError` when it does not return an optimizer over exactly the
        parameters it was given."""
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        stand_ins = [torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
                     for _, p in named]
        what = getattr(make, "__name__", None) or type(make).__name__
        # some options refuse meta tensors (fused kernels): then try the parameters themselves
        attempts = [stand_ins] + ([[p for _, p in named]]
                                  if not any(p.is_meta for _, p in named) else [])
        for k, params in enumerate(attempts):
            try:
                probe = make(params)
                stand_ins = params
                break
            except Exception as exc:  # noqa: BLE001 - the user's code: say what failed
                if k == len(attempts) - 1:
                    raise OptimizerCallableError(
                        f"the optimizer callable {what} failed on the model's parameters",
                        expected="a callable taking a list of parameters and returning a "
                                 "torch.optim.Optimizer", found=f"{type(exc).__name__}: {exc}",
                        fix="call it yourself on list(model.parameters()) to see the error"
                    ) from exc
        if not isinstance(probe, torch.optim.Optimizer):
            raise OptimizerCallableError(
                f"the optimizer callable {what} did not return an optimizer",
                expected="a torch.optim.Optimizer", found=type(probe).__name__,
                fix="return the optimizer, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)")
        name_of = {id(t): n for (n, _), t in zip(named, stand_ins)}
        overrides: dict[str, dict[str, Any]] = {}
        foreign = 0
        for group in probe.param_groups:
            options = {k: v for k, v in group.items()
                       if k != "params" and not _same(v, probe.defaults.get(k, _MISSING))}
            for t in group["params"]:
                if id(t) in name_of:
                    overrides[name_of[id(t)]] = options
                else:
                    foreign += 1
        left_out = [n for n, _ in named if n not in overrides]
        if foreign or left_out:
            raise OptimizerCallableError(
                f"the optimizer callable {what} does not build its optimizer over the parameters "
                f"it is given",
                expected="every parameter it is passed, and no other tensor",
                found=(f"{foreign} tensors it was not given" if foreign else
                       f"{len(left_out)} parameters left out, e.g. {left_out[:3]}"),
                fix="build the optimizer from the callable's argument (not from the model you "
                    "closed over); freeze a parameter with requires_grad_(False) instead of "
                    "leaving it out")
        table = dict(overrides)
        return cls(type(probe), {}, group_options=lambda name: table.get(name, {}), make=make,
                   built_kernel=OptimizerKernel.of_options(probe.defaults))

    @classmethod
    def of(cls, optimizer: Any, named_parameters: Iterable[tuple[str, torch.Tensor]]
           ) -> "OptimizerFactory":
        """``optimizer=`` of ``parallelize`` or ``plan`` as a factory: a factory as it is; a
        torch optimizer class, or a ``functools.partial`` of one, by class and options; any
        other callable (a lambda, a function, a partial of a function) read once on stand-ins
        of ``named_parameters`` (:meth:`from_callable`)."""
        if isinstance(optimizer, OptimizerFactory):
            return optimizer
        if isinstance(optimizer, functools.partial) and isinstance(optimizer.func, type) and \
                issubclass(optimizer.func, torch.optim.Optimizer) and not optimizer.args:
            return cls(optimizer.func, dict(optimizer.keywords))
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            return cls(optimizer, {})
        if isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInputError("optimizer is an optimizer already built over the original "
                                    "model's parameters",
                                    expected="how to build one: a class, functools.partial(cls, "
                                             "lr=...), or a callable taking the parameters",
                                    found=f"a {type(optimizer).__name__} instance",
                                    fix="pass lambda params: torch.optim.AdamW(params, lr=...): "
                                        "each rank builds it over the shards it updates")
        if callable(optimizer):
            return cls.from_callable(optimizer, list(named_parameters))
        raise InvalidInputError("optimizer has an unexpected form",
                                expected="a torch optimizer class, functools.partial(torch.optim."
                                         "AdamW, lr=...), or a callable taking the parameters "
                                         "and returning a torch.optim.Optimizer",
                                found=repr(optimizer)[:80],
                                fix="optimizer=functools.partial(torch.optim.AdamW, lr=3e-4)")

    def renamed(self, fqn_of: Mapping[str, str]) -> "OptimizerFactory":
        """This factory with ``group_options`` asked by the names in ``fqn_of``'s values for
        the engine's local names (its keys): the engine names a stage's parameters by graph
        attribute, the user's rules speak of the model's parameter names."""
        if self.group_options is None:
            return self
        inner = self.group_options
        return dataclasses.replace(self, group_options=lambda name: inner(fqn_of.get(name, name)))

    @property
    def kernel(self) -> OptimizerKernel | None:
        """How the step runs: the ``fused`` / ``foreach`` the optimizer is given; None: torch's
        default for the device (foreach on a GPU, the for-loop on a CPU). What the cost model
        prices (OptimizerProfile.kernel)."""
        return self.built_kernel or OptimizerKernel.of_options(self.options)

    def _probe(self, tensors: int = 1, foreach: bool = False
               ) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer] | None:
        """The optimizer built over ``tensors`` 64 x 64 fp32 parameters (the dtype of the master
        weights it steps) and stepped once; with ``foreach`` a group that leaves its kernel to
        torch (``foreach=None``) set to the foreach path torch takes on a GPU. None where it
        cannot step a CPU tensor (a kernel only for GPUs)."""
        probes = [torch.nn.Parameter(torch.zeros(64, 64)) for _ in range(tensors)]
        for probe in probes:
            probe.grad = torch.full_like(probe, 1e-3)
        try:
            optimizer = (self.make(probes) if self.make is not None
                         else self.optimizer_class(probes, **self.options))
            if foreach:
                for group in optimizer.param_groups:
                    if "foreach" in group and group["foreach"] is None \
                            and not group.get("fused"):
                        group["foreach"] = True
            optimizer.step()
        except Exception:  # noqa: BLE001 - a GPU-only kernel
            return None
        return probes, optimizer

    def state_bytes_per_param(self) -> float:
        """Bytes of state the optimizer keeps per parameter element, measured: built over a
        probe and stepped once (:meth:`_probe`), its per-parameter state tensors counted
        (scalar state, such as Adam's step count, left out): AdamW 8 (its two moments), with
        ``amsgrad`` 12, SGD with momentum 4, plain SGD 0, Adagrad 4; a factored optimizer
        (Adafactor) its rows and columns over the probe's 4096 elements. What the cost model
        prices (OptimizerProfile.state_bytes). An optimizer that cannot step a CPU
        tensor is counted as Adam's 8."""
        built = self._probe()
        if built is None:
            return 8.0
        (probe,), optimizer = built
        held = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 1)
        return held / probe.numel()

    def step_cost(self, gpu: bool = False) -> OptimizerStep | None:
        """What one step moves, runs and allocates, counted on the probe's second step (the
        first builds the state: SGD clones its momentum there) under a dispatch mode that sees
        every ATen call (:class:`_StepTraffic`): bytes read and written per parameter element,
        calls per parameter tensor: torch's for-loop AdamW 84 bytes and 8 calls, foreach the
        same, fused 28 and 1; SGD with momentum 32 and 3, fused 20; plain SGD 12 and 1; Adagrad
        48 and 4. The probe runs on a CPU with the optimizer's own options; ``gpu``: a kernel
        left to torch is counted on the foreach path it takes on a GPU (on a CPU, the for-loop;
        the same bytes, batched).

        Its temporaries, from the peaks of live fresh tensors over two probe tensors and over
        three (n elements each): what grows with the tensors stepped, ``peak_3 - peak_2`` per n
        (foreach AdamW's ``_foreach_sqrt`` of every moment at once: 4 bytes an element), and
        what a step holds whatever their number, ``peak_3 - 3 (peak_3 - peak_2)`` per n of the
        largest tensor (the for-loop's square root and quotient of one tensor, 8 bytes an
        element, while the previous tensor's 4-byte ``denom`` is still bound: 12). SGD and the
        fused kernels hold none. None where the optimizer cannot step a CPU tensor (the cost
        model then prices AdamW's)."""
        counted = []
        for tensors in (1, 2, 3):
            built = self._probe(tensors, foreach=gpu)
            if built is None:
                return None
            probes, optimizer = built
            with _StepTraffic(probes[0].numel()) as traffic:
                optimizer.step()
            counted.append(traffic)
        one, two, three = counted
        n = 64 * 64
        grows = max(three.peak - two.peak, 0) / n
        return OptimizerStep(one.bytes / n, float(one.calls), temporary_bytes=grows,
                             tensor_temporary_bytes=max(three.peak / n - 3 * grows, 0.0))

    def profile(self, gpu: bool = False) -> OptimizerProfile:
        """What the planner prices of this optimizer: its kernel, its state per parameter
        (:meth:`state_bytes_per_param`), its step (:meth:`step_cost`, on the path a GPU takes
        with ``gpu``) and whether its update is element-wise."""
        return OptimizerProfile(self.kernel, self.state_bytes_per_param(), self.step_cost(gpu),
                                self.is_elementwise)

    @property
    def is_elementwise(self) -> bool:
        if self.elementwise is not None:
            return self.elementwise
        return self.optimizer_class in ELEMENTWISE_OPTIMIZERS

    def build(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        """The optimizer over ``named_tensors``, grouped by ``group_options``."""
        groups: dict[tuple, dict[str, Any]] = {}
        for name, tensor in named_tensors:
            overrides = dict(self.group_options(name)) if self.group_options else {}
            key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
            group = groups.setdefault(key, {"params": [], **overrides})
            group["params"].append(tensor)
        if not groups:  # a rank that updates nothing (all its shards are padding) still steps
            groups[()] = {"params": []}
        param_groups = list(groups.values())
        if self.make is not None:
            return self._build_with_callable(param_groups)
        try:
            return self.optimizer_class(param_groups, **self.options)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(
                f"could not build {self.optimizer_class.__name__}",
                expected="keyword arguments the optimizer accepts",
                found=f"{self.options} ({exc})",
                fix="check the option names against the optimizer's signature") from exc


    def _build_with_callable(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        assert self.make is not None
        tensors = [t for g in param_groups for t in g["params"]]
        optimizer = self.make(tensors if tensors else [{"params": []}])
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerCallableError("the optimizer callable did not return an optimizer",
                                         expected="a torch.optim.Optimizer",
                                         found=type(optimizer).__name__)
        # the callable's own split saw shards (flat pieces under ZeRO): make the groups again
        # from the options it gave each parameter by name (add_param_group fills the rest from
        # the optimizer's defaults)
        optimizer.param_groups.clear()
        for group in param_groups:
            optimizer.add_param_group(group)
        return optimizer


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values differ
        return False


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """Compute in ``param_dtype``, update fp32 master weights, reduce gradients in ``grad_dtype``.

    ``grad_dtype=torch.float32`` (the default) accumulates micro-batch gradients and reduces them
    across data-parallel ranks in fp32: 4 bytes per parameter of gradient instead of 2, in exchange
    for sums that do not lose low bits. ``grad_dtype=torch.bfloat16`` gives the 16 bytes per
    parameter of the standard mixed-precision Adam accounting.
    """

    param_dtype: torch.dtype = torch.bfloat16
    grad_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "grad_dtype"):
            value = getattr(self, name)
            if value not in _FLOAT_DTYPES:
                raise ValueError(f"{name} must be a floating dtype (one of {_FLOAT_DTYPES}), "
                                 f"got {value!r}")

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by (at most 1)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def global_grad_norm(local_parts: Iterable[torch.Tensor], norm_type: float,
                     groups: Sequence[dist.ProcessGroup | None]) -> torch.Tensor:
    """The ``norm_type`` norm of the gradient spread over ``groups``.

    ``local_parts`` are the gradient elements this rank is responsible for (each element of the
    model must be in exactly one rank's parts); the partial sums of ``|g|^p`` (or the maxima, for
    the infinity norm) are reduced over each group in turn, which reduces over the mesh they span.
    Computed in fp32 whatever the gradient dtype. Returns an fp32 scalar tensor, equal on every
    rank of the groups.
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise InvalidInputError("bad gradient norm type", expected="a positive p or inf",
                                found=repr(norm_type), fix="use 2.0 (the usual) or math.inf")
    parts = [p for p in local_parts if p.numel()]
    device = parts[0].device if parts else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for p in parts:
            local = torch.maximum(local, p.detach().abs().max().float())
        op = dist.ReduceOp.MAX
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for p in parts:
            local += torch.linalg.vector_norm(p.detach(), norm_type, dtype=torch.float32) ** norm_type
        op = dist.ReduceOp.SUM
    local = local.reshape(1)
    from autopar.runtime.comm import wait_work

    for group in groups:
        if group is not None:
            wait_work(dist.all_reduce(local, op=op, group=group, async_op=True),
                      "all-reduce of the gradient norm")
    total = local[0]
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)
