"""Kernel times: how long one GEMM, one memory-bound op or one optimizer step takes on a device.

The leaf of the cost model (:mod:`autopar.planner.cost_model` composes a step, the layer pricing
of :mod:`autopar.planner.layer_costs` sums nodes): every rate comes from the
:class:`~autopar.cluster.Cluster` (datasheet numbers times documented efficiencies, or a measured
table from ``autopar calibrate``), never fitted to end-to-end throughput.

- GEMM ``(batch, M, N, K)``: ``t = max(2 batch M N K / (peak * e_gemm * e_wave),
  bytes / (bw * e_mem), floor)``; ``e_wave`` is wave quantization (NVIDIA's *Matrix
  Multiplication Background* guide): the output's ``ceil(M/tm) ceil(N/tn)`` tiles run in waves of
  ``sm_count``, the best of the 256x128, 128x256 and 128x128 tiles (shrunk to a power of two
  >= 16 for a dimension shorter than the tile). A device with a measured ``gemm_table`` uses
  ``t = max(2 batch M N K / rate(batch M, N, K), floor)`` instead, the rate interpolated between
  measured shapes.
- memory-bound: ``t = max(bytes / (bw * e_mem), floor)``.
- the optimizer step, by the kernel it runs (``OptimizerKernel``: torch's default is foreach on
  a GPU, the for-loop on a CPU) and by what the optimizer's step moves and runs
  (``OptimizerStep``, counted by the runtime on a probe; AdamW's by default): the bytes it moves
  per parameter of the local shard (AdamW's ``ADAMW_BYTES_PER_PARAM``: 28 fused, 84 for
  foreach and the for-loop, which run the same ops; SGD with momentum 32) at the memory
  bandwidth, or the device's measured time per parameter of AdamW where it measured one
  (``optimizer_s_per_param``, ``fused_optimizer_s_per_param``: a CPU core steps a tensor at a
  time, mostly in its caches, faster than streaming it) times the bytes' ratio to AdamW's,
  plus the measured fixed cost per parameter tensor (``optimizer_s_per_tensor``: a CPU core's
  for-loop AdamW runs 8 ops per tensor, 45-70 us however small the tensor) times the calls'
  ratio to AdamW's.
- an offloaded step on a GPU's host: the same over fp32 host tensors (torch's default there:
  the for-loop), at the node's host memory bandwidth, or the host's measured rate where that is
  longer (``Cluster.host_optimizer_s_per_param``, measured for the for-loop).
- the host's launches on a GPU: a layer takes the longer of its kernels and its nodes times
  ``launch_overhead_s`` (the host runs ahead of the device until it cannot).
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, Sequence

from autopar.cluster import Cluster
from autopar.plan_types import OptimizerKernel, OptimizerStep

__all__ = ["wave_efficiency", "gemm_tiling", "SPLIT_K_MIN", "table_rate", "gemm_time",
           "conv_times", "memory_time", "optimizer_time",
           "offloaded_optimizer_time", "OPTIMIZER_BYTES_PER_PARAM", "HOST_ADAMW_BYTES_PER_PARAM",
           "ADAMW_BYTES_PER_PARAM", "ADAMW_OPS_PER_TENSOR",
           "GEMM_TILES",
           "ATTENTION_BACKWARD_FACTOR", "PRECISION_BYTES"]

#: Bytes the Adam step moves per parameter of the local shard (see module docstring).
OPTIMIZER_BYTES_PER_PARAM = 28
#: Bytes torch's AdamW moves per parameter in its default implementation on host tensors (the
#: for-loop ``_single_tensor_adam``: torch picks foreach or fused kernels only for GPU tensors),
#: what the runtime runs for an offloaded optimizer; fp32, each op reading its operands and
#: writing its result: ``param.mul_`` (weight decay) 8, ``exp_avg.lerp_(grad)`` 12,
#: ``exp_avg_sq.mul_`` 8, ``.addcmul_(grad, grad)`` 16, ``sqrt()`` 8 and ``/ bias_correction`` 8
#: (two new tensors), ``.add_(eps)`` 8, ``param.addcdiv_(exp_avg, denom)`` 16.
HOST_ADAMW_BYTES_PER_PARAM = 84
#: Bytes torch's AdamW moves per parameter by its kernel: the fused kernel (``_fused_adamw_``,
#: torch/optim/adamw.py) reads weights, gradients and the two moments once and writes weights
#: and moments once (OPTIMIZER_BYTES_PER_PARAM); foreach (``_multi_tensor_adamw``) runs the
#: for-loop's ops, each batched over the tensors (``_foreach_mul_``, ``_foreach_lerp_``, ...),
#: so it moves what the for-loop moves (HOST_ADAMW_BYTES_PER_PARAM).
ADAMW_BYTES_PER_PARAM = {OptimizerKernel.FUSED: OPTIMIZER_BYTES_PER_PARAM,
                         OptimizerKernel.FOREACH: HOST_ADAMW_BYTES_PER_PARAM,
                         OptimizerKernel.FOR_LOOP: HOST_ADAMW_BYTES_PER_PARAM}
#: ATen calls torch's AdamW makes per parameter tensor by its kernel: the fused kernel one for
#: them all, foreach and the for-loop eight (two ``mul_``, ``lerp_``, ``addcmul_``, ``sqrt``,
#: ``div``, ``add_``, ``addcdiv_``; counted by ``OptimizerFactory.step_cost``). The measured
#: per-tensor cost of a device is AdamW's; another optimizer's is that times its calls over
#: these.
ADAMW_OPS_PER_TENSOR = {OptimizerKernel.FUSED: 1.0, OptimizerKernel.FOREACH: 8.0,
                        OptimizerKernel.FOR_LOOP: 8.0}
#: Thread-block tiles cuBLAS uses for large GEMMs (NVIDIA Matrix Multiplication Background).
GEMM_TILES = ((256, 128), (128, 256), (128, 128))
#: FlashAttention-2's backward does 5 matmuls to the forward's 2.
ATTENTION_BACKWARD_FACTOR = 2.5
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def wave_efficiency(batch: float, m: float, n: float, sm_count: int) -> float:
    """Useful fraction of the tile waves a GEMM's output needs (1 when sm_count is 0).

    A dimension shorter than the tile gets a tile shrunk to it (at least 16, the tensor-core
    MMA granule), as cuBLAS's kernels for skinny matrices do."""
    if sm_count <= 0:
        return 1.0
    best = 0.0
    for tm, tn, tiles in _tilings(batch, m, n):
        waves = math.ceil(tiles / sm_count)
        best = max(best, batch * m * n / (waves * sm_count * tm * tn))
    return min(best, 1.0)


