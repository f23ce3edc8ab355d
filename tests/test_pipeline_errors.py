"""Pipeline executor errors: bad inputs, mismatched plans, and a silent peer (a timeout, never a
hang)."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import sympy
import torch

from autopar.errors import InvalidInputError, PlanMismatchError
from autopar.ir import TensorSpec
from autopar.runtime.local_pool import LocalPool, RemoteError
from autopar.runtime.mesh import ParallelMesh
from autopar.runtime.pipeline import PipelineExecutor, bind_sizes, split_microbatches
from autopar.runtime.schedules import build_schedule

B, S = sympy.Symbol("b", integer=True, positive=True), sympy.Symbol("s", integer=True,
                                                                     positive=True)


def test_micro_batches_and_sizes():
    tokens = torch.arange(24).reshape(6, 4)
    parts = split_microbatches((tokens, 3), 3)
    assert [p[0].tolist() for p in parts] == [tokens[0:2].tolist(), tokens[2:4].tolist(),
                                             tokens[4:6].tolist()]
    assert all(p[1] == 3 for p in parts)
    with pytest.raises(InvalidInputError, match="divisible by 4"):
        split_microbatches((tokens,), 4)
    spec = TensorSpec((B, S), torch.long)
    assert bind_sizes([spec, spec], [tokens, tokens]) == {"b": 6, "s": 4}
    with pytest.raises(InvalidInputError, match="disagree"):
        bind_sizes([spec, spec], [tokens, tokens[:, :2]])
    with pytest.raises(InvalidInputError, match="number of dims"):
        bind_sizes([spec], [tokens[0]])


def test_schedule_must_match_mesh_and_split():
    split = SimpleNamespace(stages=(None, None), input_specs=(), target_specs=(),
                            shared_params=dict, param_requires_grad={}, constants={})
    mesh = SimpleNamespace(pp=4, pp_rank=0, dp=1, tp=1, rank=0, timeout=timedelta(seconds=5))
    with pytest.raises(PlanMismatchError, match="pipeline size"):
        PipelineExecutor(split, build_schedule("1f1b", 2, 4), mesh, tensors={})
    mesh.pp = 2
    with pytest.raises(PlanMismatchError, match="disagree on the stages"):
        PipelineExecutor(split, build_schedule("interleaved-1f1b", 2, 4, 2), mesh, tensors={})


def test_other_placeholders_need_a_binding():
    from autopar.passes.split_stages import StageInput, StageInputKind

    stage = SimpleNamespace(index=0, returns_loss=True, inputs=(), outputs=(),
                            placeholders=(StageInput("tp", StageInputKind.OTHER, "tp"),))
    split = SimpleNamespace(stages=(stage,), input_specs=(), target_specs=(),
                            shared_params=dict, param_requires_grad={}, constants={})
    mesh = SimpleNamespace(pp=1, pp_rank=0, dp=1, tp=1, rank=0, timeout=timedelta(seconds=5))
    with pytest.raises(InvalidInputError, match="bindings"):
        PipelineExecutor(split, build_schedule("1f1b", 1, 1), mesh, tensors={})
    executor = PipelineExecutor(split, build_schedule("1f1b", 1, 1), mesh, tensors={},
                                bindings={"tp": object()})
    assert executor.parameters() == []


def _one_rank_stays_silent(split, tensors, inputs, targets):
    mesh = ParallelMesh(1, 2, 1)
    executor = PipelineExecutor(split, build_schedule("1f1b", 2, 2), mesh, tensors=tensors)
    if mesh.pp_rank == 0:
        return "skipped"  # never sends: rank 1 must time out, not hang
    return executor.step(inputs, targets)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_silent_peer_times_out_with_the_action_named(tiny_models):
    from autopar.passes.split_stages import split_into_stages

    model, _, inputs, targets, captured = tiny_models["llama"]  # no tied weights: no group
    split = split_into_stages(captured.gm, captured.layers, [(0, 1), (2, 3)],
                              constants=captured.constants)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    pool = LocalPool(2, timeout_s=60, collective_timeout_s=4)
    start = time.monotonic()
    try:
        with pytest.raises(RemoteError, match="timed out on 1RECV_F0 from rank 0"):
            pool.run(_one_rank_stays_silent, split, tensors, inputs, targets)
    finally:
        pool.close()
    assert time.monotonic() - start < 60


def _one_rank_fails(split, tensors, inputs, targets, bad_key, where):
    mesh = ParallelMesh(1, 2, 1)
    if mesh.pp_rank == 1 and where == "forward":  # a wrong-shaped weight: the forward raises
        tensors = {**tensors, bad_key: torch.ones(3)}
    executor = PipelineExecutor(split, build_schedule("1f1b", 2, 2), mesh, tensors=tensors)
    if mesh.pp_rank == 1 and where == "backward":  # the weight's gradient hook raises in 1B0

        def fail(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("injected in the backward")

        executor.params[bad_key].register_hook(fail)
    start = time.monotonic()
    try:
        executor.step(inputs, targets)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        elapsed = time.monotonic() - start
        if mesh.pp_rank == 1:  # the executor kept alive: only its shutdown can release rank 0
            time.sleep(6)
        return type(exc).__name__, str(exc), elapsed
    return None


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failing_stage_releases_its_peer_at_once(tiny_models, where):
    """Stage 1 raises in its forward, or in its first backward (with the next micro-batch's
    activation receive already posted, whose buffer holds the group's connections open unless
    dropped), while rank 0 waits for its gradient: rank 0 must learn it in seconds (the failing
    rank closes its point-to-point group), not at the 60 s timeout, and with the failing
    rank's error named (it announces the failure before it closes the group)."""
    from autopar.passes.split_stages import split_into_stages

    model, _, inputs, targets, captured = tiny_models["llama"]
    split = split_into_stages(captured.gm, captured.layers, [(0, 1), (2, 3)],
                              constants=captured.constants)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    bad_key = next(k for k in split.stages[1].params if k.endswith("norm.weight"))
    pool = LocalPool(2, timeout_s=120, collective_timeout_s=60)
    try:
        (err0, text0, elapsed0), (err1, _, _) = pool.run(_one_rank_fails, split, tensors,
                                                         inputs, targets, bad_key, where)
    finally:
        pool.close()
    assert (err0, err1) == ("CommunicationTimeoutError", "StageExecutionError")
    assert "stopped waiting on 0RECV_B" in text0 and "a peer failed" in text0, text0
    assert "rank 1" in text0 and "StageExecutionError" in text0, text0
    assert elapsed0 < 5  # rank 0's own wait, while rank 1 still holds its executor


