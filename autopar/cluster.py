"""The cluster: nodes x devices, what one device computes and stores, and how devices talk.

A :class:`Cluster` is what the cost model prices a plan against. It is built from datasheet
numbers (peak FLOP/s, memory, link line rates) times *efficiency factors* that say how much of
each a real kernel reaches; every factor carries its source in :attr:`Cluster.sources`, and none
is fitted to the end-to-end training runs the model is checked against (docs/cost-model.md).

Presets (``autopar/data/clusters/*.yaml``): ``a100-80g``, ``h100-80g``, ``h200`` (DGX-style
nodes: 8 devices on an NVSwitch, 8 InfiniBand NICs per node) and ``cpu`` (local gloo processes,
numbers from ``autopar calibrate``). A custom cluster is a JSON or YAML file of the same form;
quantities may be plain numbers in base units (bytes, bytes/s, FLOP/s, seconds) or strings with
a unit (``"312 TFLOP/s"``, ``"80 GiB"``, ``"2.039 TB/s"``, ``"200 Gb/s"``, ``"2.5 us"``)::

    cluster = Cluster.load("a100-80g").with_devices(1024)          # 128 nodes of 8
    cluster = Cluster.load("my-cluster.yaml")

This is a leaf module: it imports only :mod:`autopar.errors` and :mod:`autopar.units` (and yaml
to read files).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

from autopar.errors import ClusterSpecError
from autopar.units import parse_quantity

__all__ = ["Cluster", "DeviceSpec", "LinkSpec", "LinkKind", "GroupSpan", "CollectiveSpec",
           "COLLECTIVE_NAMES", "PRESET_NAMES", "parse_quantity", "preset_names", "processor_share",
           "preset_for_device"]

PRESET_NAMES = ("a100-80g", "h100-80g", "h200", "cpu")

#: Compute dtypes a device may list a peak for.
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------

def _check(cond: bool, message: str, *, expected: str, found: Any, fix: str) -> None:
    if not cond:
        raise ClusterSpecError(message, expected=expected, found=str(found), fix=fix)


def _positive(owner: str, name: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
           f"{owner}.{name} must be a positive number", expected="> 0", found=value,
           fix=f"give {owner}.{name} its datasheet or measured value")


def _fraction(owner: str, name: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and 0 < value <= 1,
           f"{owner}.{name} is an efficiency factor (a fraction of the datasheet number)",
           expected="0 < value <= 1", found=value,
           fix="give the measured fraction, e.g. achieved busbw / line rate from nccl-tests")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator (or one CPU process): peak rates, memory, and what kernels reach."""

    name: str
    #: Dense peak FLOP/s by compute dtype ("bf16", "fp16", "tf32", "fp32", ...).
    peak_flops: Mapping[str, float]
    memory_bytes: float
    #: Datasheet memory bandwidth (bytes/s).
    memory_bandwidth: float
    #: Fraction of peak a large, well-shaped GEMM reaches (maximum achievable matmul FLOP/s).
    gemm_efficiency: float
    #: Fraction of peak fused attention (flash) reaches, forward and backward.
    attention_efficiency: float
    #: Fraction of the datasheet bandwidth a streaming kernel reaches.
    memory_efficiency: float
    #: Shortest time one kernel takes (launch and tail), seconds.
    kernel_floor_s: float
    #: Streaming multiprocessors, for GEMM wave quantization (0: no wave model, e.g. CPUs).
    sm_count: int = 0
    #: SMs a collective occupies while it overlaps compute (one thread block per NCCL channel).
    collective_sms: int = 0
    #: Memory the framework and communication library keep (CUDA context, NCCL buffers).
    reserved_memory_bytes: float = 0.0
    #: Dtype training runs in by default on this device (mixed precision "bf16" or "fp32").
    default_dtype: str = "bf16"
    #: Measured GEMM rates at ``default_dtype``: rows (m, n, k, FLOP/s). When present they
    #: replace peak x efficiency x waves (``autopar calibrate`` measures them).
    gemm_table: tuple[tuple[float, float, float, float], ...] = ()
    #: Measured fused-attention rates: rows (sequence, head dim, forward FLOP/s, backward
    #: FLOP/s), FLOPs counted as 4 b a s^2 d forward and 2.5 times that backward.
    attention_table: tuple[tuple[float, float, float, float], ...] = ()
    #: Measured convolution rates at ``default_dtype``: rows (images, M, N, K, kernel elements,
    #: forward, input-gradient, weight-gradient FLOP/s), M N K the implicit GEMM's
    #: (``passes.analyze.conv_dims``). When present they replace the GEMM rates for
    #: convolutions (a CPU's oneDNN runs a small 1 x 1 convolution in NCHW at a fifth of its
    #: GEMM's rate, and at a third of its own rate on 16 images against 8); ``autopar
    #: calibrate`` measures them. Empty: a convolution is its implicit GEMM.
    conv_table: tuple[tuple[float, ...], ...] = ()
    #: Host time per graph node of the forward, added to the node's compute: dispatch of the op
    #: and autograd's recording of it, on the thread that then runs the op (CPU processes).
    #: 0 where the host runs ahead of the device (GPUs launch kernels asynchronously: their
    #: host cost is ``launch_overhead_s``, which bounds a layer's time rather than adding to it).
    node_overhead_s: float = 0.0
    #: The same per node of the backward graph (autograd's engine calling the node's backward
    #: function, accumulating gradients into ``.grad``), added to the backward's compute.
    node_backward_overhead_s: float = 0.0
    #: Host time per graph node of the forward where the host runs ahead of the device (GPUs:
    #: the op's dispatch, autograd's recording and the kernel's launch, while earlier kernels
    #: run): a layer's forward takes the longer of its kernels and its nodes' launches.
    #: ``autopar calibrate --device cuda`` measures it; 0 in the presets (no microbenchmark of
    #: their hosts), where a layer is priced by its kernels alone.
    launch_overhead_s: float = 0.0
    #: The same per node of the backward graph (autograd's engine thread launching each node's
    #: backward kernels).
    launch_backward_overhead_s: float = 0.0
    #: Host time per autograd node that the zero-bubble schedules' split backward adds to a
    #: layer's weight-gradient action (``runtime/split_backward.py`` walks the graph in Python
    #: and calls autograd once per weight group), on the thread that then computes (CPU
    #: processes). ``autopar calibrate`` measures it; 0 in the presets and on GPUs (not measured
    #: there).
    split_backward_overhead_s: float = 0.0
    #: Host seconds full recompute adds per checkpointed block (``checkpoint_call_overhead_s``:
    #: torch's non-reentrant ``checkpoint`` setting up its frame and hooks, forward and
    #: recompute) and per tensor the block saves (``checkpoint_tensor_overhead_s``: its pack hooks
    #: in the forward, the recompute's and the unpack in the backward), beyond running the
    #: block's forward again. ``autopar calibrate`` measures both (``--device cuda`` too); 0 in
    #: the presets.
    checkpoint_call_overhead_s: float = 0.0
    checkpoint_tensor_overhead_s: float = 0.0
    #: Measured times of element-wise and normalization ops at ``default_dtype``: op name (as in
    #: the graph; ``gelu(tanh)`` for the tanh approximation) -> (forward, backward) seconds per
    #: element of the op's largest tensor. The roofline's bytes / bandwidth stays a floor; the
    #: table matters where a device computes an op slower than it streams it (a CPU core's tanh
    #: GELU or cross-entropy). Empty: every such op is memory-bound (GPUs).
    op_table: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    #: Measured seconds per parameter of an optimizer step (``torch.optim.AdamW`` as a training
    #: script calls it, its default implementation on this device: the for-loop on a CPU). 0:
    #: the step is priced as memory traffic, the bytes its kernel moves per parameter at the
    #: streaming bandwidth (planner/kernels.py: 84 for torch's default foreach on a GPU);
    #: a CPU core's for-loop AdamW runs ~10 passes over the parameters and takes 1.5-2.5 times
    #: that.
    optimizer_s_per_param: float = 0.0
    #: Measured fixed seconds of an optimizer step per parameter tensor, whatever its size (a
    #: CPU core's for-loop AdamW issues ~10 ops per tensor). 0: the implementation steps all
    #: tensors in a few multi-tensor kernels (torch's foreach or fused AdamW on a GPU).
    optimizer_s_per_tensor: float = 0.0
    #: The same for torch's fused AdamW (``fused=True``: one vectorized kernel, on a CPU too),
    #: measured by ``autopar calibrate``; 0: priced as its memory traffic (28 bytes per
    #: parameter).
    fused_optimizer_s_per_param: float = 0.0
    fused_optimizer_s_per_tensor: float = 0.0

    def __post_init__(self) -> None:
        owner = f"device {self.name!r}"
        _check(isinstance(self.peak_flops, Mapping) and len(self.peak_flops) > 0,
               f"{owner} has no peak_flops", expected=f"a mapping dtype -> FLOP/s over {DTYPES}",
               found=self.peak_flops, fix="add e.g. peak_flops: {bf16: 312 TFLOP/s}")
        flops = {}
        for dtype, value in dict(self.peak_flops).items():
            _check(dtype in DTYPES, f"{owner} lists an unknown dtype in peak_flops",
                   expected=f"one of {DTYPES}", found=dtype, fix="rename the key")
            value = parse_quantity(value, "flop/s", what=f"{owner}.peak_flops.{dtype}")
            _positive(owner, f"peak_flops.{dtype}", value)
            flops[dtype] = value
        object.__setattr__(self, "peak_flops", flops)
        for name in ("node_overhead_s", "node_backward_overhead_s", "launch_overhead_s",
                     "launch_backward_overhead_s", "split_backward_overhead_s",
                     "checkpoint_call_overhead_s", "checkpoint_tensor_overhead_s"):
            value = parse_quantity(getattr(self, name), "s", what=f"{owner}.{name}")
            object.__setattr__(self, name, value)
            _check(math.isfinite(value) and 0 <= value < 1e-2,
                   f"{owner}.{name} must be a host time per graph node",
                   expected="0 <= value < 10 ms (a few microseconds on CPUs, 0 on GPUs)",
                   found=value, fix="regenerate with autopar calibrate, or give 0")
        # the default and the fused optimizer kernel's measured rates (0: priced as traffic)
        rates = (("per_param", 1e-6, "time per parameter", "1 us (a few ns on a CPU core; 0: "
                  "priced as memory traffic)"),
                 ("per_tensor", 1e-2, "fixed time per parameter tensor", "10 ms (~0.1 ms on a "
                  "CPU core; 0 for multi-tensor kernels)"))
        for prefix in ("", "fused_"):
            for suffix, bound, what, limit in rates:
                name = f"{prefix}optimizer_s_{suffix}"
                value = parse_quantity(getattr(self, name), "s", what=f"{owner}.{name}")
                object.__setattr__(self, name, value)
                _check(math.isfinite(value) and 0 <= value < bound,
                       f"{owner}.{name} must be an optimizer step's {what}",
                       expected=f"0 <= value < {limit}", found=value,
                       fix="regenerate with autopar calibrate, or give 0")
        for name in ("memory_bytes", "memory_bandwidth", "kernel_floor_s"):
            base = {"memory_bytes": "bytes", "memory_bandwidth": "bytes/s",
                    "kernel_floor_s": "s"}[name]
            value = parse_quantity(getattr(self, name), base, what=f"{owner}.{name}")
            object.__setattr__(self, name, value)
            _positive(owner, name, value)
        reserved = parse_quantity(self.reserved_memory_bytes, "bytes",
                                  what=f"{owner}.reserved_memory_bytes")
        object.__setattr__(self, "reserved_memory_bytes", reserved)
        _check(0 <= reserved < self.memory_bytes, f"{owner} reserves more memory than it has",
               expected=f"0 <= reserved_memory_bytes < memory_bytes ({self.memory_bytes:.4g})",
               found=reserved, fix="lower reserved_memory_bytes")
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            _fraction(owner, name, getattr(self, name))
        _check(isinstance(self.sm_count, int) and self.sm_count >= 0,
               f"{owner}.sm_count must be a non-negative integer", expected=">= 0",
               found=repr(self.sm_count), fix="give the SM count (108 on A100, 132 on H100) or 0")
        _check(isinstance(self.collective_sms, int) and 0 <= self.collective_sms
               <= max(self.sm_count, 0) and (self.sm_count > 0 or not self.collective_sms),
               f"{owner}.collective_sms must be between 0 and sm_count ({self.sm_count})",
               expected=f"0 <= collective_sms <= {self.sm_count}", found=self.collective_sms,
               fix="give the NCCL channels a collective uses (0 when there are no SMs)")
        for name, width, shape in (("gemm_table", 4, "[[m, n, k, rate], ...]"),
                                   ("attention_table", 4, "[[s, d, forward, backward], ...]"),
                                   ("conv_table", 8, "[[images, m, n, k, kernel, forward, "
                                                     "input gradient, weight gradient], ...]")):
            rows = tuple(tuple(float(x) for x in row) for row in getattr(self, name))
            _check(all(len(r) == width and all(x > 0 for x in r) for r in rows),
                   f"{owner}.{name} rows must be {width} positive numbers", expected=shape,
                   found=str(getattr(self, name))[:80], fix="regenerate with autopar calibrate")
            object.__setattr__(self, name, rows)
        table = {}
        _check(isinstance(self.op_table, Mapping), f"{owner}.op_table must be a mapping",
               expected="op name -> [forward, backward] seconds per element",
               found=type(self.op_table).__name__, fix="regenerate with autopar calibrate")
        for op, times in dict(self.op_table).items():
            ok = isinstance(op, str) and isinstance(times, (list, tuple)) and len(times) == 2 \
                and all(isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t < 1e-3
                        for t in times)
            _check(ok, f"{owner}.op_table[{op!r}] must be two times per element",
                   expected="[forward, backward] seconds per element, each in [0, 1 ms)",
                   found=times, fix="regenerate with autopar calibrate")
            table[op] = (float(times[0]), float(times[1]))
        object.__setattr__(self, "op_table", table)
        _check(self.default_dtype in self.peak_flops,
               f"{owner}.default_dtype has no peak", expected=f"one of {sorted(self.peak_flops)}",
               found=self.default_dtype, fix="add its peak to peak_flops or change default_dtype")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (clear error if the device lists none)."""
        if dtype not in self.peak_flops:
            raise ClusterSpecError(f"device {self.name!r} has no peak for {dtype}",
                                   expected=f"one of {sorted(self.peak_flops)}", found=dtype,
                                   fix=f"add peak_flops.{dtype} to the cluster file")
        return self.peak_flops[dtype]

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserved_memory_bytes


class LinkKind(str, enum.Enum):
    NVSWITCH = "nvswitch"
    NVLINK = "nvlink"
    PCIE = "pcie"
    INFINIBAND = "infiniband"
    ETHERNET = "ethernet"
    #: Processes on one host talking through the kernel (gloo over loopback TCP).
    LOOPBACK = "loopback"


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A class of link. Intra-node: ``bandwidth`` is what one device can send in one direction.
    Inter-node: one NIC's line rate, ``count`` NICs per node (one per device, rail-optimized)."""

    kind: LinkKind
    bandwidth: float
    #: Latency of one hop of a collective (one step of a ring or a tree), seconds.
    latency_s: float
    #: Bus bandwidth a collective reaches / line rate (nccl-tests busbw).
    efficiency: float
    count: int = 1

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", LinkKind(self.kind))
        except ValueError:
            raise ClusterSpecError("unknown link kind", expected=f"one of "
                                   f"{[k.value for k in LinkKind]}", found=repr(self.kind),
                                   fix="use one of the listed kinds") from None
        owner = f"{self.kind.value} link"
        object.__setattr__(self, "bandwidth", parse_quantity(self.bandwidth, "bytes/s",
                                                             what=f"{owner}.bandwidth"))
        object.__setattr__(self, "latency_s", parse_quantity(self.latency_s, "s",
                                                             what=f"{owner}.latency_s"))
        _positive(owner, "bandwidth", self.bandwidth)
        _positive(owner, "latency_s", self.latency_s)
        _fraction(owner, "efficiency", self.efficiency)
        _check(isinstance(self.count, int) and self.count >= 1, f"{owner}.count must be >= 1",
               expected="an integer >= 1", found=self.count, fix="give the NICs per node")

    @property
    def effective_bandwidth(self) -> float:
        """What one device (one NIC) reaches, bytes/s."""
        return self.bandwidth * self.efficiency


