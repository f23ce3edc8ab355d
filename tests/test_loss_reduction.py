"""Every part of a step adds up to one process's loss when the loss is not a mean over equal
parts (passes/loss_reduction.py, runtime/loss_scale.py): a summed cross entropy, a mean over
targets that ignore padding unevenly (a micro-batch with every target ignored among them),
targets masked by ``where``, such a mean beside a mean over every element, and an NLL mean beside
a sum of per-token losses and a summed element-wise loss; on one rank with 2 and 4 micro-batches,
then dp 2 x pp 2, dp 2 x tp 2, dp 2 x cp 2 and cp 2 x tp 2 (sequence parallel) on gloo
processes, each against one process's losses and parameters after two SGD steps (fp32: the sums
run in another order, so to 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

import loss_jobs as jobs
from autopar import capture
from autopar.passes import loss_reduction
from autopar.passes.loss_reduction import scale_loss, target_counts
from autopar.runtime import loss_scale

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


def _terms(loss_fn) -> tuple[int, int]:
    """The token means and batch sums :func:`scale_loss` rewrites in TinyLM's step."""
    ids = jobs.batch()
    captured = capture(jobs.TinyLM(), (ids,), loss_fn, example_targets=(ids.clone(),))
    gm = scale_loss(captured.gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return targets.count(loss_scale.token_mean), targets.count(loss_scale.batch_sum)


def _flat(logits, labels):
    return logits.flatten(0, 1), labels.flatten()


F = torch.nn.functional


def test_the_terms_the_loss_is_linear_in_are_scaled_and_no_others():
    """Token means and batch sums reached from the loss through sums, sign and numbers are
    rewritten; a term the loss is not linear in, a sum already divided by a size, a masked mean
    written out, class weights, or a mean also read outside the linear path are not (each part's
    own, as before)."""
    cases = {
        "summed": (jobs.summed, (0, 1)), "padded": (jobs.padded, (1, 0)),
        "masked": (jobs.masked, (1, 0)), "aux": (jobs.aux, (1, 0)),
        "mixed": (jobs.mixed, (1, 2)),
        "exp": (lambda y, t: F.cross_entropy(*_flat(y, t)).exp(), (0, 0)),
        "squared too": (lambda y, t: (ce := F.cross_entropy(*_flat(y, t))) + ce ** 2, (0, 0)),
        "divided by b": (lambda y, t: (F.cross_entropy(*_flat(y, t), reduction="none")
                                       / y.shape[0]).sum(), (0, 0)),
        "masked mean": (lambda y, t: (F.cross_entropy(*_flat(y, t), reduction="none")
                                      * (t.flatten() > 3)).sum() / (t > 3).sum(), (0, 0)),
        "class weights": (lambda y, t: F.cross_entropy(*_flat(y, t), weight=torch.ones(
            jobs.VOCAB)), (0, 0)),
        "a sum over some dims": (lambda y, t: F.cross_entropy(*_flat(y, t)) + y.sum(-1).mean(),
                                 (1, 0)),
    }
    for name, (loss_fn, want) in cases.items():
        assert _terms(loss_fn) == want, name


def test_targets_are_counted_from_the_batch():
    """The program that computes the padded loss's targets (``labels[:, 1:]``) counts the
    targets that are not padding, on the whole batch at once (it mixes no rows)."""
    ids = jobs.batch()
    captured = capture(jobs.TinyLM(), (ids,), jobs.padded, example_targets=(ids.clone(),))
    (count,) = target_counts(captured)
    assert count is not None and count.ignore == 0 and count.row_wise
    full = {captured.target_names[0]: ids, captured.input_names[0]: ids}
    halves = [{name: t[:4] for name, t in full.items()}, {name: t[4:] for name, t in full.items()}]
    assert count.count(full, halves) == int((ids[:, 1:] != 0).sum())


@pytest.mark.distributed
def test_replicas_stages_and_sequence_parts_add_up_to_one_processs_loss(shared_pool4):
    """dp 2 x pp 2 (1F1B, 2 micro-batches), dp 2 x tp 2 (4 micro-batches), dp 2 x cp 2 and
    cp 2 x tp 2 with sequence parallelism: every part's terms weigh their share of the whole
    batch; also with each replica passed only its rows (``local=True``: the counts added over
    the replicas)."""
    pp = {"dp": 2, "tp": 1, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"}
    configs = [(loss, pins, False) for loss in jobs.LOSSES
               for pins in (pp, {"dp": 2, "tp": 2, "pp": 1, "num_micro_batches": 4})]
    configs += [(loss, pp, True) for loss in ("summed", "padded", "mixed")]
    configs += [(loss, {"dp": 2, "tp": 1, "pp": 1, "cp": 2, "num_micro_batches": 2}, False)
                for loss in jobs.TOKEN_WISE]
    configs += [(loss, {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "num_micro_batches": 2,
                        "sequence_parallel": True}, False) for loss in ("aux", "mixed")]
    per_rank = shared_pool4.run(jobs.train, configs, timeout_s=900)
    for k, (loss, pins, local) in enumerate(configs):
        assert len({tuple(r[k]["losses"]) for r in per_rank}) == 1, (loss, pins)
        _compare(per_rank[0][k], jobs.reference(loss), f"{loss} {pins} local={local}")


def test_a_summed_loss_was_wrong_without_the_scale(monkeypatch):
    """The check can fail: with the loss left as written (each part's own), a summed loss over
    2 micro-batches is half one process's."""
    monkeypatch.setattr(loss_reduction, "scale_loss", lambda gm, **_: gm)
    (got,) = jobs.train([("summed", {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2})],
                        steps=1)
    want = jobs.reference("summed", steps=1)
    assert got["losses"][0] == pytest.approx(want["losses"][0] / 2, rel=RTOL)


@pytest.mark.parametrize("loss", ["summed", "padded", "mixed"])
def test_verify_compares_each_parts_share_of_the_loss(loss):
    """``verify`` runs one process's program on the first micro-batch with its loss scaled as
    the stages scale theirs, so a summed loss, a mean over targets counted unevenly (the first
    micro-batch counts 2 of the batch's targets) and a mix of terms compare equal, the loss
    node too (it keeps its name through the rewrite: the post layer's boundary tensor)."""
    from tp_helpers import TINY_COST

    import autopar

    torch.manual_seed(0)
    ids = jobs.batch()
    pm = autopar.parallelize(jobs.TinyLM(), example_inputs=(ids,), example_targets=(ids.clone(),),
                             loss_fn=jobs.LOSSES[loss], optimizer=jobs.SGD,
                             plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2},
                             tp_cost=TINY_COST)
    try:
        report = pm.verify((ids,), (ids,))
    finally:
        pm.close()
    assert report.ok and all(c.tensors >= 1 for c in report.layers), report.layers
    # the same ops on the same rows: fp32 rounding only
    assert report.layers[-1].layer == "loss" and report.layers[-1].max_rel <= 1e-6


def test_a_static_batch_scales_a_sum_and_warns_where_it_may_be_a_mean():
    """A graph captured at a static batch of 4 rows: a cross entropy summed over the batch (times
    0.03) is still scaled (one process's sum over both halves), while a sum divided by 4, a multiple
    of a part's rows (a mean per row written out, or a sum over 4 x k rows: the graph cannot
    tell), is taken as written, with a warning; each against one process's losses and
    parameters after two SGD steps."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jobs.static_run("summed")
    assert not [w for w in caught if "cannot tell" in str(w.message)]
    _compare(got, jobs.static_reference("summed"), "summed, static batch")
    with pytest.warns(UserWarning, match="divided by 4, a multiple of the 4 rows of a part"):
        got = jobs.static_run("row mean")
    _compare(got, jobs.static_reference("row mean"), "row mean, static batch")


def test_a_token_mean_left_unscaled_is_named_by_the_pass(monkeypatch):
    """The pass's ``ensures`` check: with the rewrite turned off, the padded loss's token mean
    is each part's own, and the pass manager names it rather than training on."""
    from autopar.errors import PassError

    monkeypatch.setattr(loss_reduction, "scale_loss", lambda gm, **_: gm)
    with pytest.raises(PassError, match="loss_scaled: cross_entropy_loss .* is each part's own"):
        jobs.train([("padded", {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2})], steps=1)
