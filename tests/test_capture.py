"""Capture: HF GPT-2, BERT, LLaMA and the project's own GPT, with their loss, symbolic shapes."""

from __future__ import annotations

import warnings

import pytest
import sympy
import torch
import torch.nn as nn

from autopar import InvalidInputError, UntraceableModelError, capture, models
from autopar.frontend import CaptureMethod
from autopar.ir import BATCH, SEQ, LayerKind, NodeKind, info

FAMILIES = ["gpt", "bert", "llama", "own_gpt"]


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_with_symbolic_batch_and_seq(tiny_models, family):
    model, loss_fn, inputs, targets, captured = tiny_models[family]
    assert captured.method is CaptureMethod.EXPORT
    assert captured.has_loss
    assert captured.example_sizes == {BATCH: 2, SEQ: 16}
    first = info(captured.node(captured.input_names[0])).spec
    assert first.shape == (BATCH, SEQ)
    target = captured.node(captured.target_names[0])
    assert info(target).kind is NodeKind.TARGET


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_graph_is_the_same_function(tiny_models, family):
    """Loss and every gradient of the captured graph equal eager PyTorch, also at a batch and
    sequence length other than the example's (the graph is symbolic, not re-traced)."""
    model, loss_fn, _, _, captured = tiny_models[family]
    gen = torch.Generator().manual_seed(7)
    for batch, seq in [(2, 16), (3, 9)]:
        tokens = torch.randint(0, 128, (batch, seq + 1), generator=gen)
        inputs, targets = (tokens[:, :-1],), (tokens[:, 1:],)
        model.zero_grad()
        expected = loss_fn(model(*inputs), *targets)
        expected.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        got = captured.run(*inputs, *targets)
        got.backward()
        # Same ATen ops in the same order: equal up to reassociation inside fused kernels.
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_and_layers(tiny_models, family):
    model, _, _, _, captured = tiny_models[family]
    assert captured.num_params == sum(p.numel() for p in model.parameters())
    blocks = [layer for layer in captured.layers if layer.kind is LayerKind.BLOCK]
    assert len(blocks) == 2
    assert len({b.signature for b in blocks}) == 1, "repeated blocks must share a signature"
    assert captured.layers[0].kind is LayerKind.PRE and captured.layers[-1].kind is LayerKind.POST
    owned = [fqn for layer in captured.layers for fqn in layer.params]
    assert sorted(owned) == sorted(p.fqn for p in captured.params.values())
    for node in captured.gm.graph.nodes:
        meta = info(node)
        assert meta.layer, node.name
        if node.op == "call_function" and meta.reads:
            assert meta.module_path, node.name


def test_tied_weights_are_one_parameter(tiny_models):
    _, _, _, _, captured = tiny_models["gpt"]
    tied = [p for p in captured.params.values() if p.aliases]
    assert len(tied) == 1
    names = {tied[0].fqn, *tied[0].aliases}
    assert names == {"lm_head.weight", "transformer.wte.weight"}


