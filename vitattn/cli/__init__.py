"""The ``vitattn`` command: ``study``, ``analyze``, ``probe``, ``bench`` and ``info``.

One module per subcommand, each with ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> exit status``. This package is the top of vitattn's import layers: it turns command
lines into library calls, and nothing in vitattn imports it (``vitattn.__main__`` aside).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from . import analyze, bench, info, probe, study

__all__ = ["OneLineParser", "build_parser", "main"]

DESCRIPTION = "The ``vitattn`` command: ``study``, ``analyze``, ``probe``, ``bench`` and ``info``."
SUBCOMMANDS = (info, bench, analyze, probe, study)  # the order of ``vitattn --help``


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2, like every other
    error of the ``vitattn`` command (argparse prints the whole usage first); its subparsers too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``vitattn`` parser: one subparser per module of :data:`SUBCOMMANDS`, ``args.func`` its ``run``."""
    parser = OneLineParser(prog="vitattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vitattn`` on ``argv`` (default ``sys.argv[1:]``); the subcommand's exit status (2 with one
    line on stderr for a usage error, 0 after ``--help``)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse: --help (0) or a usage error (2, its line already printed)
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 2
    return int(args.func(args))
