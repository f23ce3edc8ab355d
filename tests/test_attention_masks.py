"""passes/normalize.py::simplify_attention_masks: shape-only attention masks become
``is_causal`` (or go away), data-dependent and non-causal masks stay.

The numerical proof that the rewritten graphs compute the same loss and gradients as eager
PyTorch, at the example's sizes and at others, is tests/test_capture.py's
``test_captured_graph_is_the_same_function`` (GPT-2, LLaMA with grouped kv-heads, BERT).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import capture
from autopar.passes.normalize import _mask_kind

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention_calls(captured):
    return [n for n in captured.gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _mask_of(node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


@pytest.mark.parametrize("family,causal", [("gpt", True), ("llama", True), ("bert", False)])
def test_shape_only_masks_are_simplified(tiny_models, family, causal):
    *_, captured = tiny_models[family]
    calls = _attention_calls(captured)
    assert calls
    for node in calls:
        assert _mask_of(node) is None
        assert bool(node.kwargs.get("is_causal", False)) is causal


def test_a_padding_mask_from_the_inputs_is_kept():
    """BERT given an attention_mask input: the mask depends on data, so it stays, and the
    captured graph still masks the padded keys."""
    from conftest import build_tiny

    zm = build_tiny("bert")
    ids = torch.randint(0, 128, (2, 12))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, 8:] = 0
    captured = capture(zm.model, (ids, pad))
    assert all(_mask_of(n) is not None for n in _attention_calls(captured))
    got = captured.run(ids, pad)
    want = zm.model(ids, pad)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = want.logits if hasattr(want, "logits") else want
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class BandAttention(nn.Module):
    """Attention to the previous 3 positions only: a shape-only mask that is not causal."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(x.shape[1], device=x.device)
        band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band).sum()


def test_a_non_causal_shape_mask_is_kept():
    model = BandAttention()
    x = torch.randn(2, 10, 16)
    captured = capture(model, (x,))
    (node,) = _attention_calls(captured)
    assert _mask_of(node) is not None and not node.kwargs.get("is_causal", False)
    torch.testing.assert_close(captured.run(x), model(x))


def test_mask_kinds():
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    additive = torch.zeros(5, 5).masked_fill(~tril, float("-inf"))
    assert _mask_kind(tril[None, None], 5, 5) == "causal"
    assert _mask_kind(additive, 5, 5) == "causal"
    assert _mask_kind(torch.zeros(5, 5).masked_fill(~tril, torch.finfo(torch.float32).min),
                      5, 5) == "causal"
    assert _mask_kind(torch.ones(2, 1, 1, 5, dtype=torch.bool), 5, 5) == "none"
    assert _mask_kind(torch.zeros(5, 5), 5, 5) == "none"
    assert _mask_kind(tril.triu(-1), 5, 5) is None  # a band
    assert _mask_kind(torch.randn(5, 5), 5, 5) is None  # an additive bias (ALiBi-like)
    assert _mask_kind(torch.ones(4, 6, dtype=torch.bool).tril(), 4, 6) is None  # q != k length


def test_the_property_is_checked_on_the_graph(monkeypatch):
    """``attention_masks_simplified`` is a predicate, not a label: on a graph captured without
    the pass, it names the attention that still takes a causal mask as a tensor; the pass makes
    it hold, and a pass requiring it out of order fails by name."""
    import autopar.passes.normalize as normalize
    from autopar.errors import PassError
    from autopar.passes.infra import PassContext, PassManager, check_property, graph_pass
    from conftest import build_tiny

    monkeypatch.setattr(normalize, "NORMALIZE_PASSES",
                        tuple(p for p in normalize.NORMALIZE_PASSES
                              if p.name != "simplify_attention_masks"))
    zm = build_tiny("llama")
    inputs, targets = zm.example_inputs(batch=2, seq=8)
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    reason = check_property("attention_masks_simplified", captured.gm, PassContext())
    assert reason is not None and "causal mask" in reason, reason

    @graph_pass(requires=("attention_masks_simplified",))
    def needs_simple_masks(gm, ctx):
        from autopar.passes.infra import PassResult
        return PassResult(gm, False)

    with pytest.raises(PassError, match="attention_masks_simplified"):
        PassManager([needs_simple_masks]).run(captured.gm, PassContext())
    gm = PassManager([normalize.simplify_attention_masks, needs_simple_masks]).run(
        captured.gm, PassContext())
    assert check_property("attention_masks_simplified", gm, PassContext()) is None
    assert all(_mask_of(n) is None for n in gm.graph.nodes
               if n.op == "call_function" and n.target is SDPA)
