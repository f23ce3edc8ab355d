"""Initializing a meta-device model one tensor at a time (autopar.runtime.meta_init): the values
equal one device's initialization from the same random state, bit for bit, for transformers
families (their own meta flow: to_empty + init_weights) and plain modules (materialized with
their ties kept, then ``model.apply(init)``); no more than the tensors an initializer is working
on are alive at once; what an initializer leaves unset is named."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from autopar.errors import InvalidInputError
from autopar.runtime.meta_init import materialize

KW = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=128)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2,
                                                                            **KW)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0)),  # c_proj written by its parent's _init_weights; a tied LM head
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=2,
                                                                         **KW)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        decoder_start_token_id=0)),  # three names of one embedding; attention init by parent
}


def _collect(model, init=None):
    got: dict[str, torch.Tensor] = {}

    def take(names, value):
        for name in names:
            got[name] = value

    peak = materialize(model, init, take)
    return got, peak


def _tied_materialize(model: nn.Module) -> None:
    """One device's materialization of a meta model that keeps its ties (to_empty does not)."""
    real: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, t in list(store.items()):
                if t is not None:
                    if id(t) not in real:
                        empty = torch.empty_like(t, device="cpu")
                        real[id(t)] = nn.Parameter(empty, t.requires_grad) \
                            if isinstance(t, nn.Parameter) else empty
                    store[key] = real[id(t)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_families_equal_their_own_meta_flow(family):
    build = FAMILIES[family]
    with torch.device("meta"):
        model = build()
    torch.manual_seed(3)
    got, peak = _collect(model)
    after = torch.get_rng_state()
    with torch.device("meta"):
        ref = build()
    ref.to_empty(device="cpu")
    torch.manual_seed(3)
    ref.init_weights()
    want = {**dict(ref.named_parameters(remove_duplicate=False)),
            **dict(ref.named_buffers(remove_duplicate=False))}
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), (family, name)
    assert torch.equal(after, torch.get_rng_state())  # as many random numbers drawn
    assert all(t.is_meta for t in model.parameters())  # the model itself stays on meta
    largest = max(t.numel() * t.element_size() for t in want.values())
    total = sum({id(t): t.numel() * t.element_size() for t in want.values()}.values())
    assert largest <= peak < total / 3, (peak, largest, total)  # one module at a time


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.empty(16))


class Net(nn.Module):
    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight


def per_module(module: nn.Module) -> None:
    """An apply-style initializer touching a view (the padding row) and a child from its
    parent (the down projection scaled by depth, as GPT-2 does)."""
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        module.weight.data[module.padding_idx].zero_()
    elif isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            module.bias.data.fill_(0.0)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()
    elif isinstance(module, Block):
        module.down.weight.mul_(0.5)
        module.scale.fill_(2.0)
        module.scale[:4].zero_()  # through a view, the op after the buffer's own last one


def whole_model(model: nn.Module) -> None:
    """torchtitan's style: one call at the root initializes everything."""
    if isinstance(model, Net):
        for block in model.blocks:
            for sub in block.modules():
                per_module(sub)
            per_module(block)
        per_module(model.emb)


@pytest.mark.parametrize("init", [per_module, whole_model])
def test_plain_modules_equal_apply_on_one_device(init):
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(5)
    got, peak = _collect(model, init)
    with torch.device("meta"):
        ref = Net()
    _tied_materialize(ref)
    torch.manual_seed(5)
    with torch.no_grad():
        ref.apply(init)
    want = {**dict(ref.named_parameters(remove_duplicate=False)),
            **dict(ref.named_buffers(remove_duplicate=False))}
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert torch.equal(got["head.weight"], got["emb.weight"])  # one tensor, tied
    assert (got["blocks.0.scale"][:4] == 0).all() and (got["blocks.0.scale"][4:] == 2).all()
    # even the root's single call keeps only what it works on: a block's tensors, not the net's
    total = sum({id(t): t.numel() * 4 for t in want.values()}.values())
    assert peak < total / 3, (peak, total)


def test_what_an_initializer_leaves_unset_is_named():
    with torch.device("meta"):
        model = Net(layers=1)
    with pytest.raises(InvalidInputError, match="left 1 tensor.s. on the meta device") as err:
        materialize(model, lambda m: per_module(m) if not isinstance(m, Block) else None,
                    lambda names, value: None)
    assert "blocks.0.scale" in str(err.value)

    def part(module):  # the up projection's first rows only
        per_module(module)
        if isinstance(module, nn.Linear) and module.out_features == 32:
            module.weight.data.fill_(float("nan"))
            module.weight.data[:10].normal_()
    with pytest.raises(InvalidInputError,
                       match="left 352 of 512 values of blocks.0.up.weight unset"):
        materialize(model, part, lambda names, value: None)

    def value_dependent(module):
        per_module(module)
        if isinstance(module, nn.LayerNorm) and module.weight.sum() > 0:
            module.weight.mul_(2)
    with pytest.raises(InvalidInputError, match="cannot run on the meta device"):
        materialize(model, value_dependent, lambda names, value: None)
