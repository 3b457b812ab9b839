"""The ``vitattn`` command: ``study``, ``analyze``, ``probe``, ``bench`` and ``info``.

One module per subcommand, each with ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> exit status``. This package is the top of vitattn's import layers: it turns command
lines into library calls, and nothing in vitattn imports it (``vitattn.__main__`` aside).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import analyze, bench, info, probe, study

__all__ = ["build_parser", "main"]

DESCRIPTION = "The ``vitattn`` command: ``study``, ``analyze``, ``probe``, ``bench`` and ``info``."
SUBCOMMANDS = (info, bench, analyze, probe, study)  # the order of ``vitattn --help``


def build_parser() -> argparse.ArgumentParser:
    """The ``vitattn`` parser: one subparser per module of :data:`SUBCOMMANDS`, ``args.func`` its ``run``."""
    parser = argparse.ArgumentParser(prog="vitattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vitattn`` on ``argv`` (default ``sys.argv[1:]``); the subcommand's exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
