"""The vocabulary padded to a multiple of 128 x tp (passes/pad_vocab.py), in one process.

The padded size is Megatron-LM's (its ``_vocab_size_with_padding``: GPT-2's 50257 becomes 50304
at tp 1). The padded program (at tp 1, so it runs here; tests/test_parallelize.py runs tp 2 on
gloo) computes exactly the model's loss and gradients: the padded classes' logits are -inf at
every class reduction, so they add exactly 0 to the softmax's sum and get a gradient of exactly
0. Compared in fp32 at 1e-6 relative (the same ops on the same values; the LM head's GEMM over
more rows may block its sums differently). Where padding would change the result (a
label-smoothed loss sums every class's log-probability) nothing is padded, and a tp that then
does not divide the vocabulary is an error that says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import InvalidPlanError, Plan, ShardingError
from autopar.passes.pad_vocab import pad_vocabulary, padded_size
from autopar.runtime.tp import TPGroup
from autopar.tensor_parallel import tensor_parallelize

from conftest import build_tiny
from tp_helpers import TINY_COST


def test_padded_size_is_megatrons():
    # Megatron-LM pads GPT-2's 50257 to 50304 at tp 1; the multiple is 128 x tp
    assert padded_size(50257, 128, 1) == 50304
    assert padded_size(50257, 128, 2) == 50432
    assert padded_size(50257, 128, 8) == 51200
    assert padded_size(32000, 128, 8) == 32768 and padded_size(32000, 128, 2) == 32000
    assert padded_size(101, 0, 4) == 104  # 0: only what tp needs


class TinyLM(nn.Module):
    """Embedding, an LM head with a bias, optionally Gemma-style soft-capped logits."""

    def __init__(self, vocab: int = 101, hidden: int = 16, cap: float | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.cap = cap

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.emb(ids)))
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def _ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _nll(logits, target):
    return F.nll_loss(F.log_softmax(logits, dim=-1).flatten(0, 1), target.flatten())


def _smoothed(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)


def _batch(vocab: int = 101):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, 9), generator=gen)
    return (tokens[:, :-1],), (tokens[:, 1:],)


def _check_equal(model, loss_fn, inputs, targets, padded_rows: int, multiple: int = 8):
    captured = autopar.capture(model, inputs, loss_fn, example_targets=targets)
    program = tensor_parallelize(captured, 1, cost=TINY_COST, vocab_multiple=multiple)
    assert program.vocab_padding.padded == padded_rows
    module = program.module(0, TPGroup(None), full=model)
    out = module(*inputs, *targets)
    model.zero_grad()
    ref = loss_fn(model(*inputs), *targets) if loss_fn is not None else model(*inputs)
    if loss_fn is None:
        assert out.shape == ref.shape  # logits returned are cut back to the vocabulary
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        return program, module
    out.backward()
    ref.backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    grads = program.gather_state_dict([{k: p.grad for k, p in module.named_parameters()}])
    for name, p in model.named_parameters():
        assert grads[name].shape == p.shape, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
    for p in module.parameters():  # the padded rows' gradients are exactly zero
        if p.shape[0] == padded_rows:
            assert p.grad[p.shape[0] - (padded_rows - 101):].abs().max() == 0
    return program, module


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_the_zoo_families_pad_to_the_same_numbers(family):
    """GPT-2 (tied head), LLaMA (untied) and BERT (tied decoder with its own bias)."""
    zm = build_tiny(family, vocab=101)
    inputs, targets = zm.example_inputs(batch=2, seq=16, generator=torch.Generator().manual_seed(1))
    program, _ = _check_equal(zm.model, zm.loss_fn, inputs, targets, 104)
    logical = program.vocab_padding.logical_shapes
    assert logical and all(shape[0] == 101 for shape in logical.values())
    assert {int(p.spec.shape[0]) for p in program.vocab_padding.captured.params.values()
            if p.fqn in logical} == {104}


@pytest.mark.parametrize("cap,loss_fn", [(None, _ce), (30.0, _ce), (None, _nll), (5.0, _nll)])
def test_soft_capped_logits_and_log_softmax_losses(cap, loss_fn):
    """The mask sits right before the class reduction, so an element-wise map of the logits
    (tanh soft-capping maps a -inf logit to -cap) does not undo it."""
    torch.manual_seed(0)
    inputs, targets = _batch()
    _check_equal(TinyLM(cap=cap), loss_fn, inputs, targets, 104)


def test_returned_logits_are_cut_back():
    torch.manual_seed(0)
    inputs, _ = _batch()
    _check_equal(TinyLM(), None, inputs, (), 128, multiple=128)


def test_a_label_smoothed_loss_is_not_padded_and_says_why():
    torch.manual_seed(0)
    inputs, targets = _batch()
    captured = autopar.capture(TinyLM(), inputs, _smoothed, example_targets=targets)
    padding = pad_vocabulary(captured, 128, 1)
    assert not padding.active and padding.captured is captured
    assert "label-smoothed" in padding.skipped
    program = tensor_parallelize(captured, 1, cost=TINY_COST, vocab_multiple=128)
    assert program.vocab_padding.padded == 101  # runs unpadded
    with pytest.raises(ShardingError, match="label-smoothed"):
        tensor_parallelize(captured, 2, cost=TINY_COST, vocab_multiple=128)


class NormedLM(TinyLM):
    """A regularizer reads the whole table: padding would change its mean."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) * self.emb.weight.square().mean()
        return self.head(torch.tanh(x))


def test_a_table_read_otherwise_is_not_padded():
    torch.manual_seed(0)
    inputs, targets = _batch()
    captured = autopar.capture(NormedLM(), inputs, _ce, example_targets=targets)
    padding = pad_vocabulary(captured, 128, 1)
    assert not padding.active and "other than as a vocabulary" in padding.skipped


def test_captured_graph_is_left_as_it_was(tiny_models):
    captured = tiny_models["gpt"][4]
    before = {n.name: str(n.meta["autopar"].spec) for n in captured.gm.graph.nodes
              if n.op != "output"}
    padding = pad_vocabulary(captured, 128, 2)
    assert padding.active and padding.padded == 256 and padding.captured is not captured
    after = {n.name: str(n.meta["autopar"].spec) for n in captured.gm.graph.nodes
             if n.op != "output"}
    assert before == after


def test_the_plan_field():
    plan = Plan(vocab_multiple=64)
    assert Plan.from_json(plan.to_json()).vocab_multiple == 64
    assert "vocab_multiple" not in Plan().to_json()  # the default is not written
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidPlanError, match="vocab_multiple"):
            Plan(vocab_multiple=bad)
