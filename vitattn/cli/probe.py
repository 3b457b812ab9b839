"""``vitattn probe``: dense evaluation (linear and kNN probes per block) of a timm model, a study run or
a Hugging Face transformers model (``hf:<model id or folder>``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ..datasets.sized import dataset_length
from ..probe.api import METHODS, ProbeResult, probe_features
from ..probe.diagnostics import pca_images
from ..probe.extract import extract_dense_features, resolve_num_classes
from ..probe.features import patch_features
from .options import (
    USAGE_ERRORS,
    check_device,
    check_output_file,
    check_output_folder,
    hf_progress,
    int_at_least,
    parse_layers,
    parse_model_args,
    report_error,
)

__all__ = [
    "HELP",
    "NAME",
    "Backbone",
    "add_arguments",
    "load_backbone",
    "load_datasets",
    "results_table",
    "run",
    "run_probe",
]

NAME = "probe"
HELP = "dense evaluation: linear / kNN segmentation probes per block (mIoU)"
DATASETS = ("scenes", "voc", "ade20k")
DEFAULT_IMAGE_SIZE = {"scenes": 32, "voc": 448, "ade20k": 448}
PCA_IMAGES = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``vitattn probe``."""
    p.add_argument(
        "model",
        metavar="MODEL_OR_CHECKPOINT",
        help="timm model name (locatvit_* included), a `vitattn study` output folder, "
        "OUT/checkpoints/<run> folder or its model.safetensors, or hf:<model id or folder> "
        "(a transformers vision model, offline: a local folder or the Hugging Face cache)",
    )
    p.add_argument("--dataset", choices=DATASETS, default="scenes", help="segmentation data (default scenes)")
    p.add_argument(
        "--method", nargs="+", choices=tuple(METHODS), default=list(METHODS), help="probes (default: both)"
    )
    p.add_argument("--layers", default="-1", help="block indices, e.g. '0,5,-1' or 'all' (default -1)")
    p.add_argument(
        "--data-dir", metavar="DIR", help="root of VOCdevkit/ or ADEChallengeData2016/ (voc, ade20k)"
    )
    p.add_argument("--download", action="store_true", help="download PASCAL VOC 2012 with torchvision")
    p.add_argument(
        "--image-size",
        type=int_at_least(1),
        help="square input side, a multiple of the model's patch size (default 32 for scenes, 448 for "
        "voc/ade20k)",
    )
    p.add_argument("--batch-size", type=int_at_least(1), default=64, help="images per batch (default 64)")
    p.add_argument(
        "--epochs", type=int_at_least(1), help="linear probe epochs (default 20, at least 200 steps)"
    )
    p.add_argument("--k", type=int_at_least(1), help="kNN neighbours (default 10)")
    p.add_argument("--limit-train", type=int_at_least(1), metavar="N", help="use the first N train images")
    p.add_argument("--limit-test", type=int_at_least(1), metavar="N", help="use the first N test images")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="builder kwarg (repeatable)")
    p.add_argument(
        "--checkpoint", metavar="PATH", help="weights of a timm model (.safetensors or state dict)"
    )
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--out", default="vitattn-probe", metavar="DIR", help="output folder (default vitattn-probe)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, probes and bank subset (default 0)")