def _tilings(batch: float, m: float, n: float) -> Iterator[tuple[int, int, int]]:
    """(tile rows, tile columns, tiles) of the output for each of ``GEMM_TILES``, a dimension
    shorter than the tile getting a tile shrunk to it (at least 16)."""
    for tm, tn in GEMM_TILES:
        tm = min(tm, max(16, 2 ** math.ceil(math.log2(max(m, 1)))))
        tn = min(tn, max(16, 2 ** math.ceil(math.log2(max(n, 1)))))
        yield tm, tn, math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)


#: The shortest K one slice of a split-K GEMM keeps: four main-loop iterations of the 64-deep K
#: tile of CUTLASS's 16-bit Tensor Core threadblocks (128 x 128 x 64, its default for sm80 and
#: sm90); a shorter slice spends its time in the prologue and in summing the partial products.
SPLIT_K_MIN = 256


def gemm_tiling(batch: float, m: float, n: float, k: float, sm_count: int) -> tuple[float, int]:
    """(useful fraction of the SMs' time, K splits) of a GEMM: :func:`wave_efficiency`, or,
    where its output has fewer tiles than the device has SMs, split-K: K cut into ``s`` slices
    (a power of two, each at least ``SPLIT_K_MIN`` deep) computed by ``s`` times the tiles, as
    cuBLAS and CUTLASS do for a small output over a long K (a convolution's or a small layer's
    weight gradient: output channels x input channels, summed over every pixel or token of the
    micro-batch); their fp32 partial sums are then added (:func:`gemm_time` counts those
    bytes)."""
    best = (wave_efficiency(batch, m, n, sm_count), 1)
    if sm_count <= 0:
        return best
    for tm, tn, tiles in _tilings(batch, m, n):
        s = 2
        while tiles * s <= sm_count and k / s >= SPLIT_K_MIN:
            eff = min(batch * m * n * s / (sm_count * tm * tn), 1.0)
            if eff > best[0]:
                best = (eff, s)
            s *= 2
    return best


