"""PCA images of patch features next to the input images (matplotlib ``Figure``, no pyplot)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_pca_images"]


def plot_pca_images(
    images: torch.Tensor,
    pcas: Mapping[str, torch.Tensor],
    path: str | Path | None = None,
    title: str | None = None,
) -> Figure:
    """A grid: the input images ``(B, 3, H, W)`` (values clamped to [0, 1]) in the first row, then one
    row per entry of ``pcas`` (``{name: (B, 3, gh, gw)}`` from :func:`~vitattn.probe.pca_images`),
    labelled with its name. Saved as PNG to ``path`` when given; the figure is returned."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib (pip install 'vitattn[study]')") from err
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be (B, 3, H, W) or (B, 1, H, W), got shape {tuple(images.shape)}")
    b = images.shape[0]
    for name, p in pcas.items():
        if p.ndim != 4 or p.shape[0] != b or p.shape[1] != 3:
            raise ValueError(f"pcas[{name!r}] must be (B={b}, 3, gh, gw), got shape {tuple(p.shape)}")
    rows = 1 + len(pcas)
    fig = Figure(figsize=(1.3 * b + 1.2, 1.3 * rows + (0.4 if title else 0)), layout="constrained")
    axes = fig.subplots(rows, b, squeeze=False)
    grids = [("input", images.detach().float().cpu().clamp(0, 1))]
    grids += [(name, p.detach().float().cpu().clamp(0, 1)) for name, p in pcas.items()]
    for r, (name, batch) in enumerate(grids):
        for c in range(b):
            ax = axes[r][c]
            img = batch[c].permute(1, 2, 0).numpy()
            ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(name, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=110, format="png")
    return fig
