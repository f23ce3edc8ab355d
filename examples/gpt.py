"""A plain PyTorch GPT (no transformers), to show autopar on a model that is not from a hub.

Pre-norm decoder blocks with a fused QKV projection, causal scaled-dot-product attention,
a tanh-GELU MLP and an LM head tied to the token embedding: the layout of GPT-2 and nanoGPT.

    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32))
    loss = gpt_loss(model(tokens), targets)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 64
    ffn_hidden: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                             f"choose hidden as a multiple of heads")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        ffn = config.ffn_hidden or 4 * config.hidden
        self.fc = nn.Linear(config.hidden, ffn)
        self.proj = nn.Linear(ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.hidden)
        self.pos_emb = nn.Embedding(config.seq, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        """Every tensor of ``module`` itself (GPT-2's scheme): what the model built on the meta
        device is initialized with (``autopar.parallelize(..., init=GPT._init)``)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        positions = torch.arange(s, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def num_params(config: GPTConfig) -> int:
    """Closed form for this model's parameter count (tied LM head)."""
    h, f = config.hidden, config.ffn_hidden or 4 * config.hidden
    per_block = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return config.layers * per_block + config.vocab * h + config.seq * h + 2 * h


if __name__ == "__main__":
    config = GPTConfig()
    model = GPT(config)
    tokens = torch.randint(0, config.vocab, (2, 16))
    loss = gpt_loss(model(tokens), tokens)
    print(f"GPT with {sum(p.numel() for p in model.parameters()):,} parameters, loss {loss.item():.4f}"
          f" (ln(vocab) = {math.log(config.vocab):.4f})")
