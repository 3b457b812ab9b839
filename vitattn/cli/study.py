"""``vitattn study``: arguments and the glue from them to :func:`vitattn.study.run_study`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..study.amp import AMP_CHOICES
from ..study.config import ATTENTIONS, PRESETS, STUDY_WINDOW, ConfigError, StudyConfig, make_config
from ..study.datasets import DATASETS
from ..study.init import INIT_SCHEMES
from ..study.protocols import PROTOCOLS
from .options import USAGE_ERRORS, parse_model_args, report_error

__all__ = ["HELP", "NAME", "add_arguments", "config_from_args", "option_of", "run"]

NAME = "study"
HELP = "train and compare attentions: the locality study, fine-tuning timm backbones (default: quick, scenes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``study`` subcommand's options (defaults of None keep the preset's values)."""
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="quick",
        help="quick (default: the main job, a small ViT for 5 epochs, softmax vs entmax15 vs locat under "
        "the baseline, under 2 minutes on 2 CPU cores) or paper (the study's model and 200-epoch "
        "schedule, baseline and modern)",
    )
    p.add_argument(
        "--dataset",
        choices=list(DATASETS),
        help="scenes (default: procedural digit scenes with masks, nothing to download; runs get a "
        "dense probe), digits (scikit-learn's 8x8 digits), cifar10, cifar100, tinyimagenet, imagefolder "
        "(--data-dir DIR with DIR/train/<class>/* and DIR/val/<class>/*, timm's data pipeline)",
    )
    p.add_argument(
        "--data-dir",
        default="data",
        metavar="DIR",
        help="where CIFAR / Tiny-ImageNet live, or the image folder (default data)",
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
        help="softmax, entmax15, locat, adaptive (alpha-entmax, one learnable alpha per head) and/or "
        f"window ({STUDY_WINDOW}x{STUDY_WINDOW} neighbourhood softmax, --window) (default: the preset's; "
        "quick: the first three); several give one run each",
    )
    p.add_argument(
        "--window",
        type=int,
        metavar="K",
        help="--attention window: each patch attends to the K x K patches around it (default "
        f"{STUDY_WINDOW}; a window as large as the patch grid is plain softmax attention, which the "
        "study notes)",
    )
    p.add_argument(
        "--window-dilation",
        type=int,
        metavar="D",
        help="--attention window: the window takes every D-th patch (default 1)",
    )
    p.add_argument("--prr", action="store_true", help="add PRR before the head")
    b = p.add_argument_group("backbone and fine-tuning")
    b.add_argument(
        "--model",
        metavar="NAME",
        help="a timm model (ViT, Eva, Swin, vitattn's locatvit_*) instead of the study's own ViT; "
        "--attention entmax15 / locat and --prr patch it with vitattn.patch (softmax keeps its attention)",
    )
    b.add_argument(
        "--model-arg",
        action="append",
        metavar="KEY=VALUE",
        help="extra timm.create_model argument (repeatable), e.g. depth=6 or "
        "pretrained_cfg_overlay=\"{'file': 'weights.safetensors'}\" for --pretrained from a local file",
    )
    start = b.add_mutually_exclusive_group()
    start.add_argument(
        "--pretrained",
        action="store_true",
        help="start from timm's pretrained weights of --model (Hub cache)",
    )
    start.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="start from these weights (safetensors or a weights-only state dict of the model; {seed} in "
        "PATH is the run's seed); a head of another size is re-initialised",
    )
    b.add_argument(
        "--gaug-init",
        choices=("identity", "paper"),
        help="how LocAt's new GAug heads start on a backbone with weights: identity (default from weights: "
        "the model keeps its function) or paper (LocAtViT's init, the default from scratch)",
    )
    b.add_argument(
        "--img-size", type=int, metavar="PX", help="input size (default: the dataset's; 224 for imagefolder)"
    )
    b.add_argument("--drop-path", type=float, metavar="P", help="stochastic depth rate (default 0)")
    b.add_argument(
        "--layer-decay",
        type=float,
        metavar="D",
        help="layer-wise lr decay for fine-tuning (timm's param_groups_layer_decay, e.g. 0.65)",
    )
    b.add_argument(
        "--gaug-lr-scale",
        type=float,
        metavar="F",
        help="learning rate of LocAt's GAug heads times F (default 1; with --gaug-init identity their "
        "per-head gate starts at 0 and AdamW moves it by about lr per step: F sets how fast GAug may move)",
    )
    b.add_argument(
        "--init",
        choices=INIT_SCHEMES,
        help="initialisation of the study's ViT: timm or mimetic (attention; default: the preset's)",
    )
    t = p.add_argument_group("precision and speed")
    t.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        help="mixed precision: bf16 (default on CUDA: the Triton kernels run), fp16 (with a grad scaler), "
        "none (default on the CPU)",
    )
    t.add_argument("--compile", action="store_true", help="torch.compile the training model")
    d = p.add_argument_group("imagefolder (timm's data pipeline)")
    d.add_argument(
        "--auto-augment",
        metavar="POLICY",
        help="timm policy of the protocol's AA (default rand-m9-mstd0.5-inc1; original: AutoAugment)",
    )
    d.add_argument(
        "--mixup", type=float, metavar="ALPHA", help="MixUp alpha next to CutMix (default 0: CutMix alone)"
    )
    d.add_argument("--cutmix", type=float, metavar="ALPHA", help="CutMix alpha (default 1.0)")
    d.add_argument(
        "--smoothing",
        type=float,
        metavar="EPS",
        help="label smoothing of the protocols with LS (default 0.1)",
    )
    check = d.add_mutually_exclusive_group()
    check.add_argument(
        "--check-images",
        dest="check_images",
        action="store_const",
        const=True,
        help="open every image before training (default: when there are at most 50000)",
    )
    check.add_argument(
        "--no-check-images", dest="check_images", action="store_const", const=False, help=argparse.SUPPRESS
    )
    p.add_argument("--seeds", type=int, metavar="N", help="number of seeds (default 1)")
    p.add_argument("--first-seed", type=int, default=0, metavar="S", help="seeds are S, S+1, ... (default 0)")
    p.add_argument("--epochs", type=int, metavar="N", help="override the preset's epochs")
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="global batch size (default 64 on scenes, 32 on digits, else 128)",
    )
    p.add_argument("--lr", type=float, help="AdamW peak learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.05)")
    p.add_argument("--warmup-epochs", type=float, help="linear warmup before the cosine decay")
    p.add_argument("--depth", type=int, help="blocks (default 8; quick: 2)")
    p.add_argument("--dim", type=int, help="embedding width (default 192; quick: 64)")
    p.add_argument("--heads", type=int, help="attention heads (default 8; quick: 4)")
    p.add_argument(
        "--pos-embed-std",
        type=float,
        help="std of the position embedding at init (quick and digits 1.0, else timm's 0.02)",
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
        "--probe-epochs", type=int, metavar="N", help="epochs of the linear probe (quick: 10, else 20)"
    )
    p.add_argument(
        "--probe-bank-size",
        type=int,
        metavar="N",
        help="k-NN probe memory bank, patches (quick: 8192, else 32768)",
    )
    p.add_argument(
        "--scenes-version",
        type=int,
        choices=(2, 3),
        help="DigitScenes generator: 3 (default: the main digit near the centre), 2 (anywhere: earlier runs)",
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
        compile=args.compile,
        check_images=args.check_images,
    )


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """The :class:`StudyConfig` of the command line (for ``--resume``: the one stored in ``--out``)."""
    if args.resume:
        if not args.out:
            raise ValueError("--resume needs --out DIR (the folder of the study to continue)")
        from ..study.results import load_results

        path = Path(args.out) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"nothing to resume: {str(path)!r} does not exist")
        stored = StudyConfig.from_dict(load_results(path)["config"])
        return stored.with_runtime(**_runtime(args, stored.dataset))
    protocols = list(PROTOCOLS) if args.ablation else args.protocol
    if args.seeds is not None and args.seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {args.seeds}", "seeds")
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
        window=args.window,
        window_dilation=args.window_dilation,
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
        probe_epochs=args.probe_epochs,
        probe_bank_size=args.probe_bank_size,
        scenes_version=args.scenes_version,
        limit_train=args.limit_train,
        limit_test=args.limit_test,
        model=args.model,
        model_args=parse_model_args(args.model_arg) or None,
        pretrained=args.pretrained or None,
        checkpoint=args.checkpoint,
        gaug_init=args.gaug_init,
        img_size=args.img_size,
        drop_path=args.drop_path,
        layer_decay=args.layer_decay,
        gaug_lr_scale=args.gaug_lr_scale,
        init=args.init,
        amp=args.amp,
        auto_augment=args.auto_augment,
        mixup_alpha=args.mixup,
        cutmix_alpha=args.cutmix,
        label_smoothing=args.smoothing,
        **_runtime(args, args.dataset),
    )


