"""Context parallelism: the layout, the attention against torch's, the sequence-split transform and
its refusals, and training under cp (with tp, pp, dp + ZeRO-3, recompute, mixed precision,
dropout) against one process.

fp32 tolerances are those of tests/test_parallelize.py (losses rel 1e-5, parameters atol 1e-5
after three AdamW steps): the ring sums its blocks in another order than one kernel does, which
is rounding (measured 2e-7 to 7e-7 on parameters)."""

from __future__ import annotations

import pytest
import torch

import cp_jobs
import parallelize_jobs as jobs
from autopar.errors import InvalidPlanError, ShardingError
from autopar.plan_types import Plan
from autopar.runtime.cp import CPGroup, head_tail_positions
from autopar.runtime.local_pool import LocalPool
from test_parallelize import _compare, _compare_mixed


# ---------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_head_tail_layout_covers_the_sequence_and_balances_causal_work(cp):
    s = 4 * cp * 3
    local = s // cp
    pieces = [head_tail_positions(r, cp, local) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(pieces)).values, torch.arange(s))
    # causal work of a rank: the keys each of its queries sees (its position + 1)
    work = [int((p + 1).sum()) for p in pieces]
    assert len(set(work)) == 1, work  # every rank does the same attention work


def test_split_and_positions_agree_with_the_layout():
    x = torch.arange(2 * 24).reshape(2, 24)
    for r in range(3):
        group = CPGroup()
        group.rank, group.size = r, 3  # layout only: no communication
        assert torch.equal(group.split(x, 1)[0], head_tail_positions(r, 3, 8))
        assert torch.equal(group.positions(torch.arange(8)), head_tail_positions(r, 3, 8))
        table = torch.arange(100).float()[None, :, None]
        assert torch.equal(group.take_positions(table, 1, 8).flatten().long(),
                           head_tail_positions(r, 3, 8))
    with pytest.raises(ShardingError, match="divisible by 2 x cp = 6"):
        group.split(torch.zeros(2, 21), 1)


# ---------------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------------

def _program(captured, tp: int = 1):
    from autopar.compiler import shard_program

    return shard_program(captured, Plan(tp=tp), cost=None).gm


@pytest.mark.parametrize("family", ["llama", "gpt", "bert", "own_gpt"])
def test_transform_rewrites_attention_and_positions(tiny_models, family):
    from autopar.ir import op_name
    from autopar.passes.context_parallel import context_parallelize, sequence_split
    from autopar.runtime import cp as cp_runtime

    captured = tiny_models[family][-1]
    gm = _program(captured)
    before = sum(op_name(n) == "scaled_dot_product_attention" for n in gm.graph.nodes)
    out = context_parallelize(gm)
    calls = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert calls.count(cp_runtime.attention) == before == 2  # two blocks
    # the tokens' positions: arange (LLaMA's rotary, GPT's learned positions) or the
    # position-id buffer's slice (BERT)
    positions = calls.count(cp_runtime.positions) + calls.count(cp_runtime.take_positions)
    assert positions == 1, family
    assert sequence_split.check(out, None) is None
    assert sum(op_name(n) == "scaled_dot_product_attention" for n in gm.graph.nodes) == before


def test_eager_attention_is_refused_by_name():
    """Attention written out (softmax(q k^T) v) cannot be split: the error names the op."""
    from autopar import capture
    from autopar.passes.context_parallel import context_parallelize

    model, loss_fn = jobs.make_model("llama_eager")
    inputs, targets = jobs.batches("llama", 1)[0]
    captured = capture(model, inputs, loss_fn, example_targets=targets)
    with pytest.raises(ShardingError, match="two sequence dims|contracting a sequence|softmax"
                       ) as err:
        context_parallelize(_program(captured))
    assert "scaled_dot_product_attention" in err.value.fix


class _Pooled(torch.nn.Module):
    """Classification from the first token (BERT's pooler): reads one position of the sequence."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.emb(x)[:, 0])


class _Masked(torch.nn.Module):
    """Attention with a mask given as an input (padding): data-dependent."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def test_token_mixing_and_masks_are_refused_by_name():
    from autopar import capture
    from autopar.passes.context_parallel import context_parallelize

    x = torch.randint(0, 64, (2, 16))
    captured = capture(_Pooled(), (x,), torch.nn.functional.cross_entropy,
                       example_targets=(torch.tensor([0, 1]),))
    with pytest.raises(ShardingError, match="along the sequence"):
        context_parallelize(_program(captured))
    h = torch.randn(2, 16, 16)
    mask = torch.rand(2, 1, 16, 16) > 0.3
    captured = capture(_Masked(), (h, mask), lambda out: out.pow(2).mean())
    with pytest.raises(ShardingError, match="attention mask"):
        context_parallelize(_program(captured))


