"""Initialize a model built on the meta device one module at a time, keeping only slices.

A model too large for one process is built under ``with torch.device("meta"):``: its tensors have
shapes and dtypes but no storage. Its initial values must still be what the same model
initialized on one device would hold, so that a parallel run starts where a single-device run
starts, on every plan. :func:`materialize` replays that initialization, in the same order and
from the same random state, over the meta model, in two passes:

1. **Rehearsal, on meta.** The initializer is applied to one module at a time, children before
   parents (the order of ``nn.Module.apply``, which is also how transformers' ``init_weights``
   walks a model), under a :class:`~torch.overrides.TorchFunctionMode` that numbers every tensor
   op and records, for each of the model's tensors, the last op that touches it or a view of it
   (``weight[pad]``, ``weight.data``). Nothing is allocated and no random number is drawn (the
   CPU random state and transformers' "initialized" flags are put back afterwards).
2. **Performance, for real.** The same walk again: now every op touching one of the model's meta
   tensors gets a real CPU tensor in its place (allocated on first touch, filled with NaN), so
   ``nn.init.normal_(module.weight)``, ``module.weight.data.fill_(1)`` or
   ``module.weight[pad].zero_()`` write real memory and draw from the CPU generator exactly as on
   one device; queries of shape or dtype stay on meta. Right after a tensor's last op it is handed
   to ``take(names, value)`` (which keeps this rank's slices) and dropped.

So a process holds only the tensors an initializer is working on: one module's, even when a
parent's initializer writes its children's (GPT-2's scaled ``c_proj``, T5's attention) or one
call initializes the whole model (torchtitan's ``init_weights``). Every rank draws the whole
model's random numbers: the values equal one device's at every slice, whatever the plan.

The reference is the model's tensors materialized in place (ties kept) and initialized on one
device from the same random state; for a transformers model, transformers' own meta flow
(``to_empty``, ``init_weights``: a tied LM head is written untied, then tied back to its source).
A tensor the initializer never touches, or leaves partly NaN, is an
:class:`~autopar.errors.InvalidInputError` naming it, raised on every rank alike.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_unary
from torch.utils._pytree import tree_flatten, tree_map

from autopar.errors import InvalidInputError

__all__ = ["default_init", "materialize", "meta_tensors"]

#: Tensor methods and properties that read only metadata: on a meta tensor they allocate nothing.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
    "is_floating_point", "is_complex", "is_contiguous", "get_device", "__len__", "type",
    "shape", "dtype", "device", "ndim", "is_meta", "requires_grad", "is_leaf", "layout",
    "names", "is_cuda", "is_sparse", "is_quantized", "itemsize", "nbytes",
})


class _Live:
    """Bytes of stand-ins alive now, and the most at any time."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


class _Entry:
    """One meta tensor of the model: its names, its last op, its stand-in while it lives."""

    __slots__ = ("meta", "names", "last", "real", "done", "live")

    def __init__(self, meta: torch.Tensor, names: list[str], live: "_Live") -> None:
        self.meta = meta
        self.live = live
        self.names = names  # empty: a stand-in whose value is dropped (an untied HF target)
        self.last = -1  # the number of the last op touching it (-1: none)
        self.real: torch.Tensor | None = None
        self.done = False

    def materialize(self) -> torch.Tensor:
        if self.done:
            raise InvalidInputError(
                f"the initializer touched {self._name()} after the rehearsal's last touch",
                expected="an initializer that runs the same ops on meta tensors as on real ones",
                found=f"{self._name()} used again after it was handed over",
                fix="make init= independent of tensor values (no .item(), no branches on data)")
        if self.real is None:
            self.real = torch.empty(self.meta.shape, dtype=self.meta.dtype, device="cpu")
            if self.real.is_floating_point() or self.real.is_complex():
                self.real.fill_(float("nan"))  # what the initializer leaves unset shows
            else:
                self.real.zero_()
            self.live.add(self.real.numel() * self.real.element_size())
        return self.real

    def _name(self) -> str:
        return self.names[0] if self.names else "a tied tensor"


