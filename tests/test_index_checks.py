"""The ranges of indexes a model computes from the batch's sizes (passes/index_checks.py),
against the indexes themselves: each module below computes its positions one way, is captured
with a symbolic sequence, and the range the pass derives is compared, at every sequence length
from 1 to 24, with the min and max of the positions eager PyTorch computes. Then the part of an
input a lookup reads (a slice the model takes first), against eager slicing, and a step that
one process runs with values outside the table where it never reads them."""

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


# -- the part of an input a lookup reads (index_bounds' regions) ------------------------------

VOCAB = 100  # padded to 128 rows: an id in [100, 128) would read a padded row silently


class _Shifted(nn.Module):
    """A language model that shifts inside, as some training code does: it embeds every token
    but the last (``ids[:, :-1]``), and the loss drops the first label (``labels[:, 1:]``), so
    one process never reads the ids' last column or the labels' first."""

    def __init__(self, hidden=16):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        return self.head(self.tokens(ids[:, :-1]))


def _shifted_loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


def _reads(forward, ids_shape=(2, 9)):
    """index_bounds of a model whose forward is ``forward(ids)`` into a 50-row table."""
    from autopar.passes.index_checks import index_bounds

    class _M(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(50, 4)

        def forward(self, ids):
            return self.table(forward(ids))

    ids = torch.zeros(ids_shape, dtype=torch.long)
    captured = capture(_M(), (ids,), lambda out: out.float().pow(2).mean())
    (bounds,) = index_bounds(captured).values()
    return bounds


@pytest.mark.parametrize("view, reads", [
    (lambda ids: ids, "all"),
    (lambda ids: ids[:, :-1], "part"),
    (lambda ids: ids[:, 2:], "part"),
    (lambda ids: ids[:, 1:-1:2], "part"),
    (lambda ids: ids[:, 1:].reshape(-1), "part"),     # sliced, then the values rearranged
    (lambda ids: ids.reshape(-1)[3:], "checked"),      # a slice of the flattened batch
    (lambda ids: ids[1:], "checked"),                  # a slice of the micro-batch's rows
])
def test_a_lookup_checks_the_part_of_the_input_it_reads(view, reads):
    """``IndexBound.indexed`` against eager slicing at every sequence length 3 to 12: the
    values the lookup reads, exactly ("all", "part"); where the part cannot be named by slices
    of the batch passed (a slice after a reshape, or across the batch's rows, which hold every
    micro-batch), every value is checked ("checked"): never fewer than one process reads."""
    (bound,) = _reads(view)
    assert bound.rows == 50
    assert bool(bound.region) == (reads == "part")
    for s in range(3, 13):
        ids = torch.arange(2 * s).view(2, s)
        got = bound.indexed(ids, {"s": s})
        if reads == "checked":
            assert torch.equal(got, ids), s
        else:
            assert sorted(got.flatten().tolist()) == sorted(view(ids).flatten().tolist()), s


def test_values_one_process_never_reads_are_not_refused():
    """Each batch against one process (tp 1 on 1 rank; the vocabulary padded to 128): values
    outside the tables in the ids' last column and the labels' first column are never read,
    and the step runs to one process's loss; an id in [100, 128) where it is read, which a
    padded row would take silently, and a label of 100, are refused by name before the step,
    as one process's lookup and loss refuse them."""
    import autopar
    from autopar.passes.index_checks import index_bounds

    torch.manual_seed(0)
    model = _Shifted()
    reference = _Shifted()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 9), generator=gen)
    pm = autopar.parallelize(model, example_inputs=(ids,), example_targets=(ids,),
                             loss_fn=_shifted_loss, optimizer=torch.optim.SGD,
                             plan={"dp": 1, "tp": 1, "pp": 1})
    try:
        (bound,) = index_bounds(pm.captured)[pm.captured.input_names[0]]
        assert bound.rows == VOCAB and bound.region
        outside_read = ids.clone()
        outside_read[:, -1] = 10**6  # the ids' last column: never embedded
        labels = ids.clone()
        labels[:, 0] = -5  # the labels' first column: dropped by the loss
        with torch.no_grad():
            want = float(_shifted_loss(reference(outside_read), labels))
        got = float(pm.train_step((outside_read,), (labels,)))
        assert abs(got - want) < 1e-5, (got, want)  # fp32, one step on one rank
        padded = ids.clone()
        padded[1, 3] = VOCAB + 5  # a padded row's id, where it is read
        bad_label = ids.clone()
        bad_label[2, 4] = VOCAB
        for batch, refused in (((padded,), (ids,)), ((ids,), (bad_label,))):
            with pytest.raises((IndexError, RuntimeError)):
                _shifted_loss(reference(*batch), *refused)
            with pytest.raises(autopar.InvalidInputError, match="indexes outside") as err:
                pm.train_step(batch, refused)
            assert f"({VOCAB} rows)" in str(err.value) and err.value.fix
    finally:
        pm.close()