#: Collectives a cluster may describe one by one (``Cluster.collectives``).
COLLECTIVE_NAMES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


@dataclass(frozen=True, slots=True)
class CollectiveSpec:
    """How one collective of the backend performs inside a node when it is not the ring of the
    intra-node link: the per-step latency and the bus bandwidth it reaches, both measured.
    gloo's reduce-scatter is the case in point: at 1-16 MiB between two processes it took as
    long as an all-reduce of the same tensor, which a ring does in half the time."""

    #: Latency of one step of the collective's ring (the fit's latency / its steps), seconds.
    latency_s: float
    #: Bus bandwidth (bytes/s), as the ring formula of :mod:`autopar.planner.comm` uses it.
    bus_bandwidth: float

    def __post_init__(self) -> None:
        for name, base in (("latency_s", "s"), ("bus_bandwidth", "bytes/s")):
            object.__setattr__(self, name, parse_quantity(getattr(self, name), base,
                                                          what=f"collective {name}"))
            _positive("collective", name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class GroupSpan:
    """Where a communication group sits: ``size`` ranks over ``nodes`` nodes, at most
    ``per_node`` of them in one node."""

    size: int
    nodes: int
    per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True, slots=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices, their intra-node links and inter-node network."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    #: Fixed software latency of one collective call (NCCL's base latency), seconds.
    collective_latency_s: float = 3.6e-6
    backend: str = "nccl"
    #: CPU cores the devices of one node share (a CPU cluster, whose devices are processes of
    #: one thread each); 0 when every device has its own compute (GPUs). With more processes
    #: computing on a node than it has cores, each gets ``cores / processes`` of one
    #: (:meth:`compute_share`).
    cores_per_node: int = 0
    #: Throughput of a node's cores while more processes compute than it has cores, relative to
    #: fair sharing (1.0): time-sliced processes evict each other's caches. autopar calibrate
    #: measures it (``cores`` then ``2 x cores`` processes running the same work).
    oversubscription_efficiency: float = 1.0
    #: Seconds a rank's compute takes longer when it resumes after waiting, on a node holding
    #: more processes than cores: the ranks take turns on the cores (a pipeline hands each
    #: micro-batch on) and each resumes on a core where others ran since, its caches cold.
    #: autopar calibrate measures it (a transformer layer handed round a ring of ``2 x cores``
    #: processes, ``cores`` at a time, against ``cores`` processes running it without pause).
    #: Not paid on a node with a core per process.
    resume_s: float = 0.0
    #: The training software's data-parallel gradient reduction runs during the backward, bucket
    #: by bucket as gradients are ready (autopar's runtime, PyTorch DDP, FSDP, Megatron-LM's
    #: ``--overlap-grad-reduce`` since 2023): True. False: it follows the whole backward
    #: (Megatron-LM's local DDP of 2021-2022, the software of the published runs that
    #: benchmarks/published_runs.py checks the model against).
    overlap_grad_reduce: bool = True
    #: Bytes/s one device moves to or from host memory, one direction (PCIe); 0 when the
    #: device is the host (CPU clusters). What optimizer offload streams gradients and updated
    #: weights over (Plan.offload).
    host_link_bandwidth: float = 0.0
    #: Bytes/s of one node's host memory (all its sockets), shared by its devices' offloaded
    #: optimizer steps; 0 when the device is the host (its own optimizer_s_per_param prices it).
    host_memory_bandwidth: float = 0.0
    #: Measured seconds per parameter of the offloaded optimizer step on one node's host: torch's
    #: AdamW, its default implementation over fp32 host tensors (what the runtime runs), one
    #: process using all the host's threads; ``autopar calibrate --device cuda`` measures it.
    #: 0: priced as its memory traffic alone (``kernels.HOST_ADAMW_BYTES_PER_PARAM``).
    host_optimizer_s_per_param: float = 0.0
    #: The same step's fixed seconds per parameter tensor (the default implementation issues
    #: ~10 ops per tensor); measured with it.
    host_optimizer_s_per_tensor: float = 0.0
    #: Bytes/s of one node's local disk (read or write), shared by its devices: what
    #: ``offload="disk"`` pages the optimizer state through; 0: no disk to offload to.
    disk_bandwidth: float = 0.0
    #: Collectives that inside a node do not perform as rings over ``intra_node`` (name from
    #: :data:`COLLECTIVE_NAMES` -> :class:`CollectiveSpec`); ``autopar calibrate`` measures
    #: them on the local backend. Empty for NCCL clusters (every collective a ring or a tree
    #: over the links).
    collectives: Mapping[str, CollectiveSpec] = field(default_factory=dict)
    #: Where each number comes from: field path -> citation.
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"cluster {self.name!r}: {name} must be a positive integer",
                   expected="an integer >= 1", found=value, fix=f"set {name}")
        if isinstance(self.device, Mapping):
            object.__setattr__(self, "device", _build(DeviceSpec, self.device, "device"))
        for name in ("intra_node", "inter_node"):
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, _build(LinkSpec, getattr(self, name), name))
        object.__setattr__(self, "collective_latency_s",
                           parse_quantity(self.collective_latency_s, "s",
                                          what="collective_latency_s"))
        _check(self.collective_latency_s >= 0, "collective_latency_s must be >= 0",
               expected=">= 0", found=self.collective_latency_s, fix="give NCCL's base latency")
        _check(self.backend in ("nccl", "gloo"), f"unknown backend {self.backend!r}",
               expected="'nccl' or 'gloo'", found=self.backend, fix="set backend")
        _check(isinstance(self.cores_per_node, int) and not isinstance(self.cores_per_node, bool)
               and self.cores_per_node >= 0,
               f"cluster {self.name!r}: cores_per_node must be a non-negative integer",
               expected="the CPU cores of a node (CPU clusters) or 0 (devices with their own "
                        "compute)", found=repr(self.cores_per_node),
               fix="give os.cpu_count() of the host (autopar calibrate records it), or 0")
        _check(isinstance(self.oversubscription_efficiency, (int, float))
               and not isinstance(self.oversubscription_efficiency, bool)
               and 0 < self.oversubscription_efficiency <= 1,
               f"cluster {self.name!r}: oversubscription_efficiency must be in (0, 1]",
               expected="the throughput of an oversubscribed node's cores relative to fair "
                        "sharing, in (0, 1]", found=repr(self.oversubscription_efficiency),
               fix="leave it out (1.0) or take autopar calibrate's figure")
        object.__setattr__(self, "oversubscription_efficiency",
                           float(self.oversubscription_efficiency))
        object.__setattr__(self, "resume_s", parse_quantity(self.resume_s, "s", what="resume_s"))
        _check(math.isfinite(self.resume_s) and self.resume_s >= 0,
               f"cluster {self.name!r}: resume_s must be >= 0 seconds",
               expected="the seconds a rank's compute loses resuming on shared cores, >= 0",
               found=repr(self.resume_s), fix="leave it out (0) or take autopar calibrate's figure")
        _check(isinstance(self.overlap_grad_reduce, bool),
               f"cluster {self.name!r}: overlap_grad_reduce must be true or false",
               expected="a boolean", found=repr(self.overlap_grad_reduce),
               fix="true when gradients are reduced during the backward, false when after it")
        for name in ("host_link_bandwidth", "host_memory_bandwidth", "disk_bandwidth"):
            value = parse_quantity(getattr(self, name), "bytes/s", what=name)
            _check(math.isfinite(value) and value >= 0, f"cluster {self.name!r}: {name} must "
                   f"be a bandwidth", expected=">= 0 bytes/s (0: none)", found=value,
                   fix=f"give e.g. {name}: 25 GB/s, or leave it out")
            object.__setattr__(self, name, value)
        for name, limit in (("host_optimizer_s_per_param", 1e-6),
                            ("host_optimizer_s_per_tensor", 1e-2)):
            value = parse_quantity(getattr(self, name), "s", what=name)
            _check(math.isfinite(value) and 0 <= value < limit,
                   f"cluster {self.name!r}: {name} must be a host optimizer step's time",
                   expected=f"0 <= value < {limit:g} s (0: priced as host memory traffic)",
                   found=value, fix="regenerate with autopar calibrate --device cuda, or give 0")
            object.__setattr__(self, name, value)
        _check(isinstance(self.collectives, Mapping),
               f"cluster {self.name!r}: collectives must be a mapping",
               expected=f"{{name: {{latency_s, bus_bandwidth}}}} with names among "
                        f"{list(COLLECTIVE_NAMES)}", found=repr(self.collectives),
               fix="write collectives as key: value pairs, or leave it out")
        specs = {}
        for op, spec in self.collectives.items():
            _check(op in COLLECTIVE_NAMES, f"cluster {self.name!r}: unknown collective {op!r}",
                   expected=f"one of {list(COLLECTIVE_NAMES)}", found=repr(op),
                   fix="rename or remove it")
            if isinstance(spec, Mapping):
                spec = _build(CollectiveSpec, spec, f"collectives.{op}")
            _check(isinstance(spec, CollectiveSpec),
                   f"cluster {self.name!r}: collectives.{op} must be a mapping",
                   expected="{latency_s, bus_bandwidth}", found=repr(spec),
                   fix="give the collective's hop latency and bus bandwidth")
            specs[op] = spec
        object.__setattr__(self, "collectives", specs)
        object.__setattr__(self, "sources", dict(self.sources))

    # -- size ---------------------------------------------------------------------------------
    @property
    def gpu(self) -> bool:
        """Whether its devices are GPUs (NCCL), the path torch's optimizers, kernels and
        collectives take there; False for a CPU cluster's processes (gloo)."""
        return self.backend == "nccl"

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def with_devices(self, devices: int, devices_per_node: int | None = None) -> "Cluster":
        """The same hardware with ``devices`` in all, ``devices_per_node`` per node (default:
        the preset's node size, or all on one node when fewer)."""
        local = self.intra_node.kind is LinkKind.LOOPBACK  # processes on one host
        per_node = devices_per_node or (devices if local else min(self.devices_per_node, devices))
        if not isinstance(devices, int) or devices < 1:
            raise ClusterSpecError("the device count must be a positive integer",
                                   expected=">= 1", found=repr(devices), fix="pass --gpus N")
        if per_node < 1:
            raise ClusterSpecError("devices per node must be positive", expected=">= 1",
                                   found=repr(per_node), fix="pass --gpus-per-node G")
        if devices % per_node:
            raise ClusterSpecError(
                f"{devices} devices do not fill whole nodes of {per_node}",
                expected=f"a multiple of {per_node} devices",
                found=f"{devices} = {devices // per_node} x {per_node} + {devices % per_node}",
                fix=f"use --gpus {(devices // per_node + 1) * per_node} or pass "
                    f"--gpus-per-node that divides {devices}")
        if per_node > self.devices_per_node and not local:
            raise ClusterSpecError(
                f"cluster {self.name!r} has nodes of {self.devices_per_node} devices",
                expected=f"--gpus-per-node <= {self.devices_per_node}", found=str(per_node),
                fix="describe a bigger node in a cluster file, or use fewer devices per node")
        return dataclasses.replace(self, nodes=devices // per_node, devices_per_node=per_node)

    def span(self, ranks: list[int] | range) -> GroupSpan:
        """Where a group of global ranks sits (ranks fill node 0 first, then node 1, ...)."""
        per: dict[int, int] = {}
        for r in ranks:
            node = r // self.devices_per_node
            per[node] = per.get(node, 0) + 1
        return GroupSpan(size=len(ranks), nodes=len(per), per_node=max(per.values()))

    def peak_flops(self, dtype: str | None = None) -> float:
        return self.device.peak(dtype or self.device.default_dtype)

    def compute_share(self, computing: float) -> float:
        """Fraction of its own speed a device computes at while ``computing`` devices of its
        node compute at once: 1 up to ``cores_per_node`` processes, then
        ``oversubscription_efficiency x cores_per_node / computing`` on a CPU cluster (the
        processes share the cores, and the kernel's scheduler shares them fairly, at the cost of
        colder caches), 1 when the devices have their own compute (``cores_per_node == 0``)."""
        if self.cores_per_node <= 0:
            return 1.0
        return processor_share(computing, self.cores_per_node, self.oversubscription_efficiency)

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        def link(spec: LinkSpec) -> dict[str, Any]:
            return {"kind": spec.kind.value, "bandwidth": spec.bandwidth,
                    "latency_s": spec.latency_s, "efficiency": spec.efficiency,
                    "count": spec.count}

        d = self.device
        return {
            "name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
            "backend": self.backend, "collective_latency_s": self.collective_latency_s,
            "cores_per_node": self.cores_per_node,
            "oversubscription_efficiency": self.oversubscription_efficiency,
            "resume_s": self.resume_s,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "host_link_bandwidth": self.host_link_bandwidth,
            "host_memory_bandwidth": self.host_memory_bandwidth,
            "host_optimizer_s_per_param": self.host_optimizer_s_per_param,
            "host_optimizer_s_per_tensor": self.host_optimizer_s_per_tensor,
            "disk_bandwidth": self.disk_bandwidth,
            "device": {"name": d.name, "peak_flops": dict(d.peak_flops),
                       "memory_bytes": d.memory_bytes, "memory_bandwidth": d.memory_bandwidth,
                       "gemm_efficiency": d.gemm_efficiency,
                       "attention_efficiency": d.attention_efficiency,
                       "memory_efficiency": d.memory_efficiency,
                       "kernel_floor_s": d.kernel_floor_s, "sm_count": d.sm_count,
                       "collective_sms": d.collective_sms,
                       "gemm_table": [list(r) for r in d.gemm_table],
                       "attention_table": [list(r) for r in d.attention_table],
                       "conv_table": [list(r) for r in d.conv_table],
                       "op_table": {k: list(v) for k, v in d.op_table.items()},
                       "node_overhead_s": d.node_overhead_s,
                       "node_backward_overhead_s": d.node_backward_overhead_s,
                       "launch_overhead_s": d.launch_overhead_s,
                       "launch_backward_overhead_s": d.launch_backward_overhead_s,
                       "split_backward_overhead_s": d.split_backward_overhead_s,
                       "checkpoint_call_overhead_s": d.checkpoint_call_overhead_s,
                       "checkpoint_tensor_overhead_s": d.checkpoint_tensor_overhead_s,
                       "optimizer_s_per_param": d.optimizer_s_per_param,
                       "optimizer_s_per_tensor": d.optimizer_s_per_tensor,
                       "fused_optimizer_s_per_param": d.fused_optimizer_s_per_param,
                       "fused_optimizer_s_per_tensor": d.fused_optimizer_s_per_tensor,
                       "reserved_memory_bytes": d.reserved_memory_bytes,
                       "default_dtype": d.default_dtype},
            "intra_node": link(self.intra_node), "inter_node": link(self.inter_node),
            "collectives": {op: {"latency_s": c.latency_s, "bus_bandwidth": c.bus_bandwidth}
                            for op, c in self.collectives.items()},
            "sources": dict(self.sources),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, origin: str = "cluster spec") -> "Cluster":
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{origin} is not a mapping", expected="an object with "
                                   "name, nodes, devices_per_node, device, intra_node, inter_node",
                                   found=type(data).__name__, fix="see autopar/data/clusters/")
        return _build(cls, data, origin)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str) -> None:
        """Write JSON (``.json``) or YAML (``.yaml``/``.yml``)."""
        with open(path, "w") as fh:
            if path.endswith((".yaml", ".yml")):
                import yaml

                yaml.safe_dump(self.to_json(), fh, sort_keys=False)
            else:
                fh.write(self.dumps() + "\n")

    @classmethod
    def load(cls, name_or_path: str) -> "Cluster":
        """A preset name (``a100-80g``) or a JSON/YAML file."""
        if name_or_path in PRESET_NAMES:
            text = resources.files("autopar.data").joinpath(
                f"clusters/{name_or_path}.yaml").read_text()
            return cls.from_json(_parse_text(text, name_or_path), origin=f"preset {name_or_path}")
        if not os.path.exists(name_or_path):
            raise ClusterSpecError(f"no cluster preset or file named {name_or_path!r}",
                                   expected=f"a preset ({', '.join(PRESET_NAMES)}) or a path to "
                                            f"a .json/.yaml file", found=repr(name_or_path),
                                   fix="check the spelling, or write a file with "
                                       "`autopar calibrate --out cluster.json`")
        with open(name_or_path) as fh:
            text = fh.read()
        return cls.from_json(_parse_text(text, name_or_path), origin=name_or_path)


