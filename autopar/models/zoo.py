"""Transformer presets and families, built through Hugging Face ``transformers`` configs.

Shapes and sources:

- gpt2-{small,medium,large,xl}: Radford et al. 2019 (GPT-2), 1024 positions, vocab 50257.
- gpt3-*: Brown et al. 2020, Table 2.1 (n_layers, d_model, n_heads, d_head), 2048 positions,
  the GPT-2 vocabulary, GPT-2-style blocks with tied embeddings. The paper's 13B row lists
  d_model 5140 with 40 heads of 128; 40 x 128 = 5120, which is what we use (5140 is a typo).
  Likewise the 1.3B row lists d_model 2048 with 24 heads of 128 (= 3072); we keep d_model 2048
  and d_head 128, hence 16 heads. Head counts do not change parameter counts.
- bert-{base,large}: Devlin et al. 2019, 512 positions, vocab 30522, masked-LM head.
- llama-{7b,13b,33b,65b}: Touvron et al. 2023, Table 2 (dimension, heads, layers), SwiGLU hidden
  2/3 * 4d rounded up to a multiple of 256, vocab 32000, 2048 positions.

The GPT presets use the fused tanh GELU (``gelu_pytorch_tanh``), the same function as GPT-2's
``gelu_new`` computed by one kernel, as Megatron-LM does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import InvalidInputError

__all__ = ["ModelSpec", "ZooModel", "PRESETS", "FAMILIES", "build", "resolve_spec", "preset_names"]

FAMILIES = ("gpt", "bert", "llama")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a transformer, enough to build it and to cost it in closed form."""

    family: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    name: str | None = None
    #: The published parameter count this preset should reproduce (None for custom shapes).
    published_params: float | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {FAMILIES}")
        for field_name in ("layers", "hidden", "heads", "vocab", "seq"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                             f"pick hidden = heads x head_dim")
        if self.kv_heads is not None:
            if self.family != "llama":
                raise ValueError(f"kv_heads is only supported by the llama family, not {self.family}")
            if self.heads % self.kv_heads:
                raise ValueError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}; "
                                 f"grouped-query attention needs heads = kv_heads x group size")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.family == "llama":
            return _llama_ffn(self.hidden)
        return 4 * self.hidden

    @property
    def tied_embeddings(self) -> bool:
        return self.family in ("gpt", "bert")

    def with_overrides(self, **overrides: Any) -> "ModelSpec":
        clean = {k: v for k, v in overrides.items() if v is not None}
        if not clean:
            return self
        return dataclasses.replace(self, name=None, published_params=None, **clean)


def _llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    ffn = int(2 * (4 * hidden) / 3)
    return multiple_of * math.ceil(ffn / multiple_of)


def _gpt(name: str, layers: int, hidden: int, heads: int, published: float, seq: int) -> ModelSpec:
    return ModelSpec("gpt", layers, hidden, heads, 50257, seq, name=name, published_params=published)


PRESETS: dict[str, ModelSpec] = {
    "gpt2-small": _gpt("gpt2-small", 12, 768, 12, 124e6, 1024),
    "gpt2-medium": _gpt("gpt2-medium", 24, 1024, 16, 355e6, 1024),
    "gpt2-large": _gpt("gpt2-large", 36, 1280, 20, 774e6, 1024),
    "gpt2-xl": _gpt("gpt2-xl", 48, 1600, 25, 1558e6, 1024),
    "gpt3-125m": _gpt("gpt3-125m", 12, 768, 12, 125e6, 2048),
    "gpt3-350m": _gpt("gpt3-350m", 24, 1024, 16, 350e6, 2048),
    "gpt3-760m": _gpt("gpt3-760m", 24, 1536, 16, 760e6, 2048),
    "gpt3-1.3b": _gpt("gpt3-1.3b", 24, 2048, 16, 1.3e9, 2048),
    "gpt3-2.7b": _gpt("gpt3-2.7b", 32, 2560, 32, 2.7e9, 2048),
    "gpt3-6.7b": _gpt("gpt3-6.7b", 32, 4096, 32, 6.7e9, 2048),
    "gpt3-13b": _gpt("gpt3-13b", 40, 5120, 40, 13e9, 2048),
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96, 175e9, 2048),
    "bert-base": ModelSpec("bert", 12, 768, 12, 30522, 512, name="bert-base", published_params=110e6),
    "bert-large": ModelSpec("bert", 24, 1024, 16, 30522, 512, name="bert-large",
                            published_params=336e6),
    "llama-7b": ModelSpec("llama", 32, 4096, 32, 32000, 2048, name="llama-7b",
                          published_params=6.7e9),
    "llama-13b": ModelSpec("llama", 40, 5120, 40, 32000, 2048, name="llama-13b",
                           published_params=13.0e9),
    "llama-33b": ModelSpec("llama", 60, 6656, 52, 32000, 2048, name="llama-33b",
                           published_params=32.5e9),
    "llama-65b": ModelSpec("llama", 80, 8192, 64, 32000, 2048, name="llama-65b",
                           published_params=65.2e9),
}

#: The vocabulary a family shaped by its hidden size gets when none is given: the published
#: models' (GPT-2 / GPT-3, BERT, LLaMA).
_FAMILY_VOCAB = {"gpt": 50257, "bert": 30522, "llama": 32000}

