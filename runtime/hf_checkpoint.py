"""Hugging Face safetensors checkpoints, read by shard.

A checkpoint directory as ``save_pretrained`` writes it: ``model.safetensors``, or several shard
files and ``model.safetensors.index.json`` (its ``weight_map``: tensor name -> file). Opening it
(:class:`SafetensorsCheckpoint`) reads only the files' headers: names, shapes, dtypes. Every
rank then reads only the slices it holds (:meth:`SafetensorsCheckpoint.read`): safetensors maps
the file and ``get_slice`` copies just the requested ranges, so no rank holds a whole file, and
no more than one full tensor, in memory.

A checkpoint's names need not be the model's (:class:`KeyMap`): transformers renames some on
load (ViT's ``encoder.layer.N.attention.attention.query`` is its model's
``layers.N.attention.q_proj``) and converts others, one model tensor made of several checkpoint
tensors (a Mixtral's ``experts.E.w1`` and ``w3`` fused into ``experts.gate_up_proj``). A renamed
tensor is read by slice under its checkpoint name; a converted one is made whole from its
sources (one group of tensors at a time) and then sliced. The front end builds the map from
transformers' own transforms (``autopar/hf_names.py``); this module knows names and functions
only.

Checked before any training step, on every rank alike (every rank reads the same headers, so
every rank raises the same named error, and none waits on another): an index naming a missing
file, a file that is not a complete safetensors file, tensors the model has and the checkpoint
lacks (a tied weight is found under any of its names), tensors the checkpoint has and the model
lacks, shapes that differ (a converted tensor's from converting its sources' shapes on the meta
device), and non-floating dtypes that differ (floating ones are converted to the dtype the plan
stores).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from autopar.errors import InvalidInputError
from autopar.sharding import Replicate, shard_slices

__all__ = ["SafetensorsCheckpoint", "SafetensorsWriter", "TensorEntry", "KeyMap", "parse_size",
           "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: How many offending names an error lists.
_SHOWN = 5

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """What the model expects of one checkpoint tensor: its names (a tied weight has several),
    full shape, the dtype it is stored at, and whether the checkpoint must hold it."""

    fqn: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    required: bool = True


#: Makes the model tensors of one conversion group from a reader of whole checkpoint tensors
#: (by checkpoint key): {model name: tensor}.
Convert = Callable[[Callable[[str], torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class KeyMap:
    """Where a checkpoint holds the model's tensors when not under the model's own names.

    ``renamed``: model name -> checkpoint key, one tensor for one. ``converted``: model name ->
    (the group's id, the checkpoint keys it reads, the function making the group's model
    tensors); every model tensor of a group names the same function. ``consumed``: every
    checkpoint key some group reads."""

    renamed: Mapping[str, str] = field(default_factory=dict)
    converted: Mapping[str, tuple[str, tuple[str, ...], Convert]] = field(default_factory=dict)

    @property
    def consumed(self) -> frozenset[str]:
        return frozenset(k for _, keys, _ in self.converted.values() for k in keys)


def _listing(items: Sequence[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return "; ".join(items[:_SHOWN]) + more


class SafetensorsCheckpoint:
    """The headers of a safetensors checkpoint directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike,
                 keys: KeyMap | Callable[[Iterable[str]], KeyMap | None] | None = None) -> None:
        """``keys``: the checkpoint's :class:`KeyMap`, or a function of its tensor names
        returning one (None: the model's names)."""
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        #: The last conversion group's model tensors not read yet (group id, {name: tensor}).
        self._group: tuple[str, dict[str, torch.Tensor]] | None = None
        if not self.path.is_dir():
            raise InvalidInputError(f"checkpoint {self.path} is not a directory",
                                    expected=f"a directory holding {SINGLE_FILE} or {INDEX_FILE}",
                                    fix="pass the directory save_pretrained wrote")
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidInputError(f"{index} is not a safetensors index",
                                        expected='JSON with a "weight_map" of tensor -> file',
                                        found=f"{type(exc).__name__}: {exc}") from None
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).exists():
            files, weight_map = [SINGLE_FILE], None
        else:
            raise InvalidInputError(f"no safetensors checkpoint in {self.path}",
                                    expected=f"{SINGLE_FILE}, or {INDEX_FILE} and its shard files",
                                    found=", ".join(sorted(p.name for p in self.path.iterdir()))
                                    or "an empty directory",
                                    fix="save the model with save_pretrained (safe_serialization)")
        missing = [f for f in files if not (self.path / f).exists()]
        if missing:
            raise InvalidInputError(f"the index of {self.path} names shard files that are not there",
                                    expected=f"every file of {INDEX_FILE}'s weight_map",
                                    found=f"missing: {_listing(missing)}",
                                    fix="copy the whole checkpoint directory")
        #: tensor name -> (file, shape, dtype as safetensors spells it)
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for name in files:
            try:
                with safe_open(self.path / name, framework="pt") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        self.tensors[key] = (name, tuple(int(d) for d in sl.get_shape()),
                                             sl.get_dtype())
            except (SafetensorError, OSError, ValueError) as exc:
                raise InvalidInputError(f"{self.path / name} is not a complete safetensors file",
                                        found=f"{type(exc).__name__}: {exc}",
                                        fix="write the checkpoint again (a copy may have been cut "
                                            "short)") from None
        if weight_map is not None:
            astray = sorted(k for k, f in weight_map.items()
                            if k not in self.tensors or self.tensors[k][0] != f)
            if astray:
                raise InvalidInputError(f"the index of {self.path} does not match its files",
                                        expected="every tensor of the weight_map in its file",
                                        found=f"not found there: {_listing(astray)}")
        if callable(keys):
            keys = keys(list(self.tensors))
        self.keys: KeyMap = keys or KeyMap()

    def check(self, entries: Iterable[TensorEntry], *, other_names: Iterable[str] = ()) -> None:
        """Raise :class:`InvalidInputError` unless the checkpoint fits ``entries``: every
        required tensor present under one of its names, shapes equal, dtypes convertible, and no
        checkpoint tensor that is none of ``entries``' names or ``other_names`` (the model's
        other tensors, e.g. its non-persistent buffers)."""
        entries = list(entries)
        known = set(other_names) | self.keys.consumed
        missing, reshaped, retyped, unmade = [], [], [], []
        for e in entries:
            known.update(e.names)
            key = self.key_of(e)
            dtype: str | torch.dtype
            if key is not None:
                known.add(key)
                _, shape, dtype = self.tensors[key]
            elif self._group_of(e) is not None:
                made = self._converted_header(e)
                if isinstance(made, str):
                    unmade.append(f"{e.fqn} ({made})")
                    continue
                shape, dtype = made
            else:
                if e.required:
                    missing.append(f"{e.fqn} {tuple(e.shape)}")
                continue
            key = key or f"{e.fqn} (converted)"
            if shape != tuple(e.shape):
                reshaped.append(f"{key}: expected {tuple(e.shape)}, found {shape}")
            found = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
            if found is None or found.is_floating_point != e.dtype.is_floating_point or (
                    not found.is_floating_point and found != e.dtype):
                retyped.append(f"{key}: expected {str(e.dtype).removeprefix('torch.')}, found "
                               f"{dtype}")
        unexpected = sorted(k for k in self.tensors if k not in known)
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {_listing(missing)}")
        if unmade:
            problems.append(f"not made by converting the checkpoint's tensors: {_listing(unmade)}")
        if unexpected:
            problems.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
        if reshaped:
            problems.append(f"shapes differ: {_listing(reshaped)}")
        if retyped:
            problems.append(f"dtypes differ: {_listing(retyped)}")
        if problems:
            raise InvalidInputError(f"the checkpoint at {self.path} does not fit the model",
                                    expected=f"the model's {len(entries)} tensors by name, shape "
                                             f"and dtype",
                                    found=" | ".join(problems),
                                    fix="load a checkpoint saved from this model's "
                                        "configuration")

    def key_of(self, entry: TensorEntry) -> str | None:
        """The name the checkpoint holds ``entry`` under, as it is or renamed (None: it does
        not hold it as one tensor)."""
        direct = next((n for n in entry.names if n in self.tensors), None)
        if direct is not None:
            return direct
        return next((self.keys.renamed[n] for n in entry.names
                     if self.keys.renamed.get(n) in self.tensors), None)

    def holds(self, entry: TensorEntry) -> bool:
        """Whether the checkpoint holds ``entry``: as one tensor, or as a conversion's sources."""
        return self.key_of(entry) is not None or self._group_of(entry) is not None

    def _group_of(self, entry: TensorEntry) -> tuple[str, str, tuple[str, ...], Convert] | None:
        """(the model name, the group's id, sources, function) that makes ``entry``."""
        for n in entry.names:
            group = self.keys.converted.get(n)
            if group is not None and all(k in self.tensors for k in group[1]):
                return (n, *group)
        return None

    def _converted_header(self, entry: TensorEntry
                          ) -> tuple[tuple[int, ...], torch.dtype] | str:
        """The shape and dtype of a converted tensor: its group converted on the meta device,
        from its sources' headers; or why the conversion does not make it."""
        name, _, keys, convert = self._group_of(entry)  # type: ignore[misc]

        def header(key: str) -> torch.Tensor:
            _, shape, dtype = self.tensors[key]
            return torch.empty(shape, dtype=_DTYPES.get(dtype, torch.float32), device="meta")

        try:
            out = convert(header).get(name)
        except Exception as exc:  # noqa: BLE001 - its sources do not fit together
            return (f"{len(keys)} source tensors, {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}"[:200])
        if out is None:
            return "its conversion group does not make it"
        return tuple(int(d) for d in out.shape), out.dtype

    def _converted(self, entry: TensorEntry) -> torch.Tensor:
        """``entry`` whole, made by its conversion group from its sources read whole; the
        group's other tensors are kept for the reads that follow (one group at a time)."""
        from safetensors import safe_open

        name, gid, _, convert = self._group_of(entry)  # type: ignore[misc]
        if self._group is None or self._group[0] != gid or name not in self._group[1]:
            def whole(key: str) -> torch.Tensor:
                with safe_open(self.path / self.tensors[key][0], framework="pt") as f:
                    return f.get_tensor(key)

            self._group = (gid, dict(convert(whole)))
        return self._group[1].pop(name)

    def read(self, entry: TensorEntry, placement: Any = None, tp: int = 1,
             tp_rank: int = 0) -> torch.Tensor:
        """Rank ``tp_rank``'s piece of ``entry`` under ``placement`` (whole when replicated),
        reading only that piece from its file (a converted tensor is made whole first), at
        ``entry.dtype``."""
        from safetensors import safe_open

        key = self.key_of(entry)
        if key is None and self._group_of(entry) is not None:
            full = self._converted(entry)
            if placement is None or isinstance(placement, Replicate) or tp == 1:
                return full.to(entry.dtype).contiguous()
            dim = placement.dim
            pieces = [full.narrow(dim, a, b - a)
                      for a, b in shard_slices(full.shape[dim], placement, tp, tp_rank)]
            return torch.cat(pieces, dim=dim).to(entry.dtype).contiguous()
        if key is None:
            raise InvalidInputError(f"the checkpoint at {self.path} has no {entry.fqn}",
                                    expected=f"one of {list(entry.names)}")
        file, shape, _ = self.tensors[key]
        with safe_open(self.path / file, framework="pt") as f:
            sl = f.get_slice(key)
            if placement is None or isinstance(placement, Replicate) or tp == 1:
                pieces = [sl[tuple(slice(None) for _ in shape)] if shape else f.get_tensor(key)]
                dim = 0
            else:
                dim = placement.dim
                pieces = []
                for a, b in shard_slices(shape[dim], placement, tp, tp_rank):
                    index = tuple(slice(a, b) if d == dim else slice(None)
                                  for d in range(len(shape)))
                    pieces.append(sl[index])
            # no copy of our own: a piece is a view of the file's mapping (kept alive by the
            # tensor, not by the file handle) that the caller copies where it belongs and drops,
            # which lets the mapped pages go; a concatenation or a dtype change copies anyway
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
            return out.to(entry.dtype).contiguous()



