"""Figures of a study folder: the analysis module's MAD–entropy plane and MAD per layer, and the
study's own scatter of minimum first-layer MAD against test accuracy (one point per run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..analysis import LocalityReport, plot_locality_plane, plot_mad_per_layer
from .results import report_of

__all__ = ["plot_min_mad_vs_accuracy", "write_plots"]

_MARKERS = "o^sDvP*X"


def _figure(**kwargs: Any) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib (pip install 'vitattn[study]')") from err
    return Figure(layout="constrained", **kwargs)


def _save(fig: Any, path: str | Path | None) -> Any:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=130, format="png")  # a bare Figure renders with Agg
    return fig


def _group(run: dict[str, Any]) -> str:
    return f"{run['protocol']} / {run['attention']}{'+prr' if run.get('prr') else ''}"


def plot_min_mad_vs_accuracy(
    runs: list[dict[str, Any]], path: str | Path | None = None, title: str = ""
) -> Any:
    """Each run as a point (min head MAD of the first layers, test accuracy %): filled when it used
    CutMix, open without; one marker per protocol / attention."""
    fig = _figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    groups = list(dict.fromkeys(_group(r) for r in runs))
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
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title or "Locality of the first layers vs accuracy (one point per run)")
    return _save(fig, path)


def write_plots(folder: Path, data: dict[str, Any]) -> list[Path]:
    """Write ``locality_plane.png``, ``mad_per_layer.png`` and ``min_mad_vs_acc.png`` into ``folder``.

    The two analysis plots show one run per protocol / attention (its first seed: heads of
    different seeds are not the same heads, so they are not averaged)."""
    runs = data["runs"]
    if not runs:
        return []
    firsts: dict[str, LocalityReport] = {}
    for r in runs:
        firsts.setdefault(_group(r), report_of(r, data["config"]))
    cfg = data["config"]
    what = f"{cfg['dataset']}, {cfg['epochs']} epochs, first seed of each"
    paths = [folder / "locality_plane.png", folder / "mad_per_layer.png", folder / "min_mad_vs_acc.png"]
    plot_locality_plane(firsts, paths[0], title=f"Attention locality per head ({what})")
    plot_mad_per_layer(firsts, paths[1], title=f"Locality per layer ({what}; band: min–max over heads)")
    plot_min_mad_vs_accuracy(runs, paths[2], title=f"First-layer locality vs accuracy ({cfg['dataset']})")
    return paths
