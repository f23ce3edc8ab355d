"""The README's main-job command: `autopar demo` plans, trains on 4 ranks and agrees with the
single-process run (a shorter run than the default, to keep the suite fast)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_demo_trains_and_agrees():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "demo", "--steps", "10"],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "plan chosen by autopar" in out and "agrees" in out and "DISAGREES" not in out
    assert "step time: predicted" in out
    assert elapsed < 180, elapsed
