"""Jobs for tests/test_reliability_distributed.py and tests/test_properties.py: run on every rank
of a LocalPool (importable by name)."""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist

import autopar
from conftest import build_own_gpt, build_tiny
from tp_helpers import TINY_COST

LR = 1e-3
EPS = 1e-5  # see parallelize_jobs.EPS


def make_model(name: str, **overrides):
    if name == "own_gpt":
        return build_own_gpt(**overrides)
    zm = build_tiny(name, **overrides)
    return zm.model, zm.loss_fn


def batches(steps: int, batch: int = 8, seq: int = 16, vocab: int = 128, seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append(((tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)))
    return out


def _parallelize(name, pins, data, overrides=None, **kwargs):
    model, loss_fn = make_model(name, **(overrides or {}))
    return autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                               loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                               optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS),
                               **kwargs)


def train(name: str, pins: dict, steps: int, overrides: dict | None = None, *, seed: int = 0,
          batch: int = 8, seq: int = 16, vocab: int = 128, verify: bool = False):
    """Losses and the full state dict (rank 0) after ``steps`` steps."""
    data = batches(steps, batch, seq, vocab)
    pm = _parallelize(name, pins, data, overrides, seed=seed, verify=verify)
    losses = [pm.train_step(i, t) for i, t in data]
    state = pm.state_dict()
    pm.close()
    from parallelize_jobs import recomputed_regions

    return dict(losses=losses, state=state if dist.get_rank() == 0 else None,
                regions=recomputed_regions(pm))


def train_twice(name: str, pins: dict, steps: int, overrides: dict, *, seed: int = 0):
    """Evaluate, train ``steps`` steps, reset to the initial weights and train again: the
    evaluation losses (dropout off) and both runs' training losses, and the first run's state."""
    data = batches(steps)
    model, loss_fn = make_model(name, **overrides)
    pm = autopar.parallelize(model, example_inputs=data[0][0], example_targets=data[0][1],
                             loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST, seed=seed,
                             optimizer=functools.partial(torch.optim.AdamW, lr=LR, eps=EPS))
    evals = [pm.eval_step(*data[0]) for _ in range(2)]
    runs = []
    for _ in range(2):
        runs.append([pm.train_step(i, t) for i, t in data])
        if not runs[1:]:
            state = pm.state_dict()
            pm.load_state_dict(model)  # the user's model still holds the initial weights
            pm.steps = 0
    pm.close()
    return dict(evals=evals, runs=runs, state=state)


def train_many(configs):
    return [train(*c[:3], **(c[3] if len(c) > 3 else {})) for c in configs]


# -- verify ---------------------------------------------------------------------------------

def _break_shard(pm, fqn_part: str, tp_rank: int) -> None:
    """Scale one rank's shard of the first parameter whose name contains ``fqn_part``."""
    if pm.mesh.tp_rank != tp_rank:
        return
    for fqn, p in pm.executor.params.items():
        if fqn_part in fqn:
            with torch.no_grad():
                p.mul_(1.5)
            return


