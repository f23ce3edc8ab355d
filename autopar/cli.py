"""The ``autopar`` command line. Each subcommand lives in ``autopar/commands/<name>.py`` and
exposes ``register(subparsers)``; adding a command is adding a module to :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from autopar.errors import AutoparError

#: Subcommand modules, in the order ``autopar --help`` lists them.
COMMANDS = ["inspect", "plan", "explain", "simulate", "calibrate", "codegen", "demo", "run"]
#: Commands that only read, compute and print (or write a file they have closed): the console
#: script ends their process without tearing its objects down (:func:`entry`).
FAST_EXIT = frozenset({"inspect", "plan", "explain", "simulate"})


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


def entry() -> None:
    """The ``autopar`` console script: :func:`main`; after a :data:`FAST_EXIT` command, the
    process ends at once once its output is flushed (``os._exit``), skipping the interpreter's
    teardown of the planner's millions of small objects: 1.4 s of a 12 s ``autopar plan
    gpt3-175b`` on 1024 GPUs (mypy ends its runs the same way). Other commands (training,
    calibrating, launching) exit normally, running their clean-up."""
    argv = sys.argv[1:]
    rc = main(argv)
    if argv and argv[0] in FAST_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