def table_rate(table: Sequence[Sequence[float]], point: Sequence[float]) -> float:
    """Rate at ``point`` from measured rows (coordinates..., rate): inverse-distance weighting
    (power 4) in log2 space, each coordinate clamped to the measured range (exact at measured
    points, smooth between, flat outside)."""
    logs = []
    for i, x in enumerate(point):  # outside the measured range: the nearest measured size
        lo = min(row[i] for row in table)
        hi = max(row[i] for row in table)
        logs.append(math.log2(min(max(x, lo), hi)))
    num = den = 0.0
    for row in table:
        d2 = sum((math.log2(c) - x) ** 2 for c, x in zip(row, logs))
        if d2 < 1e-12:
            return row[len(point)]
        w = 1.0 / (d2 * d2)
        num += w * row[len(point)]
        den += w
    return num / den


def gemm_time(cluster: Cluster, dtype: str, batch: float, m: float, n: float, k: float) -> float:
    d = cluster.device
    esize = PRECISION_BYTES[dtype]
    flops = 2.0 * batch * m * n * k
    if d.gemm_table and dtype == d.default_dtype:  # measured rates by shape
        return max(flops / table_rate(d.gemm_table, (batch * m, n, k)), d.kernel_floor_s)
    efficiency, splits = gemm_tiling(batch, m, n, k, d.sm_count)
    rate = d.peak(dtype) * d.gemm_efficiency * efficiency
    nbytes = esize * batch * (m * k + k * n + m * n) + _split_k_bytes(batch, m, n, splits)
    return max(flops / rate, nbytes / (d.memory_bandwidth * d.memory_efficiency),
               d.kernel_floor_s)


def _split_k_bytes(batch: float, m: float, n: float, splits: int) -> float:
    """The fp32 partial sums a split-K GEMM writes and reads back to add them."""
    return 2 * 4 * splits * batch * m * n if splits > 1 else 0.0


