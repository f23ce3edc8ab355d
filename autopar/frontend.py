"""Capture: an ``nn.Module`` (plus its loss) into an annotated ATen-level fx graph.

``capture(model, example_inputs, loss_fn, example_targets=...)`` traces ``loss_fn(model(*inputs),
*targets)`` (or the model alone) with ``torch.export`` in non-strict mode, with the batch and
sequence dimensions of the inputs marked dynamic, so shapes come out as expressions in ``b`` and
``s``. A batch of one is traced as two copies of it (export would fix a size-1 dim to 1). Models
built on the meta device are traced without allocating weights (GPT-3 175B captures in seconds).
When export cannot take the model, capture retries with static shapes, and then
falls back to ``torch.fx.symbolic_trace`` with node-by-node lowering (see ``_fx_fallback``).

The result, :class:`CapturedGraph`, owns a lifted graph module: parameters, buffers and constants
are placeholders, each node carries a :class:`autopar.ir.NodeInfo`, and the graph is split into
:class:`autopar.ir.Layer` s (repeated blocks detected by structure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.fx
import torch.nn as nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind

from autopar.captured import (
    MODEL_ATTR,
    CapturedGraph,
    CaptureMethod,
    ParamInfo,
    plan_fingerprint,
    strip_model_prefix,
)
from autopar.errors import InvalidInputError, UntraceableModelError
from autopar.layers import find_layers
from autopar.moe import experts_as_operations, moe_error
from autopar.ir import (
    BATCH,
    SEQ,
    META_KEY,
    NodeInfo,
    NodeKind,
    info,
    iter_tensor_specs,
    op_name,
    spec_from_value,
)

__all__ = ["capture", "CapturedGraph", "CaptureMethod", "ParamInfo", "plan_fingerprint",
           "TracedStep"]

log = logging.getLogger(__name__)

class TracedStep(nn.Module):
    """``loss_fn(model(*inputs), *targets)`` as one module, so export traces both together."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, num_inputs: int,
                 input_kwargs: Sequence[str] = ()) -> None:
        super().__init__()
        setattr(self, MODEL_ATTR, model)
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.input_kwargs = tuple(input_kwargs)

    def forward(self, *args: Any) -> Any:
        inputs, targets = args[: self.num_inputs], args[self.num_inputs:]
        positional = inputs[: len(inputs) - len(self.input_kwargs)]
        keyword = dict(zip(self.input_kwargs, inputs[len(positional):]))
        outputs = getattr(self, MODEL_ATTR)(*positional, **keyword)
        if self.loss_fn is None:
            return outputs
        return self.loss_fn(outputs, *targets)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------

