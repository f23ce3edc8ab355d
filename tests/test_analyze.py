"""Analysis: FLOPs and activation memory as symbolic expressions, checked against closed forms
and against torch's own counters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import autopar.frontend as capture_module
from autopar import capture, models
from autopar.ir import evaluate, info
from autopar.passes.analyze import _analyze_node, analyze

SHAPES = [(1, 128), (4, 512), (8, 2048), (3, 777)]


def gpt_forward_flops(l: int, h: int, v: int, b: int, s: int) -> int:
    """Megatron-LM's count (Narayanan et al. 2021): l(24 b s h^2 + 4 b s^2 h) + 2 b s h V."""
    return l * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * v


@pytest.fixture(scope="module")
def gpt_profiles():
    out = {}
    for name in ("gpt2-small", "gpt3-1.3b"):
        # 3 layers of each (the closed form is linear in the layers; a full depth took 13 s)
        zm = models.build(name, device="meta", layers=3)
        inputs, targets = zm.example_inputs(batch=2, seq=16)
        out[name] = (zm.spec, analyze(capture(zm.model, inputs, zm.loss_fn, example_targets=targets)))
    return out


@pytest.mark.parametrize("name", ["gpt2-small", "gpt3-1.3b"])
def test_gpt_flops_match_closed_form_without_retracing(gpt_profiles, monkeypatch, name):
    spec, profile = gpt_profiles[name]

    def no_retrace(*args, **kwargs):
        raise AssertionError("the analysis must not re-trace the model")

    monkeypatch.setattr(capture_module.torch.export, "export", no_retrace)
    for b, s in SHAPES:
        want = gpt_forward_flops(spec.layers, spec.hidden, spec.vocab, b, s)
        got = profile.forward_flops(b=b, s=s)
        assert abs(got / want - 1) < 0.01, (b, s, got, want)
        gemm = evaluate(profile.gemm_flops, b=b, s=s)
        assert abs(gemm / want - 1) < 1e-3, (b, s, gemm, want)


@pytest.mark.parametrize("family", ["gpt", "bert", "llama", "own_gpt"])
def test_gemm_flops_equal_torch_flop_counter(tiny_models, family):
    """Independent reference: torch.utils.flop_counter counts the matmuls of an eager run."""
    model, loss_fn, inputs, targets, captured = tiny_models[family]
    profile = analyze(captured)
    counter = FlopCounterMode(display=False)
    # The MATH backend spells attention as two matmuls the counter sees (it has no formula for
    # the CPU flash kernel).
    with sdpa_kernel(SDPBackend.MATH), counter:
        loss_fn(model(*inputs), *targets)
    b, s = inputs[0].shape
    assert evaluate(profile.gemm_flops, b=b, s=s) == counter.get_total_flops()


class _Convs(nn.Module):
    """Plain, depthwise, grouped, pointwise, 1-D, 3-D and transposed convolutions."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.grouped = nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=4)
        self.pw = nn.Conv2d(32, 8, 1)
        self.c1 = nn.Conv1d(8, 12, 5, padding=2, groups=2)
        self.c3 = nn.Conv3d(1, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 6, 2, stride=2, groups=2)

    def forward(self, x):
        x = self.pw(self.grouped(self.dw(self.stem(x))))
        y = self.c1(x.flatten(2))
        z = self.c3(x[:, :1].unsqueeze(1))
        return y.mean() + z.mean() + self.up(x).mean()


def test_convolution_flops_equal_torch_flop_counter():
    """Independent reference: torch.utils.flop_counter's convolution formula, for every kind
    of convolution (a depthwise one does C_in times fewer multiply-adds than a plain one of
    its shape: the count read the input's channels until 2026-12-01)."""
    model = _Convs()
    x = torch.randn(2, 3, 16, 16)
    captured = capture(model, (x,), lambda out: out)
    profile = analyze(captured)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x)
    b = x.shape[0]
    assert evaluate(profile.gemm_flops, b=b) == counter.get_total_flops()


def test_repeated_layers_reuse_one_analysis(tiny_models):
    _, _, _, _, captured = tiny_models["llama"]
    analyze(captured)
    blocks = [layer for layer in captured.layers if layer.is_block]
    second = blocks[1]
    for name in second.nodes:  # recompute the copied numbers from scratch
        node = captured.node(name)
        copied = (info(node).flops, info(node).bytes_read, info(node).bytes_written)
        _analyze_node(node)
        assert copied == (info(node).flops, info(node).bytes_read, info(node).bytes_written)
    profile = analyze(captured)
    assert profile.repeated[second.signature] == 2


class _SmallBlock(nn.Module):
    """A transformer-like block with explicit attention (no fused kernels), for exact checks."""

    def __init__(self, h=32, heads=4, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.fc = nn.Linear(h, 4 * h)
        self.out = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = self.drop(torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln(x)))))


