"""A pool of local processes sharing one process group, for tests, benchmarks and verification.

Starting a process group costs seconds (interpreter, torch import, rendezvous); tests run dozens of
configurations. ``LocalPool(world_size)`` starts the processes once (gloo by default, ``file://``
rendezvous, one CPU thread each) and runs many jobs in them::

    with LocalPool(4) as pool:
        results = pool.run(my_module.train_and_compare, tp=2, pp=2)   # one result per rank

``fn`` must be importable by name (a module-level function) so the workers can unpickle it. Every
job has a timeout; a job that fails on one rank while others wait in a collective, or that hangs,
gets the workers killed and a :class:`~autopar.errors.CommunicationTimeoutError` (or the first
rank's exception) raised here. When a worker dies mid-job, the survivors get ``death_grace_s``
to report what they saw (their own errors, e.g. a CommunicationTimeoutError naming the lost
peer), which the raised :class:`RemoteError` carries. The pool then restarts on its next job.
A result is pickled by the job's own process, so one that cannot be sent back (unpicklable, or
too many tensors to share by file descriptor) is a :class:`RemoteError` too. Never a hang.

The workers are forked from Python's forkserver, which imports torch and autopar once per parent
process (:data:`PRELOAD`): a new pool of 4 starts in ~0.1 s instead of ~4.5 s of four spawned
interpreters each importing torch on two cores, so tests can give each configuration family its
own pool. A worker still starts clean: the server only imported (forking after ``import torch`` is
what DataLoader's workers do) and never touched CUDA or a process group, the parent's main module
is imported anew in each worker, and the parent's environment is copied in.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch.multiprocessing as mp

from autopar.errors import AutoparError, CommunicationTimeoutError

__all__ = ["LocalPool", "RemoteError"]


class RemoteError(AutoparError):
    """A job raised on a worker rank; the message holds that rank's traceback."""


