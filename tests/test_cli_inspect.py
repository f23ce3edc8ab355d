"""`autopar inspect`: the table, the JSON, and GPT-3 175B on a laptop budget."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from autopar.cli import main


def test_inspect_json(capsys):
    assert main(["inspect", "gpt2-small", "--batch", "2", "--seq", "256", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == 124_439_808
    l, h, v, b, s = 12, 768, 50257, 2, 256
    want = l * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * v
    assert abs(report["forward_flops"] / want - 1) < 0.01
    assert len(report["layers"]) == 14
    assert sum(layer["params"] for layer in report["layers"]) == report["params"]


def test_a_repeated_last_block_reports_what_a_full_capture_does():
    """inspect captures two blocks of a deeper model and repeats the last (as the planner
    does); every row and total equals the capture of every block (the reference). Five blocks
    (the full twelve of GPT-2 small took 13 s to capture, for no more coverage)."""
    from autopar.report import inspect_model

    for name, overrides in (("gpt2-small", dict(layers=5)),
                            ("llama", dict(layers=5, hidden=64, heads=4, kv_heads=2, vocab=100))):
        quick = inspect_model(name, batch=2, seq=128, **overrides)
        full = inspect_model(name, batch=2, seq=128, full=True, **overrides)
        assert quick.blocks_captured == 2 and full.blocks_captured is None
        assert quick.layers == full.layers
        assert (quick.params, quick.forward_flops, quick.activation_bytes) == \
            (full.params, full.forward_flops, full.activation_bytes)


def test_inspect_table_and_family_flags(capsys):
    assert main(["inspect", "llama", "--layers", "3", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--vocab", "100"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.[0-2]" in out and "total" in out


def test_inspect_unknown_model_is_a_clear_error(capsys):
    assert main(["inspect", "gpt5"]) == 1
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow
def test_inspect_gpt3_175b_fast_and_small():
    """The issue's budget: under 60 s and under 2 GiB on this (2-core) machine."""
    code = ("import resource, sys; from autopar.cli import main; rc = main(['inspect', "
            "'gpt3-175b', '--json']); sys.stdout.flush(); "
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); "
            "sys.exit(rc)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert abs(report["params"] / 175e9 - 1) < 0.02
    assert len(report["layers"]) == 98
    maxrss_kb = int(proc.stderr.split("MAXRSS_KB")[1].split()[0])
    assert elapsed < 60, elapsed
    assert maxrss_kb < 2 * 1024 * 1024, maxrss_kb
