"""A workload: a model with what planning and training it need (example inputs, targets, loss).

Every command that takes ``MODEL`` and :func:`autopar.plan` start from one. ``MODEL`` is:

- a zoo preset or family (``gpt3-175b``, ``llama``; see :mod:`autopar.models.zoo`);
- a Hugging Face ``transformers`` config: a ``config.json`` file or a directory holding one
  (as ``save_pretrained`` writes). The model is built on the meta device with random weights,
  its class from the config's ``architectures`` (else the task its config implies); the
  inputs and the loss follow the class's task (:data:`TASKS`): causal or masked language
  modelling, sequence-to-sequence, image or sequence classification;
- ``path/to/file.py:function``: the user's own model. ``function`` is called with the keyword
  arguments it accepts among ``batch`` and ``seq`` (small sizes to trace with: batch and
  sequence are symbolic in the captured graph, so the plan is priced at ``--global-batch`` and
  ``--seq``) and returns a :class:`Workload`, or ``(model, example_inputs, loss_fn)``, or
  ``(model, example_inputs, loss_fn, example_targets)``, or a dict with those keys. The model
  may live on the meta device. ``loss_fn(model(*example_inputs), *example_targets)`` (keyword
  inputs for a dict of example inputs) must return a scalar.

A deep model is captured with at most :data:`CAPTURE_BLOCKS` blocks when its config says how
many it has (``num_hidden_layers``): blocks are one computation repeated, and the cost model
extends the last captured block to the real depth (:class:`autopar.planner.cost_model.ModelCosts`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import InvalidInputError
from autopar.models.zoo import (FAMILIES, PRESETS, build, lm_loss,  # noqa: F401 - lm_loss: TASKS
                                resolve_spec)

__all__ = ["Workload", "TASKS", "CAPTURE_BLOCKS", "load_workload", "workload_from_config",
           "workload_from_function", "model_info"]

#: Blocks captured when a model is deeper (the cost model repeats the last one).
CAPTURE_BLOCKS = 2
#: Batch and sequence length traced with (symbolic in the graph: the plan scales them).
TRACE_BATCH, TRACE_SEQ = 2, 16

#: Shape flags of the command line -> the transformers config attribute they set.
CONFIG_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
                "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
                "ffn_hidden": "intermediate_size", "vocab": "vocab_size",
                "seq": "max_position_embeddings"}


@dataclass(frozen=True)
class Workload:
    """What planning or parallelizing a model needs.

    ``depth``: the number of repeated blocks of the real model when ``model`` is a shallower
    copy of it (None: ``model`` is the model). ``info``: shape facts the plan document shows
    (family, layers, hidden, heads, vocab, ...). ``max_seq``: the positions the model supports
    (None: unknown, not a sequence model, or positions computed rather than learned).
    """

    name: str
    model: nn.Module
    example_inputs: Any
    loss_fn: Callable[..., torch.Tensor]
    example_targets: Any = ()
    depth: int | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    max_seq: int | None = None


def classification_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of one label per sample (image or sequence classification)."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits, labels)


def _tokens(config: Any, batch: int, seq: int, device: str) -> torch.Tensor:
    if device == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    return torch.randint(0, vocab, (batch, seq), device=device)


def _labels(config: Any, batch: int, device: str) -> torch.Tensor:
    if device == "meta":
        return torch.empty(batch, dtype=torch.long, device="meta")
    return torch.randint(0, int(getattr(config, "num_labels", 2)), (batch,), device=device)


def _lm_task(config, batch, seq, device):
    tokens = _tokens(config, batch, seq, device)
    return (tokens,), (_tokens(config, batch, seq, device),), lm_loss


def _seq2seq_task(config, batch, seq, device):
    inputs = {"input_ids": _tokens(config, batch, seq, device),
              "decoder_input_ids": _tokens(config, batch, seq, device)}
    return inputs, (_tokens(config, batch, seq, device),), lm_loss


def _image_task(config, batch, seq, device):
    size = getattr(config, "image_size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    pixels = (torch.empty(batch, channels, h, w, device="meta") if device == "meta"
              else torch.randn(batch, channels, h, w, device=device))
    return (pixels,), (_labels(config, batch, device),), classification_loss


def _sequence_classification_task(config, batch, seq, device):
    return (_tokens(config, batch, seq, device),), (_labels(config, batch, device),), \
        classification_loss


#: A transformers class name's ending -> how to make its inputs, targets and loss.
TASKS: dict[str, Callable[..., tuple[Any, tuple, Callable]]] = {
    "ForCausalLM": _lm_task,
    "LMHeadModel": _lm_task,
    "ForMaskedLM": _lm_task,
    "ForConditionalGeneration": _seq2seq_task,
    "ForSeq2SeqLM": _seq2seq_task,
    "ForImageClassification": _image_task,
    "ForSequenceClassification": _sequence_classification_task,
}


def _task_of(cls_name: str):
    for suffix, task in TASKS.items():
        if cls_name.endswith(suffix):
            return task
    return None


# ---------------------------------------------------------------------------------------------
# MODEL strings
# ---------------------------------------------------------------------------------------------

def load_workload(source: str, *, batch: int = TRACE_BATCH, seq: int | None = None,
                  attention: str = "sdpa", overrides: Mapping[str, Any] | None = None,
                  shallow: bool = True, device: str = "meta", pad_vocab: bool = False
                  ) -> Workload:
    """The workload ``source`` names: a zoo preset or family, a transformers config file or
    directory, or ``file.py:function`` (see the module docstring). ``overrides``: shape flags
    (layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq = positions). ``shallow``: build a
    deep model with :data:`CAPTURE_BLOCKS` blocks (``depth`` says how many it has).
    ``pad_vocab``: pad a zoo preset's vocabulary to :data:`VOCAB_MULTIPLE` (what a plan
    assumes, as Megatron-LM does)."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if ".py:" in source:
        path, _, function = source.rpartition(":")
        if overrides:
            raise InvalidInputError("shape flags do not apply to a model built by a function",
                                    found=f"{sorted(overrides)} with {source}",
                                    fix="let the function take its shapes, or drop the flags")
        return workload_from_function(path, function, batch=batch, seq=seq)
    if source.endswith(".json") or os.path.isdir(source):
        return workload_from_config(source, batch=batch, seq=seq, attention=attention,
                                    overrides=overrides, shallow=shallow, device=device)
    return _zoo_workload(source, batch=batch, seq=seq, attention=attention, overrides=overrides,
                         shallow=shallow, device=device, pad_vocab=pad_vocab)


