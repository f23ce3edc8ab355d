"""Optimizer state offloaded to files (``Plan.offload = "disk"``; ZeRO-Infinity's NVMe path,
Rajbhandari et al. 2021), paged in per bucket for its step and written back after it.

The element-wise state of every optimizer piece (Adam's two moments: 8 bytes per parameter in
fp32, the largest part of training memory after mixed precision's master weights) lives in one
file per bucket under ``<directory>/rank<r>-<pid>/``. The step walks the buckets in order: it
waits for bucket k's state (read while bucket k - 1 stepped), starts reading bucket k + 1's,
steps bucket k alone (the other pieces have no gradient, so ``torch.optim`` skips them), and hands
its state to a writer thread, which drops it once written. At most three buckets' state are in
memory at once (the one stepping, the one read ahead, the one being written), whatever the
model's size. Scalar state (Adam's step counts) stays in memory. File reads and writes release
the GIL, so they overlap the step's arithmetic.

The numbers are those of the step in memory: the same element-wise update on the same values,
bucket by bucket instead of all at once (``tests/test_offload.py``).

Bad storage is an :class:`~autopar.errors.OffloadError` with the directory, what it needs and how
to fix it: a directory that cannot be created or written is found at construction (before any
training); a disk that fills up is found before the first write (the bytes needed against
``shutil.disk_usage``) or, when a write fails anyway, at that step, with the partial file removed.
These files are scratch, never a checkpoint (``ParallelModel.save`` pages the state in and
writes a DCP checkpoint as without offload); they are removed by :meth:`StatePager.close`.
"""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from autopar.errors import OffloadError

__all__ = ["StatePager", "state_directory"]


#: Each state tensor starts at a multiple of this many bytes in its bucket's file.
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class _Entry:
    """One state tensor of one optimizer piece inside its bucket's file."""

    piece: int  # index into the bucket's pieces
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _fix(directory: Path) -> str:
    return (f"give parallelize(offload_dir=...) a writable directory on a disk with room for "
            f"the optimizer state (8 bytes per parameter for Adam), or plan without "
            f"offload=\"disk\" (now: {directory}); a run stopped by this error resumes from its "
            f"last checkpoint (ParallelModel.save)")


def state_directory(directory: str | os.PathLike, rank: int, *, keep: bool = True) -> Path:
    """This process's folder under ``directory``, created and probed with a written, synced
    file (removed again unless ``keep``): an :class:`OffloadError` when it cannot be.
    ``parallelize`` probes it while each rank builds its program, so a rank whose disk refuses
    stops every rank at once."""
    base = Path(directory)
    root = base / f"rank{rank}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".probe"
        with open(probe, "wb") as fh:
            fh.write(b"autopar")
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as exc:
        raise OffloadError("the offload directory cannot be written",
                           expected="a directory this process can create files in",
                           found=f"{base}: {exc.strerror or exc}", fix=_fix(base)) from None
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return root


