"""Checkpoints that load under any plan: full-tensor keys, rectangular blocks, no pickles.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP) by every rank at
once, plus a JSON sidecar and a completion marker written by rank 0::

    <dir>/.metadata           DCP's index: for every key, the full shape and the blocks saved
    <dir>/__<rank>_0.distcp   the blocks each rank wrote (one torch.save'd tensor per block)
    <dir>/autopar.json        format version, model fingerprint, tensor table, plan, step count,
                              optimizer class and state names (JSON, never pickle)
    <dir>/COMPLETE            written last, atomically: a directory without it is never loaded

**Keys do not depend on the layout.** Every tensor is stored under the original model's
parameter name (its FQN; a tied weight once, its aliases listed in the sidecar) in its full,
global shape: ``model/<fqn>`` (the fp32 master weights under mixed precision),
``optim/<state>/<fqn>`` (element-wise optimizer state such as Adam's ``exp_avg``, in the
parameter's full shape) and ``optim/<state>/<fqn>`` as a 0-d tensor for scalar state (``step``).

**Every rank writes exactly what it holds, as rectangles of the full tensor.** A rank holds a
contiguous, row-major element range of its tensor-parallel piece of each parameter: all of it
under ZeRO-0, its ZeRO shard's intersection with the parameter under ZeRO-1/2/3 (a flat element
range, not a rectangle). A row-major element range ``[a, b)`` of a tensor of shape ``(d0, ...,
dn-1)`` is the union of at most ``2n - 1`` boxes (a partial last-dim run, partial blocks of
higher dims, whole rows in the middle, then the same on the way down), each itself a contiguous
range, so it needs no copy and no communication: :func:`flat_range_boxes`. A box of the
tensor-parallel piece maps to one box of the full tensor (``Shard(d)``: shifted along ``d``) or,
for a ``StridedShard`` (GPT-2's fused ``c_attn``: rank r holds ``[q_r; k_r; v_r]``), to one box
per block it crosses: :func:`local_box_to_global`. One copy of each element is written: the
first pipeline rank holding a tied weight, tensor-parallel rank 0 of a replicated tensor, replica
0 of a hybrid-sharded group, and under ZeRO-0 (where every data-parallel rank holds everything)
the data-parallel ranks split each parameter into equal element ranges, so writing is spread
over all ranks. Save needs no gather and no transient memory beyond DCP's copy of one block at a
time: it works the same at 100B parameters.

**Loading reads only what the new layout needs.** Each rank describes the element range it will
hold under its (new) plan the same way, as boxes of the full tensors, and DCP's resharding
(:func:`torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list`) reads the
overlaps with the saved boxes straight into the master weights and fresh optimizer-state tensors.
So a checkpoint saved at dp x pp x tp = 2 x 2 x 1 with ZeRO-2 loads at 1 x 1 x 2 with ZeRO-0,
with another bucket size, micro-batch count, schedule or world size.

**No pickles are loaded.** Tensors are read with ``torch.load(weights_only=True)`` (DCP's
reader); nothing is stored as pickled bytes (the planners refuse byte items both ways); the
metadata DCP pickles is read with an unpickler that admits only DCP's own metadata classes
(:class:`SafeFileSystemReader`); the rest is JSON.

The custom parts are two DCP planners (:class:`BlockSavePlanner`, :class:`BlockLoadPlanner`:
public extension points, documented as such by torch) that take a list of :class:`Block` (they
and the geometry above live in ``runtime/checkpoint_blocks.py``); the
DCP storage layer, index and resharding are torch's. Why not DTensor: a ZeRO shard is a flat
element range, which no DTensor placement describes; why not ShardedTensor: its constructors
for arbitrary shards are private, and it would still need the boxes computed here.

This module is runtime: it imports torch, the leaf vocabulary (:mod:`autopar.errors`,
:mod:`autopar.sharding`) and ``runtime/zero.py``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from autopar.errors import CheckpointError, InvalidInputError, PlanMismatchError
from autopar.runtime.comm import agree_on_success
from autopar.runtime.checkpoint_blocks import (Block, BlockLoadPlanner, BlockSavePlanner,
                                               TensorLayout, flat_range_boxes,
                                               local_box_to_global, range_blocks)

__all__ = ["TensorLayout", "Block", "flat_range_boxes", "local_box_to_global", "save", "load",
           "read_sidecar", "is_complete", "latest", "latest_step", "complete_step_dir",
           "step_dir", "SafeFileSystemReader", "BlockSavePlanner", "BlockLoadPlanner", "SIDECAR",
           "COMPLETE", "FORMAT_VERSION"]

FORMAT = "autopar-checkpoint"
FORMAT_VERSION = 1
SIDECAR = "autopar.json"
COMPLETE = "COMPLETE"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
#: Buffers a training forward updates (BatchNorm's running statistics): model state too.
BUFFER_PREFIX = "buffer/"
_STEP_DIR = re.compile(r"^step-(\d+)$")

#: What DCP's pickled ``.metadata`` may reference (checked by :class:`_MetadataUnpickler`).
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "PureWindowsPath")} | {
    ("torch", name) for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32",
                                 "int16", "int8", "uint8", "bool", "strided")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _METADATA_GLOBALS:
            raise InvalidInputError(
                "the checkpoint's .metadata references an object outside DCP's metadata classes",
                expected="only torch.distributed.checkpoint metadata types",
                found=f"{module}.{name}",
                fix="load only checkpoints written by autopar / torch.distributed.checkpoint")
        return super().find_class(module, name)


def read_metadata(path: str) -> Metadata:
    """DCP's ``.metadata`` of ``path``, unpickled with only DCP's metadata classes allowed."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise InvalidInputError("the checkpoint's .metadata is not DCP metadata",
                                found=type(metadata).__name__)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_metadata` (DCP's own reader
    unpickles it unrestricted; tensors it already reads with ``weights_only=True``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise InvalidInputError("per-rank DCP metadata is not an autopar format")
        metadata = read_metadata(str(self.path))
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------------------------
# What a data-parallel engine holds, per parameter
# ---------------------------------------------------------------------------------------------

@dataclass
class _Held:
    """One parameter on this rank: the element range of its tp piece it holds (master weights
    and optimizer piece) and the range it writes."""

    name: str
    layout: TensorLayout
    numel: int
    held: tuple[int, int] | None
    master: torch.Tensor | None  # 1-D view of the held range of the master weights
    piece: Any  # the optimizer's tensor for the held range (None: frozen or nothing held)
    write: tuple[int, int] | None

    def flat_master(self, a: int, b: int) -> torch.Tensor:
        return self.master[a - self.held[0]:b - self.held[0]]


def _held(engine: Any, layouts: Mapping[str, TensorLayout]) -> list[_Held]:
    from autopar.runtime.zero import ZeroStage

    out = []
    for bucket in engine.buckets:
        pieces = {name: piece for name, piece, _, _ in bucket.pieces}
        g = bucket.groups
        for slot in bucket.slots:
            layout = layouts[slot.name]
            if tuple(slot.shape) != layout.local_shape:
                raise PlanMismatchError(f"{slot.name} ({layout.key}) has local shape "
                                        f"{tuple(slot.shape)}, its layout says "
                                        f"{layout.local_shape}")
            n = slot.numel
            if bucket.stage is ZeroStage.NONE:
                held = (0, n)
                master = bucket.master[slot.offset:slot.offset + n]
                lo, hi = g.dp_rank * n // g.dp_size, (g.dp_rank + 1) * n // g.dp_size
                write = (lo, hi) if layout.writes and hi > lo else None
            else:
                own = bucket.own
                a, b = max(own.start, slot.offset), min(own.stop, slot.offset + n)
                held = (a - slot.offset, b - slot.offset) if a < b else None
                master = bucket.master[a - own.start:b - own.start] if held else None
                write = held if held and layout.writes and g.replicate_rank == 0 else None
            out.append(_Held(slot.name, layout, n, held, master,
                             pieces.get(slot.name) if held else None, write))
    return out


def _local_state_names(engine: Any) -> tuple[list[str], list[str]]:
    """Element-wise and scalar optimizer state names of this rank's pieces."""
    elementwise, scalar = set(), set()
    for state in engine.optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                (scalar if v.dim() == 0 else elementwise).add(k)
            elif v is not None:
                raise InvalidInputError(f"optimizer state {k!r} is a {type(v).__name__}",
                                        expected="tensor state (element-wise or 0-d)",
                                        fix="use a torch optimizer whose state is tensors")
    return sorted(elementwise), sorted(scalar)


def _agree(problem: Exception | None, what: str, payload: Any = None) -> list[Any]:
    """Collective: every rank learns whether any rank failed, and all raise (none is left
    waiting in DCP's collectives); returns every rank's ``payload``."""
    return agree_on_success(problem, what, payload)


def _optim_key(state: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{state}/{key}"


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------

def _save_blocks(engine: Any, layouts: Mapping[str, TensorLayout], elementwise: Sequence[str],
                 scalar: Sequence[str]) -> list[Block]:
    """What this rank writes: its share of every parameter and of its optimizer state."""
    blocks: list[Block] = []
    for h in _held(engine, layouts):
        if h.write is None:
            continue
        a, b = h.write
        blocks += range_blocks(h.layout, a, b, h.flat_master(a, b), MODEL_PREFIX + h.layout.key)
        if h.piece is None:
            continue
        state = engine.optimizer.state.get(h.piece, {})
        for name in elementwise:
            value = state.get(name)
            flat = (value.detach().reshape(-1) if isinstance(value, torch.Tensor)
                    else torch.zeros_like(h.piece).reshape(-1))
            if flat.numel() != h.held[1] - h.held[0]:
                raise InvalidInputError(f"optimizer state {name!r} of {h.layout.key} is not "
                                        f"element-wise", expected=f"{h.held[1] - h.held[0]} "
                                        f"elements, like the parameter", found=str(flat.numel()))
            flat = flat[a - h.held[0]:b - h.held[0]]
            blocks += range_blocks(h.layout, a, b, flat, _optim_key(name, h.layout.key))
        if a == 0 and h.layout.tp_rank == 0:  # one writer per scalar: the holder of element 0
            for name in scalar:
                value = state.get(name)
                value = (value.detach().reshape(()) if isinstance(value, torch.Tensor)
                         else torch.zeros((), dtype=torch.float32))
                blocks.append(Block(_optim_key(name, h.layout.key), (), (), value))
    return blocks


def save(path: str, engine: Any, layouts: Mapping[str, TensorLayout],
         sidecar: Mapping[str, Any],
         buffers: Sequence[tuple[TensorLayout, torch.Tensor]] = ()) -> None:
    """Write ``engine``'s master weights and optimizer state under ``layouts``' keys, and the
    ``buffers`` (each the local tensor of a layout: written where ``writes``), then the sidecar
    and the completion marker (rank 0). Collective over the world; call between steps."""
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    problem, names = None, ([], [])
    try:
        if dist.get_rank() == 0 and os.path.isdir(path):  # an overwrite: incomplete until it
            for name in os.listdir(path):  # ends, and no blocks of a larger world left behind
                if name in (COMPLETE, SIDECAR, ".metadata") or name.endswith(".distcp"):
                    os.remove(os.path.join(path, name))
        os.makedirs(path, exist_ok=True)
        names = _local_state_names(engine)
    except OSError as exc:
        problem = CheckpointError.unwritable(path, exc)
        problem.__cause__ = exc
    except InvalidInputError as exc:
        problem = exc
    gathered = _agree(problem, "checkpoint save", names)  # (after rank 0's clean-up)
    elementwise = sorted(set().union(*(set(e) for e, _ in gathered)))
    scalar = sorted(set().union(*(set(s) for _, s in gathered)))
    problem, blocks = None, []
    try:
        blocks = _save_blocks(engine, layouts, elementwise, scalar)
        for layout, tensor in buffers:
            if layout.writes:
                blocks += range_blocks(layout, 0, tensor.numel(),
                                       tensor.detach().reshape(-1).contiguous(),
                                       BUFFER_PREFIX + layout.key)
    except (InvalidInputError, PlanMismatchError) as exc:
        problem = exc
    _agree(problem, "checkpoint save")
    try:  # DCP gathers every rank's write errors and raises them on all
        dcp.save({}, storage_writer=dcp.FileSystemWriter(path), planner=BlockSavePlanner(blocks))
    except Exception as exc:  # noqa: BLE001 - torch's CheckpointException wraps the OSErrors
        raise CheckpointError.unwritable(path, exc) from exc
    problem = None
    if dist.get_rank() == 0:
        payload = {"format": FORMAT, "format_version": FORMAT_VERSION,
                   "optimizer_state": {"elementwise": elementwise, "scalar": scalar},
                   "saved_at": time.time(), **sidecar}
        try:
            _write_atomically(os.path.join(path, SIDECAR), json.dumps(payload, indent=1))
            _write_atomically(os.path.join(path, COMPLETE), f"{FORMAT} {FORMAT_VERSION}\n")
        except OSError as exc:  # no marker: the directory is never loaded as a checkpoint
            problem = CheckpointError.unwritable(path, exc)
            problem.__cause__ = exc
    _agree(problem, "checkpoint save")


def _load_blocks(engine: Any, layouts: Mapping[str, TensorLayout], metadata: Mapping[str, Any],
                 elementwise: Sequence[str], scalar: Sequence[str]
                 ) -> tuple[list[Block], dict[int, dict[str, torch.Tensor]]]:
    """What this rank reads (views into its master weights and into fresh optimizer state, by
    piece), checked against the checkpoint's index."""
    blocks: list[Block] = []
    fresh: dict[int, dict[str, torch.Tensor]] = {}
    for h in _held(engine, layouts):
        if h.held is None:
            continue
        a, b = h.held
        blocks += range_blocks(h.layout, a, b, h.master, MODEL_PREFIX + h.layout.key)
        if h.piece is None or not (elementwise or scalar):
            continue
        # Read into the existing state tensors where they fit (no second copy of the optimizer
        # state while loading), else into new ones.
        existing = engine.optimizer.state.get(h.piece, {})
        state: dict[str, torch.Tensor] = {}
        for name in elementwise:
            old = existing.get(name)
            fits = (isinstance(old, torch.Tensor) and old.shape == h.piece.shape
                    and old.dtype == h.piece.dtype and old.is_contiguous())
            state[name] = old if fits else torch.zeros_like(h.piece)
            blocks += range_blocks(h.layout, a, b, state[name].view(-1),
                                   _optim_key(name, h.layout.key))
        for name in scalar:
            md = metadata.get(_optim_key(name, h.layout.key))
            dtype = md.properties.dtype if isinstance(md, TensorStorageMetadata) else torch.float32
            old = existing.get(name)
            fits = isinstance(old, torch.Tensor) and old.dim() == 0 and old.dtype == dtype
            state[name] = old if fits else torch.zeros((), dtype=dtype)
            blocks.append(Block(_optim_key(name, h.layout.key), (), (), state[name]))
        fresh[id(h.piece)] = state
    for blk in blocks:
        md = metadata.get(blk.key)
        if not isinstance(md, TensorStorageMetadata):
            raise PlanMismatchError(f"the checkpoint has no tensor {blk.key}",
                                    expected="every parameter of this model (and the optimizer "
                                             "state the checkpoint lists)",
                                    found=f"{len(metadata)} entries",
                                    fix="load a checkpoint of this model")
        if tuple(md.size) != tuple(blk.full_shape):
            raise PlanMismatchError(f"{blk.key} has another shape in the checkpoint",
                                    expected=str(tuple(blk.full_shape)), found=str(tuple(md.size)),
                                    fix="load a checkpoint of this model")
        stored = sum(math.prod(c.sizes) for c in md.chunks)
        if stored != math.prod(md.size):
            raise InvalidInputError(f"the checkpoint holds {stored} of the {math.prod(md.size)} "
                                    f"elements of {blk.key}", fix="the checkpoint is damaged")
    return blocks, fresh


def load(path: str, engine: Any, layouts: Mapping[str, TensorLayout],
         sidecar: Mapping[str, Any],
         buffers: Sequence[tuple[TensorLayout, torch.Tensor]] = ()) -> list[str]:
    """Read into ``engine`` (master weights, optimizer state, then the compute parameters) what
    this rank holds under ``layouts``, and into ``buffers`` (contiguous local tensors) their
    parts; returns the buffers the checkpoint does not hold (one saved before they were), left
    as they are. Collective over the world; call between steps."""
    import torch.distributed.checkpoint as dcp
    from autopar.runtime.zero import ZeroStage

    path = os.fspath(path)
    names = sidecar.get("optimizer_state", {})
    elementwise, scalar = list(names.get("elementwise", ())), list(names.get("scalar", ()))
    problem, blocks, fresh, absent = None, [], {}, []
    try:
        metadata = read_metadata(path).state_dict_metadata
        blocks, fresh = _load_blocks(engine, layouts, metadata, elementwise, scalar)
        for layout, tensor in buffers:
            key = BUFFER_PREFIX + layout.key
            if key not in metadata:
                absent.append(layout.key)
                continue
            if tuple(metadata[key].size) != tuple(layout.stored_shape or layout.full_shape):
                raise PlanMismatchError(f"buffer {layout.key} has another shape in the "
                                        f"checkpoint", expected=str(tuple(layout.full_shape)),
                                        found=str(tuple(metadata[key].size)),
                                        fix="load a checkpoint of this model")
            blocks += range_blocks(layout, 0, tensor.numel(), tensor.view(-1), key)
    except (OSError, InvalidInputError, PlanMismatchError) as exc:
        problem = exc
    _agree(problem, "checkpoint load")  # nothing is overwritten unless every rank can load
    for bucket in engine.buckets:
        if bucket.stage is ZeroStage.PARAMETERS:
            bucket.free()  # regathered from the loaded shard at the next forward
    dcp.load({}, storage_reader=SafeFileSystemReader(path), planner=BlockLoadPlanner(blocks))
    optimizer = engine.optimizer
    current = optimizer.state_dict()
    pieces = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.load_state_dict({"state": {i: fresh[id(p)] for i, p in enumerate(pieces)
                                         if id(p) in fresh},
                               "param_groups": current["param_groups"]})
    with torch.no_grad():  # master -> compute parameters (gathered under ZeRO-1/2)
        for bucket in engine.buckets:
            bucket.after_step()
        for bucket in engine.buckets:
            bucket.wait_gather()
    _barrier("checkpoint load")
    return absent


def _barrier(what: str) -> None:
    from autopar.runtime.zero import wait_work

    if dist.get_world_size() > 1:
        wait_work(dist.barrier(async_op=True), what)


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# Directories
# ---------------------------------------------------------------------------------------------

def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def read_sidecar(path: str) -> dict[str, Any]:
    """The checkpoint's JSON sidecar, after checking the directory is a complete checkpoint."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InvalidInputError(f"no checkpoint at {path}", expected="a directory written by "
                                "ParallelModel.save", found="nothing there",
                                fix="check the path (autopar.runtime.checkpoint.latest(root) finds "
                                    "the newest complete checkpoint under a root)")
    if not is_complete(path):
        raise InvalidInputError(f"the checkpoint at {path} is incomplete",
                                expected=f"a {COMPLETE} marker (written after every rank saved)",
                                found="no marker: the save was interrupted or is still running",
                                fix="load an earlier checkpoint (latest() skips incomplete ones)")
    with open(os.path.join(path, SIDECAR)) as f:
        sidecar = json.load(f)
    if sidecar.get("format") != FORMAT or sidecar.get("format_version") != FORMAT_VERSION:
        raise PlanMismatchError(f"{path} is not an autopar checkpoint of format "
                                f"{FORMAT_VERSION}",
                                found=f"format {sidecar.get('format')!r} version "
                                      f"{sidecar.get('format_version')!r}",
                                fix="load it with the autopar version that wrote it")
    return sidecar


def step_dir(root: str, step: int) -> str:
    """The directory :func:`latest` expects for the checkpoint of ``step``: ``root/step-<step>``."""
    return os.path.join(os.fspath(root), f"step-{int(step):08d}")


def _complete_steps(root: str) -> dict[int, str]:
    """Step -> directory of the complete checkpoints under ``root``."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return {}
    found = {}
    for name in sorted(os.listdir(root)):
        m = _STEP_DIR.match(name)
        if m and is_complete(os.path.join(root, name)):
            found[int(m.group(1))] = os.path.join(root, name)
    return found


def latest_step(root: str) -> int | None:
    """The highest step with a complete checkpoint under ``root`` (``step-<N>`` directories),
    or None. Incomplete ones (no marker: a save interrupted by a lost rank) are skipped."""
    found = _complete_steps(root)
    return max(found) if found else None


def latest(root: str) -> str | None:
    """The directory of :func:`latest_step`'s checkpoint, or None."""
    found = _complete_steps(root)
    return found[max(found)] if found else None


def complete_step_dir(root: str, step: int) -> str:
    """The complete checkpoint directory of ``step`` under ``root`` (however its number is
    padded)."""
    found = _complete_steps(root)
    if step not in found:
        raise InvalidInputError(f"no complete checkpoint of step {step} under {root}",
                                found=f"steps {sorted(found)}")
    return found[step]
