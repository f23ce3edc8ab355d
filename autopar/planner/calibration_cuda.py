"""Measure one CUDA device (``autopar calibrate --device cuda``) with CUDA events: bf16 GEMM
rates (peak and a table by shape), copy bandwidth, a tiny kernel's throughput floor, causal
fused-attention rates and element-wise op times, and its host (the time to launch a graph node,
an offloaded AdamW step); the nodes and links come from the GPU's preset
(one device measures no link). The CPU host's calibration is :mod:`autopar.planner.calibration`.
"""

from __future__ import annotations

import datetime
import statistics
from typing import Any, Callable

from autopar.planner.calibration_host import CHECKPOINT_SOURCE

__all__ = ["measure_cuda", "calibrate_cuda_cluster", "cuda_cluster"]


#: Shapes of the GPU GEMM table (bf16): tokens m x n x k, from a micro-batch of one short
#: sequence to a large one; capped at 2^37 multiply-adds.
CUDA_TABLE_M = (512, 2048, 8192, 32768)
CUDA_TABLE_NK = (1024, 4096, 16384)
CUDA_TABLE_MAX_MACS = 2**37
#: Element-wise op table shape on the GPU: 64M elements, so that each kernel runs ~100 us and
#: the host's dispatch (~10-20 us per op from Python, which a training step hides by running
#: ahead of the GPU) does not enter the per-element time.
CUDA_OP_ROWS, CUDA_OP_COLS = 32768, 2048
CUDA_ATTENTION_SEQ = (512, 1024, 2048, 4096)
CUDA_ATTENTION_HEAD = (64, 128)