_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``, ``200MB``, ``20KB`` (save_pretrained's spelling) or an integer."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper()
    for unit, scale in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * scale)
    raise InvalidInputError(f"max_shard_size={size!r} is not a size",
                            expected="a positive number of bytes, or e.g. '5GB', '200MB'")


class SafetensorsWriter:
    """Writes a Hugging Face safetensors checkpoint one tensor at a time, so the writer never
    holds more than the tensor it is given: each file's header (names, dtypes, shapes, offsets:
    the safetensors format) is laid out from the tensors' shapes before any data is written.
    Files are filled in order up to ``max_shard_bytes`` (one ``model.safetensors`` when all fit,
    else ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``, as
    ``save_pretrained`` names them). Everything is written to a hidden directory beside ``path``
    and renamed onto it at :meth:`commit`, so a crash leaves no half checkpoint at ``path``."""

    def __init__(self, path: str | os.PathLike,
                 tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int) -> None:
        self.path = Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise InvalidInputError(f"{self.path} exists and is not an empty directory",
                                    fix="save to a new directory")
        files: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        for name, shape, dtype in tensors:
            nbytes = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                nbytes *= int(d)
            if files[-1] and size + nbytes > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append((name, tuple(int(d) for d in shape), dtype, nbytes))
            size += nbytes
        n = len(files)
        self.names = ["model.safetensors"] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.files = files
        self.order = [(name, shape, dtype) for f in files for name, shape, dtype, _ in f]
        self.tmp = self.path.parent / f".{self.path.name}.partial-{os.getpid()}"
        self.tmp.mkdir(parents=True)
        self._next = 0
        self._file_index = -1
        self._handle: Any = None
        self._left_in_file = 0

    def _open_next_file(self) -> None:
        self._file_index += 1
        header: dict[str, Any] = {}
        offset = 0
        for name, shape, dtype, nbytes in self.files[self._file_index]:
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._handle = open(self.tmp / self.names[self._file_index], "wb")
        self._handle.write(len(text).to_bytes(8, "little") + text)
        self._left_in_file = len(self.files[self._file_index])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor, in the order given at construction, at its shape and dtype."""
        want_name, shape, dtype = self.order[self._next]
        if name != want_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise InvalidInputError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} out of "
                                    f"order", expected=f"{want_name} {shape} {dtype}")
        if self._left_in_file == 0:
            if self._handle is not None:
                self._handle.close()
            self._open_next_file()
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(data.numpy().tobytes())
        self._left_in_file -= 1
        self._next += 1

    def commit(self, extra: Any = None) -> None:
        """Close the last file, write the index when there are several, let ``extra(directory)``
        add files (a model's config.json), then move the checkpoint to ``path``."""
        if self._next != len(self.order):
            raise InvalidInputError("the checkpoint is incomplete",
                                    expected=f"{len(self.order)} tensors", found=str(self._next))
        if self._handle is not None:
            self._handle.close()
        if len(self.names) > 1:
            total = sum(nbytes for f in self.files for *_, nbytes in f)
            weight_map = {name: self.names[i] for i, f in enumerate(self.files)
                          for name, *_ in f}
            (self.tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if extra is not None:
            extra(self.tmp)
        if self.path.exists():
            self.path.rmdir()  # empty (checked at construction)
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Remove what was written (nothing is left at ``path``)."""
        import shutil

        if self._handle is not None:
            self._handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