#: Small defaults for a bare family name (``build("gpt")``), overridable field by field.
_FAMILY_DEFAULTS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", 2, 64, 4, 128, 64),
    "bert": ModelSpec("bert", 2, 64, 4, 128, 64),
    "llama": ModelSpec("llama", 2, 64, 4, 128, 64, kv_heads=2, ffn_hidden=128),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def resolve_spec(name: str, **overrides: Any) -> ModelSpec:
    """A preset or family name plus overrides (layers, hidden, heads, kv_heads, ffn_hidden,
    vocab, seq) -> ModelSpec."""
    key = name.lower()
    if key in PRESETS:
        base = PRESETS[key]
    elif key in _FAMILY_DEFAULTS:
        base = _FAMILY_DEFAULTS[key]
        # The family's tiny defaults derive from its hidden size and heads: a user who shapes the
        # model gets the family's rules (LLaMA's ffn = 8h/3 rounded up to 256, one kv head per
        # head, the published vocabulary) rather than the tiny model's fixed 128 and 2.
        if overrides.get("hidden") is not None and overrides.get("ffn_hidden") is None:
            base = dataclasses.replace(base, ffn_hidden=None)
        if overrides.get("hidden") is not None and overrides.get("vocab") is None:
            base = dataclasses.replace(base, vocab=_FAMILY_VOCAB[key])
        if overrides.get("heads") is not None and overrides.get("kv_heads") is None:
            base = dataclasses.replace(base, kv_heads=None)
    else:
        raise InvalidInputError(f"unknown model {name!r}",
                                expected=f"a preset ({', '.join(PRESETS)}) or a family "
                                         f"({', '.join(FAMILIES)})",
                                found=repr(name))
    try:
        return base.with_overrides(**overrides)
    except ValueError as exc:
        raise InvalidInputError(f"bad shape for {name}: {exc}") from exc


@dataclass
class ZooModel:
    """A built zoo model, its loss, and a way to make inputs for it."""

    name: str
    spec: ModelSpec
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)

    def example_inputs(self, batch: int = 2, seq: int | None = None, *,
                       device: torch.device | str | None = None,
                       generator: torch.Generator | None = None
                       ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Random token ids and targets: ``(inputs, targets)``."""
        seq = seq or min(self.spec.seq, 128)
        if seq > self.spec.seq:
            raise InvalidInputError(f"sequence length {seq} exceeds the model's {self.spec.seq} positions")
        if device is None:
            first = next(self.model.parameters())
            device = first.device
        device = torch.device(device)
        if device.type == "meta":
            tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
            return (tokens,), (tokens.clone(),)
        tokens = torch.randint(0, self.spec.vocab, (batch, seq + 1), generator=generator)
        tokens = tokens.to(device)
        if self.spec.family == "bert":  # masked-LM: predict every position's token
            return (tokens[:, :seq].contiguous(),), (tokens[:, :seq].contiguous(),)
        return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)


def lm_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy on ``outputs.logits`` (or a logits tensor): causal, masked and
    sequence-to-sequence language modelling."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def build(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
          dropout: float | None = None, attention: str = "sdpa", seed: int | None = 0,
          **overrides: Any) -> ZooModel:
    """Build a preset or family with random weights.

    Args:
        name: a preset (``gpt3-175b``) or family (``gpt``, ``bert``, ``llama``).
        device: ``"meta"`` builds without allocating weights (for planning large models).
        dropout: dropout probability (default: the family's published value, 0.1 for GPT and
            BERT, 0 for LLaMA); pass 0.0 for exact numerical comparisons.
        attention: ``"sdpa"`` (fused attention) or ``"eager"`` (explicit softmax, which stores
            the attention matrix; what Korthikanti et al.'s activation formulas assume).
        overrides: layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq.
    """
    spec = resolve_spec(name, **overrides)
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - transformers is a test/model dependency
        raise InvalidInputError("the model zoo needs transformers",
                                fix="pip install 'transformers>=5'") from exc
    if attention not in ("sdpa", "eager"):
        raise InvalidInputError(f"unknown attention implementation {attention!r}",
                                expected="'sdpa' or 'eager'")
    config = _hf_config(spec, dropout, attention)
    if seed is not None and torch.device(device).type != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = _hf_model(spec, config)
    model = model.to(dtype=dtype).train()
    return ZooModel(spec.name or spec.family, spec, model, lm_loss, {"config": config})


def _hf_config(spec: ModelSpec, dropout: float | None, attention: str):
    from transformers import BertConfig, GPT2Config, LlamaConfig

    if spec.family == "gpt":
        p = 0.1 if dropout is None else dropout
        return GPT2Config(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads,
                          n_inner=spec.ffn_hidden, vocab_size=spec.vocab, n_positions=spec.seq,
                          activation_function="gelu_pytorch_tanh", resid_pdrop=p, embd_pdrop=p,
                          attn_pdrop=p, use_cache=False, tie_word_embeddings=True,
                          bos_token_id=0, eos_token_id=0, attn_implementation=attention)
    if spec.family == "bert":
        p = 0.1 if dropout is None else dropout
        return BertConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden,
                          num_attention_heads=spec.heads, intermediate_size=spec.ffn,
                          vocab_size=spec.vocab, max_position_embeddings=spec.seq,
                          hidden_dropout_prob=p, attention_probs_dropout_prob=p,
                          pad_token_id=0, attn_implementation=attention)
    p = 0.0 if dropout is None else dropout
    return LlamaConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden,
                       num_attention_heads=spec.heads, num_key_value_heads=spec.num_kv_heads,
                       intermediate_size=spec.ffn, vocab_size=spec.vocab,
                       max_position_embeddings=spec.seq, attention_dropout=p, use_cache=False,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                       attn_implementation=attention)


def _hf_model(spec: ModelSpec, config) -> nn.Module:
    from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

    cls = {"gpt": GPT2LMHeadModel, "bert": BertForMaskedLM, "llama": LlamaForCausalLM}[spec.family]
    return cls(config)