def test_module_paths_and_param_reads(tiny_models):
    _, _, _, _, captured = tiny_models["llama"]
    linears = [n for n in captured.gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    q_proj = [n for n in linears if info(n).module_path == "model.layers.0.self_attn.q_proj"]
    assert len(q_proj) == 1
    assert info(q_proj[0]).reads == ("model.layers.0.self_attn.q_proj.weight",)
    assert info(q_proj[0]).layer == "model.layers.0"
    assert info(q_proj[0]).requires_grad


def test_gpt2_conv1d_becomes_linear(tiny_models):
    _, _, _, _, captured = tiny_models["gpt"]
    ops = [n.target for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.addmm.default not in ops
    assert ops.count(torch.ops.aten.linear.default) == 2 * 4 + 1  # 4 per block + LM head


def test_llama_rotary_region_is_inlined(tiny_models):
    _, _, _, _, captured = tiny_models["llama"]
    names = {str(n.target) for n in captured.gm.graph.nodes}
    assert not any("wrap_with_set_grad_enabled" in t for t in names)


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_batch_of_one_keeps_the_batch_symbolic(family):
    """Export fixes a size-1 dim to 1; capture traces a batch of one as two, so ``b`` stays in
    every shape (the post layer's tensors included) and the graph runs at any batch."""
    from conftest import build_tiny

    zm = build_tiny(family)
    gen = torch.Generator().manual_seed(3)
    inputs, targets = zm.example_inputs(batch=1, seq=16, generator=gen)
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    assert captured.method is CaptureMethod.EXPORT and not captured.warnings
    assert captured.example_sizes == {BATCH: 1, SEQ: 16}
    post = [n for n in captured.gm.graph.nodes if n.op == "call_function"
            and info(n).layer == "post" and info(n).spec is not None and info(n).spec.ndim == 3]
    assert post and all(BATCH in info(n).spec.shape for n in post)
    for batch, seq in [(1, 16), (3, 9)]:
        inputs, targets = zm.example_inputs(batch=batch, seq=seq, generator=gen)
        expected = zm.loss_fn(zm.model(*inputs), *targets)
        torch.testing.assert_close(captured.run(*inputs, *targets), expected, rtol=1e-6, atol=1e-6)


class _OneSequence(nn.Module):
    """Works on a batch of one only: the batch dim is folded away by a reshape."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x.reshape(x.shape[-2], x.shape[-1]))


def test_batch_of_one_that_cannot_double_keeps_the_sequence_symbolic():
    with pytest.warns(UserWarning, match="batch size fixed to 1"):
        captured = capture(_OneSequence(), (torch.randn(1, 6, 8),))
    assert captured.method is CaptureMethod.EXPORT
    assert captured.example_sizes == {SEQ: 6}
    assert captured.run(torch.randn(1, 5, 8)).shape == (5, 8)


def test_meta_device_capture_allocates_nothing():
    zm = models.build("gpt2-medium", device="meta")
    inputs, targets = zm.example_inputs(batch=2, seq=8)
    captured = capture(zm.model, inputs, zm.loss_fn, example_targets=targets)
    assert all(p.is_meta for p in zm.model.parameters())
    assert captured.num_params == sum(p.numel() for p in zm.model.parameters())
    assert sum(layer.is_block for layer in captured.layers) == 24


class _MakesTensorsFromData(nn.Module):
    """A forward that makes tensors from Python data, as GPT-Neo's attention (a fill value of
    ``torch.tensor(finfo.min, device=x.device)``) and Falcon's (``qkv[..., [-2]]`` indexes with a
    list) do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.proj.weight  # a tie the capture must keep

    def forward(self, x):
        y = self.proj(x)
        fill = torch.tensor(-7.5, dtype=y.dtype, device=y.device)
        y = torch.where(y > 0, y, fill)
        return self.head(y[..., [-2, 1]].repeat(1, 1, 4))


def test_a_meta_capture_keeps_the_values_of_tensors_made_from_data():
    """Captured on the meta device, those tensors would be meta too, without values, and the
    program could not run; the capture recovers them (a second trace on fake CPU tensors): the
    same constants as the capture of the real model, the model's own (meta, tied) parameters
    left in place."""
    loss = lambda out, t: nn.functional.mse_loss(out, t)  # noqa: E731
    x = torch.randn(2, 3, 8)
    real = capture(_MakesTensorsFromData(), (x,), loss, example_targets=(x,))
    with torch.device("meta"):
        model = _MakesTensorsFromData()
    before = [id(p) for p in model.parameters()]
    captured = capture(model, (x,), loss, example_targets=(x,))
    assert [id(p) for p in model.parameters()] == before and model.head.weight is model.proj.weight
    assert all(p.is_meta for p in model.parameters())
    assert sorted(captured.constants) == sorted(real.constants) and captured.constants
    for name, value in captured.constants.items():
        assert not value.is_meta and torch.equal(value, real.constants[name]), name


