"""``vitattn analyze``: a locality report, its JSON and plots for a timm or vitattn model, or a Hugging
Face transformers model (``hf:<model id or folder>``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..layers.kinds import PATCH_ATTENTIONS
from .options import (
    USAGE_ERRORS,
    check_device,
    check_output_folder,
    float_range,
    hf_progress,
    int_at_least,
    parse_layers,
    parse_model_args,
    report_error,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..analysis.images import InputSpec

__all__ = [
    "DATASETS",
    "HELP",
    "NAME",
    "add_arguments",
    "check_args",
    "check_model_args",
    "compute_rollout",
    "parse_query",
    "run",
]

NAME = "analyze"
HELP = "attention locality (MAD, entropy per head): table, JSON, plots"
DATASETS = ("digits",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``vitattn analyze``."""
    p.add_argument(
        "model",
        help="timm model name, e.g. vit_tiny_patch16_224 or locatvit_tiny, or hf:<model id or folder> "
        "(a transformers vision model, offline: a local folder or the Hugging Face cache)",
    )
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="builder kwarg (repeatable)")
    p.add_argument("--attention", choices=PATCH_ATTENTIONS, help="vitattn.patch the model")
    p.add_argument("--checkpoint", metavar="PATH", help=".safetensors or weights-only torch state dict")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--images", metavar="DIR", help="image folder (ImageFolder layout or flat)")
    src.add_argument("--dataset", choices=DATASETS, default="digits", help="built-in data (default)")
    p.add_argument(
        "--max-images", type=int_at_least(1), default=64, help="images to average over (default 64)"
    )
    p.add_argument("--batch-size", type=int_at_least(1), default=16)
    p.add_argument("--layers", help="block indices, e.g. '0,5,-1' (default: all)")
    p.add_argument("--map-layer", type=int, help="block of the attention-map plot (default: last analysed)")
    p.add_argument("--query", help="query of the map plot: ROW,COL, patch index or 'cls' (default: centre)")
    p.add_argument("--compare", metavar="REPORT_JSON", help="an earlier report to diff against and plot")
    p.add_argument(
        "--rollout", action="store_true", help="also write rollout.png: class-token heat maps over the images"
    )
    p.add_argument(
        "--rollout-images", type=int_at_least(1), default=4, help="images in rollout.png (default 4)"
    )
    p.add_argument(
        "--discard-ratio",
        type=float_range(0.0, 1.0, high_open=True),
        default=0.0,
        help="rollout: fraction of each row's patch weights dropped",
    )
    p.add_argument(
        "--head-fusion", choices=("mean", "max", "min"), default="mean", help="rollout: head fusion"
    )
    p.add_argument(
        "--gradient-rollout",
        action="store_true",
        help="rollout: Chefer et al.'s gradient-weighted rule for each image's top class",
    )
    p.add_argument("--out", default="vitattn-analysis", metavar="DIR", help="output folder")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_query(text: str | None) -> int | tuple[int, int] | str | None:
    """``"r,c"`` -> (row, col); ``"17"`` -> patch index; ``"cls"``; None -> the centre patch."""
    if text is None or text in ("cls", "prefix"):
        return text
    parts = text.replace(",", " ").split()
    try:
        values = [int(p) for p in parts]
    except ValueError as err:
        raise ValueError(f"--query expects ROW,COL, a patch index or 'cls', got {text!r}") from err
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise ValueError(f"--query expects ROW,COL, a patch index or 'cls', got {text!r}")


