"""Locality report: per layer and head MAD and entropy of a ViT, averaged over images (and the alpha-entmax
alpha of each head, when some layer learns it)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..adapter import ModelLayout, resolve_layout
from .maps import _analysis_layout, _evaluating, _record_layout
from .metrics import attention_entropy, grid_diagonal, mean_attention_distance

__all__ = ["LocalityReport", "ReportDiff", "head_alphas", "iter_image_batches", "locality_report"]


def _nan_stats(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, min, max) over the non-NaN values; NaN for each when there are none."""
    ok = [v for v in values if not math.isnan(v)]
    if not ok:
        return math.nan, math.nan, math.nan
    return sum(ok) / len(ok), min(ok), max(ok)


def _fmt(v: float, width: int = 9, signed: bool = False) -> str:
    return f"{'nan':>{width}}" if math.isnan(v) else f"{v:>+{width}.4f}" if signed else f"{v:>{width}.4f}"


def _compact_lists(text: str) -> str:
    """Put each innermost JSON list (numbers, strings without brackets) on one line."""
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def _plain(rows: list[list[float]]) -> list[list[float | None]]:
    return [[None if math.isnan(v) else float(v) for v in row] for row in rows]


def _floats(rows: Iterable[Iterable[float | None]]) -> list[list[float]]:
    return [[math.nan if v is None else float(v) for v in row] for row in rows]