def capture(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor,
    loss_fn: Callable | None = None,
    *,
    example_targets: Sequence[Any] | torch.Tensor = (),
    batch_dims: Mapping[int, int] | None = None,
    seq_dims: Mapping[int, int] | None = None,
    dynamic: bool = True,
) -> CapturedGraph:
    """Trace ``model`` (and ``loss_fn``) into a :class:`CapturedGraph`.

    Args:
        model: an ordinary single-device module; it may live on the meta device.
        example_inputs: positional inputs (a tuple, or a dict of keyword inputs).
        loss_fn: ``loss_fn(outputs, *targets) -> scalar``; traced with the model.
        example_targets: the targets passed to ``loss_fn``.
        batch_dims / seq_dims: which dim of input i is the batch / sequence dim. By default
            dim 0 of every tensor is the batch and dim 1 of every rank >= 2 integer tensor (token
            ids, labels, masks) or rank-3 float tensor (embeddings) is the sequence; images
            (rank 4) have no sequence dim. A marked dim the graph fixes to its size (export
            reports the constraint violated) is traced at that size instead. Inputs with
            several sequence lengths (encoder and decoder): the first input's length is
            symbolic, the others are traced at theirs.
        dynamic: mark batch and sequence symbolic (the default); False traces static shapes.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError("capture takes an nn.Module", expected="torch.nn.Module",
                                found=type(model).__name__)
    synced = [name for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced:
        raise InvalidInputError(
            "SyncBatchNorm is not supported", expected="nn.BatchNorm1d/2d/3d",
            found=f"{len(synced)} SyncBatchNorm modules ({synced[0]}, ...)",
            fix="keep the model's BatchNorms (before nn.SyncBatchNorm.convert_sync_batchnorm): "
                "autopar normalizes each micro-batch by its own rows, as DDP with BatchNorm, "
                "and combines their running statistics over the replicas into one process's "
                "(docs/models.md)")
    inputs, kwarg_names = _as_tuple(example_inputs, "example_inputs")
    targets, _ = _as_tuple(example_targets, "example_targets")
    if targets and loss_fn is None:
        raise InvalidInputError("example_targets were given without a loss_fn",
                                fix="pass loss_fn=..., or drop example_targets")
    args = inputs + targets
    if not any(isinstance(a, torch.Tensor) for a in args):
        raise InvalidInputError("no tensor among the example inputs",
                                expected="at least one torch.Tensor input",
                                found=str([type(a).__name__ for a in args]))
    # Trace from contiguous copies: a strided view (tokens[:, :-1]) makes export guard on its
    # stride and specialize the sequence length.
    device = "meta" if _model_on_meta(model) else None
    args = tuple(a.to(device).contiguous() if device and isinstance(a, torch.Tensor)
                 else a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    args = _distinct(args)

    step = TracedStep(model, loss_fn, len(inputs), kwarg_names)
    dims = _default_dims(args, batch_dims, seq_dims)
    errors: list[str] = []
    captured = None
    with _quiet_export(), _no_kv_cache(model), experts_as_operations(model):
        attempts = _dynamic_attempts(args, dims) if dynamic else []
        fixed: list[str] = []  # dims we marked that the graph specializes to their size
        for traced, marked, single in attempts:
            while marked:
                try:
                    ep, sizes = _export_dynamic(step, traced, marked)
                    captured = _from_export(ep, CaptureMethod.EXPORT, sizes, marked)
                    if single:
                        captured.example_sizes[BATCH] = 1
                    break
                except Exception as exc:  # noqa: BLE001 - every export failure leads to a retry
                    what = "batch of one traced as two" if single else "dynamic batch/seq"
                    violated = _violated_dims(exc, marked)
                    if not violated:
                        errors.append(f"torch.export with {what}: {_short(exc)}")
                        break
                    # the graph shows the dim is not a batch or sequence dim (an image's
                    # channels, a fixed number of positions): trace it at its size
                    fixed.extend(f"{kind} (input {i}, dim {d}, size {traced[i].shape[d]})"
                                 for i, d, kind in violated)
                    marked = {i: {d: k for d, k in ds.items() if (i, d, k) not in violated}
                              for i, ds in marked.items()}
                    marked = {i: ds for i, ds in marked.items() if ds}
            if captured is not None:
                break
        if captured is None:
            try:
                ep = torch.export.export(step, args, strict=False)
                captured = _from_export(ep, CaptureMethod.EXPORT_STATIC, {})
            except Exception as exc:  # noqa: BLE001
                errors.append(f"torch.export with static shapes: {_short(exc)}")
                moe = moe_error(model, _short(exc))
                if moe is not None:
                    raise moe from exc
                _raise_if_data_dependent(exc, errors)
    if captured is None:
        try:
            from autopar._fx_fallback import capture_with_fx

            with experts_as_operations(model):
                captured = capture_with_fx(step, args)
        except UntraceableModelError as exc:
            errors.append(f"torch.fx.symbolic_trace: {exc}")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"torch.fx.symbolic_trace: {_short(exc)}")
    if captured is None:
        moe = moe_error(model, "\n    " + "\n    ".join(errors))
        if moe is not None:
            raise moe
        raise UntraceableModelError(
            f"could not capture {type(model).__name__}",
            expected="a model torch.export or torch.fx can trace",
            found="\n    " + "\n    ".join(errors),
            fix="make control flow independent of tensor values (torch.cond, torch.where), "
                "register fake kernels for custom ops, or pass example inputs of the right form")
    if captured.method is not CaptureMethod.EXPORT:
        causes = errors + [f"the graph fixes the size of {f}" for f in fixed]
        msg = (f"{type(model).__name__} was captured with {captured.method.value}: batch and "
               f"sequence sizes are fixed to the example inputs'. Causes: " + "; ".join(causes)
               + "".join(f". {w}" for w in captured.warnings))
        warnings.warn(msg, stacklevel=2)
        captured.warnings.append(msg)
    elif any(f.startswith("batch") for f in fixed) or (
            any(f.startswith("seq") for f in fixed)
            and any(t.dim() == 2 and not t.is_floating_point() for t in args
                    if isinstance(t, torch.Tensor))):  # text whose length the graph fixes
        msg = (f"{type(model).__name__} fixes the size of {', '.join(fixed)}: it was captured "
               f"at that size, and runs only at it")
        warnings.warn(msg, stacklevel=2)
        captured.warnings.append(msg)
    if captured.method is CaptureMethod.EXPORT and errors:
        # a batch of one that export would not double: only the sequence is symbolic
        msg = (f"{type(model).__name__} was captured with the batch size fixed to 1 (only the "
               f"sequence length is symbolic). Cause: {errors[0]}")
        warnings.warn(msg, stacklevel=2)
        captured.warnings.append(msg)

    if device == "meta" and captured.exported is not None:
        with _quiet_export(), _no_kv_cache(model), experts_as_operations(model):
            captured = _with_real_constants(captured, step, args)
    n_in = len(inputs)
    user = captured.input_names
    captured = dataclasses.replace(captured, model=model, has_loss=loss_fn is not None,
                                   input_kwargs=tuple(kwarg_names), input_names=user[:n_in],
                                   target_names=user[n_in:])
    for name in captured.target_names:
        info(captured.node(name)).kind = NodeKind.TARGET
    from autopar.passes.normalize import normalize_graph

    captured = dataclasses.replace(captured, gm=normalize_graph(captured))
    _annotate_module_paths(captured, model)
    _propagate_requires_grad(captured.gm)
    return dataclasses.replace(captured, layers=find_layers(captured, model))


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def _distinct(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every example tensor its own memory. torch.export traces one placeholder for tensors that
    share memory and feeds every use from it: the same ``ids`` passed as the input and the
    target (a language model's labels) gave a graph that embedded the targets, so a step
    whose labels differ from its ids computed another loss, silently. A tensor that shares
    memory with an earlier one is traced from a copy."""
    seen: set[int] = set()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key = id(a) if a.device.type == "meta" else a.untyped_storage().data_ptr()
            if key in seen:
                a = a.clone()
                key = id(a) if a.device.type == "meta" else a.untyped_storage().data_ptr()
            if key:  # an empty tensor has no memory to share
                seen.add(key)
        out.append(a)
    return tuple(out)


