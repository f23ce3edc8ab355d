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

A rank that fails on its own while its process lives on (an op raising inside its stage, out of
memory, a loss function that throws) says so before it raises (:func:`announce_failure`): it
writes its error under a key of the job's store (the default process group's, every rank's
``init_process_group`` store). A host wait that lasts longer than :data:`FAILURE_POLL_S` looks
for that key between slices of its deadline, so its peers stop with the failing rank's error
named within about a second, not at their timeout (gloo keeps a live peer's connections open,
so nothing else tells them). The key is scoped to the job's current set of process groups
(:func:`new_failure_scope`, called on every rank alike by each ``parallelize`` and where
``runtime/groups.py`` agrees on the groups), so a failure is never read by the next model. The stream waits of NCCL do not
block the host and look for nothing: there the watchdog's timeout stands. Calls with no
asynchronous form (the object collectives, ``new_group``) wait inside torch with the group's
timeout (the same value); :func:`blocking` names their failure as :func:`wait_work` does.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

from autopar.errors import CommunicationTimeoutError, error_from_parts, error_parts

__all__ = ["wait_work", "collective", "activity", "set_rank_label", "set_default_timeout",
           "default_timeout", "set_stream_waits", "stream_waits", "DEFAULT_TIMEOUT_S",
           "note_failure", "failure_count", "announce_failure", "announced_failure", "check_world",
           "new_failure_scope", "blocking", "FAILURE_POLL_S", "all_gather_bytes",
           "all_gather_object", "broadcast_bytes", "broadcast_object", "agree_on_success", "rank_device"]

#: Default timeout of every collective and p2p transfer (seconds); AUTOPAR_TIMEOUT_S overrides.
DEFAULT_TIMEOUT_S = 300.0

#: Seconds a host wait waits between looks for a peer's announced failure
#: (:func:`announced_failure`): how late a peer learns of it; one store lookup per slice.
FAILURE_POLL_S = 1.0

_state: dict[str, Any] = {"rank": "", "activity": "", "timeout": None, "failures": 0,
                          "stream_waits": False, "scope": 0}


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


def _store() -> Any:
    """The job's store (the default group's), or None outside a job."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: nothing to announce to or read
        return None


def _failure_key() -> str:
    return f"autopar/failure/{_state['scope']}"


def new_failure_scope() -> None:
    """Start a new scope for announced failures: called on every rank alike (at the start of
    every ``parallelize``, which every rank calls in the same order, and where the ranks agree
    on the process groups they use, runtime/groups.py), so a failure announced under one model
    is never read by the next."""
    _state["scope"] += 1


def announce_failure(exc: BaseException) -> None:
    """Tell the job's other ranks that this one failed with ``exc`` (see the module docstring):
    the first rank to announce in a scope is the one named; best effort, never raises."""
    store = _store()
    if store is None:
        return
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    found = [line for line in lines[1:] if line.startswith("found:")]
    during = f" during {_state['activity']}" if _state["activity"] else ""
    line = f"{_who()} failed{during}: {type(exc).__name__}: {lines[0] if lines else ''}" + \
        (f" ({found[0]})" if found else "")
    try:
        key = _failure_key()
        if store.add(f"{key}/count", 1) == 1:  # atomic: the first failure is the cause
            store.set(key, line[:500])
    except Exception:  # noqa: BLE001 - the original error is what must surface
        pass


def announced_failure() -> str | None:
    """The failure a rank of this job announced in the current scope, or None."""
    store = _store()
    if store is None:
        return None
    try:
        key = _failure_key()
        if store.check([key]):
            return bytes(store.get(key)).decode(errors="replace")
    except Exception:  # noqa: BLE001 - a store that cannot answer tells nothing
        return None
    return None


def _named(exc: BaseException, what: str, limit: timedelta) -> CommunicationTimeoutError:
    """``exc``, a failed wait on ``what``, as the named error (counted by :func:`note_failure`)."""
    note_failure()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = "timed out" in first.lower() or "timeout" in first.lower()
    during = f" during {_state['activity']}" if _state["activity"] else ""
    seconds = f"{limit.total_seconds():g} s"
    if timed_out:
        peer = announced_failure()
        if peer is not None:
            return _peer_failed(what, during, peer, seconds)
        summary = f"{_who()} timed out on {what}{during} after {seconds}"
        fix = ("a peer rank is stuck or far slower than this one: look at its log first; if "
               "the work is just slow, raise parallelize(timeout_s=...) / AUTOPAR_TIMEOUT_S")
    else:
        # a pipeline rank whose stage raised announces it, then closes its point-to-point
        # groups: its neighbour's transfer ends here, and the announcement names the cause
        peer = announced_failure()
        if peer is not None:
            return _peer_failed(what, during, peer, seconds)
        summary = f"{_who()} lost a peer on {what}{during}"
        fix = ("a peer rank crashed or was killed: its log has the cause; restart the job "
               "(from the last checkpoint)")
    return CommunicationTimeoutError(
        summary, expected=f"every rank of the group to join within {seconds}",
        found=first[:300], fix=fix)


def _peer_failed(what: str, during: str, peer: str, seconds: str) -> CommunicationTimeoutError:
    return CommunicationTimeoutError(
        f"{_who()} stopped waiting on {what}{during}: a peer failed",
        expected=f"every rank of the group to join within {seconds}", found=peer[:500],
        fix="the failing rank's error (found) is the cause: fix it there and restart the job "
            "(from the last checkpoint)")


def _is_wait_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is ``Work.wait``'s own timeout (the slice ran out, the work goes on), not
    the backend's failure of the operation."""
    return str(exc).strip().startswith("Operation timed out")


