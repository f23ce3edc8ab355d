"""``parallelize(compile=...)``: stage graphs run through torch.compile train to the same numbers
as the graphs run as they are, and plans a compiled graph cannot run are refused by name.

The backend here is ``aot_eager``: AOTAutograd traces the forward and backward as inductor does
and runs them with eager kernels, so the test checks autopar's side (the compiled module inside
the executor, recompute, micro-batches, the optimizer step on its parameters) in seconds, where
inductor would spend a minute generating C++ on this host. Inductor itself is measured on a GPU
(``benchmarks/gpu_step.py --compile``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.errors import InvalidInputError, InvalidPlanError
from conftest import build_tiny

SGD = functools.partial(torch.optim.SGD, lr=0.1)

#: Graphs handed to the backend below: proof that the stages ran compiled.
COMPILED: list[int] = []


@torch._dynamo.register_backend(name="autopar_test_aot_eager")
def _counting_aot_eager(gm, example_inputs, **kwargs):
    """torch's ``aot_eager``, counting the graphs dynamo hands it."""
    from torch._dynamo.backends.registry import lookup_backend

    COMPILED.append(len(gm.graph.nodes))
    return lookup_backend("aot_eager")(gm, example_inputs, **kwargs)


def _run(plan, compile, steps=2):
    zm = build_tiny("gpt")
    inputs, targets = zm.example_inputs(batch=4, seq=16, generator=torch.Generator().manual_seed(3))
    pm = autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                             loss_fn=zm.loss_fn, optimizer=SGD, plan=plan, compile=compile)
    try:
        losses = [pm.train_step(inputs, targets) for _ in range(steps)]
        losses.append(pm.eval_step(inputs, targets))
        state = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    finally:
        pm.close()
    return losses, state


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_stages_train_like_uncompiled(recompute):
    """Two SGD steps over two micro-batches, then an evaluation: every loss and every parameter
    equal the uncompiled run's to 1e-6 relative (fp32; AOTAutograd's decompositions reorder a
    few sums, so not bit-equal)."""
    plan = {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2, "recompute": recompute}
    ref_losses, ref_state = _run(plan, False)
    COMPILED.clear()
    losses, state = _run(plan, "autopar_test_aot_eager")
    # the stage's whole graph reached the backend (one graph: no break), and nothing else
    assert len(COMPILED) == 1 and COMPILED[0] > 50, COMPILED
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    moved = max(float((state[k] - v).abs().max()) for k, v in ref_state.items())
    assert moved < 1e-5


def test_compile_refuses_what_it_cannot_run():
    zm = build_tiny("gpt")
    inputs, targets = zm.example_inputs(batch=4, seq=16)
    with pytest.raises(InvalidInputError, match="unknown torch.compile backend") as err:
        autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                            loss_fn=zm.loss_fn, optimizer=SGD, compile="no-such-backend",
                            plan={"dp": 1, "tp": 1, "pp": 1})
    assert err.value.fix
    with pytest.raises(InvalidInputError, match="bool or a torch.compile backend"):
        autopar.parallelize(zm.model, example_inputs=inputs, example_targets=targets,
                            loss_fn=zm.loss_fn, optimizer=SGD, compile=3,
                            plan={"dp": 1, "tp": 1, "pp": 1})
    from autopar.parallel_model import _check_compilable

    with pytest.raises(InvalidPlanError, match="does not run the zb-h1 schedule") as err:
        _check_compilable(autopar.Plan(schedule="zb-h1"))
    assert "1f1b" in err.value.fix
    with pytest.raises(InvalidPlanError, match="does not run ZeRO-3"):
        _check_compilable(autopar.Plan(zero=3))
    _check_compilable(autopar.Plan(zero=2))  # nothing to refuse
