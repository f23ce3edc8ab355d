"""Micro-batches add up to one process's loss when the loss does not reduce as a mean over equal
parts (passes/loss_reduction.py): a summed cross entropy, a mean over targets that ignore
padding unevenly (a micro-batch with every target ignored among them), targets masked by
``where``; on one rank with 2 and 4 micro-batches, then dp 2 x pp 2 and dp 2 x tp 2 on gloo
processes, each against one process's losses and parameters after two SGD steps (fp32: the
sums run in another order, so to 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

import autopar
import loss_jobs as jobs
from autopar.passes.loss_reduction import loss_reduction

#: Summation order differs between one process and micro-batches (fp32).
RTOL, ATOL = 1e-5, 1e-6


def _compare(got: dict, want: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert a == pytest.approx(b, rel=RTOL), (what, step, a, b)
    if got["state"] is not None:
        for name, value in want["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=f"{what}: {name}")


@pytest.mark.parametrize("loss", list(jobs.LOSSES))
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_micro_batches_add_up_to_one_processs_loss(loss, micro_batches):
    """One rank: the weights alone make the difference (without them the summed loss was
    1/m of one process's, the padded one off by the uneven counts, and a micro-batch whose
    targets are all ignored NaN)."""
    (got,) = jobs.train([(loss, {"dp": 1, "tp": 1, "pp": 1,
                                 "num_micro_batches": micro_batches})])
    _compare(got, jobs.reference(loss), f"{loss}, {micro_batches} micro-batches")


def test_what_keeps_the_parts_weights():
    """A loss with another term, a cross entropy with class weights: no LossReduction (the
    parts keep 1 / m); a mean over equal counts: weights None."""
    from autopar import capture

    ids = jobs.batch()
    cases = {"aux": jobs.with_aux,
             "class weights": lambda logits, labels: torch.nn.functional.cross_entropy(
                 logits.flatten(0, 1), labels.flatten(), weight=torch.ones(jobs.VOCAB))}
    for name, loss in cases.items():
        captured = capture(jobs.TinyLM(), (ids,), loss, example_targets=(ids.clone(),))
        assert loss_reduction(captured) is None, name
    captured = capture(jobs.TinyLM(), (ids,), jobs.padded, example_targets=(ids.clone(),))
    reduction = loss_reduction(captured)
    assert reduction is not None and (reduction.reduction, reduction.ignore) == ("mean", 0)
    assert reduction.weights([[5, 5], [5, 5]], 1) is None
    assert reduction.weights([[1, 3], [0, 4]], 1) == [0.0, 2 * 4 / 8]
    full = {captured.target_names[0]: ids, captured.input_names[0]: ids}
    halves = [{name: t[:4] for name, t in full.items()}, {name: t[4:] for name, t in full.items()}]
    assert reduction.row_wise and reduction.counts(full, halves) == [
        int((ids[:4, 1:] != 0).sum()), int((ids[4:, 1:] != 0).sum())]


@pytest.mark.distributed
def test_replicas_and_stages_add_up_to_one_processs_loss(shared_pool4):
    """dp 2 x pp 2 (1F1B, 2 micro-batches) and dp 2 x tp 2 (4 micro-batches): every replica's
    micro-batches weigh their share of the whole batch's count; also with each replica passed
    only its rows (``local=True``: the counts all-reduced over the replicas)."""
    configs = [(loss, pins, local) for loss in jobs.LOSSES for pins, local in (
        ({"dp": 2, "tp": 1, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"}, False),
        ({"dp": 2, "tp": 2, "pp": 1, "num_micro_batches": 4}, False),
        ({"dp": 2, "tp": 1, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"}, True))]
    per_rank = shared_pool4.run(jobs.train, configs, timeout_s=600)
    for k, (loss, pins, local) in enumerate(configs):
        assert len({tuple(r[k]["losses"]) for r in per_rank}) == 1, (loss, pins)
        _compare(per_rank[0][k], jobs.reference(loss), f"{loss} {pins} local={local}")


def test_a_summed_loss_was_wrong_without_the_weights(monkeypatch):
    """The check can fail: with the weights off (the executor's 1 / m), a summed loss over 2
    micro-batches is half one process's."""
    from autopar import parallel_model

    monkeypatch.setattr(parallel_model.ParallelModel, "_loss_weights",
                        lambda self, names, batch, local: None)
    (got,) = jobs.train([("summed", {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2})],
                        steps=1)
    want = jobs.reference("summed", steps=1)
    assert got["losses"][0] == pytest.approx(want["losses"][0] / 2, rel=RTOL)
    assert autopar is not None
