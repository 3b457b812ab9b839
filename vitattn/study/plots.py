"""Figures of a study folder: the analysis module's MAD–entropy plane and MAD per layer, the
study's own scatter of minimum first-layer MAD against test accuracy (one point per run), and, on
datasets with masks, the attentions side by side on a few test scenes (where one query looks in the
first block, and PCA images of the probed block's patch features)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..analysis import LocalityReport, plot_locality_plane, plot_mad_per_layer
from ..analysis.plots import new_figure as _figure
from ..analysis.plots import save_figure as _save
from .results import report_of
from .words import plural

__all__ = ["padded_limits", "plot_attention_comparison", "plot_min_mad_vs_accuracy", "write_plots"]

_MARKERS = "o^sDvP*X"


def _group(run: dict[str, Any]) -> str:
    return f"{run['protocol']} / {run['attention']}{'+prr' if run.get('prr') else ''}"


def padded_limits(values: list[float], pad: float = 0.08, floor: float | None = None) -> tuple[float, float]:
    """Axis limits that hold every value with a margin of ``pad`` times the span on each side, so
    that no marker touches (or is clipped by) the frame; the span covers ``floor`` too when given
    (e.g. 0 for an axis meant to start at 0). A single value gets a span of 1 % of its size (at least
    0.01)."""
    lo, hi = min(values), max(values)
    if floor is not None:
        lo = min(lo, floor)
    span = hi - lo if hi > lo else max(abs(hi) * 0.01, 0.01)
    return lo - pad * span, hi + pad * span


def plot_min_mad_vs_accuracy(
    runs: list[dict[str, Any]], path: str | Path | None = None, title: str = ""
) -> Any:
    """Each run as a point (min head MAD of the first layers, test accuracy %): filled when it used
    CutMix, open without; one marker per protocol / attention. The axes hold every point with a
    margin (:func:`padded_limits`; MAD from 0)."""
    fig = _figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    groups = list(dict.fromkeys(_group(r) for r in runs))
    xs = [r["min_mad_first"] for r in runs if r.get("min_mad_first") is not None]
    ys = [100 * r["test_acc"] for r in runs if r.get("min_mad_first") is not None]
    for k, g in enumerate(groups):
        rs = [r for r in runs if _group(r) == g and r.get("min_mad_first") is not None]
        if not rs:
            continue
        cut = rs[0]["components"]["cutmix"]
        ax.scatter(
            [r["min_mad_first"] for r in rs],
            [100 * r["test_acc"] for r in rs],
            marker=_MARKERS[k % len(_MARKERS)],
            s=46,
            facecolors=f"C{k % 10}" if cut else "none",
            edgecolors=f"C{k % 10}",
            linewidths=1.3,
            label=f"{g}{' (CutMix)' if cut else ''}",
            zorder=3,
        )
    first = runs[0].get("first_layers", [0]) if runs else [0]
    blocks = f"blocks {first[0]}–{first[-1]}" if len(first) > 1 else f"block {first[0]}"
    ax.set_xlabel(f"minimum head MAD in {blocks} (fraction of the grid diagonal)")
    ax.set_ylabel("test accuracy (%)")
    if xs:
        ax.set_xlim(*padded_limits(xs, floor=0.0))
        ax.set_ylim(*padded_limits(ys))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title or "Locality of the first layers vs accuracy (one point per run)")
    return _save(fig, path)


def _query_patch(mask: torch.Tensor, label: int, grid: tuple[int, int]) -> int:
    """Row-major index of the patch under the centroid of the main digit's pixels (``label + 1``)."""
    ys, xs = torch.nonzero(mask == label + 1, as_tuple=True)
    h, w = mask.shape
    if ys.numel() == 0:
        return (grid[0] // 2) * grid[1] + grid[1] // 2
    row = min(int(ys.double().mean() * grid[0] / h), grid[0] - 1)
    col = min(int(xs.double().mean() * grid[1] / w), grid[1] - 1)
    return row * grid[1] + col


def plot_attention_comparison(
    folder: Path, data: dict[str, Any], num_images: int = 4, path: str | Path | None = None
) -> Any:
    """The first seed of each protocol / attention on ``num_images`` test scenes, side by side.

    Per run two rows: where the query at the main digit's centre (cyan box) looks in block 0 (mean
    over heads, over the patches) and the PCA image (first three components as RGB) of the probed
    block's patch features. Reloads each run's ``model.safetensors`` from ``folder``; None when the
    dataset has no masks.
    """
    import dataclasses

    from safetensors.torch import load_file

    from ..adapter import layout_of
    from ..probe import pca_images
    from .builtin_datasets import probe_datasets
    from .config import StudyConfig
    from .dataset_specs import DATASETS
    from .model import build_model
    from .run_data import probe_transform

    cfg = data["config"]
    config = StudyConfig.from_dict(cfg)
    has_masks = DATASETS[cfg["dataset"]].has_masks
    sets = probe_datasets(cfg["dataset"], config.scenes_version) if has_masks else None
    if sets is None or not data["runs"]:
        return None
    from matplotlib.patches import Rectangle

    from ..analysis import attention_maps

    test = sets[1]
    items = [test[i] for i in range(min(num_images, len(test)))]
    images = torch.stack([it[0] for it in items])
    x = probe_transform(config)(images)
    # the architecture of each run without its starting weights: model.safetensors holds them all
    bare = dataclasses.replace(config, pretrained=False, checkpoint=None, gaug_init=config.gaug_init)
    firsts: dict[str, dict[str, Any]] = {}
    for r in data["runs"]:
        firsts.setdefault(_group(r), r)
    rows = 1 + 2 * len(firsts)
    n = len(items)
    fig = _figure(figsize=(1.7 * n + 1.2, 1.6 * rows))
    axes = fig.subplots(rows, n, squeeze=False)
    for j in range(n):
        axes[0][j].imshow(images[j].permute(1, 2, 0).numpy())
        axes[0][j].set_title(f"label {int(items[j][1])}", fontsize=8)
    axes[0][0].set_ylabel("scene", fontsize=8)
    for k, (name, run) in enumerate(firsts.items()):
        model: Any = build_model(bare, run["attention"])  # a timm ViT (blocks, forward_intermediates)
        model.load_state_dict(load_file(str(folder / run["checkpoint"])))
        model.eval()
        gh, gw = layout_of(model).grid() or tuple(cfg["grid_size"])
        queries = [_query_patch(it[2], int(it[1]), (gh, gw)) for it in items]
        probe = run.get("probe") or {}
        layer = int(probe.get("layer", len(model.blocks) - 1))
        with torch.no_grad():
            maps = attention_maps(model, x, layers=[0])[0]  # (B, H, N, N)
            feats = model.forward_intermediates(
                x, indices=[layer], output_fmt="NCHW", intermediates_only=True
            )
        if not isinstance(feats, list):  # intermediates_only=True gives the list of block outputs
            raise TypeError(f"forward_intermediates returned {type(feats).__name__}, expected a list")
        pca = pca_images(feats[-1])
        prefix = int(model.num_prefix_tokens)
        for j in range(n):
            q = queries[j]
            row = maps[j, :, prefix + q, prefix:].mean(0).reshape(gh, gw)
            ax = axes[1 + 2 * k][j]
            ax.imshow(row.numpy(), cmap="magma")
            ax.add_patch(Rectangle((q % gw - 0.5, q // gw - 0.5), 1, 1, fill=False, ec="cyan", lw=1.2))
            axes[2 + 2 * k][j].imshow(pca[j].permute(1, 2, 0).numpy())
        axes[1 + 2 * k][0].set_ylabel(f"{name}\nblock 0 attention", fontsize=7)
        axes[2 + 2 * k][0].set_ylabel(f"{name}\nPCA block {layer}", fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{cfg['dataset']}: attention of the main digit's centre and patch-feature PCA", fontsize=9)
    return _save(fig, path)


def write_plots(folder: Path, data: dict[str, Any]) -> list[Path]:
    """Write ``locality_plane.png``, ``mad_per_layer.png``, ``min_mad_vs_acc.png`` and, on
    datasets with masks, ``attention_comparison.png`` into ``folder``.

    The two analysis plots show one run per protocol / attention (its first seed: heads of
    different seeds are not the same heads, so they are not averaged)."""
    runs = data["runs"]
    if not runs:
        return []
    firsts: dict[str, LocalityReport] = {}
    for r in runs:
        firsts.setdefault(_group(r), report_of(r, data["config"]))
    cfg = data["config"]
    what = f"{cfg['dataset']}, {plural(cfg['epochs'], 'epoch')}, first seed of each"
    paths = [folder / "locality_plane.png", folder / "mad_per_layer.png", folder / "min_mad_vs_acc.png"]
    plot_locality_plane(firsts, paths[0], title=f"Attention locality per head ({what})")
    plot_mad_per_layer(firsts, paths[1], title=f"Locality per layer ({what}; band: min–max over heads)")
    plot_min_mad_vs_accuracy(runs, paths[2], title=f"First-layer locality vs accuracy ({cfg['dataset']})")
    comparison = folder / "attention_comparison.png"
    if plot_attention_comparison(folder, data, path=comparison) is not None:
        paths.append(comparison)
    return paths
