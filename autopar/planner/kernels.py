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
- the optimizer step: 28 bytes moved per parameter of the local shard (Adam reads weights,
  gradients, two moments and writes three, plus the low-precision copy), or the device's
  measured time per parameter where that is longer (``optimizer_s_per_param``), plus the
  measured fixed cost per parameter tensor it steps (``optimizer_s_per_tensor``: a CPU core's
  for-loop AdamW runs ~10 ops per tensor, 45-70 us however small the tensor).
- an offloaded step on a GPU's host: torch's for-loop AdamW over fp32 host tensors, 84 bytes
  of host memory traffic per parameter (``HOST_ADAMW_BYTES_PER_PARAM``), or the host's measured
  rate where that is longer (``Cluster.host_optimizer_s_per_param``).
- the host's launches on a GPU: a layer takes the longer of its kernels and its nodes times
  ``launch_overhead_s`` (the host runs ahead of the device until it cannot).
"""

from __future__ import annotations

import math
from typing import Sequence

from autopar.cluster import Cluster

__all__ = ["wave_efficiency", "table_rate", "gemm_time", "memory_time", "optimizer_time",
           "offloaded_optimizer_time", "OPTIMIZER_BYTES_PER_PARAM", "HOST_ADAMW_BYTES_PER_PARAM",
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
    for tm, tn in GEMM_TILES:
        tm = min(tm, max(16, 2 ** math.ceil(math.log2(max(m, 1)))))
        tn = min(tn, max(16, 2 ** math.ceil(math.log2(max(n, 1)))))
        tiles = math.ceil(batch) * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sm_count)
        best = max(best, batch * m * n / (waves * sm_count * tm * tn))
    return min(best, 1.0)


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
    rate = d.peak(dtype) * d.gemm_efficiency * wave_efficiency(batch, m, n, d.sm_count)
    nbytes = esize * batch * (m * k + k * n + m * n)
    return max(flops / rate, nbytes / (d.memory_bandwidth * d.memory_efficiency),
               d.kernel_floor_s)


def memory_time(cluster: Cluster, nbytes: float) -> float:
    d = cluster.device
    return max(nbytes / (d.memory_bandwidth * d.memory_efficiency), d.kernel_floor_s)


def offloaded_optimizer_time(cluster: Cluster, params: float, offload: str,
                             weight_bytes: float, state_bytes: float = 8.0,
                             tensors: float = 0.0) -> float:
    """One device's optimizer step over ``params`` parameters with its state offloaded
    (``Plan.offload``), as the runtime does it (runtime/data_parallel.py, runtime/offload.py):

    - the reduced fp32 gradients go to the host and the updated weights (``weight_bytes`` per
      parameter) come back over ``host_link_bandwidth``, after the backward and before the next
      forward (not overlapped);
    - the host steps: ``HOST_ADAMW_BYTES_PER_PARAM`` of memory traffic per parameter at the
      node's ``host_memory_bandwidth`` shared by its devices, or the measured time of torch's
      AdamW on that host (``host_optimizer_s_per_param`` and ``_per_tensor``, one device's step
      using the whole host, so ``devices_per_node`` of them one after another), whichever is
      longer (a CPU cluster's device is the host: its own :func:`optimizer_time`);
    - ``disk``: each bucket's ``state_bytes`` per parameter (Adam's two fp32 moments) is read
      before its step and written after it, at the node's ``disk_bandwidth`` shared by its
      devices, overlapped with the other buckets' steps: the longer of the two.
    """
    if offload == "none":
        return optimizer_time(cluster, params, tensors)
    per_node = cluster.devices_per_node
    if cluster.host_link_bandwidth > 0:
        link = params * (4.0 + weight_bytes) / cluster.host_link_bandwidth
        host = HOST_ADAMW_BYTES_PER_PARAM * params * per_node / cluster.host_memory_bandwidth \
            if cluster.host_memory_bandwidth > 0 else optimizer_time(cluster, params, tensors)
        host = max(host, per_node * (params * cluster.host_optimizer_s_per_param
                                     + tensors * cluster.host_optimizer_s_per_tensor))
    else:
        link, host = 0.0, optimizer_time(cluster, params, tensors)
    if offload == "disk":
        if cluster.disk_bandwidth <= 0:
            return math.inf
        host = max(host, 2 * state_bytes * params * per_node / cluster.disk_bandwidth)
    return link + host


def optimizer_time(cluster: Cluster, params: float, tensors: float = 0.0) -> float:
    """One device's Adam step over ``params`` parameters in ``tensors`` tensors, alone on its
    core: the memory traffic (``OPTIMIZER_BYTES_PER_PARAM``) or the measured time per parameter,
    whichever is longer, plus the measured fixed cost of each tensor."""
    d = cluster.device
    return max(memory_time(cluster, OPTIMIZER_BYTES_PER_PARAM * params),
               params * d.optimizer_s_per_param) + tensors * d.optimizer_s_per_tensor
