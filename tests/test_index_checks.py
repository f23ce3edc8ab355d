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
from autopar.passes.index_checks import computed_bounds, size_bounds

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
    pytest.param(lambda ids: ids[1:], "checked",      # a slice of the micro-batch's rows
                 marks=pytest.mark.filterwarnings("ignore:_M fixes the size of batch")),
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


# -- indexes computed from the batch's values (computed_bounds) -------------------------------

class _Computed(nn.Module):
    """Embeds ``where(ids, mask)``, an index computed from the batch's values."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.tokens = nn.Embedding(16, 8)
        self.table = nn.Embedding(TABLE, 8)
        self.register_buffer("start", torch.tensor(1))
        self.noise = nn.Dropout(0.5)

    def forward(self, ids, mask):
        return self.tokens(ids) + self.table(self.where(self, ids, mask))


COMPUTED = {  # name: (index from (module, ids, mask), row-wise)
    "mask cumsum (OPT)": (lambda m, ids, mask: torch.cumsum(mask, dim=1) * mask + 1, True),
    "padding-aware (RoBERTa)": (
        lambda m, ids, mask: torch.cumsum(ids.ne(1).int(), dim=1).type_as(mask) * ids.ne(1) + 1,
        True),
    "where and clamp": (lambda m, ids, mask: torch.where(mask > 0, ids, 0).clamp(max=30), True),
    "a scan over the batch": (lambda m, ids, mask: torch.cumsum(mask, dim=0), False),
    "the batch's largest id": (lambda m, ids, mask: ids - ids.amax() + 20, False),
    "the batch's flattened scan": (lambda m, ids, mask: mask.flatten().cumsum(0).view_as(ids)
                                   % TABLE, False),
}


@pytest.mark.parametrize("name", list(COMPUTED))
def test_a_computed_index_is_the_models_own(name):
    """The program computed_bounds copies out of the graph gives the index eager PyTorch
    computes, on batches of 2 to 8 rows; a program it calls row-wise gives, on 8 rows at once,
    what it gives on each 2-row micro-batch (the stages' view), and the programs it does not
    call row-wise would not: each mixes the batch's rows."""
    where, row_wise = COMPUTED[name]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 16, (2, 6), generator=gen)
    captured = capture(_Computed(where), (ids, torch.ones_like(ids)),
                       lambda out: out.pow(2).mean())
    (bound,) = [b for b in computed_bounds(captured) if b.table.endswith("table.weight")]
    assert bound.rows == TABLE and bound.row_wise == row_wise
    names = captured.input_names
    mixed = []
    for rows in (2, 4, 8):
        ids = torch.randint(0, 16, (rows, 6), generator=gen)
        mask = torch.randint(0, 2, (rows, 6), generator=gen)
        values = {n: t for n, t in zip(names, (ids, mask)) if n in bound.reads}
        want = where(None, ids, mask)
        assert torch.equal(bound.program(*(values[n] for n in bound.reads)), want), rows
        parts = torch.cat([where(None, ids[k:k + 2], mask[k:k + 2]) for k in range(0, rows, 2)])
        mixed.append(not torch.equal(parts, want))
    assert any(mixed) != row_wise, (name, mixed)


@pytest.mark.parametrize("where", [
    lambda m, ids, mask: torch.arange(ids.shape[1]) + m.start,            # reads a buffer
    lambda m, ids, mask: (m.noise(mask.float()) > 0).long(),              # draws random numbers
    lambda m, ids, mask: ids,                                             # a view: index_bounds
    lambda m, ids, mask: torch.arange(ids.shape[1]) + 1,                  # sizes: size_bounds
], ids=["buffer", "dropout", "input", "sizes"])
def test_what_computed_bounds_leaves_to_others(where):
    """An index that reads the model's state, or draws random numbers (running it again would
    move the generator, and the step's dropout with it), is left to the stage's lookup; one read
    through views is index_bounds', one the batch's sizes decide is size_bounds'."""
    ids = torch.randint(0, 16, (2, 6))
    captured = capture(_Computed(where), (ids, torch.ones_like(ids)),
                       lambda out: out.pow(2).mean())
    assert [b for b in computed_bounds(captured) if b.table.endswith("table.weight")] == []
