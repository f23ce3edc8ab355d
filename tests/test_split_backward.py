"""The zero-bubble split backward (``runtime/split_backward.py``): input gradients, then weight
gradients, equal to one full backward, with no input-side node run twice."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.split_backward import backward_input, backward_weight, weight_groups


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its calls (marks the input side of the graph)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Counted.calls += 1
        return g


def _stage(x, w1, b1, w2, ln_w, ln_b, extra, shared):
    """Two linears, a layer norm, a weight used twice in a row (``shared``), and a weight whose
    path to the output avoids the input side (``extra``)."""
    h = torch.nn.functional.linear(_Counted.apply(x), w1, b1).tanh()
    h = _Counted.apply(h)
    h = torch.nn.functional.layer_norm(h, (h.shape[-1],), ln_w, ln_b)
    h = h @ shared
    h = _Counted.apply(h) @ shared
    out = torch.nn.functional.linear(h, w2) + extra.sum()
    return out


def _params(gen):
    shapes = {"w1": (6, 5), "b1": (6,), "w2": (3, 6), "ln_w": (6,), "ln_b": (6,), "extra": (4,),
              "shared": (6, 6)}
    return {k: (torch.randn(*s, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
            for k, s in shapes.items()}


@pytest.mark.parametrize("with_input", [True, False])
def test_split_equals_full_backward_and_runs_the_input_side_once(with_input):
    gen = torch.Generator().manual_seed(0)
    p = _params(gen)
    x = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64).requires_grad_(with_input)
    grad = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
    names = list(p)
    ref = torch.autograd.grad(_stage(x, *p.values()), ([x] if with_input else []) +
                              list(p.values()), grad)

    out = _stage(x, *p.values())
    _Counted.calls = 0
    inputs = [x] if with_input else []
    found, pending = backward_input([out], [grad], inputs, list(p.values()))
    after_input = _Counted.calls
    weights = dict((id(t), g) for t, g in backward_weight(pending))
    # I runs every input-side node once; W none of them again, except the one between the two
    # uses of the twice-used weight (its first use needs the gradient through it). Without an
    # input that needs a gradient (a first stage), the input side is the chain of nodes above
    # two or more weights: I runs it (the two counted nodes downstream of x) and W the same one
    # again, not the whole backward.
    assert after_input == (3 if with_input else 2)
    assert _Counted.calls - after_input == 1
    if with_input:
        torch.testing.assert_close(found[0], ref[0], rtol=0, atol=1e-12)
    got = [weights[id(p[n])] for n in names]
    for n, g, r in zip(names, got, ref[1 if with_input else 0:]):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12, msg=n)


def test_scalar_loss_and_unused_weight():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4, 4, generator=gen, requires_grad=True)
    unused = torch.randn(3, generator=gen, requires_grad=True)
    x = torch.randn(2, 4, generator=gen, requires_grad=True)
    loss = (x @ w).square().mean()
    ref = torch.autograd.grad((x @ w).square().mean(), [x, w])
    found, pending = backward_input([loss], [None], [x], [w, unused])
    weights = dict((id(t), g) for t, g in backward_weight(pending))
    torch.testing.assert_close(found[0], ref[0])
    torch.testing.assert_close(weights[id(w)], ref[1])
    assert weights.get(id(unused)) is None


def test_split_backward_under_saved_gathers_frees_the_graph():
    """A stage forward with sequence parallelism runs under ``saved_gathers``
    (runtime/pipeline.py). A saved-tensor hook that kept a node's own output with its grad_fn
    made a reference cycle through C++ that gc cannot collect; the split backward retains the graph between I and W, so each micro-batch
    leaked its whole graph (zb-h1 and zb-v grew every step). Nothing of the graph may outlive W."""
    import gc

    from autopar.runtime.tp import saved_gathers

    def live_graph_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects()
                   if type(o) is torch.Tensor and o.grad_fn is not None)

    gen = torch.Generator().manual_seed(2)
    p = _params(gen)
    before = live_graph_tensors()
    for _ in range(3):
        x = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64).requires_grad_()
        with saved_gathers():
            out = _stage(x, *p.values()).tanh()  # tanh saves its own output
        found, pending = backward_input([out], [torch.ones_like(out)], [x], list(p.values()))
        backward_weight(pending)
        del x, out, found, pending
    assert live_graph_tensors() == before


def test_only_a_sequence_parallel_gather_needs_the_saved_tensor_hooks():
    """The executor enters ``saved_gathers`` only around a stage holding an all-gather whose
    gradient is a reduce-scatter (``StageModule.regathers``): that call, with ``grad`` by
    keyword or by position, and no other."""
    import torch.fx

    from autopar.runtime import tp
    from autopar.runtime.stage_module import keeps_gather_as_shard

    g = torch.fx.Graph()
    group, x = g.placeholder("tp"), g.placeholder("x")
    by_keyword = g.call_function(tp.all_gather, (group, x, 1), {"grad": "reduce_scatter"})
    by_position = g.call_function(tp.all_gather, (group, x, 1, 1, "reduce_scatter"))
    sliced = g.call_function(tp.all_gather, (group, x, 1))
    other = g.call_function(tp.reduce_scatter, (group, x, 1))
    assert keeps_gather_as_shard(by_keyword) and keeps_gather_as_shard(by_position)
    assert not keeps_gather_as_shard(sliced) and not keeps_gather_as_shard(other)
    assert not keeps_gather_as_shard(x)


def test_a_stage_without_inputs_splits_its_weight_gradients_by_layer():
    """A first stage (token ids in, nothing to differentiate) keeps the zero-bubble split: I runs
    the chain of nodes above two or more weights, and W computes the weights in groups of one
    layer each (so ZeRO-3 gathers one layer at a time for W), not in one call over the stage.
    The embedding's weight and the first layer norm's gain hang from the same node (the norm's
    backward), so they share a group: W runs a node once for all the weights below it."""
    gen = torch.Generator().manual_seed(2)
    emb = (torch.randn(10, 6, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    layers = [{"w": (torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(),
               "b": torch.zeros(6, dtype=torch.float64, requires_grad=True),
               "g": torch.ones(6, dtype=torch.float64, requires_grad=True)} for _ in range(4)]
    ids = torch.randint(0, 10, (2, 5), generator=gen)
    grad = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)

    def stage():
        h = torch.nn.functional.embedding(ids, emb)
        for layer in layers:
            h = h + torch.nn.functional.linear(
                torch.nn.functional.layer_norm(h, (6,), layer["g"]), layer["w"], layer["b"]).tanh()
        return h

    params = [emb] + [t for layer in layers for t in layer.values()]
    ref = torch.autograd.grad(stage(), params, grad)
    found, pending = backward_input([stage()], [grad], [], params)
    assert found == []
    groups = weight_groups(pending)
    assert len(groups) >= len(layers)
    layer_of = {id(t): i for i, layer in enumerate(layers) for t in layer.values()}
    for group in groups:  # one layer's weights; the embedding shares the first norm's node
        owners = sorted({layer_of.get(id(t), -1) for t in group})
        assert owners in ([i] for i in range(-1, len(layers))) or owners == [-1, 0], owners
    weights = dict((id(t), g) for t, g in backward_weight(pending))
    for t, r in zip(params, ref):
        torch.testing.assert_close(weights[id(t)], r, rtol=0, atol=1e-12)


def test_a_first_stage_without_zero3_computes_its_weights_in_one_call_at_w(monkeypatch):
    """``by_layer=False`` (no ZeRO-3 gathers to pace): a stage without inputs to differentiate
    runs nothing at I and its whole backward in one autograd call at W, with the gradients of
    one plain backward; a weight the outputs do not reach gets None."""
    gen = torch.Generator().manual_seed(3)
    emb = (torch.randn(10, 6, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    ws = [(torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
          for _ in range(3)]
    unused = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 10, (2, 5), generator=gen)
    grad = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)

    def stage():
        h = torch.nn.functional.embedding(ids, emb)
        for w in ws:
            h = h + (h @ w).tanh()
        return h

    params = [emb, *ws, unused]
    ref = torch.autograd.grad(stage(), params[:-1], grad)
    out = stage()
    calls = []
    real = torch.autograd.grad

    def counted(*args, **kwargs):
        calls.append(kwargs.get("retain_graph"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counted)
    found, pending = backward_input([out], [grad], [], params, by_layer=False)
    assert found == [] and calls == []
    assert weight_groups(pending) == [params]
    weights = dict((id(t), g) for t, g in backward_weight(pending))
    assert len(calls) == 1
    for t, r in zip(params, ref):
        torch.testing.assert_close(weights[id(t)], r, rtol=0, atol=0)
    assert weights[id(unused)] is None
    # with an input that needs a gradient, by_layer changes nothing: I computes it
    x = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64).requires_grad_()
    found, pending = backward_input([(x @ ws[0]).tanh()], [grad], [x], ws[:1], by_layer=False)
    assert found[0] is not None and len(calls) == 2


@pytest.mark.parametrize("with_input", [False, True])
def test_a_weight_two_layers_share_is_not_computed_through_the_layers_between(with_input):
    """A weight two layers read, far apart (a tied embedding and LM head in one stage: pp = 1;
    or a weight shared by two blocks), under ZeRO-3's pacing: W gathers each group's weights
    before its call and frees them after, so a call that ran the layers between again would read
    freed weights. Such a stage takes one W for all its weights instead (the whole backward where
    no input needs a gradient); the gradients are a plain backward's. It failed with a shape
    error inside autograd before (2026-11-29)."""
    gen = torch.Generator().manual_seed(4)
    emb = (torch.randn(10, 6, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    layers = [{"w": (torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(),
               "g": torch.ones(6, dtype=torch.float64, requires_grad=True)} for _ in range(3)]
    ids = torch.randint(0, 10, (2, 5), generator=gen)
    x = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64).requires_grad_()

    def stage():
        h = torch.nn.functional.embedding(ids, emb) + (x if with_input else 0)
        for layer in layers:
            h = h + torch.nn.functional.linear(
                torch.nn.functional.layer_norm(h, (6,), layer["g"]), layer["w"]).tanh()
        return (h @ emb.t()).square().mean()  # the head reads the embedding's table

    params = [emb] + [t for layer in layers for t in layer.values()]
    inputs = [x] if with_input else []
    ref = torch.autograd.grad(stage(), inputs + params)
    found, pending = backward_input([stage()], [None], inputs, params)
    if with_input:
        torch.testing.assert_close(found[0], ref[0], rtol=0, atol=1e-12)
    full = {id(t): t.data for t in params}
    empty = torch.empty(0, dtype=torch.float64)
    for t in params:  # freed after I, as ZeRO-3 frees a layer once its input side has run
        t.data = empty

    def gather(weights):
        for t in weights:
            t.data = full[id(t)]

    got = {}
    from autopar.runtime.split_backward import weight_gradient_groups
    for pairs in weight_gradient_groups(pending, gather):
        for t, g in pairs:
            got[id(t)] = g
            t.data = empty
    for t, r in zip(params, ref[len(inputs):]):
        torch.testing.assert_close(got[id(t)], r, rtol=0, atol=1e-12)