@dataclass
class LocalityReport:
    """Per layer (``layers[l]`` = block index) and head: normalized MAD and entropy, image-averaged.

    ``mad[l][h]`` is the mean attention distance over the grid diagonal and ``entropy[l][h]`` the
    entropy over ``log(patches)``, both in ``[0, 1]`` (NaN for a head that never put mass on a
    patch). ``sparsity[l][h]`` is the fraction of exact zeros in the head's whole attention matrix
    (every query and key, prefix tokens included): 0 for softmax, large for entmax-1.5; empty when
    the report was read from a file that predates it. ``alpha[l][h]`` is the head's alpha-entmax alpha
    (learned by an ``"adaptive"`` layer; softmax 1, entmax-1.5 1.5, sparsemax 2 for the others; NaN
    where a layer's normalizer is unknown), given when at least one reported layer learns its alphas,
    else empty. ``grid_size`` is None when the images came in several sizes.
    """

    layers: list[int]
    mad: list[list[float]]
    entropy: list[list[float]]
    grid_size: tuple[int, int] | None
    num_prefix_tokens: int
    num_images: int
    model: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    sparsity: list[list[float]] = field(default_factory=list)
    alpha: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (len(self.layers) == len(self.mad) == len(self.entropy)):
            raise ValueError(
                f"layers, mad and entropy must have one entry per layer, got {len(self.layers)}, "
                f"{len(self.mad)} and {len(self.entropy)}"
            )
        for layer, m, e in zip(self.layers, self.mad, self.entropy, strict=True):
            if len(m) != len(e):
                raise ValueError(f"layer {layer}: {len(m)} MAD values but {len(e)} entropy values")
        if self.sparsity and [len(s) for s in self.sparsity] != [len(m) for m in self.mad]:
            raise ValueError("sparsity must have one value per head of every layer, or be empty")
        if self.alpha and [len(a) for a in self.alpha] != [len(m) for m in self.mad]:
            raise ValueError("alpha must have one value per head of every layer, or be empty")

    def layer_summary(self) -> list[dict[str, float]]:
        """One dict per layer: heads, MAD mean/min/max and entropy mean/min/max over heads."""
        rows = []
        for layer, mad, ent in zip(self.layers, self.mad, self.entropy, strict=True):
            m_mean, m_min, m_max = _nan_stats(mad)
            e_mean, e_min, e_max = _nan_stats(ent)
            rows.append(
                dict(
                    layer=layer,
                    heads=len(mad),
                    mad_mean=m_mean,
                    mad_min=m_min,
                    mad_max=m_max,
                    entropy_mean=e_mean,
                    entropy_min=e_min,
                    entropy_max=e_max,
                )
            )
        return rows

    @property
    def mean_sparsity(self) -> float:
        """Fraction of exact zeros averaged over every layer and head (NaN without sparsity)."""
        return _nan_stats([v for row in self.sparsity for v in row])[0]

    @property
    def min_mad(self) -> float:
        """Smallest normalized MAD of any head in any layer (the study's "minimum MAD")."""
        return _nan_stats([v for row in self.mad for v in row])[1]

    def mad_patches(self) -> list[list[float]]:
        """MAD in patches: ``mad × grid diagonal`` (needs one grid size)."""
        if self.grid_size is None:
            raise ValueError("this report mixes several grid sizes; MAD in patches is not defined")
        d = grid_diagonal(self.grid_size)
        return [[v * d for v in row] for row in self.mad]

    def __str__(self) -> str:
        grid = "mixed" if self.grid_size is None else f"{self.grid_size[0]}x{self.grid_size[1]}"
        head = f"Locality report{': ' + self.model if self.model else ''} — {self.num_images} images, "
        head += f"grid {grid}, {self.num_prefix_tokens} prefix token(s)"
        cols = f"{'layer':>5} {'heads':>5} {'MAD mean':>9} {'MAD min':>9} {'MAD max':>9} {'entropy':>9}"
        lines = [head, cols]
        for r in self.layer_summary():
            lines.append(
                f"{r['layer']:>5} {r['heads']:>5} {_fmt(r['mad_mean'])} {_fmt(r['mad_min'])} "
                f"{_fmt(r['mad_max'])} {_fmt(r['entropy_mean'])}"
            )
        lines.append("MAD: mean attention distance / grid diagonal; entropy: mean over heads, / log(patches)")
        if self.alpha:
            lines.append("alpha-entmax alpha per head (1 = softmax, 1.5 = entmax-1.5, 2 = sparsemax):")
            for layer, row in zip(self.layers, self.alpha, strict=True):
                lines.append(f"{layer:>5} " + " ".join(_fmt(a, width=6) for a in row))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (NaN as None)."""
        return dict(
            model=self.model,
            layers=list(self.layers),
            mad=_plain(self.mad),
            entropy=_plain(self.entropy),
            grid_size=None if self.grid_size is None else list(self.grid_size),
            num_prefix_tokens=self.num_prefix_tokens,
            num_images=self.num_images,
            meta=dict(self.meta),
            sparsity=_plain(self.sparsity),
            alpha=_plain(self.alpha),
            summary=[
                {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                for r in self.layer_summary()
            ],
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LocalityReport:
        """Inverse of :meth:`to_dict` (the ``summary`` entry is ignored)."""
        grid = d.get("grid_size")
        return cls(
            layers=[int(i) for i in d["layers"]],
            mad=_floats(d["mad"]),
            entropy=_floats(d["entropy"]),
            grid_size=None if grid is None else (int(grid[0]), int(grid[1])),
            num_prefix_tokens=int(d["num_prefix_tokens"]),
            num_images=int(d["num_images"]),
            model=str(d.get("model", "")),
            meta=dict(d.get("meta") or {}),
            sparsity=_floats(d.get("sparsity") or []),
            alpha=_floats(d.get("alpha") or []),
        )

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        """JSON text of :meth:`to_dict`; also written to ``path`` when given."""
        text = _compact_lists(json.dumps(self.to_dict(), indent=indent))
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> LocalityReport:
        """Read a report from JSON text or from a ``.json`` file path."""
        text = str(source)
        if isinstance(source, Path) or not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        return cls.from_dict(json.loads(text))

    def compare(self, other: LocalityReport, names: tuple[str, str] | None = None) -> ReportDiff:
        """Per-layer diff of mean MAD and entropy against ``other``, on the layers both report."""
        common = [i for i in self.layers if i in other.layers]
        if not common:
            raise ValueError(f"the reports share no layer: {self.layers} vs {other.layers}")
        names = names or (self.model or "A", other.model or "B")
        if names[0] == names[1]:
            names = (f"{names[0]} (A)", f"{names[1]} (B)")
        mine = {r["layer"]: r for r in self.layer_summary()}
        theirs = {r["layer"]: r for r in other.layer_summary()}
        rows = [
            dict(
                layer=i,
                mad_a=mine[i]["mad_mean"],
                mad_b=theirs[i]["mad_mean"],
                entropy_a=mine[i]["entropy_mean"],
                entropy_b=theirs[i]["entropy_mean"],
            )
            for i in common
        ]
        return ReportDiff(names=names, rows=rows, min_mad=(self.min_mad, other.min_mad))


@dataclass
class ReportDiff:
    """Two reports side by side: per layer mean MAD and entropy of A and B and B − A."""

    names: tuple[str, str]
    rows: list[dict[str, float]]
    min_mad: tuple[float, float]

    def __str__(self) -> str:
        a, b = self.names
        lines = [
            f"A = {a}\nB = {b}",
            f"{'layer':>5} {'MAD A':>9} {'MAD B':>9} {'Δ MAD':>9} {'ent A':>9} {'ent B':>9} {'Δ ent':>9}",
        ]
        for r in self.rows:
            d_mad, d_ent = r["mad_b"] - r["mad_a"], r["entropy_b"] - r["entropy_a"]
            lines.append(
                f"{r['layer']:>5} {_fmt(r['mad_a'])} {_fmt(r['mad_b'])} {_fmt(d_mad, signed=True)} "
                f"{_fmt(r['entropy_a'])} {_fmt(r['entropy_b'])} {_fmt(d_ent, signed=True)}"
            )
        ma, mb = self.min_mad
        lines.append(f"{'min':>5} {_fmt(ma)} {_fmt(mb)} {_fmt(mb - ma, signed=True)}   (smallest head MAD)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (NaN as None)."""
        clean = [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in self.rows
        ]
        return dict(names=list(self.names), rows=clean, min_mad=list(self.min_mad))


