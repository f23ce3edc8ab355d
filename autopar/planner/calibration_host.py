"""What a training step's host costs, measured on this machine: the cost per graph node (a
tiny GPT-2's exported program), torch's AdamW step per parameter and per tensor, the disk's
bandwidth, and a speed probe that says whether the host still runs at the speed it was
calibrated at. :mod:`autopar.planner.calibration` (a CPU host) and
:mod:`autopar.planner.calibration_cuda` (a GPU's host) write them into a cluster file;
:mod:`autopar.planner.calibration_cache` keeps the probe.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable

__all__ = ["best_time", "host_cores", "block_node_times", "measure_node_overhead",
           "split_backward_node_time", "measure_optimizer_step", "measure_disk_bandwidth",
           "speed_probe", "checkpoint_overhead"]

#: The tiny GPT-2 whose exported program times the host's cost per graph node
#: (:func:`block_node_times`): blocks (against one), hidden size, tokens.
BLOCK_PROBE_LAYERS, BLOCK_PROBE_HIDDEN, BLOCK_PROBE_TOKENS = 5, 8, 4
#: Runs per repeat of that probe (a run takes milliseconds; the median of many steadies the
#: difference of two such times on a shared host).
BLOCK_PROBE_RUNS = 4
#: Hidden size and count of the transformer blocks whose parameters (4 matrices, 12 h^2, and
#: 8 vectors each) the optimizer step is timed on: ~6.3M parameters, 25 MiB per state tensor,
#: beyond a core's caches as a model's are.
OPTIMIZER_HIDDEN, OPTIMIZER_BLOCKS = 512, 2
#: Tensors and their size that time the optimizer's fixed cost per tensor (128 elements: the
#: element work is ~1% of it).
OPTIMIZER_TINY_TENSORS, OPTIMIZER_TINY_NUMEL = 64, 128


def best_time(fn: Callable[[], Any], repeat: int, inner: int = 1) -> float:
    """Median of ``repeat`` runs of ``inner`` calls (seconds per call), after one warm-up run.
    The median, not the minimum: a training step is sustained work, and on a shared host the
    minimum measures the rare moments the cores were free."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def block_node_times(device: Any = "cpu", repeat: int = 5) -> tuple[float, float]:
    """Host seconds per graph node (forward, backward) of a transformer block's own program, as
    a generated stage program pays them: the zoo's GPT-2 (``autopar.models``) at tiny sizes
    (hidden ``BLOCK_PROBE_HIDDEN``, ``BLOCK_PROBE_TOKENS`` tokens: every op a few elements, so
    what is timed is the calls), exported by ``torch.export`` as autopar's capture exports it (its ``TracedStep``),
    with ``BLOCK_PROBE_LAYERS`` blocks and with one, on ``device``. Per node: the difference of
    the two models' times over the difference of their node counts, so that the model's own
    ends (embedding, head, loss, the exported module's input checks) cancel out:

    - forward: the call to the exported module, over its ``call_function`` nodes (a tuple's
      ``getitem`` excluded: the cost model counts nodes the same way);
    - backward: ``backward()`` of the loss, over the autograd graph's nodes (each op's backward
      function and each parameter's gradient accumulation).

    A real block's node is not a chain's ``t`` or ``add``: ``linear``, ``layer_norm``, the fused
    attention and the views between them dispatch several ATen calls each; on this repository's
    2-core VM a block's node cost 2-3x a chain of ``t`` and ``add`` (docs/cost-model.md).

    On a CPU the op runs on the calling thread, so the time includes the tiny op itself. On a
    GPU the host only launches: each timing starts with the device idle and stops when the last
    call returns, without waiting for the kernels (a tiny kernel takes less than its launch, so
    the device keeps up and the host's time is what is measured)."""
    import torch

    from autopar.frontend import TracedStep

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    probes = []
    for zm in probe_models(device):
        inputs, targets = zm.example_inputs(1, BLOCK_PROBE_TOKENS, device=device)
        program = torch.export.export(TracedStep(zm.model, zm.loss_fn, 1), (*inputs, *targets),
                                      strict=False)
        nodes = sum(1 for n in program.graph.nodes
                    if n.op == "call_function" and "getitem" not in str(n.target))
        probes.append((nodes, program.module(), (*inputs, *targets)))

    def run(module: Any, args: tuple[Any, ...]) -> tuple[float, float, int]:
        sync()
        start = time.perf_counter()
        loss = module(*args)
        fwd = time.perf_counter() - start
        grad_nodes = _autograd_nodes(loss)
        sync()
        start = time.perf_counter()
        loss.backward()
        bwd = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        return fwd, bwd, grad_nodes

    # the two models alternate, so that a shared host's drift reaches both alike; two warm-up
    # runs each (the second makes the gradients' accumulation real)
    times: list[list[tuple[float, float, int]]] = [[], []]
    for i in range(BLOCK_PROBE_RUNS * repeat + 2):
        for which, (_, module, args) in enumerate(probes):
            result = run(module, args)
            if i >= 2:
                times[which].append(result)
    (n1, n2), (g1, g2) = (p[0] for p in probes), (t[0][2] for t in times)
    f1, f2 = (statistics.median(r[0] for r in t) for t in times)
    b1, b2 = (statistics.median(r[1] for r in t) for t in times)
    return max(f2 - f1, 0.0) / (n2 - n1), max(b2 - b1, 0.0) / (g2 - g1)