class _Stack(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(_SmallBlock(dropout=dropout) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _autograd_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward."""
    params = {p.data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if t.untyped_storage().data_ptr() not in params and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return total


def test_saved_activations_equal_autograd():
    """Independent reference: the tensors autograd itself saves, caught with saved-tensor hooks."""
    torch.manual_seed(0)
    model = _Stack().train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    captured = capture(model, (x,))
    profile = analyze(captured)
    predicted = sum(evaluate(layer.saved_bytes, b=2, s=8) for layer in profile.layers)
    # The analysis charges the model input x (saved by the first LayerNorm) like autograd does.
    assert predicted == _autograd_saved_bytes(model, x)


class _SameDtypeCast(nn.Module):
    """HF's ``probs.type(value.dtype)``: a cast to the tensor's own dtype, which hands back its
    input (no new tensor for autograd to save)."""

    def __init__(self):
        super().__init__()
        self.stack = _Stack()

    def forward(self, x):
        y = self.stack(x)
        return torch.softmax(y, dim=-1).to(y.dtype) @ y.transpose(-1, -2)


def test_cast_to_own_dtype_saves_nothing_new():
    torch.manual_seed(0)
    model = _SameDtypeCast().train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    profile = analyze(capture(model, (x,)))
    predicted = sum(evaluate(layer.saved_bytes, b=2, s=8) for layer in profile.layers)
    assert predicted == _autograd_saved_bytes(model, x)


def test_dropout_masks_are_one_byte_per_element():
    """With dropout on, the analysis keeps one byte per element for each mask: what the fused
    CUDA kernel (native_dropout) saves and what Korthikanti et al. count. PyTorch's CPU dropout
    instead saves the mask in the activation dtype (4 bytes here), hence 3 more bytes each."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, requires_grad=True)
    plain = analyze(capture(_Stack(dropout=0.0).train(), (x,)))
    dropped_model = _Stack(dropout=0.1).train()
    dropped = analyze(capture(dropped_model, (x,)))
    total = lambda p: sum(evaluate(layer.saved_bytes, b=2, s=8) for layer in p.layers)  # noqa: E731
    b, s, heads, h = 2, 8, 4, 32
    mask_elems = 2 * (b * heads * s * s + b * s * h)  # per block: attention probs, MLP output
    probs_copy = 2 * b * heads * s * s * 4  # dropped-out probs are no longer softmax's output
    assert total(dropped) - total(plain) == mask_elems + probs_copy
    assert _autograd_saved_bytes(dropped_model, x) - total(dropped) == 3 * mask_elems


class _TensorRecorder(torch.fx.Interpreter):
    """Runs the captured graph on real tensors and keeps each node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_bytes_moved_equal_the_real_tensors(tiny_models, family):
    """Bytes read and written per node, evaluated at a shape other than the captured one, equal
    the sizes of the tensors the graph really reads and writes when run at that shape."""
    from autopar.passes.analyze import CREATION_OPS, VIEW_OPS, _is_identity
    from autopar.ir import op_name

    _, _, _, _, captured = tiny_models[family]
    analyze(captured)
    batch, seq = 3, 11
    tokens = torch.randint(0, 128, (batch, seq + 1), generator=torch.Generator().manual_seed(3))
    recorder = _TensorRecorder(captured.gm)
    with torch.no_grad():
        recorder.run(*captured.placeholder_values(), tokens[:, :-1], tokens[:, 1:])
    checked = 0
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or op_name(node) in VIEW_OPS or _is_identity(node):
            continue
        meta = info(node)
        written = _nbytes(recorder.values[node.name])
        read = sum(_nbytes(recorder.values[a.name]) for a in dict.fromkeys(node.all_input_nodes))
        assert evaluate(meta.bytes_written, b=batch, s=seq) == written, node.name
        if op_name(node) not in CREATION_OPS:  # they read only their input's shape
            assert evaluate(meta.bytes_read, b=batch, s=seq) == read, node.name
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("family", ["gpt", "llama", "bert", "own_gpt"])
def test_layer_parameter_bytes_equal_the_modules(tiny_models, family):
    """Each block's parameter bytes equal its module's own parameters; the layers together hold
    every parameter of the model exactly once (a tied embedding / LM head counted once)."""
    model, _, _, _, captured = tiny_models[family]
    profile = analyze(captured)
    unique = {id(p): p for p in model.parameters()}
    assert sum(layer.param_bytes for layer in profile.layers) == sum(
        p.numel() * p.element_size() for p in unique.values()) == profile.param_bytes
    modules = dict(model.named_modules())
    blocks = [layer for layer in profile.layers if layer.kind.name == "BLOCK"]
    assert len(blocks) == 2
    for layer in blocks:  # a block layer is named by its module's path
        assert layer.param_bytes == sum(p.numel() * p.element_size()
                                        for p in modules[layer.name].parameters()), layer.name


@pytest.mark.parametrize("family, buffer", [("bert", "bert.embeddings.position_ids"),
                                            ("llama", "model.rotary_emb.inv_freq")])
def test_buffer_reads_are_recorded(tiny_models, family, buffer):
    """Integer and float buffers are captured with their FQN, and the ops that read them say so."""
    _, _, _, _, captured = tiny_models[family]
    assert buffer in {b.fqn for b in captured.buffers.values()}
    readers = [n for n in captured.gm.graph.nodes
               if n.op == "call_function" and buffer in info(n).reads]
    assert readers, f"no op records reading {buffer}"
