"""Measure this machine: GEMM rate, memory bandwidth, kernel floor, attention rate, and the
collectives' latency and bandwidth over the local backend (gloo processes), as a cluster file.

Every rank runs the compute microbenchmarks at the same time (as ranks do in a local run, so the
cores' contention is part of the figure); the collectives are timed over ``LocalPool``. The
latency and bus bandwidth come from a least-squares fit of the ring model the cost model uses,
``t(S) = a + 2 (n-1)/n * S / B`` for all-reduce, over message sizes from 4 KiB to 16 MiB: back
to back in relative error (the small messages set the latency), after compute unweighted (there
the noise is the same at every size; :func:`fit_ring`). What the host itself costs (a graph
node, the optimizer step, the disk, the speed probe) is measured by
:mod:`autopar.planner.calibration_host`.

``--device cuda`` (:mod:`autopar.planner.calibration_cuda`) measures one GPU instead, with CUDA events:
bf16 GEMM rates (peak and a table by shape), copy bandwidth, a tiny kernel's throughput floor,
causal fused-attention rates and element-wise op times; the nodes and links come from the GPU's
preset (one device measures no link).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

from autopar.planner.calibration_host import (
    BLOCK_PROBE_HIDDEN,
    BLOCK_PROBE_LAYERS,
    BLOCK_PROBE_TOKENS,
    CHECKPOINT_SOURCE,
    DISK_PROBE_BYTES,
    OPTIMIZER_BLOCKS,
    OPTIMIZER_HIDDEN,
    OPTIMIZER_TINY_NUMEL,
    OPTIMIZER_TINY_TENSORS,
    best_time,
    checkpoint_overhead,
    host_cores,
    measure_disk_bandwidth,
    measure_node_overhead,
    measure_optimizer_step,
    split_backward_node_time,
)

__all__ = ["measure_compute", "measure_collectives", "calibrate_cluster", "fit_ring",
           "fit_collectives"]

GEMM_SIZES = (256, 384, 512, 768, 1024)

#: Shapes of the measured GEMM table: m (tokens) x n x k, capped at 2^31 multiply-adds. Small m
#: too: a micro-batch of one short sequence is 64-128 tokens, where a CPU GEMM runs well below
#: its large-shape rate (the table is flat outside the measured range).
TABLE_M = (64, 128, 256, 1024, 4096)
TABLE_NK = (64, 256, 1024, 4096)
TABLE_MAX_MACS = 2**31
#: Fused attention table: sequence x head dim, with batch x heads = 8 or as many as make each
#: of q, k, v ATTENTION_OPERAND_BYTES (out of a core's cache, as in a step: batch 8 x 8 heads of
#: 128 x 32 is 1 MiB per operand; measured on 64 KiB operands, the table priced the small GPT's
#: attention at 6.5 ms of a forward where it took 8.7).
ATTENTION_SEQ = (64, 256, 1024, 4096)
ATTENTION_HEAD = (32, 64, 128)
ATTENTION_OPERAND_BYTES = 2 * 2**20
#: ``--quick`` stops the attention table at ATTENTION_QUICK_MAX_SEQ: the 4096 row alone is
#: ~70% of its time (its forward and backward are ~15x the 1024 row's FLOPs), and longer
#: sequences price at the longest measured row's rate (the table is flat outside its range).
ATTENTION_QUICK_MAX_SEQ = 1024
AR_SIZES = tuple(2**k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB
#: Operand bytes the GEMM table's measurements cycle through (beyond a core's L2 cache), so
#: that they read their operands cold, as a training step does; a GEMM re-reading the same
#: operands from cache measured ~10% faster than the same GEMM inside a step.
COLD_BYTES = 16 * 2**20
#: Hosts with more cores than this skip the oversubscription probe (it starts 2 x cores processes).
MAX_OVERSUBSCRIPTION_PROBE_CORES = 16
#: The compute each paced collective follows: PACE_GEMMS GEMMs of PACE_TOKENS x PACE_IN ->
#: PACE_OUT (fp32; ~13 ms on one core, the small GPT's compute between two tensor-parallel
#: collectives), operands cycled through PACE_COPIES copies (24 MiB, cold as in a step). After a
#: warm 3 ms GEMM a 2 MiB all-reduce took ~1 ms longer than back to back; after this, ~2 ms, and
#: an 8 MiB one ~3.3 ms: what a tensor-parallel step paid.
PACE_TOKENS, PACE_IN, PACE_OUT, PACE_GEMMS, PACE_COPIES = 2048, 256, 1024, 2, 8


def _mean_time(fn: Callable[[], Any], calls: int) -> float:
    """Mean seconds per call of ``calls`` calls, after two warm-up calls: what a step that makes
    many such calls pays for each. For collectives, not the median: their times are bimodal on a
    shared host (a blocked gloo wait sometimes sleeps through a scheduler tick), and a step pays
    the mean (docs/cost-model.md, "Measurements behind the model's choices")."""
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


#: Elements per op in the op table's measurements (1024 tokens x 2048 features: a micro-batch's
#: activations in an MLP; cross-entropy over a vocabulary of 2048): 8 MiB per fp32 tensor,
#: beyond a core's L2 cache, as a step's activations are. At 128 x 1024 (512 KiB, in cache) the
#: table priced the small GPT's cross-entropy at a quarter and its forward 20% short.
OP_ROWS, OP_COLS = 1024, 2048
#: The same elements as images (batch, channels, height, width) for a CNN's ops.
OP_IMAGE = (16, 32, 64, 64)


def measure_op_table(repeat: int = 5) -> dict[str, list[float]]:
    """Forward and backward seconds per element of the element-wise and normalization ops a
    transformer or a CNN runs, as the graph names them, on ``OP_ROWS x OP_COLS`` fp32 elements
    with autograd (a layer norm with its weight and bias, cross-entropy over ``OP_COLS`` classes;
    ``linear.bias``: a bias vector broadcast into a fresh output, what a CPU GEMM with a bias
    does before it accumulates, and its gradient, a sum over rows; batch norm, max pooling and
    ReLU on the same elements as ``OP_IMAGE`` images, per element of the input).
    The backward is timed alone, on a graph built beforehand."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(OP_ROWS, OP_COLS, requires_grad=True)
    y = torch.randn(OP_ROWS, OP_COLS)
    weight = torch.ones(OP_COLS, requires_grad=True)
    bias = torch.zeros(OP_COLS, requires_grad=True)
    targets = torch.randint(0, OP_COLS, (OP_ROWS,))
    # the same elements as a batch of images (NCHW) for a CNN's ops: training batch norm with
    # its per-channel weight and bias, a ResNet stem's 3 x 3 stride-2 max pool
    images = x.view(*OP_IMAGE)
    channel_w = torch.ones(OP_IMAGE[1], requires_grad=True)
    channel_b = torch.zeros(OP_IMAGE[1], requires_grad=True)
    running = (torch.zeros(OP_IMAGE[1]), torch.ones(OP_IMAGE[1]))
    ops = {
        "gelu": lambda: F.gelu(x),
        "gelu(tanh)": lambda: F.gelu(x, approximate="tanh"),
        "silu": lambda: F.silu(x),
        "add": lambda: x + y,
        "mul": lambda: x * y,
        "layer_norm": lambda: F.layer_norm(x, (OP_COLS,), weight, bias),
        "softmax": lambda: torch.softmax(x, -1),
        "log_softmax": lambda: torch.log_softmax(x, -1),
        "cross_entropy_loss": lambda: F.cross_entropy(x, targets),
        "linear.bias": lambda: bias.expand(OP_ROWS, OP_COLS).contiguous(),
        "batch_norm": lambda: F.batch_norm(images, *running, channel_w, channel_b,
                                           training=True),
        "max_pool2d": lambda: F.max_pool2d(images, 3, 2, 1),
        "relu": lambda: F.relu(images),
    }
    n = x.numel()
    out = {}
    for name, fn in ops.items():
        forward = best_time(fn, repeat, inner=3)
        times = []
        for _ in range(repeat + 1):
            result = fn()
            grad = torch.ones_like(result)
            start = time.perf_counter()
            result.backward(grad)
            times.append(time.perf_counter() - start)
        x.grad = weight.grad = bias.grad = channel_w.grad = channel_b.grad = None
        out[name] = [forward / n, statistics.median(times[1:]) / n]
    return out