def preset_names() -> list[str]:
    return list(PRESET_NAMES)


def _parse_text(text: str, origin: str) -> Any:
    import yaml

    try:
        if origin.endswith(".json"):
            return json.loads(text)
        # libyaml's parser where PyYAML was built with it: the same documents, 7x faster (the
        # 35 kB cpu preset: 15 ms against 110 ms; every rank of every parallelize loads one)
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (ValueError, yaml.YAMLError) as exc:
        raise ClusterSpecError(f"cannot parse {origin}", expected="valid JSON or YAML",
                               found=str(exc).splitlines()[0], fix="fix the syntax") from None


def _build(cls: type, data: Mapping[str, Any], origin: str) -> Any:
    """``cls(**data)`` with unknown and missing keys reported by name."""
    if not isinstance(data, Mapping):
        raise ClusterSpecError(f"{origin} must be a mapping", expected="an object",
                               found=repr(data), fix=f"write {origin} as key: value pairs")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ClusterSpecError(f"{origin} has unknown key(s) {unknown}",
                               expected=f"keys among {sorted(fields)}", found=str(unknown),
                               fix="remove or rename them")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ClusterSpecError(f"{origin} lacks key(s) {missing}", expected=f"all of {required}",
                               found=f"keys {sorted(data)}", fix="add them (see the presets in "
                                                                 "autopar/data/clusters/)")
    try:
        return cls(**dict(data))
    except TypeError as exc:
        raise ClusterSpecError(f"{origin} is malformed", expected="the fields of "
                               f"{cls.__name__}", found=str(exc), fix="check the types") from None


