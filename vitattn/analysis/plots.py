"""Plots of attention locality (matplotlib, no pyplot state: figures render with Agg to PNG).

- :func:`plot_locality_plane`: one point per head in the (MAD, entropy) plane, coloured by depth.
- :func:`plot_mad_per_layer`: MAD (and entropy) per layer, mean over heads with the head spread.
- :func:`plot_query_attention`: where one query patch looks, per head, over the input image.
- :func:`plot_rollout`: rollout heat maps (class token to patches) upsampled over the input images.
- :func:`plot_alpha_per_layer`: the alpha-entmax alpha each head learned, per layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..functional import grid_pair
from .metrics import grid_distances, mean_attention_distance
from .report import LocalityReport
from .rollout import upsample_heatmap

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "plot_alpha_per_layer",
    "plot_locality_plane",
    "plot_mad_per_layer",
    "plot_query_attention",
    "plot_rollout",
    "query_token",
]

_MARKERS = "o^sDvP*X"
Reports = LocalityReport | Mapping[str, LocalityReport] | Sequence[LocalityReport]


def new_figure(**kwargs: Any) -> Figure:
    """A matplotlib ``Figure`` with constrained layout, outside pyplot (renders with Agg)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib (pip install 'vitattn[study]')") from err
    return Figure(layout="constrained", **kwargs)


