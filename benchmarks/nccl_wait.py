"""How long a rank's host waits on a NCCL collective: torch's ``work.wait(timeout)`` against
autopar's stream wait (``runtime/comm.py``, ``work.wait()``), on one GPU (a world of one NCCL
rank: the collective still runs as a NCCL kernel on its own stream).

    python benchmarks/nccl_wait.py --json nccl-wait.json

Given a timeout, ``ProcessGroupNCCL``'s wait blocks the host until the collective has finished
(pytorch/pytorch#100162), so the host stops queueing kernels at every collective and the GPU
idles while it launches the next ones; without one it orders the current stream after the
collective and returns. Two measurements, each wait style in turn, medians of ``--rounds``:

1. **The host's wait.** ``--queue-ms`` of GEMMs queued, then an all-reduce launched and waited:
   the host seconds the wait took (blocking: about the queued work; on the stream: microseconds).
2. **A tensor-parallel-like loop.** ``--layers`` times: a GEMM of ``--n`` x ``--n`` in bf16, an
   all-reduce of its output, the wait (Megatron's row-parallel GEMM and its all-reduce), then
   one synchronize: the step's wall time, against the same loop with no collective at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.runtime import comm

WAITS = ("host, with a timeout", "stream (autopar)")


def _wait(work, style: str) -> None:
    if style == WAITS[0]:
        work.wait(timedelta(seconds=60))
    else:
        comm.wait_work(work, "all-reduce")  # stream waits: set in main


def queued_wait_s(style: str, a: torch.Tensor, queue_ms: float, gemm_s: float) -> float:
    """Host seconds one wait takes behind ``queue_ms`` of queued GEMMs."""
    torch.cuda.synchronize()
    for _ in range(max(1, int(queue_ms / 1e3 / gemm_s))):
        a @ a
    x = torch.ones(1024, device=a.device)
    work = dist.all_reduce(x, async_op=True)
    start = time.perf_counter()
    _wait(work, style)
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    assert float(x[0]) == 1.0  # a world of one: the sum is the tensor
    return took


def loop_s(style: str | None, a: torch.Tensor, layers: int) -> float:
    """Wall seconds of ``layers`` (GEMM, all-reduce, wait); ``style`` None: no collective."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(layers):
        y = a @ a
        if style is not None:
            _wait(dist.all_reduce(y, async_op=True), style)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="the GEMMs' size (n x n, bf16)")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--queue-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("nccl_wait.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), device_id=torch.device("cuda", 0))
    comm.set_stream_waits(True)  # what ParallelMesh sets on a NCCL job
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm up cuBLAS and the communicator
        loop_s(None, a, 4)
        for style in WAITS:
            loop_s(style, a, 4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    gemm_s = (time.perf_counter() - start) / 20
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "n": args.n, "layers": args.layers, "gemm_ms": gemm_s * 1e3, "waits": {}}
    bare = statistics.median(loop_s(None, a, args.layers) for _ in range(args.rounds))
    out["loop_without_collectives_ms"] = bare * 1e3
    print(f"{out['device']}, torch {out['torch']}: one {args.n}^2 bf16 GEMM {gemm_s * 1e3:.3f} ms;"
          f" {args.layers} GEMMs alone {bare * 1e3:.2f} ms")
    for style in WAITS:
        waited = statistics.median(queued_wait_s(style, a, args.queue_ms, gemm_s)
                                   for _ in range(args.rounds))
        loop = statistics.median(loop_s(style, a, args.layers) for _ in range(args.rounds))
        out["waits"][style] = {"wait_behind_queue_ms": waited * 1e3, "loop_ms": loop * 1e3,
                               "per_collective_us": (loop - bare) / args.layers * 1e6}
        print(f"  wait on the {style}: {waited * 1e3:8.3f} ms behind {args.queue_ms:g} ms of "
              f"queued GEMMs; the loop {loop * 1e3:8.2f} ms "
              f"({(loop - bare) / args.layers * 1e6:7.1f} us per collective over the GEMMs)")
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
