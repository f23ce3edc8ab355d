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
never a hang. (NCCL: ``work.wait`` returns once the kernel is queued; a stuck NCCL collective is
caught by the process group's own timeout, set to the same value, whose watchdog aborts the
process.)
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator

from autopar.errors import CommunicationTimeoutError

__all__ = ["wait_work", "collective", "activity", "set_rank_label", "set_default_timeout",
           "default_timeout", "DEFAULT_TIMEOUT_S", "note_failure", "failure_count"]

#: Default timeout of every collective and p2p transfer (seconds); AUTOPAR_TIMEOUT_S overrides.
DEFAULT_TIMEOUT_S = 300.0

_state: dict[str, Any] = {"rank": "", "activity": "", "timeout": None, "failures": 0}


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
