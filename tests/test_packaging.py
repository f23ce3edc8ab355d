"""The wheel holds every subpackage and data file: a non-editable install must not lose the CLI
(autopar.commands) or anything under passes/ and runtime/.

The wheel is built offline, by setuptools' PEP 517 backend, from a copy of the sources in a
temporary directory (so no build/ or egg-info lands in the checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Directory in the repository -> import path in the installed distribution.
ROOTS = {"autopar": "autopar", "passes": "autopar/passes", "runtime": "autopar/runtime"}


def _expected_files() -> set[str]:
    """Every .py file and data file under the package roots, as wheel paths."""
    out = set()
    for src, dest in ROOTS.items():
        for folder, dirs, files in os.walk(os.path.join(ROOT, src)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(folder, os.path.join(ROOT, src))
            for f in files:
                if f.endswith(".pyc"):
                    continue
                if f.endswith(".py") or os.path.relpath(folder, ROOT).startswith("autopar/data"):
                    out.add(os.path.normpath(os.path.join(dest, rel, f)))
    return out


def test_wheel_contains_every_subpackage_and_data_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ROOTS:
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = ("from setuptools import build_meta as backend; "
             f"print(backend.build_wheel({str(tmp_path / 'dist')!r}))")
    done = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    missing = sorted(_expected_files() - names)
    assert not missing, f"not in the wheel: {missing}"
    for package in ("autopar/commands", "autopar/planner", "autopar/models"):
        assert f"{package}/__init__.py" in names
    assert "autopar/data/clusters/cpu.yaml" in names and "autopar/data/corpus.txt" in names
    assert "autopar = autopar.cli:entry" in entry_points
    assert not [n for n in names if n.startswith(("passes/", "runtime/", "tests/"))]


def test_python_dash_m_autopar_is_the_command():
    """``python -m autopar`` runs the ``autopar`` command (an interpreter whose scripts folder is
    not on the PATH: benchmarks/gpu_session.sh calls the GPU image's python3 so)."""
    from autopar import __version__

    out = subprocess.run([sys.executable, "-m", "autopar", "--version"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert __version__ in out.stdout