def _as_tuple(value: Any, what: str) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    if value is None:
        return (), ()
    if isinstance(value, torch.Tensor):
        return (value,), ()
    if isinstance(value, Mapping):
        return tuple(value.values()), tuple(value.keys())
    if isinstance(value, (tuple, list)):
        return tuple(value), ()
    raise InvalidInputError(f"{what} has an unexpected type",
                            expected="a tensor, a tuple/list of inputs, or a dict of keyword inputs",
                            found=type(value).__name__)


def _with_real_constants(captured: CapturedGraph, step: TracedStep,
                         args: tuple[Any, ...]) -> CapturedGraph:
    """A meta model's capture with the values of the tensors its forward makes from Python data
    (``torch.tensor(finfo.min, device=x.device)`` in GPT-Neo's attention, the index lists of
    Falcon's ``qkv[..., [-2]]``): traced on the meta device they are meta too, without values,
    and the program could not run. The model is traced once more with its weights and inputs
    as fake CPU tensors, where those constants are made on the CPU with their values; each is
    taken where the two traces agree on its name, shape and dtype. A model whose forward makes
    none (GPT-2, LLaMA) is not traced again."""
    missing = {name: value for name, value in captured.constants.items()
               if isinstance(value, torch.Tensor) and value.is_meta}
    if not missing:
        return captured
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    target_of = {spec.arg.name: spec.target for spec in captured.exported.graph_signature.input_specs
                 if spec.kind == InputKind.CONSTANT_TENSOR}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with _fake_cpu_weights(getattr(step, MODEL_ATTR), mode):
            fake_args = tuple(_fake_cpu(a, mode) if isinstance(a, torch.Tensor) else a
                              for a in args)
            values = torch.export.export(step, fake_args, strict=False).constants
    except Exception:  # noqa: BLE001 - the constants stay meta; running the program says so
        return captured
    constants = dict(captured.constants)
    for name, meta_value in missing.items():
        real = values.get(target_of.get(name, ""))
        if (isinstance(real, torch.Tensor) and not isinstance(real, FakeTensor)
                and real.shape == meta_value.shape and real.dtype == meta_value.dtype):
            constants[name] = real
    return dataclasses.replace(captured, constants=constants)