#: The convolution table's shapes (``measure_conv_table``): 2-D convolutions as a CNN runs them
#: (fp32, NCHW, PyTorch's default layout, which oneDNN reorders to its blocked one and back;
#: stride 1, the size kept): images per call in CONV_BATCHES, kernel sides CONV_KERNELS, input
#: and output channels each in CONV_CHANNELS, output sides CONV_SIDES, and a stem (an image's
#: CONV_STEM_CHANNELS in, a CONV_STEM_KERNEL-wide kernel, CONV_CHANNELS out), capped at
#: CONV_MAX_MACS multiply-adds (``--quick``: a sixteenth, each pass timed once per repeat, not
#: over four calls, up to CONV_QUICK_MAX_IMAGES: 2 s on the 2-core VM where the whole table
#: takes 37). The images are a coordinate of their own: on the 2-core VM (2026-12-02) a
#: 1 x 1 convolution of 32 channels ran at 53-61 GFLOP/s on 8 or 12 images of 8 x 8 and at 18 on
#: 16 (oneDNN picks another kernel), where the GEMM of its implicit-GEMM shape runs at ~150; a
#: 3 x 3 ran at 36-164, a ResNet's 7 x 7 stem at 48. Small sides set the per-call floor (~0.1 ms
#: on 16 images, however small the image). No GEMM table prices them. A bottleneck block's 8 or
#: 16 channels pay that floor too (a 32 -> 8 1 x 1 on 16 images of 16 x 16: 0.24 ms, 9
#: GFLOP/s), hence 8 channels in the table.
CONV_BATCHES = (8, 16, 64)
CONV_KERNELS = (1, 3)
CONV_CHANNELS = (8, 32, 256)
CONV_SIDES = (4, 8, 32)
CONV_STEM_CHANNELS, CONV_STEM_KERNEL = 3, 7
#: Depthwise convolutions (groups = channels, each in CONV_CHANNELS): their kernel sides. On the
#: 2-core VM a 7 x 7 depthwise convolution's weight gradient (ConvNeXt's) took 1.5-2 ms on 16
#: images of 4-16 pixels a side, 7-20 times its forward.
CONV_DEPTHWISE_KERNELS = (3, 7)
#: ``--quick`` measures only up to this many images (the 64-image rows were half its time).
CONV_QUICK_MAX_IMAGES = 16
CONV_MAX_MACS = 2**31
#: ``--quick`` also skips inputs of more elements than this (4 MiB): a depthwise convolution's
#: few multiply-adds pass the cap, and its weight gradient on 64 images of 32 x 32 x 256 took a
#: quarter of the table's time.
CONV_QUICK_MAX_ELEMENTS = 2**20


