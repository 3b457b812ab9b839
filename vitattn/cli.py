"""The ``vitattn`` command: ``study``, ``analyze``, ``probe``, ``bench`` and ``info``."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, devices and attention backends."""
    import torch

    from . import __version__
    from .functional import available_backends

    print(f"vitattn {__version__}")
    for dist in ("torch", "timm", "entmax", "einops", "triton", "safetensors"):
        print(f"  {dist:<12} {_version(dist)}")
    print(f"  python       {sys.version.split()[0]}")
    print(f"  cpu threads  {torch.get_num_threads()}")
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "not available"
    print(f"  cuda         {cuda}")
    print(f"  backends     {', '.join(available_backends())}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmark suites side by side and print ratio tables."""
    import importlib

    from .bench import keep_heap, run_suites, suites

    for module in args.import_module or []:
        importlib.import_module(module)  # may register more suites
    known = suites()
    if args.list:
        for name, help in known.items():
            print(f"{name:<10} {help}")
        return 0
    names = args.suites or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"vitattn bench: unknown suite(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    if args.processes < 1:
        print(f"vitattn bench: --processes must be >= 1, got {args.processes}", file=sys.stderr)
        return 2
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
        except (ValueError, RuntimeError) as err:
            print(f"vitattn bench: {err}", file=sys.stderr)
            return 2
        return 0
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.keep_heap and not keep_heap():
        print("vitattn bench: --keep-heap needs glibc; the allocator is left as it is", file=sys.stderr)
    run_suites(names, quick=args.quick, json_path=args.json)
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    """Locality report (MAD, entropy per layer and head) of a model: table, JSON and PNGs."""
    from .analysis.command import run_analyze

    try:
        return run_analyze(args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"vitattn analyze: {err}", file=sys.stderr)
        return 2


def cmd_probe(args: argparse.Namespace) -> int:
    """Dense evaluation of a frozen backbone: linear / kNN segmentation probes per block, mIoU, PCA images."""
    from .probe.command import run_probe

    try:
        return run_probe(args)
    except (ValueError, OSError, ImportError) as err:
        message = " ".join(str(err).split())
        print(f"vitattn probe: {message}", file=sys.stderr)
        return 2


def cmd_study(args: argparse.Namespace) -> int:
    """The training-protocol locality study: train, test, measure MAD / entropy; table, JSON, CSV, plots."""
    from .study.command import run_command

    return run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices and attention backends")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="benchmark suites, side by side, printed as ratios")
    bench.add_argument("suites", nargs="*", help="suites to run (default: all; see --list)")
    bench.add_argument(
        "--quick", action="store_true", help="fewer repetitions (a smoke run, noisier numbers)"
    )
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument("--list", action="store_true", help="list the suites and exit")
    bench.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    bench.add_argument(
        "--keep-heap",
        action="store_true",
        help="keep freed memory in the heap (glibc): no page-fault noise from the allocator",
    )
    bench.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="run each suite in N fresh processes and print min / median / max of the per-process ratios",
    )
    bench.add_argument(
        "--import-module",
        action="append",
        metavar="MODULE",
        help="import MODULE first, here and in every child process (it may register more suites; repeatable)",
    )
    bench.set_defaults(func=cmd_bench)

    an = sub.add_parser("analyze", help="attention locality (MAD, entropy per head): table, JSON, plots")
    an.add_argument("model", help="timm model name, e.g. vit_tiny_patch16_224 or locatvit_tiny")
    an.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="builder kwarg (repeatable)")
    an.add_argument("--attention", choices=("softmax", "entmax15", "locat"), help="vitattn.patch the model")
    an.add_argument("--checkpoint", metavar="PATH", help=".safetensors or weights-only torch state dict")
    src = an.add_mutually_exclusive_group()
    src.add_argument("--images", metavar="DIR", help="image folder (ImageFolder layout or flat)")
    src.add_argument("--dataset", choices=("digits",), default="digits", help="built-in data (default)")
    an.add_argument("--max-images", type=int, default=64, help="images to average over (default 64)")
    an.add_argument("--batch-size", type=int, default=16)
    an.add_argument("--layers", help="block indices, e.g. '0,5,-1' (default: all)")
    an.add_argument("--map-layer", type=int, help="block of the attention-map plot (default: last analysed)")
    an.add_argument("--query", help="query of the map plot: ROW,COL, patch index or 'cls' (default: centre)")
    an.add_argument("--compare", metavar="REPORT_JSON", help="an earlier report to diff against and plot")
    an.add_argument("--out", default="vitattn-analysis", metavar="DIR", help="output folder")
    an.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    an.add_argument("--seed", type=int, default=0, help="seed of the random init (default 0)")
    an.add_argument("--no-progress", action="store_true", help="no progress bar")
    an.set_defaults(func=cmd_analyze)

    from .probe.command import add_arguments as add_probe_arguments

    pr = sub.add_parser("probe", help="dense evaluation: linear / kNN segmentation probes per block (mIoU)")
    add_probe_arguments(pr)
    pr.set_defaults(func=cmd_probe)

    from .study.command import add_arguments as add_study_arguments

    st = sub.add_parser("study", help="training-protocol locality study (default: quick, on built-in digits)")
    add_study_arguments(st)
    st.set_defaults(func=cmd_study)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
