"""``autopar run script.py --nproc N [-- script args]``: launch a training script over torchrun.

The launcher is torch's own (``python -m torch.distributed.run``, the elastic agent behind
``torchrun``); this command only fills in safe defaults:

- the rendezvous endpoint is ``127.0.0.1`` on a free port (found by binding port 0 on loopback);
  ``--master-addr`` / ``--master-port`` override it, and a multi-node job (``--nnodes > 1``)
  must name both;
- on a single node with a loopback endpoint, gloo and NCCL's bootstrap sockets are bound to the
  loopback interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless already set);
  torch's TCPStore servers take no bind address and listen on every interface, as under plain
  torchrun;
- one node uses torch's c10d rendezvous with a fresh workers' store per attempt, so a restarted
  rank never reads a dead peer's address from the previous attempt (the static rendezvous keeps
  one store across restarts);
- ``--max-restarts K`` restarts every worker up to K times when one fails (a lost rank); the
  script resumes from its last checkpoint (``pm.load_latest(dir)``, docs/launch.md).

Script arguments go after ``--``: ``autopar run train.py --nproc 2 -- --steps 100``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from autopar.errors import InvalidInputError

LOOPBACK = "127.0.0.1"


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--master-addr", default=None,
                   help=f"rendezvous host (default {LOOPBACK}; required with --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: a free port; required with --nnodes > 1)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all workers up to K times when one fails (default 0)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command instead of running it")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="launch a script on N local ranks over torchrun",
                       description="Launches SCRIPT over torchrun (torch.distributed.run) with "
                                   "the rendezvous on 127.0.0.1 and a free port by default. "
                                   "Script arguments go after `--`.",
                       epilog="example: autopar run train.py --nproc 4 --max-restarts 1 -- "
                              "--steps 100")
    _add_launch_options(p)
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="launcher options, then `--` and the script's arguments")
    p.set_defaults(run=run)


def _split(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """Launcher options may follow the script (``run train.py --nproc 2 -- --steps 3``): parse
    what precedes ``--`` as launcher options, pass what follows to the script."""
    rest = list(args.script_args)
    if "--" in rest:
        cut = rest.index("--")
        options, script_args = rest[:cut], rest[cut + 1:]
    else:
        options, script_args = rest, []
    if options:
        again = argparse.ArgumentParser(prog="autopar run SCRIPT", add_help=False)
        _add_launch_options(again)
        again.set_defaults(**{k: v for k, v in vars(args).items()
                              if k not in ("script", "script_args", "run", "command")})
        known, unknown = again.parse_known_args(options)
        if unknown:
            raise InvalidInputError(f"unknown launcher option(s) {unknown}",
                                    expected="--nproc, --nnodes, --node-rank, --master-addr, "
                                             "--master-port, --max-restarts",
                                    fix="put the script's own arguments after `--`: "
                                        "autopar run train.py --nproc 2 -- --steps 10")
        for k, v in vars(known).items():
            setattr(args, k, v)
    return args, script_args


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now (the OS picks it; torchrun binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def torchrun_command(args: argparse.Namespace, script_args: list[str]) -> tuple[list[str], dict]:
    """The torchrun command line and the environment additions for ``args``."""
    for name in ("nproc", "nnodes"):
        if getattr(args, name) < 1:
            raise InvalidInputError(f"--{name} must be at least 1", found=str(getattr(args, name)))
    if not 0 <= args.node_rank < args.nnodes:
        raise InvalidInputError("--node-rank must be in [0, nnodes)",
                                found=f"{args.node_rank} with --nnodes {args.nnodes}")
    if args.max_restarts < 0:
        raise InvalidInputError("--max-restarts must be >= 0", found=str(args.max_restarts))
    if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
        raise InvalidInputError("a multi-node job needs an agreed rendezvous endpoint",
                                expected="--master-addr HOST --master-port PORT on every node",
                                found=f"--nnodes {args.nnodes} without them",
                                fix="pass the address and port of node 0 on every node")
    if not os.path.isfile(args.script):
        raise InvalidInputError(f"no script at {args.script}", fix="check the path")
    addr = args.master_addr or LOOPBACK
    port = args.master_port if args.master_port is not None else free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes),
           "--nproc-per-node", str(args.nproc), "--max-restarts", str(args.max_restarts)]
    env = {}
    if args.nnodes == 1:
        # torch's c10d rendezvous, with the workers' store hosted by rank 0 on a fresh port in
        # every attempt: the static rendezvous keeps one store across restarts, and a restarted
        # rank can then read a dead peer's address from the previous attempt.
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}",
                "--local-addr", addr]
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        lo = _loopback_interface()
        if addr in (LOOPBACK, "localhost") and lo:
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if var not in os.environ:
                    env[var] = lo
    else:  # fixed node ranks, as `torchrun --master-addr`
        cmd += ["--node-rank", str(args.node_rank), "--master-addr", addr,
                "--master-port", str(port)]
    cmd += [args.script, *script_args]
    return cmd, env


def run(args: argparse.Namespace) -> int:
    args, script_args = _split(args)
    cmd, env = torchrun_command(args, script_args)
    if args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in env.items()), *cmd)
        return 0
    try:
        return subprocess.call(cmd, env={**os.environ, **env})
    except KeyboardInterrupt:  # torchrun got the signal too and stops its workers
        return 130