def _cuda_time(fn: Callable[[], Any], repeat: int, inner: int = 1) -> float:
    """Median over ``repeat`` runs of ``inner`` back-to-back calls, timed with CUDA events
    (seconds per call), after a warm-up run."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def measure_cuda(quick: bool = False) -> dict[str, Any]:
    """The current CUDA device's GEMM rates (peak and by shape, bf16), copy bandwidth, the
    throughput floor of a tiny kernel, causal fused-attention rates and element-wise op times,
    all with CUDA events. Random operands (zeros run faster on tensor cores)."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda", torch.cuda.current_device())
    repeat = 3 if quick else 7
    bf16 = torch.bfloat16
    out: dict[str, Any] = {"device_name": torch.cuda.get_device_name(dev)}
    for name, dtype in (("bf16", bf16), ("fp32", torch.float32)):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
        best = 0.0
        for n in ((4096, 8192) if name == "bf16" else (4096,)):
            a = torch.randn(n, n, dtype=dtype, device=dev)
            b = torch.randn(n, n, dtype=dtype, device=dev)
            best = max(best, 2 * n**3 / _cuda_time(lambda: torch.mm(a, b), repeat, inner=5))
        out[f"gemm_flops_{name}"] = best
    src = torch.empty(2**28 // 2, dtype=bf16, device=dev)  # 256 MiB
    dst = torch.empty_like(src)
    out["memory_bandwidth"] = 2 * src.numel() * 2 / _cuda_time(lambda: dst.copy_(src), repeat)
    one = torch.ones(1, device=dev)
    out["kernel_floor_s"] = _cuda_time(lambda: one.add(one), repeat, inner=1000)
    table = []
    for m in CUDA_TABLE_M:
        for n in CUDA_TABLE_NK:
            for k in CUDA_TABLE_NK:
                if m * n * k > CUDA_TABLE_MAX_MACS or (quick and m * n * k > 2**34):
                    continue
                a = torch.randn(m, k, dtype=bf16, device=dev)
                w = torch.randn(n, k, dtype=bf16, device=dev)
                t = _cuda_time(lambda: F.linear(a, w), repeat, inner=3)
                table.append([m, n, k, 2 * m * n * k / t])
    out["gemm_table"] = table
    att = []
    for s in CUDA_ATTENTION_SEQ:
        for d in CUDA_ATTENTION_HEAD:
            heads = max(1, 65536 // (s * d // 64))  # about the same work per shape
            q = torch.randn(1, heads, s, d, dtype=bf16, device=dev, requires_grad=True)
            flops = 4 * heads * s * s * d
            t_f = _cuda_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                             repeat)
            g = torch.ones(1, heads, s, d, dtype=bf16, device=dev)

            def fwd_bwd() -> None:
                F.scaled_dot_product_attention(q, q, q, is_causal=True).backward(g)

            t_fb = _cuda_time(fwd_bwd, repeat)
            att.append([s, d, flops / t_f, 2.5 * flops / max(t_fb - t_f, 1e-9)])
    out["attention_table"] = att
    out["op_table"] = _cuda_op_table(dev, repeat)
    out.update(measure_host(dev, repeat))
    return out


def measure_host(device: Any, repeat: int) -> dict[str, float]:
    """What the host of a ``device`` costs a training step (host-side timers, no CUDA events):

    - ``launch_overhead_s`` / ``launch_backward_overhead_s``: host seconds per graph node
      launched on ``device`` forward and backward (:func:`~autopar.planner.calibration_host.
      block_node_times`), which bound a layer's time when its kernels are shorter;
    - ``host_optimizer_s_per_param`` / ``_per_tensor``: torch's AdamW (its default
      implementation) over fp32 tensors in host memory with all the host's threads, as the
      runtime steps an offloaded optimizer (:func:`~autopar.planner.calibration_host.
      measure_optimizer_step`)."""
    from autopar.planner.calibration_host import (block_node_times, checkpoint_overhead,
                                                  measure_optimizer_step)

    fwd, bwd = block_node_times(device, repeat)
    per_param, per_tensor = measure_optimizer_step(repeat)
    call, saved = checkpoint_overhead(device, repeat)
    return {"launch_overhead_s": fwd, "launch_backward_overhead_s": bwd,
            "host_optimizer_s_per_param": per_param, "host_optimizer_s_per_tensor": per_tensor,
            "checkpoint_call_overhead_s": call, "checkpoint_tensor_overhead_s": saved}


def _cuda_op_table(dev: Any, repeat: int) -> dict[str, list[float]]:
    """Forward and backward seconds per element of the element-wise and normalization ops, bf16
    (the loss in fp32, as autopar computes it), on CUDA_OP_ROWS x CUDA_OP_COLS elements."""
    import torch
    import torch.nn.functional as F

    bf16 = torch.bfloat16
    rows, cols = CUDA_OP_ROWS, CUDA_OP_COLS
    x = torch.randn(rows, cols, dtype=bf16, device=dev, requires_grad=True)
    y = torch.randn(rows, cols, dtype=bf16, device=dev)
    xf = torch.randn(rows, cols, device=dev, requires_grad=True)
    weight = torch.ones(cols, dtype=bf16, device=dev, requires_grad=True)
    bias = torch.zeros(cols, dtype=bf16, device=dev, requires_grad=True)
    targets = torch.randint(0, cols, (rows,), device=dev)
    ops = {
        "gelu": lambda: F.gelu(x), "gelu(tanh)": lambda: F.gelu(x, approximate="tanh"),
        "silu": lambda: F.silu(x), "add": lambda: x + y, "mul": lambda: x * y,
        "layer_norm": lambda: F.layer_norm(x, (cols,), weight, bias),
        "softmax": lambda: torch.softmax(x, -1), "log_softmax": lambda: torch.log_softmax(x, -1),
        "cross_entropy_loss": lambda: F.cross_entropy(xf, targets),
    }
    wrt = {"layer_norm": (x, weight, bias), "cross_entropy_loss": (xf,)}
    n = rows * cols
    table = {}
    for name, fn in ops.items():
        forward = _cuda_time(fn, repeat)
        result = fn()  # one graph, its backward timed alone (no accumulation into .grad)
        grad = torch.ones_like(result)
        inputs = wrt.get(name, (x,))
        backward = _cuda_time(lambda out=result, wrt_=inputs, g=grad: torch.autograd.grad(
            out, wrt_, g, retain_graph=True), repeat)
        table[name] = [forward / n, backward / n]
        del result, grad
    return table


def calibrate_cuda_cluster(base: str | None = None, *, quick: bool = False,
                           name: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A cluster file for GPUs like this process's CUDA device: the device's numbers measured
    here (:func:`measure_cuda`), the nodes, links and memory of the preset ``base`` (default:
    the preset named after the device: h200, h100-80g, or a100-80g)."""
    import torch


    if not torch.cuda.is_available():
        raise RuntimeError("calibrating a GPU needs a CUDA device")
    m = measure_cuda(quick)
    return cuda_cluster(m, base, name=name, torch_version=torch.__version__), m


def cuda_cluster(m: dict[str, Any], base: str | None = None, *, name: str | None = None,
                 torch_version: str = "") -> Any:
    """The cluster :func:`calibrate_cuda_cluster` writes, from :func:`measure_cuda`'s dict."""
    from autopar.cluster import Cluster

    device_name = m["device_name"]
    if base is None:
        from autopar.cluster import preset_for_device

        base = preset_for_device(device_name)
    doc = Cluster.load(base).to_json()
    stamp = datetime.date.today().isoformat()
    where = (f"measured by autopar calibrate --device cuda on {device_name} (torch "
             f"{torch_version}, {stamp})")
    dev = doc["device"]
    dev.update({
        "name": f"{device_name} (calibrated)",
        "peak_flops": {**dev["peak_flops"], "bf16": m["gemm_flops_bf16"],
                       "fp32": m["gemm_flops_fp32"]},
        "memory_bandwidth": m["memory_bandwidth"], "memory_efficiency": 1.0,
        "gemm_efficiency": 1.0, "kernel_floor_s": m["kernel_floor_s"],
        "gemm_table": m["gemm_table"], "attention_table": m["attention_table"],
        "attention_efficiency": min(1.0, max(r[2] for r in m["attention_table"])
                                    / m["gemm_flops_bf16"]),
        "op_table": m["op_table"], "default_dtype": "bf16",
        "launch_overhead_s": m["launch_overhead_s"],
        "launch_backward_overhead_s": m["launch_backward_overhead_s"],
        "checkpoint_call_overhead_s": m["checkpoint_call_overhead_s"],
        "checkpoint_tensor_overhead_s": m["checkpoint_tensor_overhead_s"],
    })
    doc["host_optimizer_s_per_param"] = m["host_optimizer_s_per_param"]
    doc["host_optimizer_s_per_tensor"] = m["host_optimizer_s_per_tensor"]
    doc["name"] = name or f"{base}-calibrated"
    doc["sources"] = {**doc.get("sources", {}), **{
        "device.peak_flops": f"best bf16 torch.mm at n in (4096, 8192), fp32 at 4096 without "
                             f"TF32; {where}",
        "device.memory_bandwidth": f"copy of 256 MiB, read + write; {where}",
        "device.kernel_floor_s": f"back-to-back 1-element adds per launch; {where}",
        "device.gemm_table": f"F.linear bf16 rate for m in {list(CUDA_TABLE_M)}, n, k in "
                             f"{list(CUDA_TABLE_NK)}; {where}",
        "device.attention_table": f"causal scaled_dot_product_attention bf16, s in "
                                  f"{list(CUDA_ATTENTION_SEQ)}, d in {list(CUDA_ATTENTION_HEAD)}, "
                                  f"forward and backward; {where}",
        "device.op_table": f"forward and backward per element on {CUDA_OP_ROWS} x "
                           f"{CUDA_OP_COLS} bf16 elements (cross-entropy fp32); {where}",
        "device.launch_overhead_s": f"host time per node of a chain of t and add calls on the "
                                    f"GPU, forward and backward, not waiting for the kernels; "
                                    f"{where}",
        "host_optimizer_s_per_param": f"torch.optim.AdamW's default step over fp32 host tensors "
                                      f"(transformer blocks' shapes), all host threads; {where}",
        "device.checkpoint_call_overhead_s": f"{CHECKPOINT_SOURCE}on the GPU; {where}",
        "device.checkpoint_tensor_overhead_s": f"{CHECKPOINT_SOURCE}on the GPU; {where}",
        "gemm_efficiency": "1.0: the measured rates are the achievable rates",
        "links": f"from the {base} preset (one device measures no link)",
    }}
    return Cluster.from_json(doc)