def run(args: argparse.Namespace) -> int:
    """``vitattn analyze``: 0, or 2 with a one-line message on a usage, file, checkpoint or missing-extra
    error (found before anything is written)."""
    try:
        return run_analyze(args)
    except USAGE_ERRORS as err:
        return report_error(NAME, err)


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before a model is built: the device, the output folder, the option values,
    the files to read, and options that do not go together."""
    check_device(args.device)
    check_output_folder(args.out)
    parse_query(args.query)
    parse_layers(args.layers)
    parse_model_args(args.model_arg)
    if args.gradient_rollout and not args.rollout:
        raise ValueError("--gradient-rollout chooses the rule of --rollout: give --rollout too")
    if args.gradient_rollout and args.model.startswith("hf:"):
        raise ValueError(
            "--gradient-rollout needs a timm or vitattn ViT; for a transformers model use "
            "vitattn.analysis.gradient_rollout with the gradients of outputs.attentions"
        )
    if args.compare and not Path(args.compare).is_file():
        raise FileNotFoundError(f"--compare {args.compare!r}: no such report file")
    if args.images and not Path(args.images).is_dir():
        raise FileNotFoundError(f"--images {args.images!r}: no such folder")


def check_model_args(args: argparse.Namespace, model: nn.Module, spec: InputSpec) -> None:
    """What needs the model: its input size against its patches, and ``--layers`` / ``--map-layer``
    against its blocks."""
    from ..models.blocks import block_indices
    from ..probe.features import backbone_depth, check_image_size

    check_image_size(model, spec.size, "the model's input size")
    depth = backbone_depth(model)
    layers = parse_layers(args.layers)
    if layers is not None:
        block_indices(layers, depth, "--layers")
    if args.map_layer is not None:
        block_indices([args.map_layer], depth, "--map-layer")


def _first_image(args: argparse.Namespace, spec: InputSpec) -> torch.Tensor:
    from ..analysis.images import digits_images, find_images, load_image

    if args.images:
        return load_image(find_images(args.images)[0][0], spec)
    return digits_images(spec=spec, max_images=1)[0][0]


def load_model_and_spec(args: argparse.Namespace) -> tuple[nn.Module, InputSpec]:
    """The model to analyse and what it takes: a timm name (``--model-arg``, ``--attention``,
    ``--checkpoint``), or ``hf:<model id or folder>`` (:func:`vitattn.hf.load_model`, offline; its image
    processor's normalization; ``--attention`` patches it)."""
    from ..analysis.images import InputSpec, input_spec
    from ..analysis.model import build_model

    if not args.model.startswith("hf:"):
        model = build_model(args.model, parse_model_args(args.model_arg), args.attention, args.checkpoint)
        return model, input_spec(model)
    if args.model_arg or args.checkpoint:
        raise ValueError("--model-arg and --checkpoint apply to timm model names, not to hf: models")
    from ..hf.loading import load_model
    from ..patch import patch

    loaded = load_model(args.model)
    if args.attention is not None:
        patch(loaded.model, args.attention)
    return loaded.model.eval(), InputSpec(loaded.image_size, loaded.in_chans, loaded.mean, loaded.std)


def _rollout_images(args: argparse.Namespace, spec: InputSpec) -> torch.Tensor:
    """The first ``--rollout-images`` images of the analysed data, ``(B, C, H, W)``."""
    import torch

    from ..analysis.images import digits_images, image_folder_batches

    count = args.rollout_images
    if count < 1:
        raise ValueError(f"--rollout-images must be >= 1, got {count}")
    if args.images:
        batches = image_folder_batches(args.images, spec, count, count)
        return torch.cat([batch[0] for batch in batches])[:count]
    return digits_images(spec=spec, max_images=count)[0]


def compute_rollout(
    args: argparse.Namespace, model: nn.Module, spec: InputSpec
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The rollout of the first ``--rollout-images`` images: ``(images, heat maps, title)`` for
    :func:`~vitattn.analysis.plots.plot_rollout` (the class token's maps, or Jumbo's J tokens')."""
    from ..analysis.rollout import model_heatmap, model_rollout
    from ..models.origin import is_transformers_model

    if args.gradient_rollout and is_transformers_model(model):
        raise ValueError(
            "--gradient-rollout needs a timm or vitattn ViT; for a transformers model use "
            "vitattn.analysis.gradient_rollout with the gradients of outputs.attentions"
        )
    param = next(model.parameters())
    images = _rollout_images(args, spec).to(param.device, param.dtype)
    rollout = model_rollout(
        model,
        images,
        discard_ratio=args.discard_ratio,
        head_fusion=args.head_fusion,
        gradient=args.gradient_rollout,
    )
    kind = (
        "gradient-weighted rollout"
        if args.gradient_rollout
        else f"attention rollout (discard {args.discard_ratio:g}, {args.head_fusion} over heads)"
    )
    return images, model_heatmap(model, images, rollout), f"{args.model}: {kind}"


def write_rollout(args: argparse.Namespace, model: nn.Module, spec: InputSpec, path: Path) -> Path:
    """``rollout.png``: each image above its rollout heat map (:func:`compute_rollout`)."""
    from ..analysis.plots import plot_rollout

    images, heat, title = compute_rollout(args, model, spec)
    plot_rollout(images, heat, path, title=title)
    return path


def _analysis_data(args: argparse.Namespace, spec: Any) -> tuple[Any, str]:
    """The report's batches ``(images, labels)`` (``--images`` or the digits) and how to name them."""
    from ..analysis.images import digits_images, image_folder_batches

    if args.images:
        return image_folder_batches(args.images, spec, args.batch_size, args.max_images), str(args.images)
    images, labels = digits_images(spec=spec, max_images=args.max_images)
    data = list(zip(images.split(args.batch_size), labels.split(args.batch_size), strict=True))
    return data, f"{args.dataset} (scikit-learn 8x8 digits, resized to {spec.size[0]}x{spec.size[1]})"


@dataclass
class _QueryMaps:
    """One image's attention maps at one block, and the query token whose row is drawn."""

    image: Any  # (C, H, W)
    layer: int
    maps: Any  # (1, H, N, N)
    grid: tuple[int, int]
    prefix: int
    query: Any


def _query_maps(args: argparse.Namespace, model: Any, spec: Any, report: Any) -> _QueryMaps:
    """The maps of ``--map-layer`` (default: the report's last) on the first image; a ``--query``
    outside the grid is a ``ValueError`` naming it (before anything is written)."""
    from ..adapter import layout_of, resolve_layout
    from ..analysis.maps import attention_maps
    from ..analysis.plots import query_token

    image = _first_image(args, spec).to(next(model.parameters()).device)
    layer = report.layers[-1] if args.map_layer is None else args.map_layer
    maps = attention_maps(model, image[None].to(next(model.parameters()).dtype), [layer])
    layer = next(iter(maps))
    layout = layout_of(model)
    tokens, image_grid = maps[layer].shape[-1], layout.grid(image.shape[-2:])
    grid, prefix = resolve_layout(tokens, image_grid, layout.num_prefix_tokens)
    query = parse_query(args.query)
    try:
        query_token(query, grid, prefix)
    except ValueError as err:
        raise ValueError(f"--query {args.query!r}: {err}") from err
    return _QueryMaps(image, layer, maps[layer][0], grid, prefix, query)


def _write_analysis(
    args: argparse.Namespace, reports: dict[str, Any], report: Any, q: _QueryMaps, rollout: Any
) -> list[Path]:
    """Write ``report.json`` and the PNGs to ``args.out``; the paths written, in order."""
    from ..analysis.plots import (
        plot_alpha_per_layer,
        plot_locality_plane,
        plot_mad_per_layer,
        plot_query_attention,
        plot_rollout,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = ("report.json", "locality_plane.png", "mad_per_layer.png", "attention_maps.png")
    written = [out / name for name in names]
    report.to_json(written[0])
    plot_locality_plane(reports, written[1], title=f"Attention locality per head: {args.model}")
    plot_mad_per_layer(reports, written[2])
    if report.alpha:  # the model learns its alpha-entmax alphas
        written.append(out / "alpha_per_layer.png")
        plot_alpha_per_layer(reports, written[-1], title=f"Learned alpha per head: {args.model}")
    title = f"{args.model}, block {q.layer}: attention of one query, per head"
    plot_query_attention(q.image, q.maps, q.grid, q.prefix, q.query, written[3], title=title)
    if rollout is not None:
        written.append(out / "rollout.png")
        plot_rollout(rollout[0], rollout[1], written[-1], title=rollout[2])
    return written


def run_analyze(args: argparse.Namespace) -> int:
    """Check the options, build the model, run ``locality_report`` and compute the maps (and the rollout),
    then print the report and write JSON and PNGs to ``args.out``: nothing is written before every
    input has been checked and every number computed."""
    import torch

    from ..analysis.report import LocalityReport, locality_report

    check_args(args)
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with hf_progress(args.model, not args.no_progress):
        model, spec = load_model_and_spec(args)
    check_model_args(args, model, spec)
    model.to(device)
    other = LocalityReport.from_json(Path(args.compare)) if args.compare else None
    data, source = _analysis_data(args, spec)
    layers = parse_layers(args.layers)
    report = locality_report(
        model, data, max_images=args.max_images, layers=layers, progress=not args.no_progress, name=args.model
    )
    report.meta.update(
        data=source,
        checkpoint=str(args.checkpoint) if args.checkpoint else None,
        attention=args.attention,
        model_args=parse_model_args(args.model_arg),
    )
    q = _query_maps(args, model, spec, report)
    rollout = compute_rollout(args, model, spec) if args.rollout else None

    print(report)
    reports = {args.model: report}
    if other is not None:
        print()
        print(other.compare(report, names=(f"{other.model} ({args.compare})", args.model)))
        reports = {f"{other.model} (reference)": other, args.model: report}
    for path in _write_analysis(args, reports, report, q, rollout):
        print(f"wrote {path}", file=sys.stderr)
    return 0