def conv_times(cluster: Cluster, dtype: str, groups: float, m: float, n: float, k: float,
               kernel: float, images: float, nbytes: float) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds of a convolution, each the implicit
    GEMM cuDNN runs (``passes.analyze.conv_dims``: per group an M x K by K x N product, M output
    pixels, N output channels, K input channels times the ``kernel`` elements; the input
    gradient ``(groups, M, K, N)``, the weight gradient ``(groups, N, K, M)``): its FLOPs at the
    GEMM rate of that shape (the peak times ``gemm_efficiency`` and the tiling of ``groups`` x
    its outputs, split-K included), or at the device's measured convolution rates where it has
    a ``conv_table`` (its seconds per FLOP interpolated at ``(images, groups M, N, K,
    kernel)``, ``images`` the batch the call convolves: a CPU's convolutions run far from its
    GEMMs' rates, and oneDNN picks its kernel by the batch), else its measured GEMM table's;
    but its memory traffic the ``nbytes`` it really moves (input, weight and output once: the
    im2col matrix a GEMM of that shape would read is never written). A depthwise convolution
    (N = 1) thus costs its tiles' waste or its bytes, whichever is more."""
    d = cluster.device
    flops = 2.0 * groups * m * n * k
    floor = max(nbytes / (d.memory_bandwidth * d.memory_efficiency), d.kernel_floor_s)
    measured = dtype == d.default_dtype
    if d.conv_table and measured:
        # interpolated in seconds per FLOP (a harmonic mean of the rates): a shape between a
        # fast row and a latency-bound one is not priced at the fast one's pace
        point = (images, groups * m, n, k, kernel)
        f, b, w = (max(flops * table_rate(rows, point), floor)
                   for rows in _seconds_per_flop(d.conv_table))
        return f, b, w
    times = []
    for mm, nn, kk in ((m, n, k), (m, k, n), (n, k, m)):
        moved = nbytes
        if d.gemm_table and measured:
            compute = flops / table_rate(d.gemm_table, (groups * mm, nn, kk))
        else:
            efficiency, splits = gemm_tiling(groups, mm, nn, kk, d.sm_count)
            compute = flops / (d.peak(dtype) * d.gemm_efficiency * efficiency)
            moved += _split_k_bytes(groups, mm, nn, splits)
        times.append(max(compute, moved / (d.memory_bandwidth * d.memory_efficiency),
                         d.kernel_floor_s))
    return times[0], times[1], times[2]


@functools.lru_cache(maxsize=8)
def _seconds_per_flop(table: tuple[tuple[float, ...], ...]
                      ) -> tuple[list[tuple[float, ...]], ...]:
    """A ``conv_table``'s rows as three tables (forward, input gradient, weight gradient) of
    seconds per FLOP, made once per table."""
    return tuple([(*r[:5], 1 / r[5 + j]) for r in table] for j in range(3))


def memory_time(cluster: Cluster, nbytes: float) -> float:
    d = cluster.device
    return max(nbytes / (d.memory_bandwidth * d.memory_efficiency), d.kernel_floor_s)


def offloaded_optimizer_time(cluster: Cluster, params: float, offload: str,
                             weight_bytes: float, state_bytes: float = 8.0,
                             tensors: float = 0.0,
                             kernel: OptimizerKernel | None = None,
                             buckets: int = 1, step: OptimizerStep | None = None) -> float:
    """One device's optimizer step over ``params`` parameters with its state offloaded
    (``Plan.offload``), as the runtime does it (runtime/data_parallel.py, runtime/offload.py):

    - the reduced fp32 gradients go to the host and the updated weights (``weight_bytes`` per
      parameter) come back over ``host_link_bandwidth``, after the backward and before the next
      forward; bucket by bucket (``buckets`` of them): every copy down is launched first, each
      bucket steps once its own landed and its copy up starts, so the three (down, the host's
      step, up) run as a pipeline of ``buckets`` equal items, ``(D + S + U) / n + (n - 1) / n x
      max(D, S, U)``;
    - the host steps with ``kernel`` (None: torch's default on host tensors, the for-loop):
      its memory traffic per parameter (``step``'s, else AdamW's ``ADAMW_BYTES_PER_PARAM``,
      as in :func:`optimizer_time`) at the node's
      ``host_memory_bandwidth`` shared by its devices, or the measured time of torch's default
      AdamW on that host (``host_optimizer_s_per_param`` and ``_per_tensor``, one device's step
      using the whole host, so ``devices_per_node`` of them one after another; not for the
      fused kernel, which it does not measure), whichever is longer (a CPU cluster's device is
      the host: its own :func:`optimizer_time`);
    - ``disk``: each bucket's ``state_bytes`` per parameter (Adam's two fp32 moments) is read
      before its step and written after it, at the node's ``disk_bandwidth`` shared by its
      devices, overlapped with the other buckets' steps: the longer of the two.
    """
    if offload == "none":
        return optimizer_time(cluster, params, tensors, kernel, step)
    per_node = cluster.devices_per_node
    if cluster.host_link_bandwidth > 0:
        on_host = kernel or OptimizerKernel.FOR_LOOP
        link = params * (4.0 + weight_bytes) / cluster.host_link_bandwidth
        moved = step.bytes_per_param if step is not None else ADAMW_BYTES_PER_PARAM[on_host]
        host = moved * params * per_node / \
            cluster.host_memory_bandwidth if cluster.host_memory_bandwidth > 0 \
            else optimizer_time(cluster, params, tensors, on_host, step)
        if on_host is not OptimizerKernel.FUSED:  # what calibrate --device cuda measures
            ratio = moved / ADAMW_BYTES_PER_PARAM[on_host]  # it measures AdamW (as above)
            calls = step.ops_per_tensor / ADAMW_OPS_PER_TENSOR[on_host] if step else 1.0
            host = max(host, per_node * (params * cluster.host_optimizer_s_per_param * ratio
                                         + tensors * cluster.host_optimizer_s_per_tensor
                                         * calls))
    else:
        link, host = 0.0, optimizer_time(cluster, params, tensors, kernel, step)
    if offload == "disk":
        if cluster.disk_bandwidth <= 0:
            return math.inf
        host = max(host, 2 * state_bytes * params * per_node / cluster.disk_bandwidth)
    if link == 0.0:
        return host
    down, up = link * 4.0 / (4.0 + weight_bytes), link * weight_bytes / (4.0 + weight_bytes)
    n = max(int(buckets), 1)
    stages = (down, host, up)
    return sum(stages) / n + (n - 1) / n * max(stages)


def optimizer_time(cluster: Cluster, params: float, tensors: float = 0.0,
                   kernel: OptimizerKernel | None = None,
                   step: OptimizerStep | None = None) -> float:
    """One device's optimizer step over ``params`` parameters in ``tensors`` tensors with
    ``kernel`` (None: torch's default on the device, foreach on a GPU cluster, the for-loop on a
    CPU one), alone on its core. ``step``: what the optimizer's step moves and runs, counted by
    the runtime (``OptimizerFactory.step_cost``); None: AdamW's (``ADAMW_BYTES_PER_PARAM``,
    ``ADAMW_OPS_PER_TENSOR``). Its bytes at the device's measured time per parameter of
    AdamW scaled by their ratio to AdamW's bytes (a CPU core's measured rate is a rate per
    byte moved mostly in its caches), or without one streamed at the memory bandwidth; plus
    the measured fixed cost of each tensor (the fused kernel's ``fused_optimizer_*``, else
    torch's default's, which foreach on a CPU runs as a loop too), AdamW's, scaled by the
    calls per tensor over AdamW's."""
    d = cluster.device
    kernel = kernel or OptimizerKernel.default_on(cluster.gpu)
    if kernel is OptimizerKernel.FUSED:
        per_param, per_tensor = d.fused_optimizer_s_per_param, d.fused_optimizer_s_per_tensor
    else:
        per_param, per_tensor = d.optimizer_s_per_param, d.optimizer_s_per_tensor
    adamw = ADAMW_BYTES_PER_PARAM[kernel]
    moved = step.bytes_per_param if step is not None else adamw
    calls = step.ops_per_tensor / ADAMW_OPS_PER_TENSOR[kernel] if step is not None else 1.0
    # measured where the device measured the kernel: a CPU core steps one parameter's tensors at
    # a time, each mostly in its caches (the for-loop at 3.4-4.1 ns per parameter where its 84
    # bytes would stream in 5.7, the fused kernel at 0.8 where its 28 would take 1.9: cpu.yaml)
    elements = params * per_param * moved / adamw if per_param > 0 else \
        memory_time(cluster, moved * params)
    return elements + tensors * per_tensor * calls