def split_backward_node_time(repeat: int = 5) -> float:
    """Host seconds per autograd node that the zero-bubble schedules' split backward adds to a
    plain ``backward()`` on this CPU: ``runtime/split_backward.py``'s ``backward_input`` (it walks
    the graph in Python to find the input-gradient side and the cut each weight group starts
    from) and ``backward_weight`` (one autograd call per group), less one ``backward()`` of the
    same graph. On the tiny GPT-2 of :func:`block_node_times` (its blocks' embeddings given as a
    leaf, the input the I action differentiates), 5 blocks against 1, run alternately."""
    import torch

    from autopar.runtime.split_backward import backward_input, backward_weight

    probes = []
    for zm in probe_models("cpu"):
        embeds = torch.randn(1, BLOCK_PROBE_TOKENS, BLOCK_PROBE_HIDDEN)
        targets = torch.randint(0, 16, (1, BLOCK_PROBE_TOKENS))
        probes.append((zm, embeds, targets, [p for p in zm.model.parameters()]))

    def run(zm: Any, embeds: Any, targets: Any, params: list[Any], split: bool
            ) -> tuple[float, int]:
        x = embeds.detach().requires_grad_()
        loss = zm.loss_fn(zm.model(inputs_embeds=x), targets)
        nodes = _autograd_nodes(loss)
        start = time.perf_counter()
        if split:
            _, pending = backward_input([loss], [None], [x], params)
            backward_weight(pending)
        else:
            loss.backward()
        elapsed = time.perf_counter() - start
        zm.model.zero_grad(set_to_none=True)
        return elapsed, nodes

    extra: list[list[float]] = [[], []]
    nodes = [0, 0]
    for i in range(BLOCK_PROBE_RUNS * repeat + 2):
        for which, (zm, embeds, targets, params) in enumerate(probes):
            plain, nodes[which] = run(zm, embeds, targets, params, False)
            split, _ = run(zm, embeds, targets, params, True)
            if i >= 2:
                extra[which].append(split - plain)
    one, many = (statistics.median(e) for e in extra)
    return max(many - one, 0.0) / (nodes[1] - nodes[0])


#: Saved tensors of the two chains :func:`checkpoint_overhead` checkpoints, and its runs.
CHECKPOINT_PROBE_TENSORS = (8, 64)
CHECKPOINT_PROBE_RUNS = 12
#: How :func:`checkpoint_overhead` measures, for the calibrated files' sources.
CHECKPOINT_SOURCE = (f"torch.utils.checkpoint (non-reentrant, no RNG stash) over chains of "
                     f"{' and '.join(map(str, CHECKPOINT_PROBE_TENSORS))} sin ops, less the plain "
                     f"forward + backward and the forward run again: intercept per call, slope "
                     f"per saved tensor; ")


