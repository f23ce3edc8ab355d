"""This host's calibration, measured once and kept: what ``autopar demo`` prices its plan on.

A committed preset describes the machine it was measured on; on another one (or the same VM
type on a slower day) its figures can be off by 2x. ``host_calibration()`` runs
``autopar calibrate --quick --world 2`` (:func:`autopar.planner.calibration.calibrate_cluster`,
about a minute on 2 cores) the first time it is asked on a host, writes the cluster file to the
cache directory and returns its path; later calls return the file. The file is keyed by what
its figures depend on (host name, CPU count, torch and autopar versions), so a new torch or a
resized VM measures again; deleting the file does too.

The cache directory is ``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else
``~/.cache/autopar``.
"""

from __future__ import annotations

import hashlib
import os
import platform
from typing import Callable

__all__ = ["cache_dir", "host_key", "host_calibration"]


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
    now if there is none or it does not load; ``say`` is told before a measurement starts."""
    from autopar.cluster import Cluster
    from autopar.errors import ClusterSpecError
    from autopar.planner.calibration import calibrate_cluster

    path = os.path.join(cache_dir(), f"host-{host_key()}-w{world}.json")
    if os.path.exists(path):
        try:
            Cluster.load(path)
            return path
        except ClusterSpecError:
            pass  # a file from an older format or a torn write: measure again
    if say is not None:
        say(f"calibrating this machine once (autopar calibrate --quick --world {world}, about a "
            f"minute); kept in {path}")
    cluster, _ = calibrate_cluster(world, quick=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    cluster.save(partial)
    os.replace(partial, path)  # whole or absent, even if two demos start at once
    return path