@dataclasses.dataclass
class Backbone:
    """A model to probe and the input normalization it was trained with."""

    model: nn.Module
    mean: tuple[float, ...]
    std: tuple[float, ...]
    in_chans: int
    source: dict[str, Any]

    def transform(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """Batched ``(B, 3, H, W)`` in [0, 1] -> model input (grey for a 1-channel model, normalized)."""
        mean = torch.tensor(self.mean, device=device, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=device, dtype=torch.float32).view(1, -1, 1, 1)
        chans = self.in_chans

        def fn(x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] != chans:
                if chans != 1:
                    raise ValueError(f"the model takes {chans}-channel images, the data has {x.shape[1]}")
                x = x.mean(1, keepdim=True)
            return (x - mean) / std

        return fn


def _study_root(path: Path) -> tuple[Path, str | None, Path | None]:
    """(study folder, run name or None, model.safetensors or None) of a study-shaped path."""
    if path.is_dir() and (path / "results.json").is_file():
        return path, None, None
    if path.is_dir() and (path / "model.safetensors").is_file():
        return path.parent.parent, path.name, path / "model.safetensors"
    if path.is_file():
        return path.parent.parent.parent, path.parent.name, path
    raise ValueError(
        f"{str(path)!r} is neither a `vitattn study` output folder (with results.json), a run folder "
        "OUT/checkpoints/<run> nor a model.safetensors file"
    )


def _load_study(path: Path) -> Backbone:
    from ..analysis.checkpoint import load_checkpoint
    from ..study.config import StudyConfig
    from ..study.dataset_specs import DATASETS as STUDY_DATASETS
    from ..study.model import build_model

    root, name, ckpt = _study_root(path)
    results = root / "results.json"
    if not results.is_file():
        raise ValueError(
            f"{str(path)!r} is not inside a `vitattn study` output (no {str(results)!r}); for plain "
            "weights give a timm model name and --checkpoint PATH"
        )
    data = json.loads(results.read_text())
    runs = {r["name"]: r for r in data.get("runs", [])}
    if name is None:
        if len(runs) != 1:
            ckpts = ", ".join(str(root / "checkpoints" / n / "model.safetensors") for n in runs) or "none"
            raise ValueError(f"{str(root)!r} holds {len(runs)} finished runs: give one of {ckpts}")
        name = next(iter(runs))
        ckpt = root / "checkpoints" / name / "model.safetensors"
    if name not in runs:
        raise ValueError(f"run {name!r} is not in {str(results)!r} (runs: {', '.join(runs) or 'none'})")
    assert ckpt is not None
    run = runs[name]
    config = StudyConfig.from_dict(data["config"])
    config = dataclasses.replace(config, prr=bool(run.get("prr", config.prr)))
    model = build_model(config, run["attention"])
    load_checkpoint(model, ckpt)
    spec = STUDY_DATASETS[config.dataset]
    source = dict(kind="study", study=str(root), run=name, checkpoint=str(ckpt), attention=run["attention"])
    source.update(prr=config.prr, trained_on=config.dataset)
    return Backbone(model.eval(), tuple(spec.mean), tuple(spec.std), spec.channels, source)


def load_backbone(name_or_path: str, model_args: dict[str, Any], checkpoint: str | None) -> Backbone:
    """A timm model (with ``model_args``, ``checkpoint``), a study run or an ``hf:`` transformers model
    (:func:`vitattn.hf.load_model`: its image processor's normalization), with its normalization."""
    if name_or_path.startswith("hf:"):
        if model_args or checkpoint:
            raise ValueError("--model-arg and --checkpoint apply to timm model names, not to hf: models")
        from ..hf.loading import load_model

        loaded = load_model(name_or_path)
        return Backbone(loaded.model, loaded.mean, loaded.std, loaded.in_chans, loaded.source)
    path = Path(name_or_path)
    if path.exists():
        if model_args or checkpoint:
            raise ValueError(
                "--model-arg and --checkpoint apply to timm model names, not to a study checkpoint"
            )
        return _load_study(path)
    import timm.data

    from ..analysis.model import build_model

    model = build_model(name_or_path, model_args, None, checkpoint)
    cfg = timm.data.resolve_data_config({}, model=model)
    source = dict(kind="timm", name=name_or_path, model_args=model_args, checkpoint=checkpoint)
    proj = getattr(getattr(model, "patch_embed", None), "proj", None)
    in_chans = int(proj.in_channels) if isinstance(proj, nn.Conv2d) else 3
    return Backbone(model, tuple(cfg["mean"]), tuple(cfg["std"]), in_chans, source)


def _check_image_size(model: nn.Module, size: int) -> None:
    """Refuse an ``--image-size`` the model cannot take whole: not its fixed input size, or not a
    multiple of its patch size (the patch embedding would drop the remainder)."""
    from ..probe.features import check_image_size

    check_image_size(model, size, "--image-size")
    embed = getattr(model, "patch_embed", None)
    fixed = getattr(embed, "img_size", None)
    if (
        fixed is None
        or getattr(embed, "dynamic_img_size", False)
        or not getattr(embed, "strict_img_size", True)
    ):
        return
    if tuple(fixed) != (size, size):
        raise ValueError(
            f"the model takes {fixed[0]}x{fixed[1]} images but --image-size is {size}: pass "
            f"--image-size {fixed[0]}, or build the model with --model-arg img_size={size}"
        )


def _limit(ds: Dataset, n: int | None, flag: str) -> Dataset:
    if n is None:
        return ds
    if n < 1:
        raise ValueError(f"{flag} must be >= 1, got {n}")
    return Subset(ds, range(min(n, dataset_length(ds))))


def load_datasets(args: argparse.Namespace, size: int) -> tuple[Dataset, Dataset, dict[str, Any]]:
    """Train / test sets of ``--dataset`` at ``size`` px (``--limit-*`` applied) and a description."""
    if args.dataset == "scenes":
        from ..datasets.scenes import DigitScenes

        train: Dataset = DigitScenes("train", image_size=size, size=args.limit_train)
        test: Dataset = DigitScenes("test", image_size=size, size=args.limit_test)
        desc: dict[str, Any] = dict(name="scenes", train_split="train", test_split="test")
    else:
        if args.data_dir is None:
            folder = "VOCdevkit/VOC2012" if args.dataset == "voc" else "ADEChallengeData2016"
            raise ValueError(f"--dataset {args.dataset} needs --data-dir DIR (the folder holding {folder})")
        if args.dataset == "voc":
            from ..datasets.segmentation import VOCSegmentation

            train = VOCSegmentation(args.data_dir, "train", size, download=args.download)
            test = VOCSegmentation(args.data_dir, "val", size, download=args.download)
        else:
            from ..datasets.segmentation import ADE20KSegmentation

            train = ADE20KSegmentation(args.data_dir, "train", size)
            test = ADE20KSegmentation(args.data_dir, "val", size)
        desc = dict(name=args.dataset, root=str(args.data_dir), train_split="train", test_split="val")
    desc["class_names"] = list(getattr(train, "class_names", []))
    return (
        _limit(train, args.limit_train, "--limit-train"),
        _limit(test, args.limit_test, "--limit-test"),
        desc,
    )


def run(args: argparse.Namespace) -> int:
    """``vitattn probe``: 0, or 2 with a one-line message on a usage, data, checkpoint or missing-extra
    error (found before anything is written)."""
    try:
        return run_probe(args)
    except USAGE_ERRORS as err:
        return report_error(NAME, err)


def results_table(results: Sequence[ProbeResult]) -> str:
    """One Markdown table of several :meth:`ProbeResult.table` (method × block rows)."""
    lines = results[0].table().splitlines()
    for r in results[1:]:
        lines += r.table().splitlines()[2:]
    return "\n".join(lines)


def run_probe(args: argparse.Namespace) -> int:
    """Build the backbone and data, extract features once, run each method, print and write results."""
    from ..models.blocks import block_indices
    from ..probe.features import backbone_depth
    from ..probe.plots import plot_pca_images

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.batch_size < 1:  # argparse checks it; run_probe may be handed a Namespace
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_device(args.device)
    check_output_folder(args.out)
    check_output_file(args.json, "--json")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.image_size or DEFAULT_IMAGE_SIZE[args.dataset]
    parsed = parse_layers(args.layers)
    with hf_progress(args.model, not args.no_progress):  # its errors first
        bb = load_backbone(args.model, parse_model_args(args.model_arg), args.checkpoint)
    train, test, data_desc = load_datasets(args, size)
    _check_image_size(bb.model, size)
    depth = backbone_depth(bb.model)
    layers = block_indices(range(depth) if parsed is None else parsed, depth, "--layers")
    model = bb.model.to(device).eval()
    k = resolve_num_classes(train, None)
    transform = bb.transform(device)
    progress = not args.no_progress
    common: dict[str, Any] = dict(
        layers=layers, num_classes=k, transform=transform, batch_size=args.batch_size, device=device,
        progress=progress,
    )  # fmt: skip
    tr = extract_dense_features(model, train, desc="train features", **common)
    te = extract_dense_features(model, test, desc="test features", **common)
    results = []
    for method in args.method:
        options: dict[str, Any] = {"batch_size": args.batch_size}
        if method == "linear" and args.epochs is not None:
            options["epochs"] = args.epochs
        if method == "knn" and args.k is not None:
            options["k"] = args.k
        results.append(
            probe_features(tr, te, method=method, device=device, progress=progress, seed=args.seed, **options)
        )
    print(results_table(results))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = min(PCA_IMAGES, dataset_length(test))
    images = torch.stack([torch.as_tensor(test[i][0]) for i in range(n)]).float()
    maps = patch_features(model, transform(images.to(device)), layers)
    pcas = {f"block {i}": pca_images(m.patches) for i, m in maps.items()}
    pca_path = out / "pca.png"
    plot_pca_images(images, pcas, pca_path, title=f"PCA of patch features: {args.model}")
    record = {
        "model": args.model,
        "source": bb.source,
        "dataset": {**data_desc, "image_size": size, "num_classes": k},
        "train_images": len(tr),
        "test_images": len(te),
        "grid_size": list(tr.grid),
        "layers": list(layers),
        "normalization": {"mean": list(bb.mean), "std": list(bb.std)},
        "device": str(device),
        "seed": args.seed,
        "seconds": round(time.perf_counter() - t0, 3),
        "results": {r.method: r.to_dict() for r in results},
    }
    text = json.dumps(record, indent=2)
    written = [out / "probe.json", pca_path]
    (out / "probe.json").write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
        written.append(Path(args.json))
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return 0