def test_a_stage_that_fails_names_its_action_and_program_line(tiny_models):
    """torch's error from inside a stage's program (a wrong-shaped weight here) becomes a
    StageExecutionError naming the action and the line of the generated program, its cause
    kept; the executor refuses further steps."""
    from autopar.errors import StageExecutionError
    from autopar.passes.split_stages import split_into_stages

    model, _, inputs, targets, captured = tiny_models["llama"]
    split = split_into_stages(captured.gm, captured.layers, [(0, len(captured.layers) - 1)],
                              constants=captured.constants)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    bad_key = next(k for k in split.stages[0].params if k.endswith("norm.weight"))
    mesh = SimpleNamespace(pp=1, pp_rank=0, dp=1, tp=1, rank=0, timeout=timedelta(seconds=5))
    executor = PipelineExecutor(split, build_schedule("1f1b", 1, 2), mesh,
                                tensors={**tensors, bad_key: torch.ones(3)})
    with pytest.raises(StageExecutionError, match=r"program failed in 0F0 at `\w+ = ") as err:
        executor.step(inputs, targets)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert "RuntimeError" in err.value.found and "generated_code" in err.value.fix
    with pytest.raises(PlanMismatchError, match="shut down"):
        executor.step(inputs, targets)


def test_completed_sends_are_dropped_and_their_failures_raised():
    """The executor keeps each send's tensor until the send completes: at each run of
    transfers it drops the completed ones (a non-blocking ``is_completed``, then ``wait``,
    which raises a failed send's error) and keeps those in flight. (gloo reports a send
    completed only once waited, so there they stay to the end of the step; NCCL's work
    answers from its CUDA event.)"""
    from autopar.runtime.pipeline import reap_completed

    class Work:
        def __init__(self, done, error=None):
            self.done, self.error, self.waited = done, error, 0

        def is_completed(self):
            return self.done

    def wait(work, what):
        if work is not None:
            work.waited += 1
            if work.error:
                raise RuntimeError(f"{what}: {work.error}")

    done, flying = Work(True), Work(False)
    pending = [(done, "0SEND_F0", torch.zeros(1)), (flying, "0SEND_F1", torch.zeros(1)),
               (None, "nothing to send", torch.zeros(0))]
    assert [w for w, _, _ in reap_completed(pending, wait)] == [flying]
    assert (done.waited, flying.waited) == (1, 0)
    with pytest.raises(RuntimeError, match="0SEND_F2: connection closed"):
        reap_completed([(Work(True, "connection closed"), "0SEND_F2", torch.zeros(1))], wait)