def _fake_cpu(t: torch.Tensor, mode: Any) -> torch.Tensor:
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                   device="cpu")


@contextlib.contextmanager
def _fake_cpu_weights(model: nn.Module, mode: Any):
    """Every parameter and buffer of ``model`` (a meta model) replaced by a fake CPU tensor of
    its shape, ties kept (one fake per tensor), and put back on exit."""
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for store, is_param in ((module._parameters, True), (module._buffers, False)):
                for key, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in fakes:
                        fake = _fake_cpu(t, mode)
                        fakes[id(t)] = nn.Parameter(fake, t.requires_grad) if is_param else fake
                    swapped.append((store, key, t))
                    store[key] = fakes[id(t)]
        yield
    finally:
        for store, key, t in reversed(swapped):
            store[key] = t


def _model_on_meta(model: nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


def _default_dims(args: Sequence[Any], batch_dims: Mapping[int, int] | None,
                  seq_dims: Mapping[int, int] | None) -> dict[int, dict[int, str]]:
    """Which dims of which tensor args are 'batch' and 'seq'."""
    tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    if not tensors:
        return {}
    dims: dict[int, dict[int, str]] = {i: {} for i in tensors}
    if batch_dims is None:
        batch_dims = {i: 0 for i, t in tensors.items() if t.dim() >= 1}
    if seq_dims is None:  # token ids, masks, labels (B, S, ...); embeddings (B, S, H)
        seq_dims = {i: 1 for i, t in tensors.items()
                    if (t.dim() >= 2 and not t.is_floating_point()) or t.dim() == 3}
    if seq_dims and len({tensors[i].shape[d] for i, d in seq_dims.items()}) > 1:
        # several sequence lengths (an encoder's and a decoder's): the first input's is the
        # symbolic one; the others are traced at their length (the same at every step)
        first = tensors[min(seq_dims)].shape[seq_dims[min(seq_dims)]]
        seq_dims = {i: d for i, d in seq_dims.items() if tensors[i].shape[d] == first}
    batch_sizes = {tensors[i].shape[d] for i, d in batch_dims.items()}
    seq_sizes = {tensors[i].shape[d] for i, d in seq_dims.items()}
    if len(batch_sizes) > 1 or len(seq_sizes) > 1:
        raise InvalidInputError("example inputs disagree on the batch or sequence size",
                                expected="one batch size and one sequence length across inputs",
                                found=f"batch sizes {sorted(batch_sizes)}, sequence lengths "
                                      f"{sorted(seq_sizes)}",
                                fix="give inputs of the same batch and sequence length, or pass "
                                    "batch_dims= / seq_dims=")
    for i, d in batch_dims.items():  # a batch of one too: traced as two (_batch_of_two)
        if tensors[i].shape[d] >= 1:
            dims[i][d] = "batch"
    for i, d in seq_dims.items():
        if tensors[i].shape[d] >= 2 and d not in dims[i]:
            dims[i][d] = "seq"
    return {i: d for i, d in dims.items() if d}


def _dynamic_attempts(args: tuple, dims: dict[int, dict[int, str]]
                      ) -> list[tuple[tuple, dict[int, dict[int, str]], bool]]:
    """(arguments to trace, dims to mark dynamic, whether a batch of one was doubled), in order.

    Export specializes a dim of size 0 or 1 to that constant, which would leave ``b`` out of
    every shape: the sharding search and the cost model would price one sequence at any batch
    size, and sequence parallelism would not recognize the activations it splits. So a batch of
    one is traced as two copies of it first; if the model rejects that, the batch stays fixed
    and only the sequence is dynamic."""
    batch = {args[i].shape[d] for i, ds in dims.items() for d, kind in ds.items() if kind == "batch"}
    if batch != {1}:
        return [(args, dims, False)] if dims else []
    doubled = list(args)
    for i, ds in dims.items():
        for d, kind in ds.items():
            if kind == "batch":
                doubled[i] = torch.cat([doubled[i], doubled[i]], dim=d)
    attempts = [(tuple(doubled), dims, True)]
    seq_only = {i: {d: k for d, k in ds.items() if k != "batch"} for i, ds in dims.items()}
    seq_only = {i: ds for i, ds in seq_only.items() if ds}
    if seq_only:
        attempts.append((args, seq_only, False))
    return attempts


def _export_dynamic(step: nn.Module, args: tuple, dims: dict[int, dict[int, str]]
                    ) -> tuple[ExportedProgram, dict[str, int]]:
    """Export with the batch and seq dims symbolic. A model that bounds a dim (positions <= 512)
    makes export suggest ``seq = Dim('seq', max=512)``: take the bounds and export again. A
    model that slices a dim (``ids[:, 2:]``) makes export guard the slice's size away from 0
    and 1, which it specializes, and suggest nothing: the least size that keeps every guard
    (:func:`_guarded_sizes`) becomes the dim's minimum."""
    bounds: dict[str, dict[str, int]] = {"batch": {}, "seq": {}}
    sizes = {kind: args[i].shape[d] for i, ds in dims.items() for d, kind in ds.items()}
    for _ in range(3):
        named = {kind: Dim(kind, **bounds[kind]) for kind in bounds}
        spec: list[Any] = []
        for i, a in enumerate(args):
            ds = dims.get(i, {}) if isinstance(a, torch.Tensor) else {}
            spec.append({d: named[kind] for d, kind in ds.items()} or None)
        try:
            ep = torch.export.export(step, args, dynamic_shapes=(tuple(spec),), strict=False)
            return ep, sizes
        except Exception as exc:  # noqa: BLE001
            fixes = {kind: {**bounds.get(kind, {}), **bound}
                     for kind, bound in _suggested_bounds(str(exc)).items()}
            fixes.update(_guarded_sizes(str(exc), sizes, {**bounds, **fixes}))
            if not fixes or all(bounds.get(k) == v for k, v in fixes.items()):
                raise
            for kind, bound in fixes.items():
                if kind not in bounds:
                    raise
                bounds[kind] = bound
    raise UntraceableModelError("export kept asking for new shape bounds", found=str(bounds))


_VIOLATED = re.compile(r"Constraints violated \(([\w, ]+)\)")


def _violated_dims(exc: BaseException, marked: dict[int, dict[int, str]]
                   ) -> list[tuple[int, int, str]]:
    """The marked (input, dim, kind) whose symbol export reports as specialized ("Constraints
    violated (seq)!"): every dim of that kind."""
    match = _VIOLATED.search(str(exc))
    if not match:
        return []
    kinds = {k.strip() for k in match.group(1).split(",")}
    return [(i, d, k) for i, ds in marked.items() for d, k in ds.items() if k in kinds]


_DIM_FIX = re.compile(r"(\w+) = Dim\('(\w+)'((?:, (?:min|max)=\d+)*)\)")


def _suggested_bounds(message: str) -> dict[str, dict[str, int]]:
    """Parse export's 'Suggested fixes' into {dim name: {min:, max:}}."""
    if "Suggested fixes" not in message:
        return {}
    out = {}
    for name, _, rest in _DIM_FIX.findall(message.split("Suggested fixes", 1)[1]):
        out[name] = {k: int(v) for k, v in re.findall(r"(min|max)=(\d+)", rest)}
    return out


#: A guard export could not prove for every size of a dim: "Not all values of seq =
#: L['ids'].size()[1] in the specified range satisfy the generated guard ((-2) + ...) != 1."
_GUARD = re.compile(r"Not all values of (\w+) = (L(?:\[[^\]]+\])+\.size\(\)\[\d+\]) in "
                    r"the specified range satisfy the generated guard (.+?)\.?\s*$", re.M)
#: What such a guard may hold once its size is ``s``: integers, arithmetic, comparisons.
_ARITHMETIC = re.compile(r"^[\s\d+\-*/%()<>=!,s]*$")
#: The names a guard may use, and their values.
_SCOPE = {"__builtins__": {}, "max": max, "min": min, "IntInfinity": lambda: float("inf")}
_WORDS = re.compile(r"\b(?:max|min|and|or|not|IntInfinity)\b")
#: Sizes tried above the example's when looking for the least size that keeps a guard.
_PROBE = 256


def _guarded_sizes(message: str, sizes: dict[str, int], bounds: dict[str, dict[str, int]]
                   ) -> dict[str, dict[str, int]]:
    """From export's guards on a dim it was told is dynamic (see :data:`_GUARD`), the widest
    run of sizes around the example's on which every guard holds (looked for down to the dim's
    minimum and up to its maximum, or :data:`_PROBE` above the example: a run that reaches
    that far is taken as unbounded), as that dim's bounds: ``ids[:, 2:]`` gives ``min=4``,
    GPT-Neo's ``s != 64`` under its ``max=64`` gives ``max=63``. Export checks them when it
    runs again. ``{}`` when a guard is not plain arithmetic in that dim's size alone, or the
    example's size breaks one."""
    guards: dict[str, list[Any]] = {}
    for kind, ref, expr in _GUARD.findall(message):
        text = expr.replace(ref, "s")
        if kind not in sizes or not _ARITHMETIC.match(re.sub(_WORDS, "", text)):
            return {}
        guards.setdefault(kind, []).append(compile(text, "<guard>", "eval"))
    out = {}
    for kind, codes in guards.items():
        def holds(size: int, codes: list[Any] = codes) -> bool:
            return all(eval(code, dict(_SCOPE), {"s": size}) for code in codes)  # noqa: S307

        size, given = sizes[kind], bounds.get(kind, {})
        low, high = given.get("min", 0), given.get("max")
        top = high if high is not None else size + _PROBE
        if not low <= size <= top or not holds(size):
            return {}
        least, most = size, size
        while least > low and holds(least - 1):
            least -= 1
        while most < top and holds(most + 1):
            most += 1
        out[kind] = {**given, "min": least}
        if most < top or high is not None:
            out[kind]["max"] = most
    return out


def _from_export(ep: ExportedProgram, method: CaptureMethod, sizes: dict[str, int],
                 dims: dict[int, dict[int, str]] | None = None) -> CapturedGraph:
    gm = ep.graph_module
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in placeholders}

    # Name export's shape symbols b and s, from the dims we marked.
    rename: dict[sympy.Symbol, sympy.Expr] = {}
    user_inputs = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    example_sizes: dict[sympy.Symbol, int] = {}
    for symbol, (kind, size) in _symbols_from_inputs(user_inputs, by_name, sizes,
                                                     dims or {}).items():
        target = BATCH if kind == "batch" else SEQ
        rename[symbol] = target
        example_sizes[target] = size

    params: dict[str, ParamInfo] = {}
    buffers: dict[str, ParamInfo] = {}
    constants: dict[str, torch.Tensor] = {}
    input_names: list[str] = []
    for spec in sig.input_specs:
        node = by_name[spec.arg.name]
        value = spec_from_value(node.meta.get("val"), rename)
        if spec.kind == InputKind.PARAMETER:
            fqn = strip_model_prefix(spec.target)
            params[node.name] = ParamInfo(node.name, fqn, (), value, True)
            node.meta[META_KEY] = NodeInfo(NodeKind.PARAMETER, value, fqn=fqn, reads=(fqn,))
        elif spec.kind == InputKind.BUFFER:
            fqn = strip_model_prefix(spec.target)
            buffers[node.name] = ParamInfo(node.name, fqn, (), value, False)
            node.meta[META_KEY] = NodeInfo(NodeKind.BUFFER, value, fqn=fqn, reads=(fqn,))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[node.name] = ep.constants[spec.target]
            node.meta[META_KEY] = NodeInfo(NodeKind.CONSTANT, value, fqn=strip_model_prefix(spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            input_names.append(node.name)
            node.meta[META_KEY] = NodeInfo(NodeKind.INPUT, value)
        else:
            raise UntraceableModelError(f"unsupported export input kind {spec.kind}")

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        kind = NodeKind.OUTPUT if node.op == "output" else NodeKind.OP
        node.meta[META_KEY] = NodeInfo(kind, spec_from_value(node.meta.get("val"), rename))

    return CapturedGraph(gm=gm, method=method, params=params, buffers=buffers,
                         constants=constants, input_names=input_names, target_names=[],
                         example_sizes=example_sizes, layers=[], has_loss=False, exported=ep,
                         symbol_rename=rename, size_ranges=_size_ranges(ep, rename))


def _size_ranges(ep: ExportedProgram, rename: dict[sympy.Symbol, sympy.Expr]
                 ) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """The sizes of b and s the exported graph holds for, where export narrowed them (a
    minimum above 2, or a maximum, from :func:`_guarded_sizes`; a maximum, from a model's bound): ``{symbol:
    (least, most or None)}``."""
    out: dict[sympy.Symbol, tuple[int, int | None]] = {}
    for symbol, target in rename.items():
        span = ep.range_constraints.get(symbol)
        if span is None or not isinstance(target, sympy.Symbol):
            continue
        low = int(span.lower) if isinstance(span.lower, sympy.Integer) else 0  # not int_oo
        high = int(span.upper) if isinstance(span.upper, sympy.Integer) else None
        if low > 2 or high is not None:
            out[target] = (low, high)
    return out


def _symbols_from_inputs(user_inputs, by_name, sizes: dict[str, int],
                         dims: dict[int, dict[int, str]]) -> dict[sympy.Symbol, tuple[str, int]]:
    """Map export's free symbols (s23...) to 'batch'/'seq': by the dims we marked (input i, dim
    d: export's user inputs are the traced step's arguments, in order), so a batch size equal
    to the sequence length is no confusion; by size for dims not marked."""
    found: dict[sympy.Symbol, tuple[str, int]] = {}
    size_to_kind = {size: kind for kind, size in sizes.items()}
    for i, spec in enumerate(user_inputs):
        val = by_name[spec.arg.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, dim in enumerate(val.shape):
            if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                hint = dim.node.hint
                kind = dims.get(i, {}).get(d) or size_to_kind.get(hint)
                if kind is not None and dim.node.expr not in found:
                    found[dim.node.expr] = (kind, hint)
    return found


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:400] if text else type(exc).__name__


def _raise_if_data_dependent(exc: BaseException, errors: list[str]) -> None:
    """Data-dependent control flow fails every tracer the same way: say so at once."""
    name = type(exc).__name__
    if "DataDependent" in name or "data-dependent" in str(exc):
        where = _user_frame(str(exc))
        raise UntraceableModelError(
            "the model has control flow that depends on tensor values" + (f" ({where})" if where else ""),
            expected="control flow that depends only on shapes and Python values",
            found=_short(exc),
            fix="rewrite the branch with torch.where / torch.cond, or move it out of forward()",
        ) from exc


def _user_frame(text: str) -> str:
    match = re.search(r'File "([^"]+)", line (\d+)', text)
    return f"{match.group(1)}:{match.group(2)}" if match else ""


@contextlib.contextmanager
def _quiet_export():
    """torch.export logs graphs and symbolic-shape notes at WARNING; keep the user's log clean."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
             "torch._dynamo", "torch.fx.experimental.recording"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module):
    """Hugging Face models build a KV cache by default; training graphs need none."""
    config = getattr(model, "config", None)
    old = getattr(config, "use_cache", None)
    if config is not None and old:
        config.use_cache = False
    try:
        yield
    finally:
        if config is not None and old:
            config.use_cache = old


# ---------------------------------------------------------------------------------------------
# Annotation: module paths, requires_grad, layers
# ---------------------------------------------------------------------------------------------

def _annotate_module_paths(captured: CapturedGraph, model: nn.Module) -> None:
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    by_fqn = dict(model.named_parameters(remove_duplicate=False))
    _merge_tied_placeholders(captured, by_fqn)
    for key, p in list(captured.params.items()):
        tensor = by_fqn.get(p.fqn)
        names = aliases.get(id(tensor), [p.fqn]) if tensor is not None else [p.fqn]
        others = tuple(n for n in names if n != p.fqn)
        captured.params[key] = ParamInfo(p.placeholder, p.fqn, others, p.spec,
                                         bool(tensor.requires_grad) if tensor is not None else True)
        info(captured.node(key)).requires_grad = captured.params[key].requires_grad

    for node in captured.gm.graph.nodes:
        meta = info(node)
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            path, _ = list(stack.values())[-1]
            meta.module_path = "" if path == MODEL_ATTR or path.startswith("_") else strip_model_prefix(path)
        elif meta.fqn:
            meta.module_path = meta.fqn.rpartition(".")[0]
        if node.op == "call_function":
            meta.reads = tuple(sorted({info(a).fqn for a in node.all_input_nodes
                                       if info(a).kind in (NodeKind.PARAMETER, NodeKind.BUFFER)}))


def _merge_tied_placeholders(captured: CapturedGraph, by_fqn: dict[str, torch.Tensor]) -> None:
    """Export may lift one tied tensor under several names; keep one placeholder per tensor."""
    primary: dict[int, torch.fx.Node] = {}
    for key in list(captured.params):
        tensor = by_fqn.get(captured.params[key].fqn)
        node = captured.node(key)
        if tensor is None:
            continue
        keep = primary.get(id(tensor))
        if keep is None:
            primary[id(tensor)] = node
            continue
        if not node.users or keep.users:  # keep the used (or the first) placeholder
            drop, kept = node, keep
        else:
            drop, kept = keep, node
            primary[id(tensor)] = node
        drop.replace_all_uses_with(kept)
        captured.gm.graph.erase_node(drop)
        del captured.params[drop.name]
    captured.gm.recompile()


_NON_DIFFERENTIABLE = {"sym_size", "eq", "ne", "lt", "le", "gt", "ge", "argmax", "argmin",
                       "logical_and", "logical_or", "logical_not", "__and__", "__or__",
                       "bitwise_and", "bitwise_or", "arange", "zeros", "ones", "full",
                       "empty", "new_ones", "new_zeros", "new_full", "new_empty", "ones_like",
                       "zeros_like", "full_like", "empty_like", "rand", "randn", "randint",
                       "detach", "detach_", "_assert_tensor_metadata", "lift_fresh_copy"}


def _propagate_requires_grad(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        meta = info(node)
        if node.op == "placeholder":
            continue
        name = op_name(node)
        spec = meta.value
        floating = any(s.is_float for s in iter_tensor_specs(spec))
        if node.op == "output" or name == "getitem":
            meta.requires_grad = any(info(a).requires_grad for a in node.all_input_nodes)
            if name == "getitem":
                meta.requires_grad = meta.requires_grad and floating
            continue
        meta.requires_grad = (floating and name not in _NON_DIFFERENTIABLE
                              and any(info(a).requires_grad for a in node.all_input_nodes))
