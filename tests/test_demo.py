"""The README's main-job command as it stands (`./dev demo` runs `autopar demo` with its
defaults): it plans, trains on 4 ranks, agrees with the single-process run, and finishes within
3 minutes."""

from __future__ import annotations

import os
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
    assert seen[0].cluster == "host.json" and seen[0].steps == 3
    assert seen[1].cluster is None  # this machine, calibrated on first use (below)


def test_host_calibration_is_measured_once_and_kept(tmp_path, monkeypatch):
    """The demo's pricing: this host's quick calibration, measured on first use, read back
    later; a file that does not load (torn, older format) is measured again; another torch
    version is another host."""
    import torch

    from autopar import Cluster
    from autopar.planner import calibration, calibration_cache, calibration_host

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    runs, said = [], []

    def fake(world, quick):
        runs.append((world, quick))
        return Cluster.load("cpu"), {}

    monkeypatch.setattr(calibration, "calibrate_cluster", fake)
    monkeypatch.setattr(calibration_host, "speed_probe", lambda: 0.01)  # the host keeps its speed
    path = calibration_cache.host_calibration(say=said.append)
    assert runs == [(2, True)] and len(said) == 1 and path in said[0]
    assert path.startswith(str(tmp_path / "cache")) and Cluster.load(path) == Cluster.load("cpu")
    assert calibration_cache.host_calibration(say=said.append) == path and len(runs) == 1
    with open(path, "w") as fh:
        fh.write("{not json")
    assert calibration_cache.host_calibration() == path and len(runs) == 2
    assert Cluster.load(path).name == "cpu"
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert calibration_cache.host_calibration() != path and len(runs) == 3


def test_host_calibration_is_measured_again_when_the_host_changed_speed(tmp_path, monkeypatch):
    """Beside the cached calibration, a speed probe: a later call within DRIFT_TOLERANCE of it
    keeps the file; beyond it (either way) measures again, saying why; a file kept without a
    probe takes today's as its reference."""
    import os

    from autopar import Cluster
    from autopar.planner import calibration, calibration_cache, calibration_host

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    runs, said, speed = [], [], [0.010]
    monkeypatch.setattr(calibration, "calibrate_cluster",
                        lambda world, quick: (runs.append(world), (Cluster.load("cpu"), {}))[1])
    monkeypatch.setattr(calibration_host, "speed_probe", lambda: speed[0])
    path = calibration_cache.host_calibration(say=said.append)
    assert len(runs) == 1 and os.path.exists(path + ".probe.json")
    tolerance = calibration_cache.DRIFT_TOLERANCE
    speed[0] = 0.010 * (1 + tolerance / 2)  # noise: kept
    assert calibration_cache.host_calibration(say=said.append) == path and len(runs) == 1
    speed[0] = 0.010 * (1 + 2 * tolerance)  # a slower day: measured again
    assert calibration_cache.host_calibration(say=said.append) == path and len(runs) == 2
    assert "slower than when it was calibrated" in said[-1]
    speed[0] = 0.010 * (1 + 2 * tolerance) / (1 + 2 * tolerance) ** 2  # faster: again
    assert calibration_cache.host_calibration(say=said.append) == path and len(runs) == 3
    assert "faster than when it was calibrated" in said[-1]
    os.remove(path + ".probe.json")  # kept before probes: today's speed becomes the reference
    speed[0] = 1.0
    assert calibration_cache.host_calibration(say=said.append) == path and len(runs) == 3
    assert calibration_cache.host_calibration(say=said.append) == path and len(runs) == 3


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_trains_and_agrees(quick_calibration, tmp_path):
    """`autopar demo` as the README runs it, on a host whose quick calibration is cached (the
    session's, placed where the demo looks for this host's)."""
    import shutil

    from autopar.planner import calibration_cache

    env = {**os.environ, "AUTOPAR_CACHE_DIR": str(tmp_path)}
    cached = tmp_path / f"host-{calibration_cache.host_key()}-w2.json"
    shutil.copy(quick_calibration, cached)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "demo"],
                          capture_output=True, text=True, timeout=300, env=env)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "plan chosen by autopar" in out and "agrees" in out and "DISAGREES" not in out
    assert "step time: predicted" in out and "calibrating" not in out
    assert "this machine's quick calibration" in " ".join(out.split())
    assert elapsed < 180, elapsed
