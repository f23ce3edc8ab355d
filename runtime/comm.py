"""Waiting on collectives with a deadline, and saying who waited on what.

Every collective and point-to-point transfer autopar issues is started asynchronously and waited
here (:func:`wait_work`, or :func:`collective` for both at once), with a timeout: the mesh's
(``parallelize(timeout_s=...)``, ``AUTOPAR_TIMEOUT_S``, default 300 s) unless the caller gives
one. A peer that never joins (stuck, or much slower than the timeout) or that is gone (crashed,
killed) makes the wait fail; the failure becomes a
:class:`~autopar.errors.CommunicationTimeoutError` naming

- this rank and its (dp, pp, tp) coordinates (set once by :class:`ParallelMesh`),
- what it was doing (the pipeline stage and micro-batch, the optimizer step...: set by the step
  driver through :func:`activity`),
- the collective and its tensor.

So every rank of a job whose peer died or hangs exits with a named error within the timeout,
never a hang.

NCCL is waited on the stream, not on the host (:func:`set_stream_waits`, which
:class:`~autopar.runtime.mesh.ParallelMesh` turns on when the job's backend is NCCL): ``wait_work``
calls ``work.wait()`` with no timeout, which orders the current CUDA stream after the collective
and returns at once, so the host keeps queueing kernels while the collective runs, as
Megatron-LM's and torchtitan's collectives do. Given a timeout, ``ProcessGroupNCCL``'s
``wait`` instead blocks the host until the collective has *finished*, polling every millisecond
(pytorch/pytorch#100162, torch >= 2.1: ``if (blockingWait_ || timeout != kNoTimeout)`` in
``WorkNCCL::synchronizeInternal``): every tensor-parallel all-reduce, pipeline receive and
ZeRO gather would then drain the GPU's queue and leave it idle while the host launches the next
kernels. A stuck NCCL collective is caught by the process group's own timeout, set to the same
value (runtime/mesh.py), whose watchdog aborts the process; with ``TORCH_NCCL_BLOCKING_WAIT=1``
torch's ``wait`` blocks the host and raises at that timeout instead, which :func:`wait_work` turns
into the named error (the price: the host-blocking waits above).
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator

from autopar.errors import CommunicationTimeoutError

__all__ = ["wait_work", "collective", "activity", "set_rank_label", "set_default_timeout",
           "default_timeout", "set_stream_waits", "stream_waits", "DEFAULT_TIMEOUT_S",
           "note_failure", "failure_count"]

#: Default timeout of every collective and p2p transfer (seconds); AUTOPAR_TIMEOUT_S overrides.
DEFAULT_TIMEOUT_S = 300.0

_state: dict[str, Any] = {"rank": "", "activity": "", "timeout": None, "failures": 0,
                          "stream_waits": False}


def note_failure() -> None:
    """Count a failed transfer or collective of this process (a wait that timed out or lost a
    peer, an executor shut down): a group that saw one may hold a half-finished operation, so
    the shared groups (runtime/groups.py) are not reused after it."""
    _state["failures"] += 1


def failure_count() -> int:
    """Failed transfers and collectives this process has seen (:func:`note_failure`)."""
    return int(_state["failures"])


def default_timeout() -> timedelta:
    """The timeout set by :func:`set_default_timeout` (parallelize's ``timeout_s``), else
    ``AUTOPAR_TIMEOUT_S``, else 300 s."""
    if _state["timeout"] is not None:
        return _state["timeout"]
    return timedelta(seconds=float(os.environ.get("AUTOPAR_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


def set_default_timeout(timeout: timedelta | float | None) -> None:
    _state["timeout"] = _as_timedelta(timeout) if timeout is not None else None


def set_stream_waits(on: bool) -> None:
    """Wait on collectives by ordering the current stream after them (``work.wait()``, no
    timeout: NCCL's asynchronous wait) rather than by blocking the host until they finish
    (``work.wait(timeout)``: what gloo, whose collectives run on the host, needs for a
    deadline). See the module docstring."""
    _state["stream_waits"] = bool(on)


def stream_waits() -> bool:
    """Whether :func:`wait_work` waits on the stream (:func:`set_stream_waits`)."""
    return bool(_state["stream_waits"])


def set_rank_label(label: str) -> None:
    """How errors name this process, e.g. ``"rank 3 (dp 1, pp 0, tp 1)"``."""
    _state["rank"] = label


@contextlib.contextmanager
def activity(text: str) -> Iterator[None]:
    """Errors raised inside say that this rank was doing ``text`` (nested: the innermost)."""
    before = _state["activity"]
    _state["activity"] = text
    try:
        yield
    finally:
        _state["activity"] = before


def set_activity(text: str) -> None:
    """Like :func:`activity`, for callers that mark phases without a block (a stage hook)."""
    _state["activity"] = text


def _as_timedelta(timeout: timedelta | float) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def _who() -> str:
    if _state["rank"]:
        return _state["rank"]
    try:
        import torch.distributed as dist

        return f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"
    except Exception:  # noqa: BLE001 - naming must never fail
        return "this process"


def wait_work(work: Any, what: str, timeout: timedelta | float | None = None) -> None:
    """Wait on an async collective or p2p ``work``; a timeout or a lost peer becomes a
    CommunicationTimeoutError naming this rank, its activity and ``what``."""
    if work is None:
        return
    limit = _as_timedelta(timeout) if timeout is not None else default_timeout()
    try:
        if _state["stream_waits"]:
            work.wait()  # the group's own timeout (the same value) is its watchdog's
        else:
            work.wait(limit)
    except RuntimeError as exc:  # DistBackendError is a RuntimeError
        note_failure()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timed out" in first.lower() or "timeout" in first.lower()
        during = f" during {_state['activity']}" if _state["activity"] else ""
        seconds = f"{limit.total_seconds():g} s"
        if timed_out:
            summary = f"{_who()} timed out on {what}{during} after {seconds}"
            fix = ("a peer rank is stuck or far slower than this one: look at its log first; if "
                   "the work is just slow, raise parallelize(timeout_s=...) / AUTOPAR_TIMEOUT_S")
        else:
            summary = f"{_who()} lost a peer on {what}{during}"
            fix = ("a peer rank crashed or was killed: its log has the cause; restart the job "
                   "(from the last checkpoint)")
        raise CommunicationTimeoutError(
            summary, expected=f"every rank of the group to join within {seconds}",
            found=first[:300], fix=fix) from exc


def collective(fn: Callable[..., Any], *args: Any, what: str,
               timeout: timedelta | float | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, async_op=True, **kwargs)`` (a torch.distributed collective) and wait on it
    with :func:`wait_work`; returns what ``fn`` returned."""
    work = fn(*args, async_op=True, **kwargs)
    wait_work(work, what, timeout)
    return work
