"""BatchNorm trains, evaluates and keeps its running statistics as one process does.

A BatchNorm in training normalizes each micro-batch by its own statistics and updates its
running mean and variance; in evaluation it normalizes by those. Reference: one process that
runs each batch as the parallel run's dp x m micro-batches, in order (the rows each replica's
micro-batches hold, as ``train_one_process(micro_batches=...)``), gradients accumulated, AdamW;
then ``model.eval()`` on the first batch.

Until 2026-12-08:
- ``eval_step`` ran the training graph: batch statistics, and the running ones updated (the
  evaluation loss of this model 2.2861 where one process gives 2.3210);
- recompute failed in the backward (``modified by an inplace operation``: the counter of a
  checkpointed block's input), and would have updated the statistics twice;
- data-parallel replicas each kept their own statistics;
- ``verify`` compared a training-mode reference with them, and updated the user's model's;
- and the planner picks recompute for such a model, so ``parallelize`` of a ResNet failed.

Tolerances: losses 1e-5 relative, parameters 1e-5 absolute (the family tests' fp32 bounds:
reordered sums amplified by Adam's first steps); running statistics 1e-5 absolute (combined
over the replicas in float64 from fp32 updates); the counter exactly; the replicas' statistics
equal to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

import batch_norm_jobs as jobs

CONFIGS = [
    {"dp": 2, "recompute": "none"},
    {"dp": 2, "recompute": "full", "zero": 3, "num_micro_batches": 2},
    {"dp": 1, "pp": 2, "num_micro_batches": 2, "recompute": "full"},
    {"dp": 1, "tp": 2, "recompute": "full"},
    # bf16: fp32 pixels cast to bf16 as FSDP's cast_forward_inputs does (a bf16 convolution of
    # fp32 pixels failed), the norms' bf16 weights cast up to their fp32 statistics
    {"dp": 2, "recompute": "full", "mixed_precision": True},
    # compiled blocks (AOT autograd): the norms run outside the compiled graphs, which would
    # otherwise fix evaluation and recompute at their first trace
    {"dp": 2, "recompute": "full", "compile": "aot_eager"},
]


@pytest.mark.distributed
def test_batch_norm_trains_and_evaluates_as_one_process(shared_pool2):
    results = shared_pool2.run(jobs.train, CONFIGS, timeout_s=600)
    references = {}
    for k, pins in enumerate(CONFIGS):
        m = pins["dp"] * pins.get("num_micro_batches", 1)
        want = references.setdefault(m, jobs.reference(m))
        got = results[0][k]
        assert all(rank[k]["spread"] <= 1e-6 for rank in results), pins
        if pins.get("mixed_precision"):
            _compare_mixed(got, want, pins)
            continue
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), pins
        assert got["eval"] == pytest.approx(want["eval"], rel=1e-5), pins
        assert got["eval_again"] == got["eval"], pins
        state = got["state"]
        assert set(state) == set(want["state"]), pins
        for key, value in want["state"].items():
            if key.endswith("num_batches_tracked"):
                assert int(state[key]) == int(value) == jobs.STEPS * m, (pins, key)
            else:
                torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5,
                                           msg=f"{pins}: {key}")


def test_context_parallelism_through_a_batch_norm_over_tokens_is_refused():
    """A BatchNorm1d over a sequence's tokens (a convolutional speech or text block) takes its
    statistics over the whole sequence: a context-parallel rank holding half the tokens would
    normalize by other numbers than one process. The planner refuses cp there, naming the op."""
    import torch.nn as nn

    import autopar
    from autopar.errors import InfeasiblePlanError

    class TokenConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.bn = nn.BatchNorm1d(16)
            self.out = nn.Linear(16, 50)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.bn(self.emb(ids).transpose(1, 2)).transpose(1, 2))

    ids = torch.randint(0, 50, (4, 16))
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(TokenConv(), "cpu", devices=2, example_inputs=(ids,), example_targets=(ids,),
                     loss_fn=lambda o, t: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()),
                     global_batch=4, cp=2)
    assert "a batch_norm over the tokens" in err.value.found


def _compare_mixed(got, want, pins):
    """bf16 compute against fp32 one process: losses and the evaluation within two bf16 ulps
    (2^-6 relative), as tests/test_parallelize.py's mixed-precision sanity bound; the running
    statistics (fp32 buffers updated from bf16 activations), relative to their largest
    element: variances within 2% (measured 0.06-0.6%), means within 10% (measured 2-5.4%: means
    of activations near zero); the counter exactly. The replicas' agreement and the fp32
    configurations check the combination itself."""
    assert got["losses"] == pytest.approx(want["losses"], rel=2 ** -6), pins
    assert got["eval"] == pytest.approx(want["eval"], rel=2 ** -6), pins
    assert got["eval_again"] == got["eval"], pins
    for key, value in want["state"].items():
        if key.endswith("num_batches_tracked"):
            assert int(got["state"][key]) == int(value), (pins, key)
        elif "running" in key:
            assert got["state"][key].dtype == torch.float32, (pins, key)
            err = (got["state"][key] - value).abs().max() / value.abs().max()
            assert err < (0.02 if key.endswith("var") else 0.1), (pins, key, float(err))


REGULARIZED = [
    {"dp": 2, "recompute": "none", "regularize": True},
    {"dp": 1, "pp": 2, "num_micro_batches": 2, "recompute": "full", "regularize": True},
    {"dp": 1, "tp": 2, "num_micro_batches": 2, "regularize": True},
]


@pytest.mark.distributed
def test_channel_dropout_and_stochastic_depth_draw_alike_under_every_plan(shared_pool2):
    """``nn.Dropout2d`` (``aten.feature_dropout``) and stochastic depth as timm and torchvision
    draw it (``new_empty(...).bernoulli_(keep)``) and as Hugging Face does (``floor(keep +
    torch.rand(...))``) are drawn per sample from (seed, step, site, sample), as dropout's
    masks: every plan trains as the world-1 program with the same seed on the same two
    micro-batches (BatchNorm's statistics are per micro-batch; losses 1e-5 relative,
    parameters 1e-5 absolute: the bounds above), and ``verify`` draws the program's numbers.
    Until 2026-12-08 they drew from each process's torch RNG: each plan drew other numbers,
    and tensor-parallel ranks drew different masks for one replicated activation. Channel
    dropout is off in evaluation; stochastic depth, captured in training, is drawn there too
    (warned)."""
    import warnings

    from autopar.errors import UnsupportedOpWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (want,) = jobs.train([{"dp": 1, "pp": 1, "tp": 1, "num_micro_batches": 2,
                               "regularize": True}])
    assert any(isinstance(w.message, UnsupportedOpWarning) and "eval_step" in str(w.message)
               for w in caught)
    plain = jobs.reference(2)
    assert abs(want["losses"][0] - plain["losses"][0]) > 1e-3  # the draws change the loss
    results = shared_pool2.run(jobs.train, REGULARIZED, timeout_s=600)
    for k, pins in enumerate(REGULARIZED):
        got = results[0][k]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), pins
        assert got["eval"] == pytest.approx(want["eval"], rel=1e-5), pins
        for key, value in want["state"].items():
            if key.endswith("num_batches_tracked"):
                assert int(got["state"][key]) == int(value), (pins, key)
            else:
                torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-5,
                                           msg=f"{pins}: {key}")


def test_sync_batch_norm_is_refused_with_the_way_out():
    """nn.SyncBatchNorm (statistics over every replica's rows) is not supported: its forward
    calls a collective torch.export cannot trace (and refuses CPU tensors). A named error says
    to keep the BatchNorms, whose running statistics autopar combines over the replicas."""
    import torch.nn as nn

    import autopar
    from autopar.errors import InvalidInputError

    model = nn.SyncBatchNorm.convert_sync_batchnorm(jobs.build())
    (inputs,), (labels,) = jobs.batches(1)[0]
    with pytest.raises(InvalidInputError, match="SyncBatchNorm is not supported") as err:
        autopar.capture(model, (inputs,), jobs.loss_fn, example_targets=(labels,))
    assert "convert_sync_batchnorm" in err.value.fix


@pytest.mark.distributed
def test_running_statistics_are_checkpointed(shared_pool2, tmp_path):
    """A checkpoint holds the running statistics with the weights: saved at dp 2 after one
    step, loaded at pp 2 (two micro-batches, the same rows per micro-batch), the second step and
    the evaluation are one process's. Until 2026-12-08 a checkpoint held no buffers: a resumed
    BatchNorm evaluated with its initial statistics."""
    want = jobs.reference(2)
    path = str(tmp_path / "ckpt")
    got = shared_pool2.run(jobs.resume, (path, {"dp": 2, "recompute": "none"},
                                         {"dp": 1, "pp": 2, "num_micro_batches": 2}),
                           timeout_s=600)[0]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)
    for key, value in want["state"].items():
        if key.endswith("num_batches_tracked"):
            assert int(got["state"][key]) == int(value), key
        else:
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-5, msg=key)
