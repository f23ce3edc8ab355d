"""The README's main-job command as it stands (`./dev demo` runs `autopar demo` with its
defaults): it plans, trains on 4 ranks, agrees with the single-process run, and finishes within
3 minutes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


def test_demo_prices_on_the_cluster_it_is_given(monkeypatch):
    """``autopar demo --cluster FILE`` reaches parallelize's cluster (the demo's own pricing of
    a calibrated host); without it the demo uses the cpu preset (None)."""
    import autopar.demo
    from autopar.cli import main

    seen = []
    monkeypatch.setattr(autopar.demo, "run_demo",
                        lambda cfg: seen.append(cfg) or {"agrees": True})
    assert main(["demo", "--cluster", "host.json", "--steps", "3"]) == 0
    assert main(["demo"]) == 0
    assert seen[0].cluster == "host.json" and seen[0].steps == 3 and seen[1].cluster is None


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_trains_and_agrees():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "demo"],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "plan chosen by autopar" in out and "agrees" in out and "DISAGREES" not in out
    assert "step time: predicted" in out
    assert elapsed < 180, elapsed