class StatePager:
    """Pages the element-wise optimizer state of ``buckets`` to files under ``directory``."""

    def __init__(self, directory: str | os.PathLike, rank: int, optimizer: torch.optim.Optimizer,
                 buckets: Sequence[Any]) -> None:
        self.optimizer = optimizer
        self.buckets = [b for b in buckets if b.requires_grad and b.pieces]
        self.root = state_directory(directory, rank)
        self._index: dict[int, list[_Entry]] = {}  # bucket index -> its file's entries
        self._on_disk: set[int] = set()
        self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-offload-read")
        self._writes = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix="autopar-offload-write")
        self._pending: dict[int, Future] = {}  # bucket index -> its write in flight
        self._checked = False
        #: Bytes written and read since construction (diagnostics).
        self.bytes_written = 0
        self.bytes_read = 0

    # -- files ----------------------------------------------------------------------------------
    def _path(self, bucket: Any) -> Path:
        return self.root / f"bucket{bucket.index}.bin"

    def _tensors(self, bucket: Any) -> list[tuple[int, str, torch.Tensor]]:
        """The element-wise state tensors of ``bucket``'s pieces (those shaped like the piece)."""
        out = []
        for i, (_, piece, _, _) in enumerate(bucket.pieces):
            for name, value in self.optimizer.state.get(piece, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == piece.shape \
                        and value.numel() > 0:
                    out.append((i, name, value))
        return out

    def _write(self, bucket: Any, tensors: list[tuple[int, str, torch.Tensor]]) -> None:
        path = self._path(bucket)
        entries, offset = [], 0
        for i, name, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(_Entry(i, name, tuple(t.shape), t.dtype, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN  # every tensor aligned in the file
        try:
            with open(path, "wb") as fh:
                for e, (_, _, t) in zip(entries, tensors):
                    fh.seek(e.offset)
                    fh.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)
                fh.truncate(offset)
        except OSError as exc:
            path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise OffloadError("the offload directory is full",
                                   expected=f"{offset} bytes free for bucket {bucket.index}'s "
                                            f"optimizer state",
                                   found=f"{self.root}: no space left on the device",
                                   fix=_fix(self.root.parent)) from None
            raise OffloadError("the optimizer state could not be written",
                               found=f"{path}: {exc.strerror or exc}",
                               fix=_fix(self.root.parent)) from None
        self._index[bucket.index] = entries
        self.bytes_written += offset

    def _read(self, bucket: Any) -> list[tuple[_Entry, torch.Tensor]]:
        """The bucket's file in one buffer (one allocation: large enough for the C allocator to
        map it on its own and give it back to the OS when it is freed, where many tensor-sized
        ones would stay in its heap) and its state tensors as views of it."""
        entries = self._index.get(bucket.index, [])
        if not entries:
            return []
        size = self._path(bucket).stat().st_size
        buf = torch.empty(size, dtype=torch.uint8)
        with open(self._path(bucket), "rb") as fh:
            fh.readinto(buf.numpy().data)
        out = []
        for e in entries:
            t = buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            out.append((e, t.to(bucket.master_device)))
        self.bytes_read += size
        return out

    # -- paging ---------------------------------------------------------------------------------
    def _check_room(self, tensors: list[tuple[int, str, torch.Tensor]], bucket: Any) -> None:
        """Before the first write: the disk must hold every bucket's state, estimated from the
        first bucket's bytes per element (an element-wise optimizer keeps the same state for
        every element): an OffloadError before anything is written."""
        per_element = sum(t.numel() * t.element_size() for _, _, t in tensors) / max(
            1, sum(p.numel() for _, p, _, _ in bucket.pieces))
        need = int(per_element * sum(p.numel() for b in self.buckets for _, p, _, _ in b.pieces))
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise OffloadError("the offload directory is too small for the optimizer state",
                               expected=f"{need} bytes free", found=f"{self.root}: {free} bytes "
                                                                    f"free", fix=_fix(self.root.parent))

    def page_out(self, bucket: Any) -> None:
        """Hand ``bucket``'s state to the writer; the optimizer keeps empty placeholders."""
        tensors = self._tensors(bucket)
        if not tensors:
            return
        if not self._checked:
            self._check_room(tensors, bucket)
            self._checked = True
        pieces = bucket.pieces
        for i, name, _ in tensors:
            self.optimizer.state[pieces[i][1]][name] = torch.empty(0)
        self._on_disk.add(bucket.index)
        self._pending[bucket.index] = self._writes.submit(self._write, bucket, tensors)

    def read_ahead(self, bucket: Any) -> Future | None:
        """Start reading ``bucket``'s state, once its own write (if still in flight) is done."""
        if bucket.index not in self._on_disk:
            return None
        write = self._pending.pop(bucket.index, None)
        if write is not None:
            write.result()
        return self._reads.submit(self._read, bucket)

    def install(self, bucket: Any, read: Future | None) -> None:
        """Put ``bucket``'s state read by :meth:`read_ahead` back into the optimizer."""
        if read is None:
            return
        for e, t in read.result():
            self.optimizer.state[bucket.pieces[e.piece][1]][e.name] = t
        self._on_disk.discard(bucket.index)

    def wait_writes(self) -> None:
        pending, self._pending = self._pending, {}
        for f in pending.values():
            f.result()  # re-raises the writer's OffloadError here, at this step

    def page_in_all(self) -> None:
        """Every bucket's state back in memory (a checkpoint reads or replaces it)."""
        for b in self.buckets:
            self.install(b, self.read_ahead(b))

    def page_out_all(self) -> None:
        for b in self.buckets:
            self.page_out(b)
        self.wait_writes()

    def on_disk_bytes(self) -> int:
        return sum(e.nbytes for k in self._on_disk for e in self._index.get(k, []))

    def close(self) -> None:
        """Wait for the writer, stop the threads and remove the files."""
        try:
            self.wait_writes()
        finally:
            self._reads.shutdown(wait=True)
            self._writes.shutdown(wait=True)
            shutil.rmtree(self.root, ignore_errors=True)