def measure_conv_table(quick: bool = False, repeat: int = 5) -> list[list[float]]:
    """Rows ``[images, M, N, K, kernel elements, forward, input-gradient, weight-gradient
    FLOP/s]`` of the convolutions in ``CONV_*`` (M, N, K their implicit GEMM's,
    ``passes.analyze.conv_dims``; each pass ``2 M N K`` FLOPs), each pass timed alone
    (``aten.convolution_backward`` with one output asked for), operands cycled through copies
    (:func:`_conv_rates`)."""
    # (kernel side, channels in, out, groups)
    shapes = [(kernel, c_in, c_out, 1) for kernel in CONV_KERNELS for c_in in CONV_CHANNELS
              for c_out in CONV_CHANNELS]
    shapes += [(CONV_STEM_KERNEL, CONV_STEM_CHANNELS, c_out, 1) for c_out in CONV_CHANNELS]
    shapes += [(kernel, c, c, c) for kernel in CONV_DEPTHWISE_KERNELS for c in CONV_CHANNELS]
    rows = []
    cap = CONV_MAX_MACS // (16 if quick else 1)
    for images in CONV_BATCHES:
        if quick and images > CONV_QUICK_MAX_IMAGES:
            continue
        for kernel, c_in, c_out, groups in shapes:
            for side in CONV_SIDES:
                # per group (conv_dims), the groups folded into M as conv_times looks them up
                m = groups * images * side * side
                n, k = c_out // groups, c_in // groups * kernel * kernel
                if m * n * k > cap or (quick and images * c_in * side * side
                                       > CONV_QUICK_MAX_ELEMENTS):
                    continue
                rows.append([images, m, n, k, kernel * kernel,
                             *_conv_rates(images, c_in, c_out, side, kernel, groups, repeat,
                                          inner=1 if quick else 4)])
    return rows