def checkpoint_overhead(device: Any = "cpu", repeat: int = 5) -> tuple[float, float]:
    """Host seconds torch's non-reentrant checkpoint adds, as full recompute calls it
    (``runtime/layer_recompute.checkpointed``: no RNG stash, no metadata check), beyond the
    forward it runs again: (per checkpointed call, per tensor the call saves).

    A chain of ``sin`` on a 1 x 16 tensor (each saves its input) of 8 and of 64 ops, run
    alternately: forward + backward plainly, under the checkpoint, and the forward alone (what
    the recompute runs again, priced as the layer's forward). The extra of the checkpointed
    run over the other two is linear in the saved tensors: its slope is the per-tensor cost
    (pack hooks in the forward and in the recompute, the unpack in the backward), its
    intercept the per-call one. On ``cuda`` the host's times, not waiting for the kernels."""
    import torch
    from torch.utils.checkpoint import checkpoint

    cuda = torch.device(device).type == "cuda"
    x0 = torch.randn(1, 16, device=device)

    def chain(n: int) -> Callable[[Any], Any]:
        def run(x: Any) -> Any:
            for _ in range(n):
                x = torch.sin(x)
            return x
        return run

    def timed(f: Callable[[Any], Any], mode: str) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        x = x0.detach().requires_grad_()
        start = time.perf_counter()
        if mode == "checkpoint":
            y = checkpoint(f, x, use_reentrant=False, preserve_rng_state=False,
                           determinism_check="none")
        else:
            y = f(x)
        if mode == "forward":
            return time.perf_counter() - start
        y.sum().backward()
        return time.perf_counter() - start

    times: dict[tuple[int, str], list[float]] = {}
    for i in range(CHECKPOINT_PROBE_RUNS * repeat + 2):
        for n in CHECKPOINT_PROBE_TENSORS:
            f = chain(n)
            for mode in ("plain", "forward", "checkpoint"):
                t = timed(f, mode)
                if i >= 2:
                    times.setdefault((n, mode), []).append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    lo, hi = CHECKPOINT_PROBE_TENSORS
    extra = {n: med[(n, "checkpoint")] - med[(n, "plain")] - med[(n, "forward")]
             for n in (lo, hi)}
    per_tensor = max(0.0, (extra[hi] - extra[lo]) / (hi - lo))
    return max(0.0, extra[lo] - lo * per_tensor), per_tensor


def probe_models(device: Any = "cpu") -> list[Any]:
    """The probes' tiny GPT-2s (the zoo's, hidden ``BLOCK_PROBE_HIDDEN``, ``BLOCK_PROBE_TOKENS``
    positions, no dropout) with one block and with ``BLOCK_PROBE_LAYERS``, on ``device``."""
    from autopar.models import build

    return [build("gpt", layers=layers, hidden=BLOCK_PROBE_HIDDEN, heads=2, vocab=16,
                  seq=BLOCK_PROBE_TOKENS, dropout=0.0, seed=0, device=device)
            for layers in (1, BLOCK_PROBE_LAYERS)]


