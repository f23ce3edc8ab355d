"""Frozen parameters (``requires_grad=False``) train as in one process under every plan kind.

Fine-tuning freezes most of a model: LoRA adapters on frozen weights, frozen embeddings and
norms. A frozen parameter has no gradient, no reduction and no optimizer state, yet the
backward still reads it. ZeRO-3 frees a unit's gathered parameters once its gradients are
counted; before units learnt to wait for their inputs' gradients as well, a frozen LayerNorm's
weight was freed before its backward read it, and ZeRO-3 failed in the backward on every
layout (``weight of shape [0]``).

Reference: the same model in one process, AdamW over its trainable parameters. Tolerance:
losses 1e-5 relative, parameters 1e-5 absolute after 2 steps (reordered fp32 sums, ~1e-7,
amplified by Adam's first steps to ~1e-6); frozen parameters must be equal to the bit.
"""

from __future__ import annotations

import pytest
import torch

import frozen_jobs as jobs

pytestmark = pytest.mark.distributed

CONFIGS = [
    ("lora", {"dp": 4, "zero": 3}),
    ("lora", {"dp": 2, "pp": 2, "zero": 3, "num_micro_batches": 2}),
    ("lora", {"dp": 1, "tp": 2, "pp": 2, "num_micro_batches": 2}),
    ("norms", {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True}),
    ("norms", {"dp": 4, "zero": 3, "reshard_after_forward": False}),
    ("norms", {"dp": 2, "pp": 2, "zero": 3, "num_micro_batches": 4,
               "schedule": "interleaved-1f1b", "virtual_stages": 2}),
    ("norms", {"dp": 2, "pp": 2, "zero": 3, "num_micro_batches": 2, "recompute": "full"}),
    ("norms", {"dp": 2, "pp": 2, "zero": 2, "num_micro_batches": 2, "schedule": "zb-h1"}),
]


def test_frozen_parameters_train_as_one_process(shared_pool4):
    references = {kind: jobs.reference(kind) for kind in ("lora", "norms")}
    per_rank = shared_pool4.run(jobs.train, CONFIGS, timeout_s=900)
    for (kind, pins), (losses, state) in zip(CONFIGS, per_rank[0]):
        want_losses, want = references[kind]
        frozen = jobs.frozen_names(kind)
        assert losses == pytest.approx(want_losses, rel=1e-5), (kind, pins)
        assert set(state) == set(want), (kind, pins)
        for key, value in want.items():
            if key in frozen:
                assert torch.equal(state[key], value), (kind, pins, key)
            else:
                torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5,
                                           msg=f"{kind} {pins}: {key}")
        initial = dict(jobs.build(kind)[0].named_parameters())
        assert all(not torch.equal(state[k], p) for k, p in initial.items()
                   if k not in frozen), (kind, pins)  # every trainable parameter moved
