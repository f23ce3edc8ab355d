"""Mixture-of-experts models for tests/test_moe.py: a tiny Mixtral (transformers) and the plain
model of examples/moe.py, their batches, the single-process reference and the job every rank of
a LocalPool runs (importable by name)."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist

import autopar
from parallelize_jobs import shared_captures
from tp_helpers import TINY_COST

LR = 1e-3
EPS = 1e-5  # see tests/parallelize_jobs.py: Adam's epsilon vs reduction-order noise
TIMEOUT_S = 60
BATCH, SEQ, VOCAB = 8, 16, 128


def make_model(name: str):
    """The model (seeded: every call gives the same weights) and its loss."""
    if name == "mixtral":
        import transformers as tf

        from autopar.models.zoo import lm_loss

        config = tf.MixtralConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                  vocab_size=VOCAB, max_position_embeddings=64,
                                  num_hidden_layers=2, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2,
                                  architectures=["MixtralForCausalLM"])
        config.use_cache = False
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return tf.MixtralForCausalLM(config).train(), lm_loss
    if name == "example":
        from examples.moe import MoELM, loss_fn

        torch.manual_seed(0)
        return MoELM(balance_coef=0.1).train(), loss_fn
    raise KeyError(name)


def batches(steps: int, batch: int = BATCH) -> list[tuple[tuple, tuple]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(1, VOCAB, (batch, SEQ + 1), generator=gen)
        out.append(((tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)))
    return out


def reference(name: str, steps: int = 2, micro_batches: int = 1) -> dict[str, Any]:
    """One process, fp32, AdamW: the losses and every parameter after ``steps`` steps; the
    batch split into ``micro_batches`` equal parts whose losses are averaged (what a parallel
    run computes when the loss is not a mean over tokens: the load-balancing term)."""
    model, loss_fn = make_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for inputs, targets in batches(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in zip(inputs[0].chunk(micro_batches), targets[0].chunk(micro_batches)):
            loss = loss_fn(model(x), y) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return dict(losses=losses, state={k: v.detach().clone() for k, v in
                                      model.state_dict().items()})


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def train(configs, steps: int = 2):
    """For each ``(model, pins)``: parallelize, train ``steps`` steps; rank 0 returns the state
    dict. A failure is returned (as text), not raised, so one plan does not hide the others."""
    out = []
    for name, plan in configs:
        start = time.perf_counter()
        try:
            model, loss_fn = make_model(name)
            data = batches(steps)
            with shared_captures(f"moe:{name}", "cpu"):  # this module's own models
                pm = autopar.parallelize(model, example_inputs=data[0][0],
                                         example_targets=data[0][1], loss_fn=loss_fn,
                                         plan=dict(plan), tp_cost=TINY_COST, timeout_s=TIMEOUT_S,
                                         optimizer=functools.partial(torch.optim.AdamW, lr=LR,
                                                                     eps=EPS))
            losses = [pm.train_step(inputs, targets) for inputs, targets in data]
            state = pm.state_dict()
            result = dict(losses=losses, state=state if dist.get_rank() == 0 else None,
                          held=pm.program.held_bytes(),
                          expert_bytes=sum(_numel(p.local_shape) * 4 for p in pm.program.held
                                           if p.fqn in pm.program.experts))
            pm.close()
        except Exception as exc:  # noqa: BLE001 - reported per plan by the test
            import traceback

            result = dict(error=f"{type(exc).__name__}: {exc}"[:2000] + traceback.format_exc()[-3000:])
        result["seconds"] = time.perf_counter() - start
        out.append(result)
    return out


def checkpoint_round_trip(path: str) -> dict[str, Any]:
    """Train a step under dp 4 x ep 2 and save (sharded, and as transformers' safetensors), then
    load the sharded checkpoint under dp 2 x tp 2 (ep 1) and dp 4 x ep 4 with ZeRO-2: the next
    steps' losses of every plan."""
    out: dict[str, Any] = {}
    data = batches(3)
    for plan, action in ((dict(dp=4, ep=2, tp=1, pp=1, num_micro_batches=1), "save"),
                         (dict(dp=2, ep=1, tp=2, pp=1, num_micro_batches=1), "load"),
                         (dict(dp=4, ep=4, tp=1, pp=1, num_micro_batches=1, zero=2), "load")):
        model, loss_fn = make_model("mixtral")
        pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=loss_fn, plan=plan, tp_cost=TINY_COST,
                                 timeout_s=TIMEOUT_S, optimizer=functools.partial(
                                     torch.optim.AdamW, lr=LR, eps=EPS))
        if action == "save":
            pm.train_step(*data[0])
            pm.save(path)
            pm.save_pretrained(path + "-hf")
            saved = pm.state_dict()
        else:
            pm.load(path)
        out[f"ep={plan['ep']}, tp={plan['tp']}"] = [pm.train_step(*d) for d in data[1:]]
        pm.close()
    # a model built on the meta device reads its experts' slices from the safetensors files
    with torch.device("meta"):
        model, loss_fn = make_model("mixtral")
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, plan=dict(dp=4, ep=2, num_micro_batches=1),
                             tp_cost=TINY_COST, timeout_s=TIMEOUT_S, checkpoint=path + "-hf",
                             optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
    expert_bytes = sum(_numel(p.local_shape) * 4 for p in pm.program.held
                       if p.fqn in pm.program.experts)
    state = pm.state_dict()
    out["meta_read_equal"] = all(torch.equal(state[k], v) for k, v in saved.items()
                                 if k in state and v.is_floating_point())
    out["meta_expert_bytes"] = expert_bytes
    pm.close()
    return out
