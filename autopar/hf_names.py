"""How a Hugging Face checkpoint's tensors become a transformers model's, and back.

transformers (5.x) renames and converts checkpoint tensors on load and reverses that on save
(``transformers.conversion_mapping``; ``from_pretrained`` and ``save_pretrained`` both apply it),
so a checkpoint on the Hub or one ``save_pretrained`` wrote need not hold the model's own names:
ViT's ``vit.encoder.layer.N.attention.attention.query`` is its model's
``vit.layers.N.attention.q_proj``, GPT-NeoX's ``embed_out`` its ``lm_head``, and a Mixtral's
per-expert ``block_sparse_moe.experts.E.w1`` / ``w3`` (E = 0 .. experts - 1) are one fused
``mlp.experts.gate_up_proj`` per layer. autopar reads checkpoints by slice on every rank and writes
them one tensor at a time, so rather than load the model it asks transformers for the same
transforms and applies them per tensor:

- :func:`checkpoint_keys`: the :class:`~autopar.runtime.hf_checkpoint.KeyMap` of a checkpoint's
  keys for a model: each key renamed as ``from_pretrained`` renames it (``rename_source_key``
  with the model's renamings and converters), and for each conversion group (a converter's
  sources of one layer) the function that makes its model tensors with transformers' own
  converter (``WeightConverter.convert``);
- :func:`saved_tensors`: what ``save_pretrained`` writes for one model tensor
  (``revert_weight_conversion`` of that tensor alone), and :func:`saved_layout` the same on the
  meta device, for the file headers written before any data.

A model that is no transformers ``PreTrainedModel``, or whose family has no transforms, keeps
its names both ways.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from autopar.errors import InvalidInputError

__all__ = ["checkpoint_keys", "saved_name", "saved_tensors", "saved_layout"]


def _transforms(model: nn.Module) -> tuple[list[Any], list[Any]] | None:
    """The model's (renamings, converters), as ``from_pretrained`` applies them; None when it
    has none."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers is optional for models of one's own
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return (renamings, converters) if renamings or converters else None


def checkpoint_keys(model: nn.Module, keys: Iterable[str]) -> Any:
    """The :class:`~autopar.runtime.hf_checkpoint.KeyMap` of the checkpoint tensors ``keys``
    for ``model`` (see the module docstring); None when the names are the model's."""
    from autopar.runtime.hf_checkpoint import KeyMap

    found = _transforms(model)
    if found is None:
        return None
    from transformers.core_model_loading import rename_source_key

    renamings, converters = found
    present = {name: True for name in model.state_dict().keys()}
    prefix = getattr(model, "base_model_prefix", None) or None
    renamed: dict[str, str] = {}
    groups: dict[str, list[tuple[str, str]]] = {}  # the group's first target -> (key, pattern)
    for key in sorted(keys):
        target, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if pattern is None:
            if target != key:
                renamed[target] = key
        else:
            groups.setdefault(target, []).append((key, pattern))
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    converted: dict[str, tuple[str, tuple[str, ...], Callable]] = {}
    for first, sources in groups.items():
        converter = by_pattern[sources[0][1]]
        make = _group_converter(model, converter, first, sources)
        for target in _group_targets(converter, first):
            converted[target] = (first, tuple(k for k, _ in sources), make)
    return KeyMap(renamed=renamed, converted=converted)


def _group_targets(converter: Any, first: str) -> list[str]:
    """The model names a conversion group makes: its first target with each of the converter's
    target patterns in place of the first."""
    patterns = [p for p in converter.target_patterns]
    return [first.replace(patterns[0], p, 1) for p in patterns]


def _group_converter(model: nn.Module, converter: Any, first: str,
                     sources: list[tuple[str, str]]) -> Callable:
    def make(read: Callable[[str], torch.Tensor]) -> Mapping[str, torch.Tensor]:
        fresh = copy.deepcopy(converter)  # a converter collects the tensors it is given
        for key, pattern in sources:
            fresh.add_tensor(first, key, pattern, lambda key=key: read(key))
        out = fresh.convert(first, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value
                for name, value in out.items()}

    return make


def saved_name(model: nn.Module, names: tuple[str, ...]) -> str:
    """The name of a tied tensor (one tensor, several names) that ``save_pretrained`` writes:
    the first of ``names`` that is no target of transformers' ties (``all_tied_weights_keys``:
    GPT-Neo's ``lm_head.weight`` is dropped for ``transformer.wte.weight``)."""
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    return next((n for n in names if n not in targets), names[0])


def saved_tensors(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for the model tensor ``name`` (its name, or the tensors
    its reverse conversion makes: a Mixtral's fused experts split into one tensor per expert)."""
    if _transforms(model) is None:
        return {name: tensor}
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, {name: tensor}))  # type: ignore[arg-type]


def saved_layout(model: nn.Module, tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]]
                 ) -> list[tuple[str, list[tuple[str, tuple[int, ...], torch.dtype]]]]:
    """For each model tensor (name, shape, dtype), the (name, shape, dtype) of the tensors
    :func:`saved_tensors` writes for it, converted on the meta device; checked against the
    reverse conversion of all of them at once, which a conversion that needs several model
    tensors together (none in transformers' mappings today) would not match."""
    tensors = list(tensors)
    out = []
    for name, shape, dtype in tensors:
        meta = torch.empty(shape, dtype=dtype, device="meta")
        saved = saved_tensors(model, name, meta)
        out.append((name, [(k, tuple(int(d) for d in v.shape), v.dtype)
                           for k, v in saved.items()]))
    if _transforms(model) is not None:
        from transformers.core_model_loading import revert_weight_conversion

        whole = revert_weight_conversion(model, {  # type: ignore[arg-type]
            name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in tensors})
        each = {k: shape for _, saved in out for k, shape, _ in saved}
        if each != {k: tuple(int(d) for d in v.shape) for k, v in whole.items()}:
            raise InvalidInputError(
                f"{type(model).__name__}'s save conversion needs several tensors at once",
                expected="a conversion transformers applies to each model tensor on its own",
                found=f"{len(each)} tensors converted one by one, {len(whole)} all together",
                fix="save with pm.save (torch.distributed.checkpoint) or gather the state dict "
                    "and call the model's save_pretrained")
    return out