# StudyConfig fields whose option has another name (the others: --field-name)
_FIELD_OPTIONS = {
    "attentions": "--attention",
    "protocols": "--protocol",
    "model_args": "--model-arg",
    "mixup_alpha": "--mixup",
    "cutmix_alpha": "--cutmix",
    "label_smoothing": "--smoothing",
    "probe": "--no-probe",
}


def option_of(field: str) -> str:
    """The ``vitattn study`` option of a :class:`StudyConfig` field (or ``run_study`` argument):
    ``epochs`` -> ``--epochs``, ``label_smoothing`` -> ``--smoothing``; the field's name when no option
    sets it."""
    if field in _FIELD_OPTIONS:
        return _FIELD_OPTIONS[field]
    option = "--" + field.replace("_", "-")
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return option if option in parser._option_string_actions else field


def run(args: argparse.Namespace) -> int:
    """Run ``vitattn study``; 0 on success (also when stopped on purpose), 2 with one line on stderr on a
    usage, data or checkpoint error (found before anything is written), 130 when interrupted with
    Ctrl-C (rerun to resume). Errors in a study's inputs name the option (``--epochs``)."""
    from ..study.runner import run_study

    try:
        config = config_from_args(args)
        run_study(config, args.out, overwrite=args.overwrite, stop_after_epochs=args.stop_after_epochs)
    except ConfigError as err:
        return report_error(NAME, ValueError(err.render(option_of)))
    except USAGE_ERRORS as err:
        return report_error(NAME, err)
    except KeyboardInterrupt:
        print(
            "\nvitattn study: interrupted; run the same command again (or --resume --out DIR) to continue "
            "from the last finished epoch",
            file=sys.stderr,
        )
        return 130
    return 0