def _conv_rates(images: int, c_in: int, c_out: int, side: int, kernel: int, groups: int,
                repeat: int, inner: int = 4) -> list[float]:
    """FLOP/s of one convolution's forward, input gradient and weight gradient (stride 1, the
    size kept), its operands cycled through up to 4 copies (out of a core's L2 cache where
    they are large enough to matter; drawing 16 MiB of them per shape took longer than timing
    the small shapes)."""
    import torch
    import torch.nn.functional as F

    size = 4 * images * side * side * (c_in + c_out)
    copies = max(1, min(4, COLD_BYTES // size))
    pad = kernel // 2
    ops = [(torch.rand(images, c_in, side, side),
            torch.rand(c_out, c_in // groups, kernel, kernel),
            torch.rand(images, c_out, side, side)) for _ in range(copies)]
    turn = iter(range(10**9))

    def run(mask: list[bool] | None) -> None:
        x, w, g = ops[next(turn) % copies]
        if mask is None:
            F.conv2d(x, w, padding=pad, groups=groups)
        else:
            torch.ops.aten.convolution_backward(g, x, w, None, [1, 1], [pad, pad], [1, 1],
                                                False, [0, 0], groups, mask)

    flops = 2.0 * images * side * side * c_out * c_in // groups * kernel * kernel
    return [flops / best_time(lambda: run(mask), repeat, inner=min(copies, inner))
            for mask in (None, [True, False, False], [False, True, False])]


def measure_compute(quick: bool = False) -> dict[str, float]:
    """GEMM FLOP/s (fp32, bf16), streaming bandwidth, kernel floor and fused-attention rate of
    one process with one thread."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    repeat = 3 if quick else 5
    out: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        for n in GEMM_SIZES[: 3 if quick else None]:
            a = torch.randn(n, n, dtype=dtype)
            b = torch.randn(n, n, dtype=dtype)
            t = best_time(lambda: torch.mm(a, b), repeat)
            best = max(best, 2 * n**3 / t)
        out[f"gemm_flops_{name}"] = best
    src = torch.randn(8 * 2**20 // 4 * (2 if quick else 4))  # 16-32 MiB, beyond the caches
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), repeat)
    out["memory_bandwidth"] = 2 * src.numel() * 4 / t  # read + write
    one = torch.ones(1)
    # runs of 2000 (~2 ms, the optimizer probe's length): a run of 200 (0.2 ms) lost to one
    # preemption by a neighbour process once read 4.7 us against the usual 0.9-1.2
    out["kernel_floor_s"] = best_time(lambda: one.add(one), repeat, inner=2000)
    out.update(measure_node_overhead(repeat))
    out["split_backward_overhead_s"] = split_backward_node_time(repeat)
    out["checkpoint_call_overhead_s"], out["checkpoint_tensor_overhead_s"] = \
        checkpoint_overhead("cpu", repeat)
    out["op_table"] = measure_op_table(repeat)
    out["optimizer_s_per_param"], out["optimizer_s_per_tensor"] = measure_optimizer_step(repeat)
    out["fused_optimizer_s_per_param"], out["fused_optimizer_s_per_tensor"] = \
        measure_optimizer_step(repeat, fused=True)
    q = torch.randn(1, 4, 256, 64)
    t = best_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=False), repeat)
    out["attention_flops_fp32"] = 4 * 4 * 256 * 256 * 64 / t
    # GEMM rate by shape (fp32, the CPU training precision)
    table = []
    for m in TABLE_M:
        for n in TABLE_NK:
            for k in TABLE_NK:
                if m * n * k > TABLE_MAX_MACS or (quick and m * n * k > TABLE_MAX_MACS // 8):
                    continue
                # operands out of the core's cache, as in a training step (a weight was last
                # read a whole pass ago): cycle through copies filling COLD_BYTES
                copies = max(1, min(64, COLD_BYTES // (4 * (m * k + n * k))))
                pairs = [(torch.randn(m, k), torch.randn(n, k)) for _ in range(copies)]
                turn = iter(range(10**9))

                def gemm() -> None:
                    a, w = pairs[next(turn) % copies]
                    F.linear(a, w)

                t = best_time(gemm, repeat, inner=min(copies, 8))
                table.append([m, n, k, 2 * m * n * k / t])
    out["gemm_table"] = table
    out["conv_table"] = measure_conv_table(quick, repeat)
    # fused attention by sequence and head size, forward and backward
    att = measure_attention_table(attention_seqs(quick), ATTENTION_HEAD, repeat)
    out["attention_table"] = att
    return out


def attention_seqs(quick: bool) -> tuple[int, ...]:
    """The attention table's sequence lengths: all of ``ATTENTION_SEQ``, or up to
    ``ATTENTION_QUICK_MAX_SEQ`` with ``--quick``."""
    return tuple(s for s in ATTENTION_SEQ if not quick or s <= ATTENTION_QUICK_MAX_SEQ)


def measure_attention_table(seqs: Sequence[int], heads: Sequence[int], repeat: int
                            ) -> list[list[float]]:
    """Rows ``[s, d, forward FLOP/s, backward FLOP/s]`` of causal fused attention (fp32; batch x
    heads fills ATTENTION_OPERAND_BYTES, at least 8): forward timed alone, backward as
    forward + backward minus forward, its FLOPs 2.5 x the forward's (FlashAttention's count)."""
    import torch
    import torch.nn.functional as F

    att = []
    for s in seqs:
        for d in heads:
            bh = max(8, ATTENTION_OPERAND_BYTES // (s * d * 4))
            q = torch.randn(1, bh, s, d, requires_grad=True)
            flops = 4 * bh * s * s * d
            t_f = best_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                             repeat)
            o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            g = torch.ones_like(o)

            def fwd_bwd():
                out_ = F.scaled_dot_product_attention(q, q, q, is_causal=True)
                out_.backward(g)

            t_fb = best_time(fwd_bwd, repeat)
            att.append([s, d, flops / t_f, 2.5 * flops / max(t_fb - t_f, 1e-9)])
    return att


def _rank_compute(quick: bool) -> dict[str, float]:
    return measure_compute(quick)


def pace_compute() -> Callable[[], None]:
    """The compute every paced collective follows: ``PACE_GEMMS`` GEMMs of ``PACE_TOKENS x
    PACE_IN -> PACE_OUT`` per call, the operands cycled through ``PACE_COPIES`` copies so that
    they come from beyond the caches, as in a step."""
    import torch
    import torch.nn.functional as F

    operands = [(torch.randn(PACE_TOKENS, PACE_IN), torch.randn(PACE_OUT, PACE_IN))
                for _ in range(PACE_COPIES)]
    turn = iter(range(10**12))

    def pace() -> None:
        for _ in range(PACE_GEMMS):
            x, w = operands[next(turn) % PACE_COPIES]
            F.linear(x, w)

    return pace


def _rank_collectives(sizes: tuple[int, ...], repeat: int) -> dict[str, list[float]]:
    """Per size, the mean seconds of each collective, two ways: back to back (``all_reduce``,
    ...), and as a training step pays it (``all_reduce_after_compute``, ...): every call follows
    a layer's worth of GEMMs on cold operands on each rank (``PACE_*``), less that compute timed
    alone. After compute the ranks arrive at slightly different times, the first blocks and
    sleeps, and the data comes from beyond the caches, which back-to-back ranks in lockstep never
    see (docs/cost-model.md). Plus a rank 0 <-> 1 send/recv (``p2p``, half a round trip)."""
    import torch
    import torch.distributed as dist

    ops = ("all_reduce", "all_gather", "reduce_scatter")
    out: dict[str, list[float]] = {k: [] for op in ops for k in (op, f"{op}_after_compute")}
    out["p2p"] = []
    n = dist.get_world_size()
    rank = dist.get_rank()
    pace = pace_compute()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for size in sizes:
        x = torch.ones(size // 4)
        shard = torch.ones(size // 4 // n)
        full = torch.empty(shard.numel() * n)
        calls = {"all_reduce": lambda: dist.all_reduce(x),
                 "all_gather": lambda: gather(full, shard),
                 "reduce_scatter": lambda: scatter(shard, full)}
        for op in ops:
            fn = calls[op]
            dist.barrier()
            out[op].append(_mean_time(fn, repeat))
            dist.barrier()
            alone = _mean_time(pace, repeat)
            dist.barrier()
            out[f"{op}_after_compute"].append(
                max(_mean_time(lambda: (pace(), fn()), repeat) - alone, 0.0))
        dist.barrier()

        def ping() -> None:  # rank 0 <-> rank 1 round trip; the others idle
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        out["p2p"].append(_mean_time(ping, repeat) / 2)
    return out


def _mlp_block() -> Callable[[], None]:
    """A two-GEMM MLP block's forward and backward (2048 tokens, 256 -> 1024 -> 256, GELU,
    fp32: ~20 MB of weights, activations and gradients, a transformer layer's MLP at the
    benchmarks' sizes), warmed once."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x = torch.randn(2048, 256)
    w1 = torch.randn(1024, 256, requires_grad=True)
    w2 = torch.randn(256, 1024, requires_grad=True)

    def block() -> None:
        F.linear(F.gelu(F.linear(x, w1)), w2).sum().backward()

    block()
    return block


def _rank_mlp_block(iters: int) -> float:
    """Seconds for ``iters`` passes of :func:`_mlp_block`, between two barriers: the pool's ranks
    run it at once."""
    import torch.distributed as dist

    block = _mlp_block()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        block()
    dist.barrier()
    return time.perf_counter() - start


#: The work :func:`measure_oversubscription` hands round a ring of processes: a transformer
#: layer (torch's ``TransformerEncoderLayer``: hidden RESUME_HIDDEN, 4 heads, MLP 4 x hidden)
#: forward and backward on RESUME_TOKENS tokens, ~7 ms on one core of the development VM, a
#: pipeline stage's action at the demo's sizes. The cost of resuming is nearly fixed (1-2.5 ms
#: there, for layers of 5-40 ms), so a short one shows it above the noise.
RESUME_HIDDEN = 128
RESUME_TOKENS = (8, 64)
#: Passes of the layer per rank and round (~0.2 s a round on two cores), and rounds.
RESUME_VISITS = 12
RESUME_ROUNDS = 3


def _layer_block() -> Callable[[], None]:
    """The layer :func:`_rank_layer_ring` times (RESUME_HIDDEN, RESUME_TOKENS), warmed once."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(RESUME_HIDDEN, 4, 4 * RESUME_HIDDEN, dropout=0.0,
                                             batch_first=True)
    x = torch.randn(*RESUME_TOKENS, RESUME_HIDDEN)

    def block() -> None:
        layer(x).sum().backward()

    block()
    return block


def _rank_layer_ring(visits: int, tokens: int) -> float:
    """Mean seconds of one pass of :func:`_layer_block`: without pause when ``tokens`` is 0,
    else while ``tokens`` tokens go round the pool's ranks (a rank runs the layer when the token
    from its left neighbour arrives and hands it right, as a pipeline's ranks hand micro-batches
    on). Only the layer is timed, not the wait; ``visits`` passes, the first left out."""
    import torch
    import torch.distributed as dist

    block = _layer_block()
    rank, n = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % n, (rank + 1) % n
    token = torch.zeros(1)
    holding = initial = sum(1 for k in range(tokens) if k * n // tokens == rank) \
        if tokens else visits
    times, sends = [], []
    dist.barrier()
    for _ in range(visits):
        if holding == 0:
            dist.recv(token, left)
            holding = 1
        start = time.perf_counter()
        block()
        times.append(time.perf_counter() - start)
        holding -= 1
        if tokens:
            sends.append(dist.isend(token.clone(), right))
    for _ in range(initial if tokens else 0):  # the tokens that went round after the last visit
        dist.recv(token, left)
    for work in sends:
        work.wait()
    dist.barrier()
    return statistics.fmean(times[1:])


def measure_oversubscription(cores: int, iters: int = 8, rounds: int = 3) -> dict[str, float]:
    """The node's compute with two processes per core, relative to a core each.

    ``efficiency``: the throughput when all compute, relative to fair sharing. ``cores``
    processes run the same MLP block at once (one per core), then ``2 x cores`` processes; with
    fair sharing and nothing lost the second takes exactly twice as long, so the efficiency is
    ``2 t(cores) / t(2 cores)`` (capped at 1).

    ``resume_s``: what a compute gains when the ``2 x cores`` processes take turns, ``cores``
    computing at a time (:func:`_rank_layer_ring`: ``cores`` tokens going round, RESUME_VISITS
    visits a rank), over the same layer's time on ``cores`` processes without pause: fair
    sharing gives 0, but each rank resumes on a core where others ran since (docs/cost-model.md,
    "Local gloo runs").

    Each the median over ``rounds`` alternations (the resume cost over at least RESUME_ROUNDS:
    a round is ~0.2 s), as a shared host drifts between runs."""
    from autopar.runtime.local_pool import LocalPool

    ratios, alone, shared, resumes = [], [], [], []
    with LocalPool(cores, timeout_s=300) as one, LocalPool(2 * cores, timeout_s=300) as two:
        for _ in range(rounds):
            alone.append(max(one.run(_rank_mlp_block, iters)))
            shared.append(max(two.run(_rank_mlp_block, iters)))
            ratios.append(2 * alone[-1] / shared[-1])
        for _ in range(max(rounds, RESUME_ROUNDS)):
            own = statistics.fmean(one.run(_rank_layer_ring, RESUME_VISITS, 0))
            turns = statistics.fmean(two.run(_rank_layer_ring, RESUME_VISITS, cores))
            resumes.append(turns - own)
    return {"alone_s": statistics.median(alone), "oversubscribed_s": statistics.median(shared),
            "efficiency": min(1.0, statistics.median(ratios)),
            "resume_s": max(0.0, statistics.median(resumes))}


def fit_ring(sizes: list[int], times: list[float], steps_factor: float, *,
             relative: bool = True) -> tuple[float, float]:
    """Least squares ``t = a + steps_factor * S / B``: (latency a, bandwidth B).

    ``relative`` (each point weighted by ``1 / t^2``) for times whose noise grows with them,
    back-to-back calls: the sizes span four orders of magnitude, and in absolute error the
    16 MiB point decides alone and the latency, which is what the small messages of tensor and
    pipeline parallelism pay, comes out as noise (it did: 0 one day, 0.7 ms the next, against
    ~0.45 ms measured at 4-256 KiB). Absolute (unweighted) for times whose noise is the same at
    every size, collectives after compute: each is a difference of two ~13 ms timings, whose
    jitter (+-1-2 ms on the development VM) swamps the small sizes; weighted by ``1 / t^2``
    those noisy small points set the slope, and a quick calibration's reduce-scatter once came
    out with no slope at all (docs/cost-model.md, "Local gloo runs").

    A fit whose slope is not positive (noise only) returns an infinite bandwidth; the caller
    decides what stands in for it."""
    xs = [steps_factor * s for s in sizes]
    ws = [1.0 / max(t, 1e-12) ** 2 if relative else 1.0 for t in times]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, times)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, times)) / sxx
    if slope <= 0:
        return max(my, 0.0), math.inf
    return max(my - slope * mx, 0.0), 1.0 / slope


def fit_collectives(sizes: list[int], per_size: dict[str, list[float]], n: int
                    ) -> dict[str, Any]:
    """The ring fits of :func:`measure_collectives`' times over ``n`` processes.

    Two fits per collective of ``t = a + steps S / B``: back to back (relative error), whose
    latency gives the ring's per-hop latency (it grows with the group), and after compute
    (unweighted), as a step pays it, whose bandwidth is the one a step gets and whose latency,
    less the back-to-back one, is the base latency a0 every call pays arriving from compute
    (``arrival``: the median over the collectives). An after-compute fit with no positive slope
    (noise only) takes the back-to-back bandwidth, or, when that has none either, the largest
    size's time as all transfer; the point-to-point fit (``p2p``, one fit) takes the latter."""
    steps = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
             "reduce_scatter": (n - 1) / n}
    fits: dict[str, Any] = {}
    extra = []
    for op, factor in steps.items():
        latency, b2b_bw = fit_ring(sizes, per_size[op], factor)
        paced_times = per_size[f"{op}_after_compute"]
        paced, bw = fit_ring(sizes, paced_times, factor, relative=False)
        if math.isinf(bw):
            bw = b2b_bw if math.isfinite(b2b_bw) else \
                factor * sizes[-1] / max(paced_times[-1], 1e-9)
        fits[op] = {"latency_s": latency, "bus_bandwidth": bw,
                    "back_to_back_bus_bandwidth": b2b_bw if math.isfinite(b2b_bw) else None,
                    "after_compute_latency_s": paced}
        extra.append(paced - latency)
    fits["arrival"] = {"latency_s": max(statistics.median(extra), 0.0), "samples": len(extra)}
    p2p_lat, p2p_bw = fit_ring(sizes, per_size["p2p"], 1.0)
    if math.isinf(p2p_bw):
        p2p_bw = sizes[-1] / max(per_size["p2p"][-1], 1e-9)
    fits["p2p"] = {"latency_s": p2p_lat, "bandwidth": p2p_bw}
    return fits