def _worker(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float,
            tasks: "mp.Queue", results: "mp.Queue", env: dict[str, str]) -> None:
    # the parent's environment as it is now (a forkserver child has the server's, from when it
    # started), with the pool's additions
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    results.put(("ready", rank, None, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = pickle.loads(task)
        what = ""
        try:
            out = fn(*args, **kwargs)
            # pickled here rather than by the queue's feeder thread, which prints its errors
            # (too many tensors shared by file descriptor: "Too many open files") and drops
            # the message, leaving the parent to wait for its timeout
            what = "its result could not be sent back (return fewer tensors per job): "
            sent = bytes(ForkingPickler.dumps(out))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            results.put((task_id, rank, "error",
                         f"{what}{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        else:
            results.put((task_id, rank, "ok", sent))
    dist.destroy_process_group()


#: What a pool's processes are forked with already imported (the forkserver imports them once per
#: parent process): torch and autopar take ~2 s of CPU to import, which each spawned worker
#: repeated, 4.5 s to start a pool of 4 on two cores. Dynamo (0.6 s) is what every capture
#: imports on its first ``torch.export``. More modules (a caller's model libraries: importing
#: transformers and one model family's module takes ~1.5 s per worker) come from the
#: comma-separated :data:`PRELOAD_ENV`, read when the first pool of the process starts.
PRELOAD = ["torch", "torch.distributed", "autopar", "torch._dynamo", "torch.export"]
PRELOAD_ENV = "AUTOPAR_POOL_PRELOAD"


def _preload() -> list[str]:
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    return PRELOAD + [m for m in extra if m not in PRELOAD]


def _context() -> Any:
    """Workers forked from a server that preloaded :data:`PRELOAD` and the modules named in
    :data:`PRELOAD_ENV` (``forkserver``, where the platform has it; a module that does not
    import is skipped there and imported by the worker that needs it), else spawned. Either way
    each starts clean: a fresh CUDA state, no inherited threads or process groups, the parent's
    main module imported anew."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        return ctx
    return mp.get_context("spawn")


class LocalPool:
    """``world_size`` local processes in one process group, reused across jobs."""

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 120.0,
                 collective_timeout_s: float | None = None, env: dict[str, str] | None = None,
                 death_grace_s: float = 10.0) -> None:
        if not 1 <= world_size <= 64:
            raise ValueError(f"world_size must be in 1..64, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.collective_timeout_s = collective_timeout_s or timeout_s
        self.death_grace_s = death_grace_s
        self.env = {"AUTOPAR_TIMEOUT_S": str(self.collective_timeout_s), **(env or {})}
        self._procs: list[Any] = []
        self._ids = itertools.count()
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "LocalPool":
        if self._procs:
            return self
        ctx = _context()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="autopar-pool-")
        init = f"file://{os.path.join(self._tmpdir.name, 'rendezvous')}"
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, init, self.backend,
                                         self.collective_timeout_s, self._tasks[r], self._results,
                                         {**os.environ, **self.env}))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        ready: set[int] = set()
        deadline = time.monotonic() + max(self.timeout_s, 120.0)
        while len(ready) < self.world_size:
            msg = self._get(deadline)
            if msg is None:
                self._fail("start the process group", ready)
            if msg[0] == "ready":
                ready.add(msg[1])
        return self

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        self.start()
        task_id = next(self._ids)
        for q in self._tasks:
            # pickled here, one rank after the other, not by the queues' feeder threads: those run
            # concurrently, and pickling a GraphModule recompiles its code, which races (fx's
            # codegen renames the graph's nodes in place) and can hand a rank broken code.
            # One pickle per rank, since a shared tensor's file descriptor is sent only once.
            q.put(bytes(ForkingPickler.dumps((task_id, fn, args, kwargs))))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        name = getattr(fn, "__name__", str(fn))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        dead: list[int] = []
        while len(results) + len(errors) + len(dead) < self.world_size:
            if errors:  # one rank failed: the others get a short while to fail or finish too
                deadline = min(deadline, time.monotonic() + 10.0)
            msg = self._get(deadline, stop_on_death=not errors and not dead)
            if msg is None:
                now_dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if now_dead and not dead:  # the survivors may still report what they saw
                    dead = now_dead
                    deadline = min(deadline, time.monotonic() + self.death_grace_s)
                    continue
                if errors or dead:
                    break
                self._fail(f"run {name}", set(results))
            tid, rank, status, payload = msg
            if tid != task_id:
                continue
            if status != "ok":
                errors[rank] = payload
                continue
            try:
                results[rank] = pickle.loads(payload)
            except Exception as exc:  # noqa: BLE001 - e.g. out of file descriptors here
                errors[rank] = (f"its result could not be received: {type(exc).__name__}: "
                                f"{exc}\n{traceback.format_exc()}")
        if dead:
            dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
            self.kill()
            if not errors:
                raise CommunicationTimeoutError(
                    f"local pool could not run {name}: rank(s) {dead} died",
                    expected=f"all {self.world_size} ranks to answer",
                    found=f"rank(s) {sorted(set(range(self.world_size)) - set(results))} silent",
                    fix="look for a rank that crashed (its exit code, its log)")
            first = min(errors)
            raise RemoteError(f"{name}: rank(s) {dead} died; the others raised, rank(s) "
                              f"{sorted(errors)}; rank {first}:\n{errors[first]}",
                              found="\n".join(f"rank {r}: {errors[r].splitlines()[0]}"
                                               for r in sorted(errors)))
        if errors:
            first = min(errors)
            if len(results) + len(errors) < self.world_size:
                self.kill()  # the silent ranks are stuck in a collective with the failed one
            raise RemoteError(f"{name} failed on rank(s) {sorted(errors)}; rank {first}:\n"
                              f"{errors[first]}")
        return [results[r] for r in range(self.world_size)]

    def _get(self, deadline: float, stop_on_death: bool = True):
        """The next message from the workers; None on timeout or when a worker died."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if stop_on_death and any(not p.is_alive() for p in self._procs):
                return None
            try:
                return self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue

    def _fail(self, what: str, answered: set[int]) -> None:
        dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
        silent = sorted(set(range(self.world_size)) - answered)
        self.kill()
        reason = f"rank(s) {dead} died" if dead else "no answer within the timeout"
        raise CommunicationTimeoutError(
            f"local pool could not {what}: {reason}",
            expected=f"all {self.world_size} ranks to answer",
            found=f"rank(s) {silent} silent",
            fix="look for a rank that raised or a collective the ranks do not all call")
