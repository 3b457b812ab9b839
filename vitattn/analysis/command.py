"""``vitattn analyze``: a locality report, its JSON and plots for a timm or vitattn model."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .checkpoint import load_checkpoint
from .data import digits_images, find_images, image_folder_batches, input_spec, load_image
from .layout import model_grid_size, model_num_prefix_tokens, resolve_layout
from .maps import attention_maps
from .report import LocalityReport, locality_report

__all__ = ["build_model", "parse_layers", "parse_model_args", "parse_query", "run_analyze"]

DATASETS = ("digits",)


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """``["img_size=32", "depth=2", "global_pool=avg"]`` -> kwargs (Python literals, else strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--model-arg expects KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def parse_layers(text: str | None) -> list[int] | None:
    """``"0,3,-1"`` or ``"0 3 -1"`` -> ``[0, 3, -1]``; None / ``"all"`` -> None."""
    if text is None or text.strip().lower() == "all":
        return None
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as err:
        raise ValueError(f"--layers expects block indices like '0,3,-1', got {text!r}") from err


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


def build_model(
    name: str,
    model_args: dict[str, Any] | None = None,
    attention: Literal["softmax", "entmax15", "locat"] | None = None,
    checkpoint: str | Path | None = None,
) -> nn.Module:
    """A timm model (vitattn's ``locatvit_*`` included) with random init, optionally patched with
    vitattn attention (``attention``: softmax / entmax15 / locat) and loaded from ``checkpoint``."""
    import timm

    from .. import models as _models  # noqa: F401  (registers locatvit_* with timm)
    from ..patch import patch

    try:
        model = timm.create_model(name, pretrained=False, **(model_args or {}))
    except RuntimeError as err:
        if "Unknown model" in str(err):
            raise ValueError(
                f"unknown model {name!r}: give a timm model name (see timm.list_models())"
            ) from err
        raise
    if attention is not None:
        patch(model, attention)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval()


def _first_image(args: argparse.Namespace, model: nn.Module) -> torch.Tensor:
    spec = input_spec(model)
    if args.images:
        return load_image(find_images(args.images)[0][0], spec)
    return digits_images(spec=spec, max_images=1)[0][0]


def run_analyze(args: argparse.Namespace) -> int:
    """Build the model, run :func:`locality_report`, print it, write JSON and PNGs to ``args.out``."""
    from .plots import plot_locality_plane, plot_mad_per_layer, plot_query_attention

    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(args.model, parse_model_args(args.model_arg), args.attention, args.checkpoint)
    model.to(device)
    spec = input_spec(model)
    if args.images:
        data: Any = image_folder_batches(args.images, spec, args.batch_size, args.max_images)
        source = str(args.images)
    else:
        images, labels = digits_images(spec=spec, max_images=args.max_images)
        data = list(zip(images.split(args.batch_size), labels.split(args.batch_size), strict=True))
        source = f"{args.dataset} (scikit-learn 8x8 digits, resized to {spec.size[0]}x{spec.size[1]})"
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
    print(report)
    reports = {args.model: report}
    if args.compare:
        other = LocalityReport.from_json(Path(args.compare))
        print()
        print(other.compare(report, names=(f"{other.model} ({args.compare})", args.model)))
        reports = {f"{other.model} (reference)": other, args.model: report}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        out / "report.json",
        out / "locality_plane.png",
        out / "mad_per_layer.png",
        out / "attention_maps.png",
    ]
    report.to_json(written[0])
    plot_locality_plane(reports, written[1], title=f"Attention locality per head: {args.model}")
    plot_mad_per_layer(reports, written[2])
    image = _first_image(args, model).to(device)
    layer = report.layers[-1] if args.map_layer is None else args.map_layer
    maps = attention_maps(model, image[None].to(next(model.parameters()).dtype), [layer])
    layer = next(iter(maps))
    grid, prefix = resolve_layout(
        maps[layer].shape[-1], model_grid_size(model, image.shape[-2:]), model_num_prefix_tokens(model)
    )
    plot_query_attention(
        image,
        maps[layer][0],
        grid,
        prefix,
        parse_query(args.query),
        written[3],
        title=f"{args.model}, block {layer}: attention of one query, per head",
    )
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0