def _local_attention(cp, q, k, v, is_causal=False, scale=None):
    """Context-parallel attention broken on purpose: each rank attends over its own tokens."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                            scale=scale)


def verify_configs(configs):
    """For each (model, pins, fault): parallelize, verify; fault: None, ("scale", fqn part, tp
    rank), ("skip_all_reduce",): every tensor-parallel all-reduce in forward returns its
    input unreduced, or ("local_attention",): context-parallel attention over each rank's
    tokens only."""
    from autopar.runtime import cp as cp_runtime
    from autopar.runtime import tp as tp_runtime

    out = []
    data = batches(1)
    for name, pins, fault in configs:
        pm = _parallelize(name, pins, data)
        original = tp_runtime._AllReduce.forward
        original_attention = cp_runtime.CPGroup.attention
        try:
            if fault and fault[0] == "scale":
                _break_shard(pm, fault[1], fault[2])
            if fault and fault[0] == "skip_all_reduce":
                tp_runtime._AllReduce.forward = staticmethod(lambda ctx, x, group: x.clone())
            if fault and fault[0] == "local_attention":
                cp_runtime.CPGroup.attention = _local_attention
            try:
                report = pm.verify(*data[0])
                out.append(("ok", report.as_dict()))
            except autopar.VerificationError as exc:
                out.append(("VerificationError", exc.report.first_failure.layer,
                            exc.report.as_dict()))
        finally:
            tp_runtime._AllReduce.forward = original
            cp_runtime.CPGroup.attention = original_attention
            pm.close()
    return out


# -- faults ---------------------------------------------------------------------------------

def stop_answering(pins: dict, culprit: int, timeout_s: float, sleep_s: float,
                   stream_waits: bool = False):
    """Rank ``culprit`` sleeps before its second step; the others must raise
    CommunicationTimeoutError within the timeout. ``stream_waits``: waited as NCCL is
    (``work.wait()`` with no timeout: the groups' own timeout fires). Returns (kind, seconds,
    message)."""
    from autopar.runtime import comm

    data = batches(2)
    pm = _parallelize("gpt", pins, data, timeout_s=timeout_s)
    pm.train_step(*data[0])
    comm.set_stream_waits(stream_waits)
    if dist.get_rank() == culprit:
        time.sleep(sleep_s)
        return ("slept", sleep_s, "")
    start = time.monotonic()
    try:
        pm.train_step(*data[1])
    except autopar.CommunicationTimeoutError as exc:
        return ("CommunicationTimeoutError", time.monotonic() - start, str(exc))
    return ("finished", time.monotonic() - start, "")


def _throw(*_: object) -> None:
    raise RuntimeError("injected: this stage cannot run")


def fail_alone(pins: dict, culprit: int, timeout_s: float):
    """Rank ``culprit``'s stage raises inside its second step's forward (injected: a hook that
    throws, as an op failing on one rank or an out-of-memory would) while its process lives on;
    every rank returns (kind, seconds, message) of what its step raised."""
    data = batches(2)
    pm = _parallelize("gpt", pins, data, timeout_s=timeout_s)
    pm.train_step(*data[0])
    if dist.get_rank() == culprit:
        for module in pm.executor.stage_modules.values():
            module.register_forward_pre_hook(_throw)
    start = time.monotonic()
    try:
        pm.train_step(*data[1])
    except autopar.AutoparError as exc:
        return (type(exc).__name__, time.monotonic() - start, str(exc))
    return ("finished", time.monotonic() - start, "")


def _timed_parallelize(pins: dict, data, timeout_s: float) -> tuple[str, float, str]:
    """(class, seconds, message) of what parallelize raised ("no error" if nothing)."""
    start = time.monotonic()
    try:
        _parallelize("gpt", pins, data, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the class is what is checked
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "no error", time.monotonic() - start, ""


def engine_error(pins: dict, culprit: int, timeout_s: float):
    """Rank ``culprit`` fails creating its data-parallel engine (injected, as an out-of-memory
    for its buckets would), after the mesh; the others must raise in seconds, not at the
    timeout of a collective it never joins. Returns (class, seconds, message)."""
    from autopar.runtime import data_parallel

    data = batches(1)
    build = data_parallel.DataParallel._build_buckets

    def failing(self, *args, **kwargs):
        if dist.get_rank() == culprit:
            raise torch.OutOfMemoryError("injected: no memory for the gradient buckets")
        return build(self, *args, **kwargs)

    data_parallel.DataParallel._build_buckets = failing
    try:
        return _timed_parallelize(pins, data, timeout_s)
    finally:
        data_parallel.DataParallel._build_buckets = build


def die(pins: dict, culprit: int, timeout_s: float):
    """Rank ``culprit`` exits abruptly before its second step; the others raise."""
    data = batches(2)
    pm = _parallelize("gpt", pins, data, timeout_s=timeout_s)
    pm.train_step(*data[0])
    if dist.get_rank() == culprit:
        os._exit(17)
    pm.train_step(*data[1])
    return "finished"


def construction_error(pins: dict, culprit: int, timeout_s: float):
    """Rank ``culprit`` fails to compile its program (an injected PassError); every rank must
    raise at once, not at the timeout of a collective the culprit never joins. Returns
    (class, seconds, message)."""
    import autopar.api as api

    data = batches(1)
    compile_program = api.compile_program

    def failing(*args, **kwargs):
        program = compile_program(*args, **kwargs)
        if dist.get_rank() == culprit:
            from autopar.errors import PassError

            raise PassError("injected: no sharding rule for this rank's stage",
                                    fix="nothing: a test")
        return program

    api.compile_program = failing
    try:
        return _timed_parallelize(pins, data, timeout_s)
    finally:
        api.compile_program = compile_program


def capture_error(pins: dict, culprit: int, timeout_s: float):
    """Rank ``culprit`` fails capturing the model (injected: a model built otherwise on one
    rank, a file only its node lacks), before the plan: the others, waiting for rank 0's plan
    or in its broadcast, must raise in seconds. Returns (class, seconds, message)."""
    import autopar.api as api

    data = batches(1)
    capture = api._capture

    def failing(*args, **kwargs):
        if dist.get_rank() == culprit:
            raise autopar.UntraceableModelError("injected: this rank's model does not trace",
                                                fix="nothing: a test")
        return capture(*args, **kwargs)

    api._capture = failing
    try:
        return _timed_parallelize(pins, data, timeout_s)
    finally:
        api._capture = capture


def parallelize_once(pins: dict, timeout_s: float):
    """A plain parallelize of the small GPT. Returns (class, seconds, message)."""
    return _timed_parallelize(pins, batches(1), timeout_s)


def offload_dir_fails_on_one_rank(pins: dict, culprit: int, timeout_s: float, root: str):
    """Rank ``culprit``'s offload directory cannot be created (a file stands in its path, as a
    node whose local disk is read-only); every rank must raise at once. Returns (class,
    seconds, message)."""
    data = batches(1)
    blocker = os.path.join(root, "a-file")
    if dist.get_rank() == 0:
        with open(blocker, "w") as fh:
            fh.write("not a directory")
    dist.barrier()
    directory = os.path.join(blocker if dist.get_rank() == culprit else root, "state")
    start = time.monotonic()
    try:
        pm = _parallelize("gpt", pins, data, timeout_s=timeout_s, offload_dir=directory)
        pm.close()
    except Exception as exc:  # noqa: BLE001 - the class is what is checked
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "no error", time.monotonic() - start, ""


def planning_error_everywhere(pins: dict):
    """Rank 0 fails to plan; every rank must raise the same class with the same message."""
    data = batches(1)
    try:
        _parallelize("gpt", pins, data)
    except Exception as exc:  # noqa: BLE001 - the class is what is checked
        return type(exc).__name__, str(exc)
    return "no error", ""


# -- property tests -------------------------------------------------------------------------

def property_case(case: dict):
    """One drawn (model shape, plan): parallelize, one SGD step; rank 0 also runs the plain
    single-process step and returns the loss and the largest parameter difference."""
    name, shape, pins, batch, seq = (case["family"], case["shape"], case["pins"], case["batch"],
                                     case["seq"])
    data = batches(1, batch=batch, seq=seq, vocab=shape["vocab"], seed=case["seed"])
    (inputs, targets), = data
    model, loss_fn = make_model(name, **shape)
    optimizer = functools.partial(torch.optim.SGD, lr=0.5)
    pm = autopar.parallelize(model, example_inputs=inputs, example_targets=targets,
                             loss_fn=loss_fn, plan=dict(pins), tp_cost=TINY_COST,
                             optimizer=optimizer)
    loss = pm.train_step(inputs, targets)
    state = pm.state_dict()
    pm.close()
    if dist.get_rank() != 0:
        return dict(loss=loss)
    reference, _ = make_model(name, **shape)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_loss = loss_fn(reference(*inputs), *targets)
    ref_loss.backward()
    opt.step()
    worst, key = 0.0, ""
    for k, want in reference.state_dict().items():
        if torch.is_floating_point(want) and k in state:
            d = (state[k] - want).abs().max().item()
            if d > worst:
                worst, key = d, k
    missing = [k for k, v in reference.state_dict().items()
               if torch.is_floating_point(v) and k not in state and "bias" not in k.split(".")[-1]
               and "masked_bias" not in k]
    return dict(loss=loss, ref_loss=ref_loss.item(), max_diff=worst, worst=key, missing=missing)


def indexes_out_of_range(pins: dict):
    """Token ids and targets beyond the vocabulary (128) under ``pins``: what one process
    raises on each batch, what autopar's step raises on every rank (class and message), and
    the loss of a good step after both (the refusal comes before the step: the model stays
    usable), against one process's on that batch."""
    data = batches(1)
    (tokens,), (targets,) = data[0]
    cases = {"token": ((tokens + 128,), (targets,)), "target": ((tokens,), (targets + 128,)),
             "negative token": ((tokens - 129,), (targets,))}
    model, loss_fn = make_model("gpt")
    pm = _parallelize("gpt", pins, data)
    out = {}
    for name, (inputs, wanted) in cases.items():
        try:
            loss_fn(model(*inputs), *wanted)
            reference = "no error"
        except (IndexError, RuntimeError) as exc:
            reference = type(exc).__name__
        try:
            pm.train_step(inputs, wanted)
            out[name] = (reference, "no error", "")
        except autopar.AutoparError as exc:
            out[name] = (reference, type(exc).__name__, str(exc))
    good = pm.train_step(*data[0])
    with torch.no_grad():
        want = float(loss_fn(model(*data[0][0]), *data[0][1]))
    pm.close()
    return out, good, want


# -- sizes refused before the step ------------------------------------------------------------

def size_cases(name: str, pins: dict, cases: list[tuple[int, int]]):
    """Parallelize ``name`` under ``pins``, then evaluate batches of ``(seq, rows)`` in turn:
    per case the loss, or the refusal's (type, message). Seeded per case, as
    :func:`size_case_reference` is."""
    data = batches(1)
    pm = _parallelize(name, pins, data)
    out = []
    for seq, rows in cases:
        tokens = torch.randint(0, 128, (rows, seq + 1),
                               generator=torch.Generator().manual_seed(seq * 100 + rows))
        try:
            out.append(pm.eval_step((tokens[:, :-1],), (tokens[:, 1:],)))
        except autopar.AutoparError as exc:
            out.append((type(exc).__name__, str(exc)))
    pm.close()
    return out


def size_case_reference(name: str, seq: int, rows: int) -> float:
    """One process's loss on :func:`size_cases`' batch of ``(seq, rows)``."""
    model, loss_fn = make_model(name)
    tokens = torch.randint(0, 128, (rows, seq + 1),
                           generator=torch.Generator().manual_seed(seq * 100 + rows))
    with torch.no_grad():
        return loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).item()