def test_plan_carries_cp():
    plan = Plan(dp=2, cp=2, tp=2, micro_batch_size=2, cp_attention="allgather")
    assert plan.world_size == 8 and plan.replicas == 4 and plan.global_batch == 4
    assert Plan.from_json(plan.to_json()) == plan
    assert "cp" not in Plan(dp=2).to_json()  # plans without cp read as before
    with pytest.raises(InvalidPlanError):
        Plan(cp=0)
    with pytest.raises(InvalidPlanError, match="cp_attention"):
        Plan(cp=2, cp_attention="ulysses")


# ---------------------------------------------------------------------------------------------
# On processes
# ---------------------------------------------------------------------------------------------

ATTENTION = [(size, kind, causal, hq, hkv) for size in (2, 4) for kind in ("ring", "allgather")
             for causal in (True, False) for hq, hkv in ((4, 4), (4, 2))]

#: (model, pins, options): cp alone and with each axis; causal (LLaMA, GPT-2, own GPT) and
#: bidirectional (BERT); ring and all-gather attention; ZeRO-3 over dp x cp; every recompute;
#: a zero-bubble schedule; mixed precision.
TRAIN = [
    ("llama", dict(cp=4, micro_batch_size=8), {}),
    ("bert", dict(cp=4, micro_batch_size=8, cp_attention="allgather"), {}),
    ("llama", dict(cp=2, tp=2, micro_batch_size=8), {}),
    ("gpt", dict(cp=2, tp=2, micro_batch_size=8, sequence_parallel=True), {}),
    ("llama", dict(cp=2, pp=2, num_micro_batches=4, schedule="1f1b"), {}),
    ("gpt", dict(cp=2, pp=2, num_micro_batches=4, schedule="zb-h1", recompute="full"), {}),
    ("own_gpt", dict(cp=2, dp=2, micro_batch_size=4, zero=3, cp_attention="allgather"), {}),
    ("gpt", dict(cp=2, dp=2, micro_batch_size=2, zero=3, recompute="selective"), {}),
    ("llama", dict(cp=2, dp=2, micro_batch_size=4, zero=1), dict(mixed_precision=True)),
]


def _full_pins(pins):
    pins = dict(pins)
    for axis in ("dp", "tp", "pp", "cp"):
        pins.setdefault(axis, 1)
    return pins


@pytest.mark.distributed
def test_context_parallel_training_equals_one_process():
    configs = [(name, _full_pins(pins), options) for name, pins, options in TRAIN]
    refs = {name: jobs.reference(name) for name in {c[0] for c in configs}}
    mixed = {(n, p["dp"] * p.get("num_micro_batches", 1)):
             jobs.reference_mixed(n, p["dp"] * p.get("num_micro_batches", 1))
             for n, p, o in configs if o.get("mixed_precision")}
    with LocalPool(4, timeout_s=600) as pool:
        errors = pool.run(cp_jobs.attention_errors, ATTENTION, timeout_s=300)
        per_rank = pool.run(jobs.train, configs, timeout_s=900)
        dropout = pool.run(cp_jobs.dropout_runs,
                           [dict(dp=4, tp=1, pp=1, micro_batch_size=2),
                            dict(dp=2, cp=2, tp=1, pp=1, micro_batch_size=4),
                            dict(dp=1, cp=2, tp=2, pp=1, micro_batch_size=8,
                                 sequence_parallel=True)], timeout_s=600)
        bad = pool.run(cp_jobs.bad_sequence, dict(dp=2, cp=2, tp=1, pp=1, micro_batch_size=4),
                       18, timeout_s=300)
    # attention: fp32 rounding of a different summation order (measured <= 1.5e-6)
    for rank_errors in errors:
        for case, err in zip(ATTENTION, rank_errors):
            assert err < 1e-5, (case, err)
    for k, (name, pins, options) in enumerate(configs):
        what = f"{name} {pins} {options}"
        result = per_rank[0][k]
        if options.get("mixed_precision"):
            m = pins["dp"] * pins.get("num_micro_batches", 1)
            _compare_mixed(result, mixed[(name, m)], refs[name], what)
        else:
            _compare(result, refs[name], what)
        for r in per_rank:  # every rank reports the same loss
            assert r[k]["losses"] == per_rank[0][k]["losses"], what
    (base_losses, base_state), *others = dropout[0]
    for losses, state in others:  # the same masks whatever the plan
        assert losses == pytest.approx(base_losses, rel=1e-6)
        for key, want in base_state.items():
            torch.testing.assert_close(state[key], want, rtol=0, atol=1e-5)
    for result in bad:
        assert result is not None and result[0] == "ShardingError"
        assert "divisible by 2 x cp = 4" in result[1] and "length 18" in result[1]
