"""``vitattn study``: arguments and the glue from them to :func:`vitattn.study.run_study`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..study.config import ATTENTIONS, PRESETS, StudyConfig, make_config
from ..study.datasets import DATASETS
from ..study.protocols import PROTOCOLS

__all__ = ["HELP", "NAME", "add_arguments", "config_from_args", "run"]

NAME = "study"
HELP = "training-protocol locality study (default: quick, on built-in digits)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``study`` subcommand's options (defaults of None keep the preset's values)."""
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="quick (default: a small ViT for 8 epochs, softmax vs entmax15 vs locat under the "
        "baseline, about 3 minutes on 2 CPU cores) or paper (the study's model and 200-epoch "
        "schedule, baseline and modern)",
    )
    p.add_argument(
        "--dataset",
        choices=list(DATASETS),
        help="scenes (default: procedural digit scenes with masks, nothing to download; runs get a "
        "dense probe), digits (scikit-learn's 8x8 digits), cifar10, cifar100, tinyimagenet",
    )
    p.add_argument(
        "--data-dir", default="data", metavar="DIR", help="where CIFAR / Tiny-ImageNet live (default data)"
    )
    p.add_argument("--download", action="store_true", help="download CIFAR into --data-dir if missing")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--protocol",
        nargs="+",
        metavar="NAME",
        help=f"protocols to run (default: the preset's baseline modern); known: {' '.join(PROTOCOLS)}",
    )
    g.add_argument(
        "--ablation",
        action="store_true",
        help="all 8 combinations of AutoAugment, CutMix and label smoothing",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        choices=ATTENTIONS,
        metavar="KIND",
        help="softmax, entmax15 and/or locat (default: the preset's; quick: all three); several "
        "give one run each",
    )
    p.add_argument("--prr", action="store_true", help="add PRR before the head")
    p.add_argument("--seeds", type=int, metavar="N", help="number of seeds (default 1)")
    p.add_argument("--first-seed", type=int, default=0, metavar="S", help="seeds are S, S+1, ... (default 0)")
    p.add_argument("--epochs", type=int, metavar="N", help="override the preset's epochs")
    p.add_argument(
        "--batch-size", type=int, metavar="N", help="global batch size (default 32 on digits, else 128)"
    )
    p.add_argument("--lr", type=float, help="AdamW peak learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.05)")
    p.add_argument("--warmup-epochs", type=float, help="linear warmup before the cosine decay")
    p.add_argument("--depth", type=int, help="blocks (default 8; smaller for tests)")
    p.add_argument("--dim", type=int, help="embedding width (default 192)")
    p.add_argument("--heads", type=int, help="attention heads (default 8)")
    p.add_argument(
        "--pos-embed-std", type=float, help="std of the position embedding at init (digits 1.0, else 0.02)"
    )
    p.add_argument(
        "--first-layers",
        type=int,
        metavar="K",
        help="the first K blocks whose minimum head MAD is reported (default depth // 4, i.e. 2 of 8)",
    )
    flip = p.add_mutually_exclusive_group()
    flip.add_argument(
        "--hflip",
        dest="hflip",
        action="store_const",
        const=True,
        help="random horizontal flip (default: on, off on digits)",
    )
    flip.add_argument(
        "--no-hflip", dest="hflip", action="store_const", const=False, help="no horizontal flip"
    )
    p.add_argument(
        "--analysis-images", type=int, metavar="N", help="test images for MAD / entropy (default 256)"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the dense probe of each run (scenes)")
    p.add_argument(
        "--probe-layer", type=int, metavar="I", help="block whose features are probed (default -1, the last)"
    )
    p.add_argument(
        "--probe-train-images",
        type=int,
        metavar="N",
        help="training scenes the probes are fitted on (default 1000)",
    )
    p.add_argument(
        "--limit-train", type=int, metavar="N", help="use the first N training images (smoke tests)"
    )
    p.add_argument("--limit-test", type=int, metavar="N", help="use the first N test images (smoke tests)")
    p.add_argument(
        "--out", metavar="DIR", help="output folder (default runs/study-<dataset>-<preset>-<hash>)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the study in --out with its own configuration (other options but runtime "
        "ones are ignored); an unfinished study of the same configuration resumes anyway",
    )
    p.add_argument("--overwrite", action="store_true", help="delete an earlier study in --out first")
    p.add_argument(
        "--workers", type=int, metavar="N", help="data-loader workers (default 0 for digits, else 2)"
    )
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--stop-after-epochs", type=int, help=argparse.SUPPRESS)  # simulated interruption (tests)


def _runtime(args: argparse.Namespace, dataset: str | None) -> dict[str, object]:
    embedded = dataset in (None, "scenes", "digits")  # in memory: no loader workers needed
    workers = args.workers if args.workers is not None else (0 if embedded else 2)
    return dict(
        data_dir=args.data_dir,
        download=args.download,
        workers=workers,
        threads=args.threads,
        progress=not args.no_progress,
        device=args.device,
    )


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """The :class:`StudyConfig` of the command line (for ``--resume``: the one stored in ``--out``)."""
    if args.resume:
        if not args.out:
            raise ValueError("--resume needs --out DIR (the folder of the study to continue)")
        path = Path(args.out) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"nothing to resume: {str(path)!r} does not exist")
        stored = StudyConfig.from_dict(json.loads(path.read_text())["config"])
        return stored.with_runtime(**_runtime(args, stored.dataset))
    protocols = list(PROTOCOLS) if args.ablation else args.protocol
    seeds = None if args.seeds is None else list(range(args.first_seed, args.first_seed + args.seeds))
    if seeds is None and args.first_seed:
        seeds = [args.first_seed]
    return make_config(
        args.preset,
        dataset=args.dataset,
        protocols=protocols,
        attentions=args.attention,
        prr=args.prr or None,
        seeds=seeds,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_epochs=args.warmup_epochs,
        depth=args.depth,
        dim=args.dim,
        heads=args.heads,
        first_layers=args.first_layers,
        pos_embed_std=args.pos_embed_std,
        hflip=args.hflip,
        analysis_images=args.analysis_images,
        probe=False if args.no_probe else None,
        probe_layer=args.probe_layer,
        probe_train_images=args.probe_train_images,
        limit_train=args.limit_train,
        limit_test=args.limit_test,
        **_runtime(args, args.dataset),
    )


def run(args: argparse.Namespace) -> int:
    """Run ``vitattn study``; 0 on success (also when stopped on purpose), 2 on a usage / data error,
    130 when interrupted with Ctrl-C (rerun to resume)."""
    from ..study.datasets import DatasetMissingError
    from ..study.runner import StudyConfigMismatch, run_study

    try:
        config = config_from_args(args)
        run_study(config, args.out, overwrite=args.overwrite, stop_after_epochs=args.stop_after_epochs)
    except (DatasetMissingError, StudyConfigMismatch, ValueError, FileNotFoundError, ImportError) as err:
        print(f"vitattn study: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\nvitattn study: interrupted; run the same command again (or --resume --out DIR) to continue "
            "from the last finished epoch",
            file=sys.stderr,
        )
        return 130
    return 0
