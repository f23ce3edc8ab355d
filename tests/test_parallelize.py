"""autopar.parallelize end to end on real gloo processes, against the single-process run.

Every world-4 (dp, pp, tp) shape and world 8 as (2, 2, 2), on the project's own GPT, HF GPT-2
and HF LLaMA (kv-heads < heads), ZeRO 0 to 3 rotated over the models and shapes, with the four
schedules and sequence parallelism mixed in: after 3 AdamW steps, losses and every parameter equal
the single-process run.

Tolerance: parameters within 1e-5 absolute, losses within 1e-5 relative. The parallel program
computes the same sums in another order (tensor-parallel all-reduces, micro-batch accumulation,
data-parallel averaging); in fp32 that moves results by ~1e-7 (measured: <= 3e-7 after 3 steps).
Adam's epsilon is 1e-5 so rounding noise on near-zero gradients is not magnified into O(lr)
steps. A real fault (a missing reduction, a wrong scale, a stale tied weight) moves parameters by
O(lr) = 1e-3.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar import PlanMismatchError
from autopar.runtime.local_pool import LocalPool

import parallelize_jobs as jobs

pytestmark = pytest.mark.distributed

MODELS = ("own_gpt", "gpt", "llama")
WORLD4 = [  # (dp, pp, tp, schedule, virtual stages, micro-batches, sequence parallel)
    (4, 1, 1, "1f1b", 1, 1, False),
    (1, 4, 1, "1f1b", 1, 4, False),
    (1, 1, 4, "1f1b", 1, 1, True),
    (2, 2, 1, "gpipe", 1, 2, False),
    (2, 1, 2, "1f1b", 1, 2, False),
    (1, 2, 2, "interleaved-1f1b", 2, 2, True),
]


def _pins(dp, pp, tp, schedule, v, m, sp, zero):
    return dict(dp=dp, pp=pp, tp=tp, schedule=schedule, virtual_stages=v, num_micro_batches=m,
                sequence_parallel=sp and tp > 1, zero=zero)


@pytest.fixture(scope="module")
def references():
    return {name: jobs.reference(name) for name in MODELS}


def _compare(result, reference, what):
    ref_losses, ref_state = reference
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), what
    state = result["state"]
    for key, want in ref_state.items():
        if not torch.is_floating_point(want):
            continue
        assert key in state, f"{what}: {key} missing from state_dict()"
        torch.testing.assert_close(state[key], want, rtol=0, atol=1e-5, msg=f"{what}: {key}")


def test_every_world4_shape_with_zero_0_to_3(references):
    configs = []
    for j, name in enumerate(MODELS):
        for i, shape in enumerate(WORLD4):
            zero = (i + j) % 4
            if shape[1] == 4 and j == 2:  # one zero-bubble run (ZeRO <= 2 with ZB-H1)
                shape = shape[:3] + ("zb-h1",) + shape[4:]
                zero = min(zero, 2)
            configs.append((name, _pins(*shape, zero=zero)))
    assert {(n, p["zero"]) for n, p in configs} >= {(n, z) for n in MODELS for z in range(4)}
    with LocalPool(4, timeout_s=600) as pool:
        per_rank = pool.run(jobs.train, configs, timeout_s=900)
    for k, (name, pins) in enumerate(configs):
        _compare(per_rank[0][k], references[name], f"{name} {pins}")
        # every rank got the same loss
        assert len({r[k]["losses"][-1] for r in per_rank}) == 1, f"{name} {pins}"


def test_world8_dp2_pp2_tp2(references):
    configs = [(name, _pins(2, 2, 2, "1f1b", 1, 2, sp, zero))
               for name, zero, sp in (("own_gpt", 0, False), ("gpt", 1, True), ("llama", 2, False),
                                      ("gpt", 3, False))]
    with LocalPool(8, timeout_s=600) as pool:
        per_rank = pool.run(jobs.train, configs, timeout_s=900)
    for k, (name, pins) in enumerate(configs):
        _compare(per_rank[0][k], references[name], f"world 8 {name} {pins}")


def test_single_process_state_dict_loads_into_the_original_model():
    """parallelize in one process: the trained state dict loads into the user's model class and
    gives the same outputs; load_state_dict puts it back."""
    model, loss_fn = jobs.make_model("gpt")
    data = jobs.batches("gpt", 2)
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2},
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    for inputs, targets in data:
        pm.train_step(inputs, targets)
    state = pm.state_dict()
    fresh, _ = jobs.make_model("gpt")
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing)
    inputs, targets = data[0]
    assert pm.eval_step(inputs, targets) == pytest.approx(loss_fn(fresh(*inputs), *targets).item(),
                                                         rel=1e-6)
    pm.load_state_dict(jobs.make_model("gpt")[0])  # back to the initial weights
    init_model, _ = jobs.make_model("gpt")
    assert pm.eval_step(inputs, targets) == pytest.approx(
        loss_fn(init_model(*inputs), *targets).item(), rel=1e-6)
    pm.close()


def test_plan_for_another_world_size_is_refused():
    model, loss_fn = jobs.make_model("own_gpt")
    data = jobs.batches("own_gpt", 1)
    with pytest.raises(PlanMismatchError, match="world size"):
        autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                            loss_fn=loss_fn, plan=autopar.Plan(dp=2, num_micro_batches=4),
                            optimizer=torch.optim.SGD)
