"""autopar.solver's process-wide side effects."""

from __future__ import annotations

import os
import threading

import pytest


def test_first_backend_calls_on_many_threads_leave_stdout_where_it_was():
    """The first ``backend()`` points file descriptor 1 at /dev/null while HiGHS prints its
    banner. The layout search calls it from several threads at once; unguarded, one thread
    could save another's /dev/null and restore it, silencing the process's stdout for good
    (seen: ``autopar plan --json`` printed nothing)."""
    pytest.importorskip("highspy")
    from autopar import solver

    before = os.fstat(1)
    saved = solver._HIGHS
    try:
        for _ in range(20):
            solver._HIGHS = None
            start = threading.Barrier(8)

            def first_call() -> None:
                start.wait(timeout=30)
                solver.backend()

            threads = [threading.Thread(target=first_call) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            after = os.fstat(1)
            assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino), \
                "stdout left pointing elsewhere"
    finally:
        solver._HIGHS = saved
