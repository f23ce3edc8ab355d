"""`autopar run` over torchrun: a rank lost mid-training, the job restarted, training resumed.

The one torchrun smoke test of the suite. examples/train_resume.py trains the own GPT on 2 ranks,
saving a checkpoint every 2 steps. In the faulty run rank 1 calls os._exit(1) before step 3 on
the first attempt; torchrun (--max-restarts 1) stops rank 0 and restarts both, which resume from
the step-2 checkpoint. The final parameters must equal, bit for bit, those of the same script
run without a fault: the resumed run repeats the same computations from the same fp32 master
weights, Adam state and step count, on the same data.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from autopar.commands.run import torchrun_command
from autopar.errors import InvalidInputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_resume.py")


def _launch(tmp, name: str, *script_args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "autopar.cli", "run", SCRIPT, "--nproc", "2", "--max-restarts",
           "1", "--", "--ckpt", str(tmp / name), "--out", str(tmp / f"{name}.pt"), "--steps",
           "4", "--every", "2", "--timeout", "30", *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.distributed
def test_a_lost_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    # both jobs at once: each spends most of its time starting processes, not computing
    runs = {"faulty": _launch(tmp_path, "faulty", "--fail-at", "3"),
            "clean": _launch(tmp_path, "clean")}
    logs = {}
    try:
        for name, proc in runs.items():
            logs[name], _ = proc.communicate(timeout=240)
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
    for name, proc in runs.items():
        assert proc.returncode == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    assert "attempt 0: starting fresh" in logs["faulty"]
    assert "attempt 1: resumed from step 2" in logs["faulty"], logs["faulty"][-4000:]
    assert "attempt 1" not in logs["clean"]
    faulty = torch.load(tmp_path / "faulty.pt", weights_only=True)
    clean = torch.load(tmp_path / "clean.pt", weights_only=True)
    assert faulty.keys() == clean.keys()
    for key, value in clean.items():
        assert torch.equal(faulty[key], value), key


def _args(**overrides):
    import argparse

    base = dict(nproc=2, nnodes=1, node_rank=0, master_addr=None, master_port=None,
                max_restarts=0, script=SCRIPT)
    return argparse.Namespace(**{**base, **overrides})


def test_run_binds_the_rendezvous_to_loopback_by_default():
    cmd, env = torchrun_command(_args(max_restarts=2), ["--steps", "3"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    endpoint = cmd[cmd.index("--rdzv-endpoint") + 1]
    assert endpoint.startswith("127.0.0.1:") and int(endpoint.split(":")[1]) > 0
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-restarts") + 1] == "2"
    assert cmd[-3:] == [SCRIPT, "--steps", "3"]
    cmd, _ = torchrun_command(_args(nnodes=2, node_rank=1, master_addr="10.0.0.1",
                                    master_port=29500), [])
    assert cmd[cmd.index("--master-addr") + 1] == "10.0.0.1"
    assert cmd[cmd.index("--node-rank") + 1] == "1"
    with pytest.raises(InvalidInputError, match="multi-node job needs"):
        torchrun_command(_args(nnodes=2), [])
    with pytest.raises(InvalidInputError, match="no script"):
        torchrun_command(_args(script="missing.py"), [])


def test_run_splits_launcher_options_from_script_arguments():
    from autopar.cli import build_parser
    from autopar.commands.run import _split

    args, script_args = _split(build_parser().parse_args(
        ["run", SCRIPT, "--nproc", "3", "--max-restarts", "1", "--", "--steps", "5"]))
    assert (args.nproc, args.max_restarts, script_args) == (3, 1, ["--steps", "5"])
    with pytest.raises(InvalidInputError, match="after `--`"):
        _split(build_parser().parse_args(["run", SCRIPT, "--steps", "5"]))
