"""A plain PyTorch mixture-of-experts language model (no autopar inside), and its workload.

Each block is attention followed by a mixture of ``num_experts`` SwiGLU experts, ``top_k`` per
token, with a Switch-Transformer load-balancing loss (Fedus et al. 2021, eq. 4) added to the
language-model loss. The experts keep transformers' layout (stacked ``gate_up_proj`` and
``down_proj``, ``act_fn``, ``forward(hidden_states, top_k_index, top_k_weights)``), which is
what autopar recognizes and captures as one operation; the router is ordinary code.

    autopar plan examples/moe.py:workload --gpus 8
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Experts(nn.Module):
    """``num_experts`` SwiGLU feed-forward networks as two stacked weights."""

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inner, hidden) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inner) * inner ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):  # the token count per expert depends on the router
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    """Router (linear, softmax, top-k, renormalized) and experts; returns the output and the
    router's probabilities (for the load-balancing loss)."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inner)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).reshape(x.shape), probs


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, inner, num_experts, top_k)

    def forward(self, x: torch.Tensor, balance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        y, probs = self.moe(self.norm2(x))
        return x + y, balance + load_balancing_loss(probs, self.moe.top_k)


def load_balancing_loss(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss: E * sum_e (share of routes to e) * (mean prob of e);
    1 when the routing is uniform."""
    experts = probs.shape[-1]
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(1).float()
    return experts * (chosen.mean(0) / top_k * probs.mean(0)).sum()


class MoELM(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, inner: int = 64,
                 layers: int = 2, num_experts: int = 4, top_k: int = 2, seq: int = 64,
                 balance_coef: float = 0.01) -> None:
        super().__init__()
        self.balance_coef = balance_coef
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, inner, num_experts, top_k)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        balance = x.new_zeros(())
        for block in self.blocks:
            x, balance = block(x, balance)
        return self.head(self.norm(x)), self.balance_coef * balance / len(self.blocks)


def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Language-model cross-entropy plus the blocks' load-balancing loss."""
    logits, balance = outputs
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten()) + balance


def workload(batch: int = 8, seq: int = 16):
    """``autopar plan examples/moe.py:workload``: the model, example tokens and the loss."""
    torch.manual_seed(0)
    model = MoELM()
    tokens = torch.randint(0, 128, (batch, seq + 1))
    return model, (tokens[:, :-1].contiguous(),), loss_fn, (tokens[:, 1:].contiguous(),)