def measure_collectives(world: int, quick: bool = False) -> dict[str, Any]:
    from autopar.runtime.local_pool import LocalPool

    sizes = AR_SIZES[:-1] if quick else AR_SIZES
    with LocalPool(world, timeout_s=600) as pool:
        compute = pool.run(_rank_compute, quick)
        coll = pool.run(_rank_collectives, sizes, 10 if quick else 40)
    per_size = {k: [max(r[k][i] for r in coll) for i in range(len(sizes))]
                for k in coll[0]}
    fits = fit_collectives(list(sizes), per_size, world)
    merged = {k: statistics.fmean(r[k] for r in compute) for k in compute[0]
              if not k.endswith("_table")}
    merged["op_table"] = {op: [statistics.fmean(r["op_table"][op][j] for r in compute)
                               for j in (0, 1)] for op in compute[0]["op_table"]}
    # per shape, the mean of each measured rate over the ranks (a row's last ``rates`` values)
    for key, rates in (("gemm_table", 1), ("attention_table", 2), ("conv_table", 3)):
        rows = [r[key] for r in compute]
        merged[key] = [[*rows[0][i][:-rates], *[statistics.fmean(rr[i][j] for rr in rows)
                                                for j in range(-rates, 0)]]
                       for i in range(len(rows[0]))]
    return {"world": world, "sizes": list(sizes), "times": per_size, "compute": merged,
            "per_rank_compute": compute,
            **fits}