class _NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.tokens(ids))


def test_one_tensor_passed_as_input_and_target_captures_both():
    """A language model's example ``(ids,)`` passed as the inputs and the targets: torch.export
    traces one placeholder for tensors that share memory, and the graph would read the targets
    where the model reads its ids, so a step whose labels differ computed another loss,
    silently. Against eager PyTorch with labels != ids, and the same captured on meta."""
    torch.manual_seed(0)
    model = _NextToken()
    loss = lambda logits, labels: nn.functional.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), labels.flatten())
    ids = torch.randint(0, 11, (2, 6))
    captured = capture(model, (ids,), loss, example_targets=(ids,))
    assert len({n.name for n in captured.gm.graph.nodes if n.op == "placeholder"
                and info(n).kind in (NodeKind.INPUT, NodeKind.TARGET)}) == 2
    step_ids, labels = torch.randint(0, 11, (2, 6)), torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(captured.run(step_ids, labels), loss(model(step_ids), labels))
    with torch.device("meta"):
        on_meta = _NextToken()
    meta_ids = ids.to("meta")
    captured = capture(on_meta, (meta_ids,), loss, example_targets=(meta_ids,))
    kinds = [info(n).kind for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert kinds.count(NodeKind.INPUT) == kinds.count(NodeKind.TARGET) == 1


class _Sliced(nn.Module):
    """Embeds a slice of its ids; with ``window``, mixes the tokens through a causal mask
    sliced from a buffer of that many rows (GPT-Neo's ``bias[:, :, :s, :s]``)."""

    def __init__(self, view, window=None):
        super().__init__()
        self.view = view
        self.tokens = nn.Embedding(50, 4)
        if window:
            self.register_buffer("causal", torch.tril(torch.ones(window, window)))
        self.window = window

    def forward(self, ids):
        h = self.tokens(self.view(ids))
        if self.window:
            n = h.shape[1]
            h = self.causal[:n, :n] @ h
        return h


def _energy(out):
    return out.pow(2).mean()


SLICES = {"ids[:, 2:]": lambda ids: ids[:, 2:], "ids[:, 1:-1:2]": lambda ids: ids[:, 1:-1:2],
          "ids[:, 4:-4]": lambda ids: ids[:, 4:-4]}


def _captured_quietly(model, ids):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = capture(model, (ids,), _energy)
    shown = [str(w.message) for w in caught if "captured" in str(w.message)
             or "fixes the size" in str(w.message)]
    assert not shown and not captured.warnings, shown
    return captured


@pytest.mark.parametrize("name", list(SLICES))
def test_a_model_that_slices_its_sequence_keeps_it_symbolic(name):
    """Export guards the slice's length away from 0 and 1 (sizes it specializes) and suggests
    no bound; the capture takes the least sequence that keeps every guard, where it had fixed
    the sequence at the example's 16: the least s at which the slice keeps 2 tokens, found here
    by eager slicing, and the graph equals eager PyTorch at every s from it to 24."""
    view = SLICES[name]
    model = _Sliced(view)
    captured = _captured_quietly(model, torch.randint(0, 50, (2, 16)))
    least = min(s for s in range(1, 17) if view(torch.zeros(1, s)).shape[1] >= 2)
    assert SEQ in captured.example_sizes and captured.size_ranges == {SEQ: (least, None)}
    for s in range(least, 25):
        ids = torch.randint(0, 50, (3, s))
        torch.testing.assert_close(captured.run(ids), _energy(model(ids)), msg=str(s))


def test_a_buffer_slice_bounds_the_sequence_from_above():
    """A causal mask sliced from a 32-row buffer (GPT-Neo's pattern): export bounds s by 32
    and guards ``s != 32`` (where the slice would be the whole buffer), which it cannot state
    as a bound; the capture keeps s symbolic for 2 to 31 where it had fixed it at 16. With the
    ids sliced first the range moves by the 2 tokens dropped. The graph equals eager PyTorch
    at each size in the range."""
    for view, want in ((lambda ids: ids, (2, 31)), (lambda ids: ids[:, 2:], (4, 33))):
        model = _Sliced(view, window=32)
        captured = _captured_quietly(model, torch.randint(0, 50, (2, 16)))
        assert captured.size_ranges == {SEQ: want}
        for s in range(want[0], want[1] + 1):
            ids = torch.randint(0, 50, (2, s))
            torch.testing.assert_close(captured.run(ids), _energy(model(ids)), msg=str(s))


def test_model_without_loss():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    captured = capture(model, (torch.randn(4, 8),))
    assert not captured.has_loss
    out = captured.run(torch.randn(5, 8))
    assert out.shape == (5, 4)
    assert [layer.name for layer in captured.layers] == ["0", "1", "2"]


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # branch on a tensor value
            return self.proj(x)
        return -self.proj(x)


def test_data_dependent_control_flow_is_named():
    with pytest.raises(UntraceableModelError, match="control flow") as err:
        capture(_DataDependent(), (torch.randn(2, 4),))
    assert "torch.where" in str(err.value)


def test_bad_inputs_are_named():
    model = nn.Linear(4, 4)
    with pytest.raises(InvalidInputError, match="no tensor"):
        capture(model, (3,))
    with pytest.raises(InvalidInputError, match="without a loss_fn"):
        capture(model, (torch.randn(2, 4),), example_targets=(torch.randn(2, 4),))
    with pytest.raises(InvalidInputError, match="disagree on the batch"):
        capture(nn.Bilinear(4, 4, 2), (torch.randn(2, 4), torch.randn(3, 4)))
    with pytest.raises(InvalidInputError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2, 4),))


