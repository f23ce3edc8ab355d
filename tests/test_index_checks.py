"""The ranges of indexes a model computes from the batch's sizes (passes/index_checks.py),
against the indexes themselves: each module below computes its positions one way, is captured
with a symbolic sequence, and the range the pass derives is compared, at every sequence length
from 1 to 24, with the min and max of the positions eager PyTorch computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar import capture
from autopar.passes.index_checks import size_bounds

TABLE = 40


class _Positions(nn.Module):
    def __init__(self, positions):
        super().__init__()
        self.where = positions
        self.tokens = nn.Embedding(16, 8)
        self.table = nn.Embedding(TABLE, 8)

    def forward(self, ids):
        return self.tokens(ids) + self.table(self.where(ids))


def _loss(out, ids):
    return out.float().pow(2).mean() + 0 * ids.sum()


def _s(ids):
    return ids.shape[1]


CASES = {
    "arange": lambda ids: torch.arange(_s(ids)).unsqueeze(0),
    "offset": lambda ids: (torch.arange(_s(ids)) + 2).unsqueeze(0).expand(ids.shape[0], -1),
    "start": lambda ids: torch.arange(3, _s(ids) + 3).view(1, -1),
    "scaled": lambda ids: torch.arange(_s(ids)).unsqueeze(0) * 2,
    "reversed": lambda ids: (_s(ids) - 1) - torch.arange(_s(ids)).unsqueeze(0),
    "clamped": lambda ids: torch.arange(_s(ids)).clamp(max=TABLE - 1).unsqueeze(0),
    "summed": lambda ids: (torch.arange(_s(ids)).unsqueeze(0)
                           + torch.arange(_s(ids)).unsqueeze(1)[:1]),
    "difference": lambda ids: (torch.arange(_s(ids)).unsqueeze(0)
                               - torch.arange(_s(ids)).unsqueeze(0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_range_holds_every_computed_index(case):
    model = _Positions(CASES[case])
    ids = torch.zeros(2, 6, dtype=torch.long)
    captured = capture(model, (ids,), _loss, example_targets=(ids,))
    bounds = size_bounds(captured)
    if case in ("summed", "difference"):  # a slice, two tensors: not followed, never refused
        assert bounds == []
        return
    (bound,) = bounds
    assert bound.rows == TABLE and "table" in bound.table
    for s in range(1, 25):
        where = CASES[case](torch.zeros(2, s, dtype=torch.long))
        low, high = int(where.min()), int(where.max())
        span = (int(bound.low.subs("s", s)) if bound.low.free_symbols else int(bound.low),
                int(bound.high.subs({sym: s for sym in bound.high.free_symbols})))
        assert (span[0], span[1]) == (low, high), (s, span, (low, high))
        fits = 0 <= low and high < TABLE
        assert (bound.outside({"s": s}) is None) == fits
        if fits and bound.longest("s") is not None:
            assert s <= bound.longest("s")


def test_the_longest_sequence_is_the_last_that_fits():
    """``longest`` against a search over the lengths: the offset case fits s <= TABLE - 2."""
    model = _Positions(CASES["offset"])
    ids = torch.zeros(2, 6, dtype=torch.long)
    (bound,) = size_bounds(capture(model, (ids,), _loss, example_targets=(ids,)))
    last = max(s for s in range(1, 2 * TABLE) if bound.outside({"s": s}) is None)
    assert bound.longest("s") == last == TABLE - 2
    assert bound.outside({"b": 2}) is None  # no size for s: nothing to say
