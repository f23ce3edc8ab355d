"""Verify and dropout across ranks, on real gloo processes (one shared LocalPool(4)).

- ``parallelize(..., verify=True)`` passes on a tp=2 x pp=2 plan with sequence parallelism, on
  a dp=2 x pp=2 plan with full recompute and on a tp=2 x pp=2 ZB-H1 plan with selective
  recompute; a program broken on purpose (one rank's shard of a weight scaled, or the
  tensor-parallel all-reduce skipped, or context-parallel attention over each rank's own
  tokens) raises VerificationError naming the layer where the fault is; a correct cp 2 x tp 2
  program with sequence parallelism passes, every layer and the loss compared.
- HF GPT-2 with dropout 0.1: those plans train to the same losses and parameters as the world-1
  autopar run with the same seed (dropout masks are a function of seed, step, site and sample,
  never of the plan), two runs of the same program are identical, and evaluation turns dropout
  off.

Tolerance: losses 1e-5 relative, parameters 1e-5 absolute after 2 AdamW steps, as in
tests/test_parallelize.py (reordered fp32 sums, ~1e-7; a mask that differs moves a loss by
~1e-2: a tenth of the activations change).
"""

from __future__ import annotations

import pytest
import torch

import reliability_jobs as jobs

pytestmark = pytest.mark.distributed

DROPOUT = {"dropout": 0.1}
SEED = 3
PLANS = [  # tp=2 with SP (and pp=2), dp=2 (and pp=2, full recompute: masks replayed)
    {"dp": 1, "pp": 2, "tp": 2, "num_micro_batches": 2, "sequence_parallel": True},
    {"dp": 2, "pp": 2, "tp": 1, "num_micro_batches": 2, "recompute": "full"},
    # selective recompute: attention with dropout is an attention core (its probabilities'
    # masks replayed); ZB-H1's last rank runs W0 after F1 and I1, so the core's recompute in W0
    # must draw micro-batch 0's masks, not those of the micro-batch run last
    {"dp": 1, "pp": 2, "tp": 2, "num_micro_batches": 2, "sequence_parallel": True,
     "schedule": "zb-h1", "recompute": "selective"},
]


@pytest.fixture(scope="module")
def world1_dropout():
    return jobs.train_twice("gpt", {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2}, 2,
                            DROPOUT, seed=SEED)


def test_dropout_and_verify_across_plans(shared_pool4, world1_dropout):
    ref = world1_dropout
    assert ref["runs"][0] == ref["runs"][1]  # two runs: identical to the bit
    assert ref["evals"][0] == ref["evals"][1]  # evaluation: no dropout
    assert abs(ref["runs"][0][0] - ref["evals"][0]) > 1e-3  # training: dropout

    configs = [("gpt", pins, 2, dict(overrides=DROPOUT, seed=SEED, verify=True))
               for pins in PLANS]
    per_rank = shared_pool4.run(jobs.train_many, configs, timeout_s=900)
    for k, pins in enumerate(PLANS):
        got = per_rank[0][k]
        assert got["losses"] == pytest.approx(ref["runs"][0], rel=1e-5), pins
        for key, want in ref["state"].items():
            if torch.is_floating_point(want):
                torch.testing.assert_close(got["state"][key], want, rtol=0, atol=1e-5,
                                           msg=f"{pins}: {key}")
        assert len({r[k]["losses"][-1] for r in per_rank}) == 1
        if pins.get("recompute") == "selective":  # both blocks' attention is recomputed
            assert sum(r[k]["regions"] for r in per_rank[::2]) == 2, pins


def test_verify_names_the_broken_layer(shared_pool4):
    configs = [
        ("gpt", {"dp": 2, "pp": 1, "tp": 2, "num_micro_batches": 1},
         ("scale", "h.1.mlp.c_fc.weight", 1)),
        ("llama", {"dp": 1, "pp": 2, "tp": 2, "num_micro_batches": 2}, ("skip_all_reduce",)),
        # context parallelism: each rank holds some tokens of the reference's whole sequence
        ("llama", {"dp": 1, "cp": 2, "tp": 2, "sequence_parallel": True,
                   "num_micro_batches": 2}, None),
        ("llama", {"dp": 1, "pp": 2, "cp": 2, "num_micro_batches": 2}, ("local_attention",)),
    ]
    per_rank = shared_pool4.run(jobs.verify_configs, configs, timeout_s=900)
    assert all(r == per_rank[0] for r in per_rank)  # one report, every rank
    (kind, layer, report), (kind2, layer2, report2), (ok, cp_report), (kind4, layer4, report4) \
        = per_rank[0]
    assert (kind, layer) == ("VerificationError", "transformer.h.1"), report
    assert report["transformer.h.0"]["max_rel"] < 1e-5 and report["pre"]["tensors"] == 4
    assert (kind2, layer2) == ("VerificationError", "model.layers.0"), report2
    assert report2["pre"]["max_rel"] < 1e-5
    # every layer and the loss compared on every rank (fp32, reordered sums: ~1e-7)
    assert ok == "ok", cp_report
    for name in ("pre", "model.layers.0", "model.layers.1", "loss"):
        assert cp_report[name]["tensors"] >= 4 and cp_report[name]["max_rel"] < 1e-5, cp_report
    # attention over a rank's own tokens: the first layer differs, what comes before does not
    assert (kind4, layer4) == ("VerificationError", "model.layers.0"), report4
    assert report4["pre"]["max_rel"] < 1e-5


def test_sizes_the_program_cannot_split_are_refused_before_the_step(shared_pool4):
    """Sequence parallelism splits each micro-batch's sequence over the tp ranks: a sequence
    of 15 tokens at tp 2 is refused by name before the step (it used to fail inside the stage,
    in an all-to-all, and shut the executor down), as are an empty sequence and an empty batch
    (one process fails on them too, with a raw torch error). The model stays usable: the batches
    that follow give one process's losses (fp32, 1e-5 relative: reordered sums)."""
    pins = {"dp": 1, "tp": 2, "pp": 2, "num_micro_batches": 2, "sequence_parallel": True}
    cases = [(16, 8), (15, 8), (0, 8), (16, 0), (2, 8), (32, 4)]
    got = shared_pool4.run(jobs.size_cases, "llama", pins, cases, timeout_s=600)[0]
    kind, message = got[1]
    assert kind == "InvalidInputError" and "s divisible by 2" in message \
        and "sequence parallelism" in message and "s = 15" in message, message
    assert got[2][0] == "InvalidInputError" and "empty dim (s=0)" in got[2][1], got[2]
    assert got[3][0] == "InvalidInputError" and "batch is empty" in got[3][1], got[3]
    for k in (0, 4, 5):
        assert got[k] == pytest.approx(jobs.size_case_reference("llama", *cases[k]), rel=1e-5)
