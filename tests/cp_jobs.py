"""Jobs for tests/test_context_parallel.py, run on every rank of a LocalPool (importable by name)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import autopar
import parallelize_jobs as jobs
from conftest import build_tiny, train_one_process
from tp_helpers import TINY_COST


def attention_errors(cases):
    """For each ``(cp, kind, causal, q_heads, kv_heads)``: the largest difference between
    context-parallel attention on this rank's tokens and ``scaled_dot_product_attention`` over
    the whole sequence, in the output and the gradients of q, k and v (fp32). ``cp`` < world:
    groups of ``cp`` consecutive ranks."""
    from autopar.runtime.cp import CPGroup

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {}
    for size in sorted({c[0] for c in cases}):
        for first in range(0, world, size):  # every rank creates every group
            g = dist.new_group(list(range(first, first + size))) if size < world else dist.group.WORLD
            if first <= rank < first + size:
                groups[size] = g
    out = []
    for size, kind, causal, hq, hkv in cases:
        torch.manual_seed(size * 100 + hq)
        b, s, d = 2, 8 * size, 16
        q = torch.randn(b, hq, s, d, requires_grad=True)
        k = torch.randn(b, hkv, s, d, requires_grad=True)
        v = torch.randn(b, hkv, s, d, requires_grad=True)
        dout = torch.randn(b, hq, s, d)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                               enable_gqa=hq != hkv)
        ref.backward(dout)
        cp = CPGroup(groups[size], attention=kind)
        local = [cp.split(t.detach(), 2).requires_grad_() for t in (q, k, v)]
        got = cp.attention(*local, is_causal=causal)
        got.backward(cp.split(dout, 2))
        errors = [(got - cp.split(ref.detach(), 2)).abs().max().item()]
        errors += [(mine.grad - cp.split(full.grad, 2)).abs().max().item()
                   for mine, full in zip(local, (q, k, v))]
        out.append(max(errors))
    return out


def _runs(name, build, data, pins_list, optimizer, **kwargs):
    """``build()`` a fresh (model, loss_fn), parallelize it under each plan and train on
    ``data``: per plan, the losses and rank 0's final state. The plans share one capture per
    process of the model ``name`` (jobs.shared_captures)."""
    out = []
    for pins in pins_list:
        model, loss_fn = build()
        with jobs.shared_captures(name, "cpu"):
            pm = autopar.parallelize(model, example_inputs=data[0][0],
                                     example_targets=data[0][1], loss_fn=loss_fn,
                                     plan=dict(pins), tp_cost=TINY_COST, optimizer=optimizer,
                                     **kwargs)
        losses = [pm.train_step(*d) for d in data]
        state = pm.state_dict()
        pm.close()
        out.append((losses, state if dist.get_rank() == 0 else None))
    return out


def _gpt_with_dropout():
    zm = build_tiny("gpt", dropout=0.1)
    for m in zm.model.modules():
        if type(m).__name__ == "GPT2Attention":
            m.attn_dropout.p = 0.0
    return zm.model, zm.loss_fn


def dropout_runs(pins_list, steps: int = 2):
    """GPT with hidden dropout 0.1 (attention dropout 0: refused under cp) under each plan, seed
    5: losses and rank 0's final state. Masks are a function of (seed, step, sample, element),
    never of the plan, so every plan must give the same numbers."""
    return _runs("gpt with dropout", _gpt_with_dropout, jobs.batches("gpt", steps), pins_list,
                 functools.partial(torch.optim.AdamW, lr=jobs.LR, eps=jobs.EPS), seed=5)


def bad_sequence(pins, seq: int):
    """Parallelize LLaMA under ``pins`` and train on sequences of ``seq`` tokens: the error."""
    model, loss_fn = jobs.make_model("llama")
    data = jobs.batches("llama", 1)
    with jobs.shared_captures("llama", "cpu"):
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                                 optimizer=functools.partial(torch.optim.SGD, lr=jobs.LR))
    tokens = torch.randint(0, 128, (8, seq + 1))
    try:
        pm.train_step((tokens[:, :-1],), (tokens[:, 1:],))
    except autopar.AutoparError as exc:
        return type(exc).__name__, str(exc)
    finally:
        pm.close()
    return None


def ignored_batches(steps: int = 2):
    """LLaMA batches whose targets ignore (-100) the first 12 of 16 positions of the first half
    of the rows: the cp ranks count different numbers of tokens, and so do the data-parallel
    replicas and micro-batches (16 against 64 when the batch is cut in halves)."""
    out = []
    for inputs, targets in jobs.batches("llama", steps):
        t = targets[0].clone()
        t[:4, :12] = -100
        out.append((inputs, (t,)))
    return out


def ignored_targets(pins_list):
    """LLaMA trained on :func:`ignored_batches` under each plan: losses, rank 0's state."""
    return _runs("llama", lambda: jobs.make_model("llama"), ignored_batches(), pins_list,
                 functools.partial(torch.optim.SGD, lr=0.1))


def ignored_reference():
    """One process, the same data and SGD."""
    torch.manual_seed(0)
    model, loss_fn = jobs.make_model("llama")
    return train_one_process(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                             ignored_batches())