def _autograd_nodes(out: Any) -> int:
    """Nodes of the autograd graph behind ``out`` (backward functions and gradient
    accumulators): what ``backward()`` calls."""
    seen: set[Any] = set()
    todo = [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return len(seen)


def measure_node_overhead(repeat: int = 5) -> dict[str, float]:
    """Host time per graph node on this CPU (:func:`block_node_times`), with and without the
    op itself:

    - ``node_forward_s`` / ``node_backward_s``: per node of the forward and the backward;
    - ``node_overhead_s`` / ``node_backward_overhead_s``: the same less the kernel floor (a
      1-element op without autograd, what the roofline already charges a tiny op), i.e. what a
      node costs beyond its op: the cost model adds these to every node."""
    import torch

    one = torch.ones(1)
    floor = best_time(lambda: one.add(one), repeat, inner=200)
    t_fwd, t_bwd = block_node_times("cpu", repeat)
    return {"node_forward_s": t_fwd, "node_backward_s": t_bwd,
            "node_overhead_s": max(t_fwd - floor, 0.0),
            "node_backward_overhead_s": max(t_bwd - floor, 0.0)}


def _adamw_step_time(shapes: list[tuple[int, ...]], repeat: int, fused: bool = False) -> float:
    """Median seconds of ``torch.optim.AdamW.step()`` (its defaults: the implementation a
    training script gets on this device; ``fused``: torch's fused kernel) over fresh
    parameters of ``shapes``, every one with a gradient, after two steps that create the
    moments."""
    import torch

    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True if fused else None)
    opt.step()
    opt.step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_optimizer_step(repeat: int = 5, fused: bool = False) -> tuple[float, float]:
    """(seconds per parameter, fixed seconds per tensor) of an AdamW step (``fused``: of its
    fused kernel, ``AdamW(fused=True)``).

    The fixed cost: ``OPTIMIZER_TINY_TENSORS`` tensors of ``OPTIMIZER_TINY_NUMEL`` elements,
    whose element work is negligible, over their count. The rate: ``OPTIMIZER_BLOCKS``
    transformer blocks' parameters of hidden size ``OPTIMIZER_HIDDEN``, less their tensors'
    fixed cost, per parameter."""
    h = OPTIMIZER_HIDDEN
    shapes = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
              (h,), (h,), (h,), (h,)] * OPTIMIZER_BLOCKS
    per_tensor = _adamw_step_time([(OPTIMIZER_TINY_NUMEL,)] * OPTIMIZER_TINY_TENSORS,
                                  repeat, fused) / OPTIMIZER_TINY_TENSORS
    blocks = _adamw_step_time(shapes, repeat, fused)
    params = sum(math.prod(shape) for shape in shapes)
    return max(blocks - len(shapes) * per_tensor, 0.0) / params, per_tensor


#: The speed probe's work (:func:`speed_probe`): a GEMM of SPEED_PROBE_TOKENS x
#: SPEED_PROBE_FEATURES by a square weight and a copy of SPEED_PROBE_COPY_BYTES: ~12 ms on one
#: core of this repository's VM, what a step spends on its two kinds of work.
SPEED_PROBE_TOKENS, SPEED_PROBE_FEATURES, SPEED_PROBE_COPY_BYTES = 1024, 512, 16 * 2**20


def speed_probe(repeat: int = 21) -> float:
    """Median seconds of a fixed piece of a step's work on one thread (a GEMM and a copy beyond
    the caches, ``SPEED_PROBE_*``): a third of a second that says whether this host still runs
    at the speed its calibration measured (a shared VM's cores change speed from day to day;
    :mod:`autopar.planner.calibration_cache` measures again when the probe moved)."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(SPEED_PROBE_TOKENS, SPEED_PROBE_FEATURES)
        w = torch.randn(SPEED_PROBE_FEATURES, SPEED_PROBE_FEATURES)
        src = torch.randn(SPEED_PROBE_COPY_BYTES // 4)
        dst = torch.empty_like(src)

        def work() -> None:
            F.linear(x, w)
            dst.copy_(src)

        return best_time(work, repeat)
    finally:
        torch.set_num_threads(threads)


#: Bytes written, synced and read back by :func:`measure_disk_bandwidth`.
DISK_PROBE_BYTES = 64 * 2**20


def measure_disk_bandwidth(directory: str | None = None, nbytes: int = DISK_PROBE_BYTES) -> float:
    """Bytes/s of the disk under ``directory`` (default: the temporary directory), as
    ``offload="disk"`` uses it: ``nbytes`` written in 4 MiB chunks and ``fsync``ed, then read
    back after dropping the file's pages where the OS allows (``posix_fadvise DONTNEED``); the
    slower of the two rates (a step writes what it reads)."""
    import tempfile

    chunk = os.urandom(4 * 2**20)
    with tempfile.TemporaryDirectory(dir=directory) as root:
        path = os.path.join(root, "probe.bin")
        start = time.perf_counter()
        with open(path, "wb") as fh:
            for _ in range(max(1, nbytes // len(chunk))):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        write = time.perf_counter() - start
        with open(path, "rb") as fh:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while fh.read(len(chunk)):
                pass
            read = time.perf_counter() - start
    size = max(1, nbytes // len(chunk)) * len(chunk)
    return size / max(write, read)
