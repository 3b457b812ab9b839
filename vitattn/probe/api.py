"""``dense_probe``: frozen features once, then a linear or nearest-neighbour probe per layer."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from .extract import DenseFeatures, device_of, extract_dense_features, resolve_num_classes
from .features import Backbone
from .knn import KNN_DEFAULTS, knn_probe
from .linear import LINEAR_DEFAULTS, linear_probe
from .metrics import SegmentationScores

__all__ = ["METHODS", "LayerProbe", "ProbeResult", "dense_probe", "probe_features"]

METHODS: dict[str, Callable[..., SegmentationScores]] = {"linear": linear_probe, "knn": knn_probe}
_DEFAULTS: dict[str, dict[str, Any]] = {"linear": LINEAR_DEFAULTS, "knn": KNN_DEFAULTS}


@dataclass(frozen=True)
class LayerProbe:
    """Scores of one block: ``miou``, ``pixel_acc`` in [0, 1], IoU per class (None: absent class),
    ``alignment``: mean patch / class-token cosine on the test images (None without a class token)."""

    layer: int
    miou: float
    pixel_acc: float
    per_class_iou: list[float | None]
    alignment: float | None


def _num(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else float(v)


@dataclass
class ProbeResult:
    """Results of one method over the requested blocks (``layers``: non-negative, increasing).

    ``miou`` / ``pixel_acc`` / ``per_class_iou`` are those of the **last** requested block.
    """

    method: str
    layers: tuple[int, ...]
    per_layer: dict[int, LayerProbe]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def last(self) -> LayerProbe:
        return self.per_layer[self.layers[-1]]

    @property
    def miou(self) -> float:
        return self.last.miou

    @property
    def pixel_acc(self) -> float:
        return self.last.pixel_acc

    @property
    def per_class_iou(self) -> list[float | None]:
        return self.last.per_class_iou

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN as None): ``method``, ``layers``, ``options``, ``miou``, ``pixel_acc`` and
        ``per_layer``: a list of ``{layer, miou, pixel_acc, per_class_iou, alignment}``."""
        return {
            "method": self.method,
            "layers": list(self.layers),
            "options": dict(self.options),
            "miou": _num(self.miou),
            "pixel_acc": _num(self.pixel_acc),
            "per_layer": [
                {
                    "layer": p.layer,
                    "miou": _num(p.miou),
                    "pixel_acc": _num(p.pixel_acc),
                    "per_class_iou": [_num(v) for v in p.per_class_iou],
                    "alignment": _num(p.alignment),
                }
                for p in (self.per_layer[i] for i in self.layers)
            ],
        }

    def table(self) -> str:
        """A Markdown table, one row per block: mIoU %, pixel accuracy %, alignment."""
        rows = [
            f"| {self.method} | {p.layer} | {100 * p.miou:.2f} | {100 * p.pixel_acc:.2f} | "
            f"{'-' if p.alignment is None else f'{p.alignment:.3f}'} |"
            for p in (self.per_layer[i] for i in self.layers)
        ]
        head = "| method | block | mIoU % | pixel acc % | patch-cls cos |\n|---|---:|---:|---:|---:|"
        return "\n".join([head, *rows])

    def __str__(self) -> str:
        return self.table()


def probe_features(
    train: DenseFeatures,
    test: DenseFeatures,
    *,
    method: str = "linear",
    device: torch.device | str | None = None,
    progress: bool = True,
    seed: int = 0,
    **options: Any,
) -> ProbeResult:
    """Run ``method`` (``"linear"`` | ``"knn"``) on precomputed features for every layer they hold.

    ``options`` go to :func:`~vitattn.probe.linear.linear_probe` (``epochs``, ``lr``, ``weight_decay``,
    ``batch_size``, ``min_steps``) or :func:`~vitattn.probe.knn.knn_probe` (``k``, ``temperature``,
    ``bank_size``, ``batch_size``).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}; got {method!r}")
    if train.layers != test.layers or train.num_classes != test.num_classes:
        raise ValueError("train and test features must hold the same layers and num_classes")
    run = METHODS[method]
    per_layer: dict[int, LayerProbe] = {}
    for layer in train.layers:
        try:
            s = run(train, test, layer, device=device, seed=seed, progress=progress, **options)
        except TypeError as err:
            raise TypeError(f"method={method!r}: {err}") from err
        per_layer[layer] = LayerProbe(layer, s.miou, s.pixel_acc, s.per_class_iou, test.alignment[layer])
    return ProbeResult(method, train.layers, per_layer, _options(method, options, seed))


def _options(method: str, options: dict[str, Any], seed: int) -> dict[str, Any]:
    """The options a method ran with (its defaults updated by the given ones), for the record."""
    out = {**_DEFAULTS[method], **options, "seed": seed}
    if method == "linear" and "epochs" in options and "min_steps" not in options:
        out["min_steps"] = 0
    return out


def dense_probe(
    backbone: Backbone,
    train: Dataset,
    test: Dataset,
    *,
    method: str = "linear",
    layers: Sequence[int] = (-1,),
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    num_classes: int | None = None,
    ignore_index: int = 255,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    progress: bool = True,
    seed: int = 0,
    norm: bool = True,
    **options: Any,
) -> ProbeResult:
    """Dense evaluation of a frozen ``backbone``: mIoU of a probe on its patch features, per block.

    ``train`` / ``test``: datasets of ``(image (3, H, W), ..., mask (H, W))`` items (image first, mask
    last). Images reach the backbone as given, after ``transform`` when passed (batched, on
    ``device``). ``num_classes`` defaults to ``train.num_seg_classes``. Features of all ``layers`` are
    computed once (:func:`~vitattn.probe.extract_dense_features`, kept on CPU), then ``method``
    (``"linear"`` or ``"knn"``) is run for each; ``options`` are the method's (see
    :func:`probe_features`). ``device``: default the backbone's; the probes run there too.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}; got {method!r}")
    k = resolve_num_classes(train, num_classes)
    kw: dict[str, Any] = dict(
        layers=layers,
        num_classes=k,
        ignore_index=ignore_index,
        transform=transform,
        batch_size=batch_size,
        device=device,
        norm=norm,
        progress=progress,
    )
    tr = extract_dense_features(backbone, train, desc="train features", **kw)
    te = extract_dense_features(backbone, test, desc="test features", **kw)
    dev = device if device is not None else device_of(backbone)
    return probe_features(
        tr, te, method=method, device=dev, progress=progress, seed=seed, batch_size=batch_size, **options
    )
