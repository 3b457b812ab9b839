"""Embedded data and loaders of real datasets.

- :class:`DigitScenes`: procedural scenes of scikit-learn digits with segmentation masks
  (nothing is downloaded; built in seconds and cached).
- :class:`VOCSegmentation` / :class:`ADE20KSegmentation`: PASCAL VOC 2012 and ADE20K for the dense
  probes, as ``(image, mask)`` pairs at a fixed size.

Names are imported lazily, so importing one does not import the others' dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ADE20KSegmentation",
    "DigitScenes",
    "SegmentationDatasetMissing",
    "VOCSegmentation",
]

_HOME = {
    "DigitScenes": ".scenes",
    "ADE20KSegmentation": ".segmentation",
    "SegmentationDatasetMissing": ".segmentation",
    "VOCSegmentation": ".segmentation",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