def test_shape_expressions_are_sympy(tiny_models):
    _, _, _, _, captured = tiny_models["own_gpt"]
    for node in captured.gm.graph.nodes:
        spec = info(node).spec
        if spec is not None:
            assert all(isinstance(d, sympy.Expr) for d in spec.shape)
            assert all(sym in (BATCH, SEQ) for d in spec.shape for sym in d.free_symbols)


@torch.library.custom_op("autopar_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:  # a custom kernel with no fake implementation
    return x * 2.0


_double.register_autograd(lambda ctx, grad: grad * 2.0)


class _CustomOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = torch.ops.autopar_test.double(block(x)).relu()
        return self.head(x)


def test_fx_fallback_for_ops_export_cannot_run():
    """Export needs fake kernels; symbolic_trace records the call. The fallback lowers the rest
    to ATen, keeps the custom op opaque, and computes the same loss and gradients."""
    torch.manual_seed(0)
    model = _CustomOpModel()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    loss_fn = nn.functional.cross_entropy
    with pytest.warns(UserWarning, match="symbolic_trace.*opaque.*autopar_test.double"):
        captured = capture(model, (x,), loss_fn, example_targets=(y,))
    assert captured.method is CaptureMethod.FX
    assert captured.num_params == sum(p.numel() for p in model.parameters())
    assert [layer.name for layer in captured.layers] == ["blocks.0", "blocks.1", "post"]
    ops = {str(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert "aten.linear.default" in ops and "aten.cross_entropy_loss.default" in ops
    got = captured.run(x, y)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = loss_fn(model(x), y)
    want.backward()
    torch.testing.assert_close(got, want)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_no_runtime_asserts_remain(tiny_models):
    """Normalize inlines no-grad regions before dropping asserts, so none survive (LLaMA)."""
    for family in ("gpt", "llama"):
        captured = tiny_models[family][4]
        names = {str(n.target) for n in captured.gm.graph.nodes}
        assert not any("_assert" in t for t in names), family


def test_evaluate_bare_symbol():
    from autopar.ir import evaluate

    assert evaluate(BATCH, b=3) == 3 and evaluate(BATCH * SEQ + 1, b=2, s=5) == 11