#: torch.nn.init's functions. Several take no part in torch-function dispatch or return early on
#: a meta tensor (trunc_normal_, orthogonal_) or loop on values (trunc_normal_'s rejection):
#: during a replay each is one op, rehearsed without running.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                   "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")


def _dispatching(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def init_function(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if has_torch_function_unary(tensor):
            return handle_torch_function(init_function, (tensor,), tensor, *args, **kwargs)
        return fn(tensor, *args, **kwargs)

    init_function._autopar_init = True  # type: ignore[attr-defined]
    return init_function


@contextlib.contextmanager
def _init_functions_as_ops() -> Iterator[None]:
    """torch.nn.init's functions (and transformers' table of them) as single, dispatching ops."""
    import torch.nn.init as torch_init

    tables: list[Any] = [torch_init.__dict__]
    try:
        from transformers import initialization as hf_init

        tables.append(hf_init.TORCH_INIT_FUNCTIONS)
    except ImportError:  # pragma: no cover - transformers is optional
        pass
    saved = []
    for table in tables:
        for name in _INIT_FUNCTIONS:
            fn = table.get(name)
            if fn is not None and not getattr(fn, "_autopar_init", False):
                saved.append((table, name, fn))
                table[name] = _dispatching(fn)
    try:
        yield
    finally:
        for table, name, fn in saved:
            table[name] = fn


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property getter: Tensor.data.__get__, Tensor.shape.__get__
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


#: Ops whose result shares memory with their argument without being a view (``_base`` unset).
_ALIASING = frozenset({"data", "detach", "detach_"})


class _Replay(TorchFunctionMode):
    """Numbers the tensor ops of an initializer; in the rehearsal records each entry's last op,
    in the performance substitutes real tensors and hands each entry over after its last op."""

    def __init__(self, entries: dict[int, _Entry], *, real: bool,
                 take: Callable[[_Entry], None] | None = None,
                 names: list[str] | None = None) -> None:
        super().__init__()
        self.entries = entries
        self.real = real
        self.take = take
        self.count = 0
        self.names: list[str] = names if names is not None else []  # each op's, rehearsed
        self.finishing: dict[int, list[_Entry]] = {}  # op -> the entries it is the last of
        if real:  # the rehearsal is what finds each entry's last op
            for entry in entries.values():
                self.finishing.setdefault(entry.last, []).append(entry)
        self.aliases: dict[int, tuple[torch.Tensor, _Entry]] = {}  # rehearsal only

    def _entry(self, x: Any) -> _Entry | None:
        if not isinstance(x, torch.Tensor):
            return None
        entry = self.entries.get(id(x))
        if entry is not None and entry.meta is x:
            return entry
        held = self.aliases.get(id(x))
        return held[1] if held is not None and held[0] is x else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in _METADATA:
            return func(*args, **kwargs)
        op = self.count
        self.count += 1
        if not self.real:
            self.names.append(name)
            touched = [e for e in map(self._entry, tree_flatten((args, kwargs))[0])
                       if e is not None]
            for entry in touched:
                entry.last = op
            if getattr(func, "_autopar_init", False):  # writes its tensor in place: not run
                return args[0]
            out = func(*args, **kwargs)
            if touched:  # a view of the model's tensor is the tensor, for what touches it later
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and self._entry(t) is None and (
                            name in _ALIASING or self._entry(t._base) is not None):
                        self.aliases[id(t)] = (t, self._entry(t._base) or touched[0])
            return out
        if op >= len(self.names) or self.names[op] != name:
            raise InvalidInputError(
                "the initializer ran differently on real tensors than on meta ones",
                expected=f"op {op}: {self.names[op] if op < len(self.names) else 'no op'} "
                         "(as rehearsed on meta)", found=name,
                fix="make init= independent of tensor values (no .item(), no branches on data)")

        def substitute(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                entry = self.entries.get(id(x))
                if entry is not None and entry.meta is x:
                    return entry.materialize()
            return x

        args, kwargs = tree_map(substitute, (args, kwargs))
        out = func(*args, **kwargs)
        for entry in self.finishing.get(op, ()):
            self.take(entry)  # type: ignore[misc]
        return out


def meta_tensors(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """The model's parameters and buffers on the meta device, by identity, with all their names."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        if t is not None and t.is_meta:
            out.setdefault(id(t), (t, []))[1].append(name)
    return out


def default_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """What the model's own code initializes with: transformers' ``_initialize_weights`` of the
    (sub)model a module belongs to (what ``init_weights`` applies), otherwise each module's own
    ``reset_parameters``."""
    base = _hf_base()
    if base is not None and isinstance(model, base):
        return _HFInit(model, base)

    def reset(module: nn.Module) -> None:
        fn = getattr(module, "reset_parameters", None)
        if callable(fn):
            fn()

    return reset


def _hf_base() -> type | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    return PreTrainedModel


class _HFInit:
    """transformers' ``initialize_weights`` one module at a time: a module inside a nested
    ``PreTrainedModel`` (an encoder-decoder's halves, a vision tower) takes that submodel's
    ``_initialize_weights``, under the guard transformers puts around its init functions."""

    def __init__(self, model: nn.Module, base: type) -> None:
        from transformers import initialization

        self.guard = initialization.guard_torch_init_functions
        custom = getattr(model, "is_custom_code", None)
        self.custom = bool(custom()) if callable(custom) else False
        self.owner: dict[int, Any] = {}

        def visit(module: nn.Module, fn: Any) -> None:  # transformers' smart_apply
            for child in module.children():
                visit(child, child._initialize_weights if isinstance(child, base) else fn)
            self.owner.setdefault(id(module), fn)

        visit(model, model._initialize_weights)

    def __call__(self, module: nn.Module) -> None:
        fn = self.owner.get(id(module))
        if fn is not None:
            with self.guard():
                fn(module, self.custom)


def _modules_in_apply_order(model: nn.Module) -> list[nn.Module]:
    """The modules ``model.apply(fn)`` visits, in its order (children first; a module shared by
    two parents is visited under each)."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        out.append(module)

    visit(model)
    return out


def _hf_untie(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """transformers' meta flow writes a tied target (an LM head) as its own tensor and ties it
    back to its source afterwards: give each tied target slot its own meta stand-in for the
    initialization; returns the slots and the tensors to put back."""
    base = _hf_base()
    if base is None or not isinstance(model, base):
        return []
    keys = getattr(model, "all_tied_weights_keys", None) or {}
    slots: list[tuple[nn.Module, str, torch.Tensor]] = []
    for target, source in keys.items():
        try:
            tied, origin = model.get_parameter(target), model.get_parameter(source)
        except AttributeError:
            continue
        if tied is not origin or not tied.is_meta:
            continue
        owner_name, _, attr = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        slots.append((owner, attr, tied))
        owner._parameters[attr] = nn.Parameter(torch.empty_like(tied, device="meta"),
                                               requires_grad=tied.requires_grad)
    return slots


def _flags(model: nn.Module, tensors: list[torch.Tensor]) -> list[tuple[Any, bool | None]]:
    """transformers' "already initialized" marks, to be put back after the rehearsal."""
    return [(o, getattr(o, "_is_hf_initialized", None)) for o in (*model.modules(), *tensors)]


def _restore_flags(saved: list[tuple[Any, bool | None]]) -> None:
    for obj, value in saved:
        if value is None:
            if "_is_hf_initialized" in getattr(obj, "__dict__", {}):
                del obj._is_hf_initialized
        else:
            obj._is_hf_initialized = value


def materialize(model: nn.Module, init: Callable[[nn.Module], None] | None,
                take: Callable[[list[str], torch.Tensor], None]) -> int:
    """Initialize the meta tensors of ``model`` with ``init`` (None: :func:`default_init`)
    applied module by module in ``model.apply``'s order, from the current CPU random state;
    hand each finished tensor to ``take(names, value)`` right after the last op touching it, and
    drop it. The model stays on meta; the CPU random state ends where one device's would.
    Returns the most bytes of full tensors this process held at once.

    Raises InvalidInputError when the initializer leaves a tensor untouched or partly unset."""
    names = {key: names for key, (_, names) in meta_tensors(model).items()}
    if not names:
        return 0
    untied = _hf_untie(model)
    try:
        return _materialize(model, init, take, names)
    finally:
        for owner, attr, tensor in untied:
            owner._parameters[attr] = tensor  # type: ignore[assignment]


def _materialize(model: nn.Module, init: Callable[[nn.Module], None] | None,
                 take: Callable[[list[str], torch.Tensor], None],
                 names: dict[int, list[str]]) -> int:
    # every name of a tensor as the model holds it; an untied stand-in has none (dropped)
    live = _Live()
    entries = {key: _Entry(t, names.get(key, []), live)
               for key, (t, _) in meta_tensors(model).items()}
    order = _modules_in_apply_order(model)
    apply = init if init is not None else default_init(model)

    # 1. rehearsal on meta: the last op touching each tensor
    rng = torch.get_rng_state()
    flags = _flags(model, [e.meta for e in entries.values()])
    rehearsal = _Replay(entries, real=False)
    try:
        for module in order:
            with torch.no_grad(), _init_functions_as_ops(), rehearsal:
                apply(module)
    except Exception as exc:  # noqa: BLE001 - a value-dependent initializer
        raise InvalidInputError(
            "the initializer cannot run on the meta device",
            expected="an initializer that writes tensors without reading their values",
            found=f"{type(exc).__name__}: {exc}",
            fix="make init= independent of tensor values, or pass checkpoint=") from exc
    finally:
        torch.set_rng_state(rng)
        _restore_flags(flags)
        rehearsal.aliases.clear()
    untouched = [e.names[0] for e in entries.values() if e.last < 0 and e.names]
    if untouched:
        raise InvalidInputError(
            f"the initializer left {len(untouched)} tensor(s) on the meta device",
            expected="every parameter and buffer written by init",
            found=", ".join(untouched[:5]) + (" ..." if len(untouched) > 5 else ""),
            fix="pass init= a function that initializes each module's own tensors (it is "
                "applied like model.apply(init)), or a checkpoint=")

    # 2. performance: real tensors, each handed over after its last op
    performance = _Replay(entries, real=True, take=lambda e: _finish(e, take),
                          names=rehearsal.names)
    for module in order:
        with torch.no_grad(), _init_functions_as_ops(), performance:
            apply(module)
    left = [e for e in entries.values() if not e.done]
    for entry in left:  # pragma: no cover - every entry has a last op that ran
        _finish(entry, take)
    return live.peak


def _finish(entry: _Entry, take: Callable[[list[str], torch.Tensor], None]) -> None:
    value, entry.real = entry.real, None
    entry.done = True
    if value is None:  # pragma: no cover - every touched tensor was materialized
        return
    entry.live.now -= value.numel() * value.element_size()
    if value.is_floating_point() or value.is_complex():
        unset = int(torch.isnan(value).sum())
        if unset:
            raise InvalidInputError(
                f"the initializer left {unset} of {value.numel()} values of "
                f"{entry.names[0] if entry.names else 'a tied tensor'} unset",
                expected="every value written",
                found=f"{unset} values never written (NaN where they were allocated)",
                fix="initialize the whole tensor in the module's initializer")
    if entry.names:
        take(entry.names, value)
