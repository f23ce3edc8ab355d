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
    few sums, so not bit-equal). Without recompute the stage's graph is compiled whole; under
    full recompute each captured layer on its own, each block checkpointed around its compiled
    code (the embeddings, two equal blocks, the head with the loss)."""
    plan = {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 2, "recompute": recompute}
    ref_losses, ref_state = _run(plan, False)
    COMPILED.clear()
    losses, state = _run(plan, "autopar_test_aot_eager")
    if recompute == "none":
        # the stage's whole graph reached the backend (one graph: no break), and nothing else
        assert len(COMPILED) == 1 and COMPILED[0] > 50, COMPILED
    else:  # one graph per layer, compiled once each (its recompute reuses the compiled code)
        assert len(COMPILED) == 4 and COMPILED[1] == COMPILED[2] > 2 * max(COMPILED[0],
                                                                            COMPILED[3]), COMPILED
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    moved = max(float((state[k] - v).abs().max()) for k, v in ref_state.items())
    assert moved < 1e-5


class _ReadsAParameterDetached(torch.nn.Module):
    """A parameter the graph reads without a gradient path (DeBERTa-v2's relative embeddings
    reach one compiled region so): AOTAutograd's backward returns None for it, and autograd
    still runs its post-accumulate hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.lin(x * self.scale.detach())


def test_a_compiled_backward_without_a_parameter_s_gradient_is_a_zero_gradient():
    """Compiled, the step equals the uncompiled one (1e-6, AOTAutograd's reordered sums) and
    the detached parameter keeps its value, as eager autograd leaves a parameter it never
    reaches (the hook found no gradient: was an AttributeError from inside the stage)."""
    def run(compile):
        torch.manual_seed(0)
        model = _ReadsAParameterDetached()
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        pm = autopar.parallelize(model, example_inputs=(x,), example_targets=(y,),
                                 loss_fn=torch.nn.functional.cross_entropy, optimizer=SGD,
                                 plan={"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1},
                                 compile=compile)
        try:
            losses = [pm.train_step((x,), (y,)) for _ in range(2)]
            return losses, pm.state_dict()
        finally:
            pm.close()

    want_losses, want = run(False)
    losses, state = run("autopar_test_aot_eager")
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert torch.equal(state["scale"], torch.linspace(0.5, 1.5, 8))
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7)


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
    _check_compilable(autopar.Plan(zero=3))  # each layer compiled on its own


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_zero3_and_full_recompute_compile_each_layer_and_train_like_one_process(shared_pool2):
    """ZeRO-3 gathers each captured layer before it runs and frees it after, and full
    recompute checkpoints each block: under compile, each layer is compiled on its own
    (``layer_regions``, as torchtitan compiles each block) with the gathers, frees and
    checkpoints around the compiled code. GPT-2 (2 blocks), 2 gloo ranks, 3 AdamW steps over 2
    micro-batches: the losses and every parameter equal the single-process run's (rel 1e-5 /
    atol 1e-5, tests/test_parallelize.py's bounds: micro-batch sums and reductions reorder fp32
    additions); every layer of each rank's stages ran compiled (pre, 2 blocks, post: 4 regions,
    or 2 and more per stage in a pipeline); under full recompute each block ran twice per micro-batch (its
    forward and one recompute)."""
    import parallelize_jobs as jobs


    def pins(dp, pp, zero, recompute):
        return dict(dp=dp, pp=pp, tp=1, schedule="1f1b", virtual_stages=1,
                    num_micro_batches=2, sequence_parallel=False, zero=zero,
                    recompute=recompute)

    # (ZeRO-3 without recompute: tests/test_parallelize.py::test_zero3_gathers_one_layer_at_a_time)
    configs = [("gpt", pins(2, 1, 3, "full"), {"compile": "aot_eager"}),
               ("gpt", pins(1, 2, 0, "full"), {"compile": "aot_eager"})]
    reference = jobs.reference("gpt")
    pool = shared_pool2
    per_rank = pool.run(jobs.train, configs, timeout_s=600)
    for k, (name, p, _) in enumerate(configs):
        what = f"compiled {p}"
        result = per_rank[0][k]
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5), what
        for key, want in reference["state"].items():
            if torch.is_floating_point(want):
                torch.testing.assert_close(result["state"][key], want, rtol=0, atol=1e-5,
                                           msg=f"{what}: {key}")
        regions = [r[k]["compiled_regions"] for r in per_rank]
        # at least one region per layer of the rank's stages (a layer's nodes interrupted by
        # an unlabeled one, as the last stage's, make two)
        assert regions == [4, 4] if p["pp"] == 1 else min(regions) >= 2, (what, regions)
        if p["recompute"] == "full":
            for r in per_rank:
                runs, blocks = r[k]["block_runs"]
                assert runs == 2 * 2 * blocks > 0, (what, r[k]["block_runs"])
