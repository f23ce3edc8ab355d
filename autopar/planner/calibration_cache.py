"""This host's calibration, measured once and kept: what ``autopar demo`` prices its plan on.

A committed preset describes the machine it was measured on; on another one (or the same VM
type on a slower day) its figures can be off by 2x. ``host_calibration()`` runs
``autopar calibrate --quick --world 2`` (:func:`autopar.planner.calibration.calibrate_cluster`,
about a minute on 2 cores) the first time it is asked on a host, writes the cluster file to the
cache directory and returns its path; later calls return the file. The file is keyed by what
its figures depend on (host name, CPU count, torch and autopar versions), so a new torch or a
resized VM measures again; deleting the file does too.

The same host is not always as fast: a shared VM's cores ran ~20% slower one day than the day
before, and a plan priced on the old figures came out 30% fast. Beside the file, a speed probe
(:func:`autopar.planner.calibration_host.speed_probe`, a third of a second) is kept; each later call
probes again and measures the whole calibration again when the host's speed moved by more than
``DRIFT_TOLERANCE``.

The cache directory is ``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else
``~/.cache/autopar``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Callable

__all__ = ["cache_dir", "host_key", "host_calibration", "DRIFT_TOLERANCE"]

#: Relative change of the speed probe beyond which the cached calibration is measured again:
#: above the probe's own spread on this repository's 2-core VM (medians of 21 runs spanned
#: 10.6-13.8 ms within a minute), below the ~30% a slower day cost the demo's prediction.
DRIFT_TOLERANCE = 0.2


def cache_dir() -> str:
    """Where autopar keeps per-host measurements."""
    explicit = os.environ.get("AUTOPAR_CACHE_DIR")
    if explicit:
        return explicit
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "autopar")


def host_key() -> str:
    """A short name for this host's measurements: host name, CPU count, torch and autopar
    versions (what a calibration's figures depend on)."""
    import torch

    from autopar import __version__

    text = "|".join((platform.node(), platform.machine(), str(os.cpu_count()),
                     torch.__version__, __version__))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def host_calibration(*, say: Callable[[str], None] | None = None, world: int = 2) -> str:
    """The path of this host's cached quick calibration (``world`` gloo processes), measured
    now if there is none, it does not load, or the host's speed moved by more than
    ``DRIFT_TOLERANCE`` since (its speed probe); ``say`` is told why before a measurement."""
    from autopar.cluster import Cluster
    from autopar.errors import ClusterSpecError
    from autopar.planner import calibration, calibration_host

    path = os.path.join(cache_dir(), f"host-{host_key()}-w{world}.json")
    probe_path = f"{path}.probe.json"
    why = (f"calibrating this machine once (autopar calibrate --quick --world {world}, about a "
           f"minute); kept in {path}")
    if os.path.exists(path):
        try:
            Cluster.load(path)
        except ClusterSpecError:
            pass  # a file from an older format or a torn write: measure again
        else:
            then, now = _read_probe(probe_path), calibration_host.speed_probe()
            if then is None:  # kept before probes were: today's speed is its reference
                _write(probe_path, json.dumps({"speed_probe_s": now}))
                return path
            drift = then / now - 1.0  # > 0: faster now
            if abs(drift) <= DRIFT_TOLERANCE:
                return path
            why = (f"this machine runs {abs(drift):.0%} {'faster' if drift > 0 else 'slower'} "
                   f"than when it was calibrated (speed probe {now * 1e3:.1f} ms, then "
                   f"{then * 1e3:.1f} ms): calibrating again; kept in {path}")
    if say is not None:
        say(why)
    cluster, _ = calibration.calibrate_cluster(world, quick=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write(path, cluster.dumps() + "\n")
    _write(probe_path, json.dumps({"speed_probe_s": calibration_host.speed_probe()}))
    return path


def _read_probe(path: str) -> float | None:
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)["speed_probe_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _write(path: str, text: str) -> None:
    """Whole or absent, even if two demos write at once."""
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(partial, path)
