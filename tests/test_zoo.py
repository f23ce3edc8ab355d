"""Model zoo: presets reproduce published sizes; families take overrides."""

from __future__ import annotations

import pytest

from autopar import InvalidInputError, models

# GPT-3 (Brown et al. 2020, Table 2.1): within 2% (the 13B row's d_model 5140 is read as 5120).
# LLaMA (Touvron et al. 2023) and BERT (Devlin et al. 2019; 336M as commonly cited): within 1%.
PUBLISHED = {
    "gpt3-125m": (125e6, 0.02), "gpt3-350m": (350e6, 0.02), "gpt3-760m": (760e6, 0.02),
    "gpt3-1.3b": (1.3e9, 0.02), "gpt3-2.7b": (2.7e9, 0.02), "gpt3-6.7b": (6.7e9, 0.02),
    "gpt3-13b": (13e9, 0.02), "gpt3-175b": (175e9, 0.02),
    "llama-7b": (6.7e9, 0.01), "llama-13b": (13.0e9, 0.01), "llama-33b": (32.5e9, 0.01),
    "llama-65b": (65.2e9, 0.01),
    "bert-base": (110e6, 0.01), "bert-large": (336e6, 0.01),
    "gpt2-small": (124e6, 0.01), "gpt2-medium": (355e6, 0.01), "gpt2-large": (774e6, 0.01),
    "gpt2-xl": (1558e6, 0.01),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_size(name):
    published, tolerance = PUBLISHED[name]
    zm = models.build(name, device="meta")
    n = sum(p.numel() for p in zm.model.parameters())
    assert abs(n / published - 1) <= tolerance, f"{name}: {n:,} vs published {published:,.0f}"


def test_gpt3_13b_uses_5120_hidden():
    spec = models.resolve_spec("gpt3-13b")
    assert spec.hidden == 5120 and spec.heads * spec.head_dim == 5120


def test_family_overrides():
    spec = models.resolve_spec("llama", layers=3, hidden=96, heads=6, kv_heads=2, ffn_hidden=128,
                               vocab=77, seq=40)
    zm = models.build("llama", device="meta", layers=3, hidden=96, heads=6, kv_heads=2,
                      ffn_hidden=128, vocab=77, seq=40)
    cfg = zm.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (3, 96, 6, 2, 128, 77)
    assert zm.spec == spec
    override = models.resolve_spec("gpt3-175b", layers=4)
    assert override.layers == 4 and override.hidden == 12288 and override.published_params is None


def test_family_shaped_by_hidden_gets_the_family_rules():
    """`autopar plan llama --hidden 4096 ...` is a LLaMA: ffn 8h/3, one kv head per head and the
    published vocabulary (not the tiny default's 128, which made the LM head a toy)."""
    spec = models.resolve_spec("llama", layers=32, hidden=4096, heads=32)
    assert (spec.ffn, spec.num_kv_heads, spec.vocab) == (11008, 32, 32000)
    assert models.resolve_spec("gpt", hidden=768, heads=12).vocab == 50257
    assert models.resolve_spec("bert", hidden=768, heads=12).vocab == 30522
    assert models.resolve_spec("llama", hidden=4096, heads=32, vocab=128).vocab == 128
    assert models.resolve_spec("llama").vocab == 128  # the bare family stays tiny


def test_llama_ffn_rule():
    assert models.resolve_spec("llama-7b").ffn == 11008
    assert models.resolve_spec("llama-65b").ffn == 22016


@pytest.mark.parametrize("bad, match", [
    (dict(hidden=65), "not divisible by heads"),
    (dict(kv_heads=3), "not divisible by kv_heads"),
])
def test_bad_shapes_are_named(bad, match):
    with pytest.raises(InvalidInputError, match=match):
        models.resolve_spec("llama", **bad)


def test_unknown_model():
    with pytest.raises(InvalidInputError, match="unknown model"):
        models.resolve_spec("gpt5-1t")