def wait_work(work: Any, what: str, timeout: timedelta | float | None = None, *,
              sliced: bool = True) -> None:
    """Wait on an async collective or p2p ``work``; a timeout, a lost peer or a peer's announced
    failure becomes a CommunicationTimeoutError naming this rank, its activity and ``what``.
    A host wait on a collective goes in slices of :data:`FAILURE_POLL_S`, looking for an
    announced failure between them (the module docstring). ``sliced=False`` for point-to-point
    transfers: gloo's send and receive take the wait's timeout as the transfer's own and fail
    it when the slice runs out (``Timed out waiting 1000ms for recv operation to complete``),
    where a collective's ``Work.wait`` only stops waiting; a failing pipeline rank closes its
    point-to-point groups instead, which ends its neighbours' transfers at once."""
    if work is None:
        return
    limit = _as_timedelta(timeout) if timeout is not None else default_timeout()
    try:
        if _state["stream_waits"]:
            work.wait()  # the group's own timeout (the same value) is its watchdog's
            return
        if not sliced:
            work.wait(limit)
            return
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            left = deadline - time.monotonic()
            if left <= FAILURE_POLL_S:
                work.wait(timedelta(seconds=max(left, 1e-3)))
                return
            try:
                work.wait(timedelta(seconds=FAILURE_POLL_S))
                return
            except RuntimeError as exc:
                if not _is_wait_timeout(exc):
                    raise
            peer = announced_failure()
            if peer is not None:
                note_failure()
                during = f" during {_state['activity']}" if _state["activity"] else ""
                raise _peer_failed(what, during, peer, f"{limit.total_seconds():g} s")
    except RuntimeError as exc:  # DistBackendError is a RuntimeError
        raise _named(exc, what, limit) from exc


@contextlib.contextmanager
def blocking(what: str, timeout: timedelta | float | None = None) -> Iterator[None]:
    """Around a ``torch.distributed`` call that has no asynchronous form and waits inside torch
    with its group's timeout (``all_gather_object``, ``broadcast_object_list``, ``new_group``):
    its failure named as :func:`wait_work` names one."""
    limit = _as_timedelta(timeout) if timeout is not None else default_timeout()
    try:
        yield
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's errors
        raise _named(exc, what, limit) from exc