def _zoo_workload(name: str, *, batch: int, seq: int | None, attention: str,
                  overrides: Mapping[str, Any], shallow: bool, device: str,
                  pad_vocab: bool) -> Workload:
    try:
        spec = resolve_spec(name, **overrides)
    except InvalidInputError as exc:
        if name.lower() in PRESETS or name.lower() in FAMILIES:
            raise
        raise InvalidInputError(
            f"unknown model {name!r}",
            expected=f"a preset ({', '.join(PRESETS)}), a family ({', '.join(FAMILIES)}), a "
                     f"transformers config.json (or a directory holding one), or "
                     f"path/to/file.py:function",
            found=repr(name),
            fix="check the spelling or the path (a config file must end in .json)") from exc
    built = dict(overrides)
    if shallow:
        built["layers"] = min(spec.layers, CAPTURE_BLOCKS)
    vocab = spec.vocab
    if pad_vocab and overrides.get("vocab") is None and spec.vocab % VOCAB_MULTIPLE:
        vocab = -(-spec.vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        built["vocab"] = vocab
    zm = build(name, device=device, attention=attention, **built)
    inputs, targets = zm.example_inputs(batch=batch, seq=min(seq or TRACE_SEQ, spec.seq))
    info = {"name": spec.name or spec.family, "family": spec.family, "layers": spec.layers,
            "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.num_kv_heads,
            "ffn_hidden": spec.ffn, "vocab": vocab, "max_seq": spec.seq,
            "overrides": dict(overrides), "attention": attention}
    if vocab != spec.vocab:
        info["vocab_padded_from"] = spec.vocab
    return Workload(info["name"], zm.model, inputs, zm.loss_fn, targets,
                    depth=spec.layers if shallow else None, info=info, max_seq=_position_limit(zm.model, spec.seq))


#: A preset's vocabulary is padded to a multiple of this (Megatron-LM's
#: --make-vocab-size-divisible-by default), so that every tensor-parallel degree up to it
#: divides the embedding, the LM head and the loss. A vocabulary given with --vocab is kept.
VOCAB_MULTIPLE = 128


def _read_config(source: str) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError as exc:  # pragma: no cover - transformers is a model dependency
        raise InvalidInputError("a transformers config needs transformers",
                                fix="pip install 'transformers>=5'") from exc
    where = source if source.endswith(".json") else os.path.join(source, "config.json")
    if not os.path.isfile(where):
        raise InvalidInputError(f"no transformers config at {source}",
                                expected="a config.json file, or a directory holding one",
                                found="nothing at that path",
                                fix="write one with config.save_pretrained(dir)")
    try:
        with open(where) as fh:
            raw = json.load(fh)
    except ValueError as exc:
        raise InvalidInputError(f"{where} is not JSON", expected="a transformers config.json",
                                found=str(exc)[:200], fix="write it with config.save_pretrained")
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise InvalidInputError(f"{where} is not a transformers config",
                                expected="a JSON object with a model_type key (what "
                                         "PretrainedConfig.save_pretrained writes)",
                                found=f"keys {sorted(raw)[:8] if isinstance(raw, dict) else type(raw).__name__}",
                                fix="write it with config.save_pretrained(dir), or pass "
                                    "path/to/file.py:function for a model of your own")
    try:
        return AutoConfig.from_pretrained(where)
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInputError(f"transformers cannot read {where}",
                                expected="a config of a model type this transformers knows",
                                found=str(exc).splitlines()[0][:300],
                                fix="upgrade transformers, or pass path/to/file.py:function") \
            from exc


def _model_class(config: Any) -> type:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None and _task_of(name) is not None:
            return cls
    # no (known) architecture: the task the config implies
    if getattr(config, "is_encoder_decoder", False):
        auto = transformers.AutoModelForSeq2SeqLM
    elif hasattr(config, "image_size") and hasattr(config, "num_channels"):
        auto = transformers.AutoModelForImageClassification
    else:
        auto = transformers.AutoModelForCausalLM
    mapping = auto._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        raise InvalidInputError(
            f"no task head for a {type(config).__name__}",
            expected=f"architectures naming a class ending in one of {sorted(TASKS)}",
            found=f"architectures {getattr(config, 'architectures', None)}",
            fix="set architectures in the config, or pass path/to/file.py:function") from None


def workload_from_config(source: str, *, batch: int = TRACE_BATCH, seq: int | None = None,
                         attention: str = "sdpa", overrides: Mapping[str, Any] | None = None,
                         shallow: bool = True, device: str = "meta") -> Workload:
    """A transformers config (file or directory) built on ``device`` with random weights."""
    config = _read_config(source)
    for flag, value in (overrides or {}).items():
        attr = CONFIG_FLAGS.get(flag)
        if attr is None or not hasattr(config, attr):
            raise InvalidInputError(f"--{flag.replace('_', '-')} does not apply to this config",
                                    expected=f"a {type(config).__name__} with {attr or flag}",
                                    found="no such field", fix="edit the config instead")
        setattr(config, attr, value)
    cls = _model_class(config)
    task = _task_of(cls.__name__)
    assert task is not None
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if attention == "sdpa" and not getattr(cls, "_supports_sdpa", True):
        attention = "eager"  # the class writes its attention out (Gemma 2, BLOOM, GPT-Neo, ...)
    if attention and getattr(config, "_attn_implementation", None) in (None, "eager", "sdpa"):
        config._attn_implementation = attention
    layers = getattr(config, "num_hidden_layers", None)
    depth = None
    built = config
    if shallow and isinstance(layers, int) and layers > CAPTURE_BLOCKS and \
            not getattr(config, "is_encoder_decoder", False):
        built = _shallow(config, CAPTURE_BLOCKS)
        depth = layers if built is not config else None
    max_seq = getattr(config, "max_position_embeddings", None)
    trace_seq = min(seq or TRACE_SEQ, max_seq or TRACE_SEQ)
    with torch.device(device):
        model = cls(built)
    model.train()
    inputs, targets, loss_fn = task(config, batch, trace_seq, device)
    name = os.path.basename(os.path.normpath(source.removesuffix("config.json") or source)) \
        or config.model_type
    if name.endswith(".json"):
        name = name.removesuffix(".json")
    info = model_info(config, name=name, cls=cls.__name__)
    if task is _image_task:
        max_seq = None
    return Workload(name, model, inputs, loss_fn, targets, depth=depth, info=info,
                    max_seq=_position_limit(model, max_seq))


def _position_limit(model: nn.Module, max_seq: int | None) -> int | None:
    """The longest sequence ``model`` can take: its position table's rows when it learns one
    (GPT-2, BERT: an ``nn.Embedding`` of ``max_position_embeddings`` rows); None when positions
    are computed (rotary, ALiBi: any length runs, context extension is the recipe's business)."""
    if max_seq is None:
        return None
    learned = any(isinstance(m, nn.Embedding) and m.num_embeddings == max_seq
                  for m in model.modules())
    return max_seq if learned else None


def _shallow(config: Any, layers: int) -> Any:
    """A copy of ``config`` with ``layers`` blocks, or ``config`` itself when per-layer fields
    (sliding-window layer types, ...) do not allow cutting it, or when its layers are stages of
    different widths (ConvNeXt's and Swin's ``num_hidden_layers`` name their stages, with a
    list per stage: ``depths``, ``hidden_sizes``, ``num_heads``): those are not repeats of one
    block."""
    depth = config.num_hidden_layers
    if any(isinstance(v, (list, tuple)) and len(v) == depth and k != "layer_types"
           for k, v in config.to_dict().items()):  # a list per stage
        return config
    copy = config.__class__.from_dict(config.to_dict())
    try:
        copy.num_hidden_layers = layers
        for key in ("layer_types",):  # per-layer lists follow the depth
            value = getattr(copy, key, None)
            if isinstance(value, list) and len(value) > layers:
                setattr(copy, key, value[-layers:])
        if hasattr(copy, "validate"):
            copy.validate()
    except Exception:  # noqa: BLE001 - the config refuses: capture the full depth
        return config
    copy._attn_implementation = config._attn_implementation
    return copy


def model_info(config: Any, *, name: str, cls: str) -> dict[str, Any]:
    """The plan document's model table from a transformers config."""
    def first(*names):
        return next((getattr(config, n) for n in names if getattr(config, n, None) is not None),
                    None)

    return {"name": name, "family": config.model_type, "class": cls,
            "layers": first("num_hidden_layers", "num_layers"),
            "hidden": first("hidden_size", "d_model"),
            "heads": first("num_attention_heads", "num_heads"),
            "kv_heads": first("num_key_value_heads"),
            "ffn_hidden": first("intermediate_size", "d_ff"),
            "vocab": first("vocab_size"), "max_seq": first("max_position_embeddings")}


def workload_from_function(path: str, function: str, *, batch: int = TRACE_BATCH,
                           seq: int | None = None) -> Workload:
    """Import ``path`` and call ``function`` (see the module docstring for the contract)."""
    where = f"{path}:{function}"
    if not os.path.isfile(path):
        raise InvalidInputError(f"no file {path}", expected="path/to/file.py:function",
                                found="nothing at that path", fix="check the path")
    module_name = f"autopar_user_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise InvalidInputError(f"cannot import {path}", expected="a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: name it and its error
        raise InvalidInputError(f"importing {path} failed", found=f"{type(exc).__name__}: {exc}",
                                fix=f"run python {path} to see the error") from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        found = ("nothing of that name" if fn is None else f"a {type(fn).__name__}")
        names = [n for n, v in vars(module).items() if inspect.isfunction(v)
                 and not n.startswith("_") and v.__module__ == module_name]
        raise InvalidInputError(f"{path} has no function {function!r}",
                                expected=f"a function returning the workload, one of {names}",
                                found=found, fix=f"check the name after the colon in {where}")
    try:
        accepted = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        accepted = {}
    kwargs: dict[str, Any] = {}
    if "batch" in accepted:
        kwargs["batch"] = batch
    if "seq" in accepted and seq is not None:
        kwargs["seq"] = seq
    elif "seq" in accepted:
        kwargs["seq"] = TRACE_SEQ
    try:
        result = fn(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise InvalidInputError(f"{where} raised", found=f"{type(exc).__name__}: {exc}",
                                fix=f"call {function}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) "
                                    f"yourself to see the error") from exc
    return _as_workload(result, where, default_name=function)


_CONTRACT = ("a Workload, (model, example_inputs, loss_fn), (model, example_inputs, loss_fn, "
             "example_targets), or a dict with those keys")


def _as_workload(result: Any, where: str, *, default_name: str) -> Workload:
    if isinstance(result, Workload):
        work = result
    elif isinstance(result, Mapping):
        missing = {"model", "example_inputs", "loss_fn"} - set(result)
        if missing:
            raise InvalidInputError(f"{where} returned a dict without {sorted(missing)}",
                                    expected=_CONTRACT, found=f"keys {sorted(result)}",
                                    fix="return model, example_inputs and loss_fn")
        work = Workload(str(result.get("name", default_name)), result["model"],
                        result["example_inputs"], result["loss_fn"],
                        result.get("example_targets", ()))
    elif isinstance(result, tuple) and len(result) in (3, 4):
        work = Workload(default_name, *result)
    else:
        found = (f"a tuple of {len(result)}" if isinstance(result, tuple)
                 else type(result).__name__)
        raise InvalidInputError(f"{where} returned the wrong things", expected=_CONTRACT,
                                found=found, fix="return (model, example_inputs, loss_fn)")
    if not isinstance(work.model, nn.Module):
        raise InvalidInputError(f"{where} returned a model that is not an nn.Module",
                                expected=_CONTRACT, found=type(work.model).__name__,
                                fix="return the torch.nn.Module first")
    if not callable(work.loss_fn):
        raise InvalidInputError(f"{where} returned a loss_fn that is not callable",
                                expected=_CONTRACT, found=type(work.loss_fn).__name__,
                                fix="return loss_fn(outputs, *targets) -> scalar")
    if not work.info:
        work = dataclasses.replace(work, info={"name": work.name,
                                               "family": type(work.model).__name__})
    return work