def _is_pair(data: Any) -> bool:
    return (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and isinstance(data[0], torch.Tensor)
        and data[0].dim() == 4
        and not (isinstance(data[1], torch.Tensor) and data[1].dim() == 4)
    )


def iter_image_batches(data: Any) -> Iterator[torch.Tensor]:
    """``(B, C, H, W)`` image batches from a tensor batch, one ``(images, labels)`` pair, or an
    iterable of batches / pairs / dicts with an ``"image"`` entry (a ``(C, H, W)`` image is a batch of 1)."""
    if isinstance(data, torch.Tensor) or _is_pair(data):
        data = [data]
    for item in data:
        x = item
        if isinstance(item, dict):
            x = item.get("image", item.get("images"))
        elif isinstance(item, (tuple, list)):
            x = item[0] if item else None
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"data must give image batches (B, C, H, W) or (images, labels) pairs; got an item {got}"
            )
        yield x if x.dim() == 4 else x[None]


def _known_total(data: Any) -> int | None:
    if isinstance(data, torch.Tensor):
        return int(data.shape[0]) if data.dim() == 4 else 1
    if _is_pair(data):
        return int(data[0].shape[0])
    if isinstance(getattr(data, "num_images", None), int):
        return int(data.num_images)
    if isinstance(data, (list, tuple)):
        return sum(x.shape[0] for x in iter_image_batches(data))
    dataset = getattr(data, "dataset", None)  # a DataLoader
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