def collective(fn: Callable[..., Any], *args: Any, what: str,
               timeout: timedelta | float | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, async_op=True, **kwargs)`` (a torch.distributed collective) and wait on it
    with :func:`wait_work`; returns what ``fn`` returned."""
    work = fn(*args, async_op=True, **kwargs)
    try:
        wait_work(work, what, timeout)
    except CommunicationTimeoutError:
        import torch.distributed as dist

        if kwargs.get("group") in (None, dist.group.WORLD):
            _state["world_failed"] = what
        raise
    return work


def check_world() -> None:
    """Refuse to start collectives on the default process group after one of its collectives
    failed in this process (:func:`collective`: a peer failed or timed out while this rank
    waited): torch.distributed cannot cancel an operation, so the unfinished one would pair
    with the next (gloo aborts the process on the size mismatch, or hands one collective's
    bytes to another). Called where every model starts (``parallelize``)."""
    what = _state.get("world_failed")
    if what:
        raise CommunicationTimeoutError(
            f"{_who()} cannot start another model: its default process group holds an "
            f"unfinished collective ({what}, which failed earlier in this process)",
            expected="a default process group whose collectives all completed",
            found=f"{what} failed", fix="restart the job, every rank: the failure named "
                                        "before is the cause")


# -- small objects, waited as every collective is ----------------------------------------------
# torch's object collectives (all_gather_object, broadcast_object_list) have no asynchronous
# form: they wait inside torch, with the group's timeout and torch's error. These carry the
# same bytes over two tensor collectives each (the lengths, then the padded bytes), waited here.

def rank_device() -> Any:
    """This rank's device: its GPU under NCCL, else the CPU (what its collectives carry)."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, what: str, timeout: timedelta | float | None = None
                     ) -> list[bytes]:
    """Every rank's ``data``, in rank order (collective over the world)."""
    import torch
    import torch.distributed as dist

    device = rank_device()
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    collective(dist.all_gather, sizes, torch.tensor([len(data)], dtype=torch.int64,
                                                    device=device), what=what, timeout=timeout)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return [b""] * world
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    collective(dist.all_gather, bufs, buf, what=what, timeout=timeout)
    return [bytes(b[:int(n.item())].cpu().numpy().tobytes()) for b, n in zip(bufs, sizes)]


def all_gather_object(obj: Any, what: str, timeout: timedelta | float | None = None
                      ) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (collective over the world)."""
    return [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(obj), what, timeout)]


def broadcast_bytes(data: bytes, src: int, what: str,
                    timeout: timedelta | float | None = None) -> bytes:
    """Rank ``src``'s ``data`` on every rank (collective over the world; the others' ``data``
    is ignored)."""
    import torch
    import torch.distributed as dist

    device = rank_device()
    mine = dist.get_rank() == src
    size = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=device)
    collective(dist.broadcast, size, src=src, what=what, timeout=timeout)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if mine and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    collective(dist.broadcast, buf, src=src, what=what, timeout=timeout)
    return bytes(buf.cpu().numpy().tobytes())


def broadcast_object(obj: Any, src: int, what: str,
                     timeout: timedelta | float | None = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (collective over the world; the others'
    ``obj`` is ignored)."""
    import torch.distributed as dist

    data = pickle.dumps(obj) if dist.get_rank() == src else b""
    return pickle.loads(broadcast_bytes(data, src, what, timeout))


def agree_on_success(error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
    """Every rank tells every other whether its part ``what`` (e.g. "building its program")
    succeeded, before the collectives that come after it, and hands on a picklable
    ``payload``. A rank that failed raises its own error; every other rank raises the first
    failed rank's (same class, same message, naming that rank), at once rather than at the
    timeout of a collective the failed rank never joins. Returns every rank's ``payload``."""
    mine = (None if error is None else error_parts(error), payload)
    gathered = all_gather_object(mine, f"the all-gather of every rank's outcome of {what}")
    failed = [(rank, parts) for rank, (parts, _) in enumerate(gathered) if parts is not None]
    if failed:
        if error is not None:
            raise error
        rank, parts = failed[0]
        others = f" (and rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        parts = {**parts, "summary": f"rank {rank}{others} failed {what}: {parts['summary']}"}
        raise error_from_parts(**parts)
    return [p for _, p in gathered]