def processor_share(computing: float, cores: float, efficiency: float = 1.0) -> float:
    """Fraction of its own speed each of ``computing`` single-thread processes runs at on
    ``cores`` shared cores: 1 while they fit, else ``efficiency x cores / computing`` (fair
    sharing, less what oversubscription loses). The one law of the simulator and of
    :meth:`autopar.cluster.Cluster.compute_share` (the cost model's optimizer step)."""
    return 1.0 if computing <= cores else efficiency * cores / computing


#: GPU name fragments (as ``torch.cuda.get_device_name`` spells them) -> their preset, first
#: match wins (an "H100" name must not be read as an older part).
_GPU_PRESETS = (("h200", "h200"), ("h100", "h100-80g"), ("a100", "a100-80g"))
#: The preset of a GPU none of the above names: the oldest, so predictions err on the slow side.
FALLBACK_GPU_PRESET = "a100-80g"


def preset_for_device(device_name: str) -> str:
    """The cluster preset for a device by its name (``"cpu"`` for a CPU; a GPU by its
    ``torch.cuda.get_device_name``), :data:`FALLBACK_GPU_PRESET` for a GPU without one."""
    low = device_name.lower()
    if low == "cpu":
        return "cpu"
    return next((preset for key, preset in _GPU_PRESETS if key in low), FALLBACK_GPU_PRESET)