def calibrate_cluster(world: int = 2, *, quick: bool = False, name: str | None = None
                      ) -> tuple[Any, dict[str, Any]]:
    """A :class:`~autopar.cluster.Cluster` of ``world`` local processes, from measurements."""
    import torch

    from autopar.cluster import Cluster

    if world < 2:
        raise ValueError("calibration needs at least 2 processes to time collectives")
    m = measure_collectives(world, quick)
    cores = host_cores()
    probe_rounds = 1 if quick else 3
    probed = cores <= MAX_OVERSUBSCRIPTION_PROBE_CORES  # else 2 x cores processes cost more
    if probed:                                          # to start than the figure is worth
        m["oversubscription"] = measure_oversubscription(cores, 3 if quick else 8, probe_rounds)
    efficiency = m["oversubscription"]["efficiency"] if probed else 1.0
    resume = m["oversubscription"]["resume_s"] if probed else 0.0
    c = m["compute"]
    n = world
    # Two latencies from two measurements: the ring's per-step latency from the back-to-back
    # calls (it grows with the group), and the per-call cost of arriving from compute (ranks
    # out of step, the first to arrive blocked and woken) as the base latency a0 of every
    # collective.
    hop = m["all_reduce"]["latency_s"] / (2 * (n - 1))
    arrival = m["arrival"]["latency_s"]
    try:
        total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        total_ram = 8 * 2**30
    stamp = datetime.date.today().isoformat()
    pace = (f"{PACE_GEMMS} GEMMs of {PACE_TOKENS} x {PACE_IN} -> {PACE_OUT} on cold operands "
            f"on every rank")
    where = (f"measured by autopar calibrate on {platform.node() or 'this machine'} "
             f"({os.cpu_count()} CPUs, torch {torch.__version__}, {world} gloo processes of one "
             f"thread, {stamp})")
    link = {"kind": "loopback", "bandwidth": m["all_reduce"]["bus_bandwidth"],
            "latency_s": max(hop, 1e-7), "efficiency": 1.0, "count": 1}
    cluster = Cluster.from_json({
        "name": name or f"calibrated-{platform.node() or 'local'}",
        "nodes": 1, "devices_per_node": world, "backend": "gloo",
        "collective_latency_s": arrival, "cores_per_node": cores,
        "disk_bandwidth": measure_disk_bandwidth(),
        "oversubscription_efficiency": round(efficiency, 4),
        "resume_s": resume,
        "device": {
            "name": f"{platform.processor() or platform.machine()} (1 thread per process)",
            "peak_flops": {"fp32": c["gemm_flops_fp32"], "bf16": c["gemm_flops_bf16"]},
            "memory_bytes": float(total_ram) / world,
            "memory_bandwidth": c["memory_bandwidth"],
            "gemm_efficiency": 1.0,
            "attention_efficiency": min(1.0, c["attention_flops_fp32"] / c["gemm_flops_fp32"]),
            "memory_efficiency": 1.0,
            "kernel_floor_s": c["kernel_floor_s"],
            "op_table": c["op_table"],
            "node_overhead_s": c["node_overhead_s"],
            "node_backward_overhead_s": c["node_backward_overhead_s"],
            "split_backward_overhead_s": c["split_backward_overhead_s"],
            "checkpoint_call_overhead_s": c["checkpoint_call_overhead_s"],
            "checkpoint_tensor_overhead_s": c["checkpoint_tensor_overhead_s"],
            "optimizer_s_per_param": c["optimizer_s_per_param"],
            "optimizer_s_per_tensor": c["optimizer_s_per_tensor"],
            "fused_optimizer_s_per_param": c["fused_optimizer_s_per_param"],
            "fused_optimizer_s_per_tensor": c["fused_optimizer_s_per_tensor"],
            "sm_count": 0,
            "reserved_memory_bytes": 0.0,
            "default_dtype": "fp32",
            "gemm_table": c["gemm_table"],
            "attention_table": c["attention_table"],
            "conv_table": c["conv_table"],
        },
        "intra_node": link,
        "inter_node": dict(link),
        # all-gather and reduce-scatter as measured: gloo's are not rings at the all-reduce's
        # bandwidth (per step of the ring formula: the fit's latency over its n - 1 steps)
        "collectives": {name: {"latency_s": max(m[key]["latency_s"] / (n - 1), 1e-7),
                               "bus_bandwidth": m[key]["bus_bandwidth"]}
                        for name, key in (("all-gather", "all_gather"),
                                          ("reduce-scatter", "reduce_scatter"))},
        "sources": {
            "device.peak_flops": f"best torch.mm rate over n in {list(GEMM_SIZES)}; {where}",
            "device.memory_bandwidth": f"tensor copy of 16-32 MiB, read + write; {where}",
            "device.kernel_floor_s": f"median time of a 1-element add; {where}",
            "device.node_overhead_s": (
                f"per node of a tiny GPT-2's exported forward ({BLOCK_PROBE_LAYERS} blocks "
                f"against 1, hidden {BLOCK_PROBE_HIDDEN}, {BLOCK_PROBE_TOKENS} tokens), less "
                f"the kernel floor; {where}"),
            "device.node_backward_overhead_s": (
                f"per autograd node of the same model's backward, less the kernel floor; "
                f"{where}"),
            "device.split_backward_overhead_s": (
                f"per autograd node, what runtime/split_backward.py's backward_input and "
                f"backward_weight take over one backward() of the same tiny GPT-2 ({BLOCK_PROBE_LAYERS} "
                f"blocks against 1); {where}"),
            "device.checkpoint_call_overhead_s": CHECKPOINT_SOURCE + where,
            "device.checkpoint_tensor_overhead_s": CHECKPOINT_SOURCE + where,
            "cores_per_node": f"CPU cores of the host (affinity mask); {where}",
            "disk_bandwidth": f"{DISK_PROBE_BYTES // 2**20} MiB written with fsync and read "
                              f"back in 4 MiB chunks in the temporary directory, the slower "
                              f"rate; {where}",
            "oversubscription_efficiency": (
                f"2 t(cores) / t(2 x cores): {cores} then {2 * cores} processes running the "
                f"same MLP block (2048 x 256 -> 1024 -> 256, forward and backward) at once, median "
                f"of {probe_rounds}; {where}"
                if probed else
                f"not measured on a host of more than {MAX_OVERSUBSCRIPTION_PROBE_CORES} cores "
                f"(1.0: fair sharing)"),
            "resume_s": (
                f"a transformer layer's forward and backward (hidden {RESUME_HIDDEN}, "
                f"{RESUME_TOKENS[0] * RESUME_TOKENS[1]} tokens) handed round a ring of "
                f"{2 * cores} processes by {cores} tokens, {cores} computing at a time, less its "
                f"time on {cores} processes without pause, median of "
                f"{max(probe_rounds, RESUME_ROUNDS)}; {where}"
                if probed else
                f"not measured on a host of more than {MAX_OVERSUBSCRIPTION_PROBE_CORES} cores "
                f"(0)"),
            "device.optimizer_s_per_param": (
                f"median torch.optim.AdamW step (defaults) over {OPTIMIZER_BLOCKS} transformer "
                f"blocks' parameters at hidden {OPTIMIZER_HIDDEN}, less the per-tensor cost, per "
                f"parameter; {where}"),
            "device.optimizer_s_per_tensor": (
                f"median torch.optim.AdamW step (defaults) over {OPTIMIZER_TINY_TENSORS} "
                f"tensors of {OPTIMIZER_TINY_NUMEL} elements, per tensor; {where}"),
            "device.fused_optimizer_s_per_param": (
                f"as device.optimizer_s_per_param, torch.optim.AdamW(fused=True); {where}"),
            "device.fused_optimizer_s_per_tensor": (
                f"as device.optimizer_s_per_tensor, torch.optim.AdamW(fused=True); {where}"),
            "device.op_table": f"forward and backward of each op on {OP_ROWS} x {OP_COLS} fp32 "
                               f"elements with autograd, per element; {where}",
            "device.attention_efficiency": f"scaled_dot_product_attention rate / GEMM rate; "
                                           f"{where}",
            "device.memory_bytes": "physical memory / processes",
            "intra_node": f"all_reduce times (4 KiB-16 MiB) fitted to the ring model "
                          f"t = a + 2(n-1)/n S/B: hop latency a / 2(n-1) back to back "
                          f"(relative error), bandwidth B after {pace} (unweighted); {where}",
            "collective_latency_s": f"median over all-reduce, all-gather and reduce-scatter "
                                   f"of the ring fit's latency a after {pace} less a back to "
                                   f"back: the ranks' arrival out of step; {where}",
            "inter_node": "single node: same as intra_node",
            "collectives": f"all_gather_single and reduce_scatter_single times (4 KiB-16 "
                           f"MiB) fitted to t = a + (n-1)/n S/B: hop latency a / (n-1) back to "
                           f"back (relative error), bandwidth B after {pace} (unweighted); "
                           f"{where}",
            "gemm_efficiency": "1.0: the measured rate is the achievable rate",
            "device.gemm_table": f"F.linear rate for m in {list(TABLE_M)}, n, k in "
                                 f"{list(TABLE_NK)} (m n k <= 2^31), operands cycled through "
                                 f"{COLD_BYTES >> 20} MiB (cold caches); {where}",
            "device.conv_table": (
                f"conv2d forward, input and weight gradients (aten.convolution_backward), fp32 "
                f"NCHW, images "
                f"{[b for b in CONV_BATCHES if not quick or b <= CONV_QUICK_MAX_IMAGES]}, "
                f"kernels {list(CONV_KERNELS)}, channels in "
                f"and out in {list(CONV_CHANNELS)}, and {CONV_STEM_CHANNELS} in by a "
                f"{CONV_STEM_KERNEL} x {CONV_STEM_KERNEL} kernel, depthwise with kernels "
                f"{list(CONV_DEPTHWISE_KERNELS)}, output sides {list(CONV_SIDES)}, stride 1 "
                f"(M N K <= 2^{CONV_MAX_MACS.bit_length() - 1 - (4 if quick else 0)}), "
                f"operands cycled through up to 4 copies; {where}"),
            "device.attention_table": f"causal scaled_dot_product_attention, batch x heads = "
                                      f"max(8, {ATTENTION_OPERAND_BYTES >> 20} MiB / "
                                      f"(4 s d)), s in {list(attention_seqs(quick))}, d in "
                                      f"{list(ATTENTION_HEAD)}, forward and backward; {where}",
        },
    })
    return cluster, m