class _HeadMean:
    """Running mean per head of ``(B, H)`` values over images, skipping NaN entries."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, values: torch.Tensor) -> None:
        values = values.double().cpu()
        ok = ~values.isnan()
        total, count = torch.where(ok, values, 0.0).sum(0), ok.sum(0)
        if self.total is None or self.count is None:
            self.total, self.count = total, count
        else:
            self.total += total
            self.count += count

    def means(self) -> list[float]:
        if self.total is None or self.count is None:
            return []
        return torch.where(self.count > 0, self.total / self.count.clamp_min(1), math.nan).tolist()


@dataclass
class _LayerStats:
    """What :func:`locality_report` accumulates for one block."""

    mad: _HeadMean = field(default_factory=_HeadMean)
    entropy: _HeadMean = field(default_factory=_HeadMean)
    sparsity: _HeadMean = field(default_factory=_HeadMean)


def head_alphas(attn: nn.Module) -> tuple[list[float], bool]:
    """``(alpha per head, whether they are learned)`` of an attention module: a vitattn layer's
    ``head_alphas()`` (learned with ``normalizer="adaptive"``), 1 for each head of another layer with
    ``num_heads`` (timm's softmax), else ``([], False)``."""
    read = getattr(attn, "head_alphas", None)
    if callable(read):
        return [float(a) for a in read()], getattr(attn, "adaptive_alpha", None) is not None
    heads = getattr(attn, "num_heads", None)
    return ([1.0] * int(heads) if isinstance(heads, int) else []), False


def _report_alphas(layout: ModelLayout, layers: Sequence[int], heads: Sequence[int]) -> list[list[float]]:
    """The alphas of ``layers`` (their ``heads`` counts) when one of them learns its alphas, else ``[]``."""
    modules = layout.attentions
    rows, learned = [], False
    for i, count in zip(layers, heads, strict=True):
        alphas, adaptive = head_alphas(modules[i] or nn.Identity())
        learned = learned or adaptive
        rows.append(alphas if len(alphas) == count else [math.nan] * count)
    return rows if learned else []


def _progress(total: int | None, enabled: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    return tqdm(total=total, unit="img", desc="attention", disable=not enabled, leave=False)


def _run_batches(
    layout: Any, data: Any, max_images: int | None, progress: bool, before: Callable[[torch.Tensor], None]
) -> int:
    """Run ``layout.forward`` on the image batches of ``data`` (moved to the model's device and dtype),
    at most ``max_images`` images, ``before(batch)`` ahead of each, with a progress bar; the number of
    images run."""
    param = next(layout.model.parameters(), None)
    seen = 0
    total = _known_total(data)
    bar = _progress(min(total, max_images) if total and max_images else total or max_images, progress)
    try:
        for x in iter_image_batches(data):
            if max_images is not None:
                x = x[: max_images - seen]
            if param is not None:
                x = x.to(param.device, param.dtype if x.is_floating_point() else None)
            before(x)
            layout.forward(x)
            seen += x.shape[0]
            if bar is not None:
                bar.update(x.shape[0])
            if max_images is not None and seen >= max_images:
                break
    finally:
        if bar is not None:
            bar.close()
    return seen


def locality_report(
    model: nn.Module,
    data: Any,
    grid_size: int | Sequence[int] | None = None,
    num_prefix_tokens: int | None = None,
    max_images: int | None = None,
    layers: int | Iterable[int] | None = None,
    *,
    progress: bool = True,
    name: str | None = None,
) -> LocalityReport:
    """MAD and entropy per layer and head of ``model``, averaged over the images of ``data``.

    Args:
        model: a timm ViT, vitattn model or transformers vision model (see :func:`attention_maps`);
            run in eval mode under ``torch.no_grad()``, its training flags restored afterwards.
        data: a ``(B, C, H, W)`` tensor, an ``(images, labels)`` pair, or an iterable of either
            (a ``DataLoader``). Batches are moved to the model's device and dtype.
        grid_size, num_prefix_tokens: the token layout; read from the model by default
            (``patch_embed`` grid for each input size, ``model.num_prefix_tokens``).
        max_images: stop after this many images (None = all of ``data``).
        layers: block indices (None = all blocks).
        progress: show a tqdm progress bar over images (on stderr).
        name: the model's name in the report (default: its class name).

    Images are weighted equally: per image and head, the mean over query patches, then the mean
    over images (NaN values, heads with no patch mass in an image, are skipped). When a reported
    block learns its alpha-entmax alphas (``normalizer="adaptive"``), the report also holds every
    reported block's alpha per head (:attr:`LocalityReport.alpha`).
    """
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be >= 1 or None, got {max_images}")
    layout = _analysis_layout(model)
    stats: dict[int, _LayerStats] = {}
    grids: set[tuple[int, int]] = set()
    prefixes: set[int] = set()
    tokens: dict[str, Any] = {}  # the grid and prefix count of the batch being read

    def sink(i: int, probs: torch.Tensor) -> None:
        grid, prefix = resolve_layout(probs.shape[-1], tokens["grid"], tokens["prefix"])
        grids.add(grid)
        prefixes.add(prefix)
        layer = stats.setdefault(i, _LayerStats())
        layer.mad.add(mean_attention_distance(probs, grid, prefix))
        layer.entropy.add(attention_entropy(probs, prefix, grid_size=grid))
        layer.sparsity.add((probs == 0).flatten(2).double().mean(-1))

    def before(x: torch.Tensor) -> None:  # the token layout of the batch about to run
        grid, prefix = layout.grid(x.shape[-2:]), layout.num_prefix_tokens
        tokens["grid"] = grid_size if grid_size is not None else grid
        tokens["prefix"] = num_prefix_tokens if num_prefix_tokens is not None else prefix

    with _record_layout(layout, sink, layers) as chosen, torch.no_grad(), _evaluating(model):
        seen = _run_batches(layout, data, max_images, progress, before)
    if seen == 0:
        raise ValueError("data gave no images")
    missing = [i for i in chosen if i not in stats]
    if missing:
        raise RuntimeError(f"blocks {missing} did not run their attention in the model's forward")

    mad = [stats[i].mad.means() for i in chosen]
    return LocalityReport(
        layers=list(chosen),
        mad=mad,
        entropy=[stats[i].entropy.means() for i in chosen],
        sparsity=[stats[i].sparsity.means() for i in chosen],
        grid_size=next(iter(grids)) if len(grids) == 1 else None,
        num_prefix_tokens=next(iter(prefixes)) if len(prefixes) == 1 else -1,
        num_images=seen,
        model=name or type(model).__name__,
        alpha=_report_alphas(layout, chosen, [len(row) for row in mad]),
    )