def save_figure(fig: Figure, path: str | Path | None, dpi: int = 130) -> Figure:
    """Write ``fig`` as a PNG at ``path`` (parents created) when a path is given; return ``fig``."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=dpi, format="png")  # a bare Figure renders with the Agg canvas
    return fig


def _named(reports: Reports) -> dict[str, LocalityReport]:
    if isinstance(reports, LocalityReport):
        return {reports.model or "model": reports}
    if isinstance(reports, Mapping):
        return dict(reports)
    out: dict[str, LocalityReport] = {}
    for i, r in enumerate(reports):
        out[r.model if r.model and r.model not in out else f"{r.model or 'model'} #{i}"] = r
    return out


def _uniform_mad(grid: tuple[int, int]) -> float:
    n = grid[0] * grid[1]
    return float(mean_attention_distance(torch.full((n, n), 1.0 / n, dtype=torch.float64), grid))


def plot_locality_plane(reports: Reports, path: str | Path | None = None, title: str | None = None) -> Figure:
    """Every head as a point (normalized MAD, normalized entropy), coloured by its block index.

    ``reports``: one :class:`LocalityReport`, a list, or ``{name: report}`` (one marker each).
    A grey star marks uniform attention on each report's grid (the top-right corner of reach).
    """
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm
    from matplotlib.lines import Line2D

    named = _named(reports)
    fig = new_figure(figsize=(6.4, 4.6))
    ax = fig.add_subplot()
    last = max((max(r.layers) for r in named.values() if r.layers), default=0)
    cmap = colormaps["viridis"].resampled(last + 1)  # one colour per block
    norm = BoundaryNorm([i - 0.5 for i in range(last + 2)], last + 1)
    x_max = 0.0
    for k, (name, rep) in enumerate(named.items()):
        xs = [v for row in rep.mad for v in row]
        ys = [v for row in rep.entropy for v in row]
        cs = [layer for layer, row in zip(rep.layers, rep.mad, strict=True) for _ in row]
        x_max = max([x_max] + [x for x in xs if not math.isnan(x)])
        marker = _MARKERS[k % len(_MARKERS)]
        ax.scatter(
            xs,
            ys,
            c=cs,
            cmap=cmap,
            norm=norm,
            marker=marker,
            s=34,
            edgecolors="black",
            linewidths=0.4,
            label=name,
            zorder=3,
        )
    for grid in {r.grid_size for r in named.values() if r.grid_size is not None}:
        u = _uniform_mad(grid)
        x_max = max(x_max, u)
        ax.scatter(
            [u],
            [1.0],
            marker="*",
            s=160,
            color="0.4",
            alpha=0.8,
            zorder=4,
            label=f"uniform attention ({grid[0]}x{grid[1]})",
        )
    step = max(1, math.ceil((last + 1) / 12))
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap),
        ax=ax,
        label="layer (block index)",
        ticks=range(0, last + 1, step),
    )
    ax.set_xlim(0, max(0.1, x_max * 1.08))
    ax.set_ylim(0, 1.04)
    ax.set_xlabel("mean attention distance (fraction of the grid diagonal)")
    ax.set_ylabel("attention entropy (fraction of log #patches)")
    ax.grid(alpha=0.3)
    handles = [  # neutral legend markers: the colour encodes depth, not the model
        Line2D([], [], ls="", marker=_MARKERS[k % len(_MARKERS)], color="0.75", mec="black", label=name)
        for k, name in enumerate(named)
    ]
    stars = [h for h in ax.collections if str(h.get_label()).startswith("uniform")]
    ax.legend(handles=handles + stars, loc="lower right", fontsize=8)
    ax.set_title(title or "Attention locality per head")
    return save_figure(fig, path)


def plot_mad_per_layer(
    reports: Reports, path: str | Path | None = None, entropy: bool = True, title: str | None = None
) -> Figure:
    """Normalized MAD per layer: mean over heads (line), min–max over heads (band), heads (dots).

    With ``entropy=True`` a second panel shows the normalized entropy the same way.
    """
    from matplotlib.ticker import MaxNLocator

    named = _named(reports)
    metrics = [("mad", "mean attention distance (normalized)")]
    if entropy:
        metrics.append(("entropy", "attention entropy (normalized)"))
    fig = new_figure(figsize=(5.2 * len(metrics), 4.0))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for k, (name, rep) in enumerate(named.items()):
            values = getattr(rep, key)
            stats = rep.layer_summary()
            color = f"C{k}"
            mean = [s[f"{key}_mean"] for s in stats]
            lo, hi = [s[f"{key}_min"] for s in stats], [s[f"{key}_max"] for s in stats]
            ax.fill_between(rep.layers, lo, hi, color=color, alpha=0.18, linewidth=0)
            ax.plot(rep.layers, mean, marker=_MARKERS[k % len(_MARKERS)], color=color, label=name)
            xs = [layer for layer, row in zip(rep.layers, values, strict=True) for _ in row]
            ax.scatter(xs, [v for row in values for v in row], s=9, color=color, alpha=0.6, zorder=3)
        top = max(
            [v for r in named.values() for row in getattr(r, key) for v in row if not math.isnan(v)] + [0.1]
        )
        if key == "mad":  # uniform attention on each grid, for scale
            for grid in sorted({r.grid_size for r in named.values() if r.grid_size is not None}):
                u = _uniform_mad(grid)
                ax.axhline(u, color="0.5", ls="--", lw=1, label=f"uniform attention ({grid[0]}x{grid[1]})")
                top = max(top, u)
        ax.set_ylim(0, 1.04 if key == "entropy" else top * 1.1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer (block index)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "Locality per layer (line: mean over heads, band: min–max)")
    return save_figure(fig, path)


def plot_alpha_per_layer(
    reports: Reports, path: str | Path | None = None, title: str | None = None
) -> Figure:
    """The alpha of every head per layer (dots, heads side by side) and its mean over heads (line), for
    the reports that hold alphas (:attr:`LocalityReport.alpha`, learned with ``normalizer="adaptive"``);
    dashed lines mark softmax (1), entmax-1.5 (1.5) and sparsemax (2).

    Raises ``ValueError`` when no report holds alphas.
    """
    from matplotlib.ticker import MaxNLocator

    named = {name: rep for name, rep in _named(reports).items() if rep.alpha}
    if not named:
        raise ValueError("no report holds alphas (no reported layer learns them: normalizer='adaptive')")
    fig = new_figure(figsize=(5.6, 4.0))
    ax = fig.subplots()
    for alpha, label in ((1.0, "softmax"), (1.5, "entmax-1.5"), (2.0, "sparsemax")):
        ax.axhline(alpha, color="0.6", ls="--", lw=0.8)
        ax.text(0.995, alpha, label, transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=7)
    for k, (name, rep) in enumerate(named.items()):
        color = f"C{k}"
        means = [_nan_mean(row) for row in rep.alpha]
        ax.plot(rep.layers, means, marker=_MARKERS[k % len(_MARKERS)], color=color, label=name)
        for layer, row in zip(rep.layers, rep.alpha, strict=True):
            spread = [0.25 * (h - (len(row) - 1) / 2) / max(len(row), 1) for h in range(len(row))]
            ax.scatter([layer + d for d in spread], row, s=12, color=color, alpha=0.7, zorder=3)
    ax.set_ylim(0.95, 2.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (block index)")
    ax.set_ylabel("alpha-entmax alpha")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "Learned alpha per head (line: mean over heads)")
    return save_figure(fig, path)


def _nan_mean(values: Sequence[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return sum(ok) / len(ok) if ok else math.nan


def query_token(
    query: int | Sequence[int] | str | None, grid: tuple[int, int], prefix: int
) -> tuple[int, str]:
    """Token index of ``query`` and a label: None = centre patch, int = patch index, (row, col), or
    ``"cls"`` / ``"prefix"`` for token 0 (needs a prefix token)."""
    gh, gw = grid
    if isinstance(query, str):
        if query not in ("cls", "prefix") or prefix == 0:
            raise ValueError(
                f"query={query!r}: only 'cls' / 'prefix' (token 0, needs a prefix token) are names"
            )
        return 0, "class token"
    if query is None:
        query = (gh // 2, gw // 2)
    if isinstance(query, int):
        if not 0 <= query < gh * gw:
            raise ValueError(f"query patch index {query} is out of range for a {gh}x{gw} grid")
        query = divmod(query, gw)
    r, c = (int(v) for v in query)
    if not (0 <= r < gh and 0 <= c < gw):
        raise ValueError(f"query (row, col) = ({r}, {c}) is outside the {gh}x{gw} grid")
    return prefix + r * gw + c, f"patch ({r}, {c})"


def plot_query_attention(
    image: torch.Tensor,
    attn: torch.Tensor,
    grid_size: int | Sequence[int],
    num_prefix_tokens: int = 0,
    query: int | Sequence[int] | str | None = None,
    path: str | Path | None = None,
    title: str | None = None,
) -> Figure:
    """Where one query looks, per head: its attention over the patches, overlaid on the image.

    Args:
        image: ``(C, H, W)`` input image (any normalization: shown min–max rescaled).
        attn: ``(H, N, N)`` or ``(1, H, N, N)`` probabilities of one block for this image.
        grid_size, num_prefix_tokens: the token layout of ``attn``.
        query: None (centre patch), a patch index (row-major), ``(row, col)``, or ``"cls"``.

    Each head's panel shows the query's probabilities over the patches (renormalized over patches,
    colour scale per head), the query outlined in cyan, and its attention distance ``d`` in patches.
    """
    from matplotlib.patches import Rectangle

    grid = grid_pair("grid_size", grid_size)
    if attn.dim() == 4 and attn.shape[0] == 1:
        attn = attn[0]
    n = num_prefix_tokens + grid[0] * grid[1]
    if attn.dim() != 3 or attn.shape[-2:] != (n, n):
        raise ValueError(
            f"attn must be (H, {n}, {n}) for grid {grid} with {num_prefix_tokens} prefix tokens, "
            f"got {tuple(attn.shape)}"
        )
    if image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    if image.dim() != 3:
        raise ValueError(f"image must be (C, H, W), got {tuple(image.shape)}")
    token, label = query_token(query, grid, num_prefix_tokens)
    img = image.detach().float().cpu()
    img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-12)
    shown = (img[0] if img.shape[0] == 1 else img[:3].permute(1, 2, 0)).numpy()
    h_px, w_px = img.shape[-2:]
    rows = attn[:, token, num_prefix_tokens:].detach().double().cpu()
    rows = rows / rows.sum(-1, keepdim=True).clamp_min(1e-30)
    dist = grid_distances(grid, dtype=torch.float64)
    heads = rows.shape[0]
    ncols = min(heads + 1, 6)
    nrows = math.ceil((heads + 1) / ncols)
    fig = new_figure(figsize=(2.3 * ncols, 2.45 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    cell_h, cell_w = h_px / grid[0], w_px / grid[1]
    extent = (0, w_px, h_px, 0)
    for k, ax in enumerate(axes):
        ax.set_axis_off()
        if k > heads:
            continue
        ax.imshow(shown, cmap="gray", extent=extent)
        if k == 0:
            ax.set_title(f"input, query {label}", fontsize=8)
        else:
            row = rows[k - 1]
            heat = row.view(grid).numpy()
            ax.imshow(heat, cmap="inferno", alpha=0.6, extent=extent, interpolation="nearest", vmin=0)
            if token >= num_prefix_tokens:
                d = float(row @ dist[token - num_prefix_tokens])
                ax.set_title(f"head {k - 1}  d = {d:.2f} patches", fontsize=8)
            else:
                ax.set_title(f"head {k - 1}", fontsize=8)
        if token >= num_prefix_tokens:
            r, c = divmod(token - num_prefix_tokens, grid[1])
            ax.add_patch(
                Rectangle((c * cell_w, r * cell_h), cell_w, cell_h, fill=False, color="cyan", lw=1.2)
            )
    fig.suptitle(title or f"attention of {label} (max-normalized per head)", fontsize=10)
    return save_figure(fig, path)


def _shown(image: torch.Tensor) -> Any:
    """``(C, H, W)`` -> an array for ``imshow``, min–max rescaled (grey for one channel)."""
    img = image.detach().float().cpu()
    img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-12)
    return (img[0] if img.shape[0] == 1 else img[:3].permute(1, 2, 0)).numpy()


def plot_rollout(
    images: torch.Tensor,
    heatmaps: torch.Tensor,
    path: str | Path | None = None,
    title: str | None = None,
    labels: Sequence[str] | None = None,
    alpha: float = 0.55,
) -> Figure:
    """Each image beside its heat map (e.g. :func:`~vitattn.analysis.rollout_heatmap`), upsampled
    bilinearly to the image and overlaid on it.

    Args:
        images: ``(B, C, H, W)`` (or one ``(C, H, W)``) inputs, any normalization (min–max rescaled).
        heatmaps: ``(B, gh, gw)`` (or ``(gh, gw)``): one patch-grid map per image, shown scaled by its
            maximum.
        labels: a caption per image (e.g. the predicted class).
        alpha: opacity of the heat map over the image.
    """
    if images.dim() == 3:
        images = images[None]
    if heatmaps.dim() == 2:
        heatmaps = heatmaps[None]
    if images.dim() != 4 or heatmaps.dim() != 3 or images.shape[0] != heatmaps.shape[0]:
        raise ValueError(
            f"images must be (B, C, H, W) and heatmaps (B, gh, gw) with the same B, got "
            f"{tuple(images.shape)} and {tuple(heatmaps.shape)}"
        )
    if labels is not None and len(labels) != images.shape[0]:
        raise ValueError(f"labels has {len(labels)} entries for {images.shape[0]} images")
    b, (h_px, w_px) = images.shape[0], images.shape[-2:]
    up = upsample_heatmap(heatmaps.detach().cpu(), (h_px, w_px)).numpy()
    fig = new_figure(figsize=(2.6 * min(b, 4), 1.45 * 2 * math.ceil(b / 4) + 0.4))
    axes = fig.subplots(2 * math.ceil(b / 4), min(b, 4), squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    for k in range(b):
        r, c = 2 * (k // 4), k % 4
        shown = _shown(images[k])
        axes[r, c].imshow(shown, cmap="gray")
        axes[r, c].set_title(labels[k] if labels is not None else f"image {k}", fontsize=8)
        axes[r + 1, c].imshow(shown, cmap="gray")
        axes[r + 1, c].imshow(up[k], cmap="jet", alpha=alpha, vmin=0.0, vmax=1.0)
    fig.suptitle(title or "attention rollout: class token to patches", fontsize=10)
    return save_figure(fig, path)
