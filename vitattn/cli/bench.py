"""``vitattn bench``: benchmark suites side by side, printed as ratio tables."""

from __future__ import annotations

import argparse
import sys

from .options import USAGE_ERRORS, check_output_file, int_at_least, report_error

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "bench"
HELP = "benchmark suites, side by side, printed as ratios"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``vitattn bench``."""
    p.add_argument("suites", nargs="*", help="suites to run (default: all; see --list)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier numbers)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--threads", type=int_at_least(1), help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--keep-heap",
        action="store_true",
        help="keep freed memory in the heap (glibc): no page-fault noise from the allocator",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="run each suite in N fresh processes and print min / median / max of the per-process ratios",
    )
    p.add_argument(
        "--import-module",
        action="append",
        metavar="MODULE",
        help="import MODULE first, here and in every child process (it may register more suites; repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    """Run benchmark suites side by side and print ratio tables; 2 with one line on stderr on a usage
    error (unknown suite or module, a bad value or path: found before any suite runs)."""
    try:
        return _run(args)
    except USAGE_ERRORS as err:
        return report_error(NAME, err)


def _run(args: argparse.Namespace) -> int:
    import importlib

    from ..bench import keep_heap, run_suites, suites

    check_output_file(args.json, "--json")
    for module in args.import_module or []:
        try:
            importlib.import_module(module)  # may register more suites
        except ImportError as err:
            raise ImportError(f"--import-module {module!r}: {err}") from err
    known = suites()
    if args.list:
        for name, help in known.items():
            print(f"{name:<10} {help}")
        return 0
    names = args.suites or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; known: {sorted(known)}")
    if args.processes < 1:
        raise ValueError(f"--processes must be >= 1, got {args.processes}")
    if args.processes > 1:  # threads and heap are the children's business
        try:
            run_suites(
                names,
                quick=args.quick,
                json_path=args.json,
                processes=args.processes,
                threads=args.threads,
                keep_heap=args.keep_heap,
                imports=args.import_module or (),
            )
        except RuntimeError as err:
            return report_error(NAME, err)
        return 0
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.keep_heap and not keep_heap():
        print("vitattn bench: --keep-heap needs glibc; the allocator is left as it is", file=sys.stderr)
    run_suites(names, quick=args.quick, json_path=args.json)
    return 0
