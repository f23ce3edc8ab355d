"""The checkpoint geometry (runtime/checkpoint_blocks.py) against brute force: a row-major
element range as boxes, a tensor-parallel piece's box as boxes of the full tensor, and a rank's
flat range as blocks, each checked by reading the elements back from an ``arange`` tensor (every
element's value is its own flat index). No processes: the distributed round trips are
tests/test_checkpoint.py's."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.runtime.checkpoint_blocks import (TensorLayout, flat_range_boxes,
                                               local_box_to_global, range_blocks)
from autopar.sharding import Replicate, make_shard

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


def _read(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


@settings(max_examples=300, deadline=None)
@given(shape=shapes, data=st.data())
def test_an_element_range_is_its_boxes_in_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_range_boxes(shape, start, stop)
    flat = torch.arange(numel).view(shape)
    got = [int(v) for off, size in boxes for v in _read(flat, off, size).flatten()]
    assert got == list(range(start, stop))  # covered, in order, nothing twice
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    for off, size in boxes:  # each box is one contiguous run of the flat range
        values = _read(flat, off, size).flatten()
        assert values.numel() == 0 or int(values[-1]) - int(values[0]) + 1 == values.numel()


def _piece(full: torch.Tensor, dim: int, blocks: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece, cut independently of autopar.sharding: each of ``blocks`` equal
    blocks of ``dim`` split ``tp`` ways, this rank's part of each, concatenated."""
    return torch.cat([b.chunk(tp, dim)[rank] for b in full.chunk(blocks, dim)], dim)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_piece_box_maps_to_the_full_tensor(data):
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, ndim - 1))
    tp, blocks = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 2, 3]))
    shape = [data.draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[dim] *= tp * blocks
    rank = data.draw(st.integers(0, tp - 1))
    full = torch.arange(math.prod(shape)).view(shape)
    layout = TensorLayout("w", tuple(shape), make_shard(dim, blocks), tp, rank)
    piece = _piece(full, dim, blocks, tp, rank)
    assert tuple(piece.shape) == layout.local_shape
    offsets = [data.draw(st.integers(0, n - 1)) for n in piece.shape]
    sizes = [data.draw(st.integers(1, n - o)) for n, o in zip(piece.shape, offsets)]
    local = _read(piece, offsets, sizes)
    covered = 0
    for cut, length, glob in local_box_to_global(layout, offsets, sizes):
        part = local.narrow(dim, cut, length)
        want = list(sizes)
        want[dim] = length
        assert torch.equal(part, _read(full, glob, want))
        covered += length
    assert covered == sizes[dim]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_flat_range_becomes_blocks_cut_to_the_stored_shape(data):
    """A rank's flat element range of its piece (a ZeRO shard's intersection with a parameter)
    as blocks: each block's values are the full tensor's at its offsets, the blocks hold every
    element of the range once, and with a padded dimension (a vocabulary padded for tp) only
    what lies inside the model's shape."""
    tp = data.draw(st.sampled_from([1, 2]))
    rows, cols = data.draw(st.integers(1, 4)) * tp * 2, data.draw(st.integers(1, 5))
    stored_rows = data.draw(st.integers(1, rows))
    rank = data.draw(st.integers(0, tp - 1))
    placement = data.draw(st.sampled_from([Replicate(), make_shard(0), make_shard(1, 1)]))
    if not isinstance(placement, Replicate) and placement.dim == 1:
        cols *= tp
    shape = (rows, cols)
    full = torch.arange(rows * cols).view(shape)
    layout = TensorLayout("w", shape, placement, tp, rank if not isinstance(placement, Replicate)
                          else 0, stored_shape=(stored_rows, cols))
    piece = full if isinstance(placement, Replicate) else _piece(full, placement.dim, 1, tp, rank)
    numel = piece.numel()
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    blocks = range_blocks(layout, start, stop, piece.flatten()[start:stop].clone())
    seen = []
    for b in blocks:
        assert b.full_shape == (stored_rows, cols)
        assert torch.equal(b.tensor, _read(full, b.offsets, b.tensor.shape))
        assert all(o + n <= s for o, n, s in zip(b.offsets, b.tensor.shape, (stored_rows, cols)))
        seen += [int(v) for v in b.tensor.flatten()]
    inside = [int(v) for v in piece.flatten()[start:stop] if int(v) // cols < stored_rows]
    assert sorted(seen) == sorted(inside)
