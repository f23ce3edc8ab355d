"""The ``autopar`` command line. Each subcommand lives in ``autopar/commands/<name>.py`` and
exposes ``register(subparsers)``; adding a command is adding a module to :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import importlib
import sys

from autopar.errors import AutoparError

#: Subcommand modules, in the order ``autopar --help`` lists them.
COMMANDS = ["inspect", "plan", "explain", "simulate", "calibrate", "codegen", "demo", "run"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Auto-parallelize PyTorch models: inspect, plan, explain, generate code, run.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"autopar.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from autopar import __version__

        print(__version__)
        return 0
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except AutoparError as exc:
        print(f"autopar: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
