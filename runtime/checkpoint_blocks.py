"""The geometry of autopar's checkpoints: what a rank holds as boxes of full tensors, and the
two ``torch.distributed.checkpoint`` planners that write and read exactly those boxes.

A rank holds a contiguous row-major element range of its tensor-parallel piece of each
parameter (:class:`TensorLayout` says how that piece sits in the full tensor). An element range
of a tensor of ``n`` dims is the union of at most ``2n - 1`` boxes, each contiguous
(:func:`flat_range_boxes`); a box of the piece is one box of the full tensor under ``Shard(d)``
and one per block it crosses under ``StridedShard`` (:func:`local_box_to_global`);
:func:`range_blocks` turns a rank's flat element range into :class:`Block` views, cut to the
model's stored shape where the program pads the tensor. :class:`BlockSavePlanner` and
:class:`BlockLoadPlanner` are DCP's public planner extension points over those blocks. What is
saved, when and where is ``runtime/checkpoint.py``'s.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autopar.errors import InvalidInputError
from autopar.sharding import Replicate, is_sharded, num_blocks, placement_str

__all__ = ["Box", "TensorLayout", "Block", "flat_range_boxes", "local_box_to_global",
           "range_blocks", "stored_part", "BlockSavePlanner", "BlockLoadPlanner"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """How one rank's local tensor sits in the full tensor it is a piece of.

    ``key``: the layout-independent name (the model's FQN). ``placement`` over the
    tensor-parallel axis (``Replicate``, ``Shard(d)``, ``StridedShard(d, k)``) with ``tp`` ranks,
    this one ``tp_rank``. ``writes``: this copy is the one saved (False on the second pipeline
    rank holding a tied weight, and on tp ranks > 0 for a replicated tensor).
    """

    key: str
    full_shape: tuple[int, ...]
    placement: Any = field(default_factory=Replicate)
    tp: int = 1
    tp_rank: int = 0
    writes: bool = True
    #: The shape stored, where the program pads the tensor (a vocabulary padded to a multiple of
    #: 128 x tp): blocks are cut to it, so a checkpoint holds the model's own shape whatever tp
    #: wrote it (None: ``full_shape``).
    stored_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.placement, Replicate) or is_sharded(self.placement)):
            raise ValueError(f"{self.key}: a stored tensor is Replicate, Shard or StridedShard "
                             f"over tp, not {placement_str(self.placement)}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if is_sharded(self.placement):
            shape[self.placement.dim] //= self.tp
        return tuple(shape)


@dataclass(frozen=True, slots=True)
class Block:
    """A box of the full tensor ``key`` and the local tensor (a view) it is written from or read
    into; ``tensor.shape`` is the box's size."""

    key: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Geometry: element ranges -> boxes -> boxes of the full tensor
# ---------------------------------------------------------------------------------------------

def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes, in order, whose union is the row-major element range ``[start, stop)`` of a
    tensor of ``shape``; each box is itself a contiguous element range (at most 2n - 1 boxes
    for n dims). A 0-d tensor is one empty box for ``[0, 1)``."""
    shape = tuple(int(d) for d in shape)
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    zeros = (0,) * (len(shape) - 1)
    if start % inner == 0 and stop % inner == 0:
        return [((first,) + zeros, (last - first + 1,) + shape[1:])]
    if first == last:
        return [((first,) + off, (1,) + size)
                for off, size in flat_range_boxes(shape[1:], start - first * inner,
                                                  stop - first * inner)]
    out: list[Box] = []
    full_from = first
    if start % inner:
        out += [((first,) + off, (1,) + size)
                for off, size in flat_range_boxes(shape[1:], start - first * inner, inner)]
        full_from = first + 1
    full_to = stop // inner
    if full_to > full_from:
        out.append(((full_from,) + zeros, (full_to - full_from,) + shape[1:]))
    if stop % inner:
        out += [((full_to,) + off, (1,) + size)
                for off, size in flat_range_boxes(shape[1:], 0, stop - full_to * inner)]
    return out


def local_box_to_global(layout: TensorLayout, offsets: Sequence[int], sizes: Sequence[int]
                        ) -> list[tuple[int, int, tuple[int, ...]]]:
    """A box of this rank's tensor-parallel piece as boxes of the full tensor:
    ``(start, length, global offsets)`` where ``start, length`` narrow the local box along the
    sharded dim (the whole box when nothing is cut)."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    p = layout.placement
    if not is_sharded(p):
        return [(0, 0, offsets)]  # the whole box
    d = p.dim
    k = num_blocks(p)
    block = layout.full_shape[d] // k  # a block of the full dim, cut tp ways
    piece = block // layout.tp  # this rank's run of each block
    out = []
    lo, hi = offsets[d], offsets[d] + sizes[d]
    i = lo
    while i < hi:
        segment = i // piece
        end = min(hi, (segment + 1) * piece)
        glob = list(offsets)
        glob[d] = segment * block + layout.tp_rank * piece + (i - segment * piece)
        out.append((i - lo, end - i, tuple(glob)))
        i = end
    return out


def range_blocks(layout: TensorLayout, start: int, stop: int, flat: torch.Tensor,
                 key: str | None = None) -> list[Block]:
    """Blocks of the full tensor for elements ``[start, stop)`` of this rank's piece, whose
    values are ``flat`` (1-D, length ``stop - start``; the blocks are views of it)."""
    key = key or layout.key
    local_shape = layout.local_shape
    out = []
    pos = start
    for offsets, sizes in flat_range_boxes(local_shape, start, stop):
        n = math.prod(sizes)
        box = flat[pos - start:pos - start + n].view(sizes)
        pos += n
        d = layout.placement.dim if is_sharded(layout.placement) else None
        for cut, length, glob in local_box_to_global(layout, offsets, sizes):
            view = box if d is None or not sizes else box.narrow(d, cut, length)
            block = stored_part(layout, Block(key, tuple(layout.full_shape), glob, view))
            if block is not None:
                out.append(block)
    assert pos == stop, (pos, stop)
    return out


def stored_part(layout: TensorLayout, block: Block) -> Block | None:
    """``block`` cut to the layout's stored shape (None when it lies wholly in the padding)."""
    stored = layout.stored_shape
    if stored is None or tuple(stored) == tuple(layout.full_shape):
        return block
    view = block.tensor
    for d, (offset, limit) in enumerate(zip(block.offsets, stored)):
        keep = min(view.shape[d], limit - offset)
        if keep <= 0:
            return None
        if keep < view.shape[d]:
            view = view.narrow(d, 0, keep)
    return Block(block.key, tuple(stored), block.offsets, view)


# ---------------------------------------------------------------------------------------------
# DCP planners over blocks, and a reader that loads no pickled objects
# ---------------------------------------------------------------------------------------------

class BlockSavePlanner(DefaultSavePlanner):
    """A DCP save planner that writes ``blocks`` (boxes of full tensors) and nothing else."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.blocks = {(b.key, tuple(b.offsets)): b for b in blocks}

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), b in self.blocks.items():
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                               sizes=torch.Size(b.tensor.shape)),
                    properties=TensorProperties.create_from_tensor(b.tensor),
                    size=torch.Size(b.full_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        if write_item.type is not WriteItemType.SHARD:
            raise InvalidInputError("autopar checkpoints store tensors only")
        b = self.blocks[(write_item.index.fqn, tuple(write_item.index.offset))]
        return b.tensor.detach().contiguous()  # DCP copies views to a minimal storage


class BlockLoadPlanner(DefaultLoadPlanner):
    """A DCP load planner that fills ``blocks`` (views into the tensors to load) from the boxes
    of the checkpoint that overlap them; it refuses pickled byte entries."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.by_key: dict[str, list[Block]] = {}
        for b in blocks:
            self.by_key.setdefault(b.key, []).append(b)

    def set_up_planner(self, state_dict: Any, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, blocks in self.by_key.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets),
                                           sizes=torch.Size(b.tensor.shape)) for b in blocks]
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise InvalidInputError(f"checkpoint entry {read_item.dest_index.fqn} is pickled bytes",
                                expected="tensors only (autopar never writes pickles)",
                                fix="load only checkpoints written by autopar")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        b = self.by_key[read_item.dest_index.fqn][read_item.dest_index.index]
        return self.transform_tensor(read_item, b.tensor)  # narrowed to the overlap
