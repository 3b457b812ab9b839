"""Frozen features of a whole segmentation dataset, computed once and kept on CPU for every probe."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..datasets.sized import dataset_length
from ..models.blocks import block_indices
from .diagnostics import alignment_sum
from .features import Backbone, backbone_depth, check_image_size, patch_features
from .progress import Progress

__all__ = ["DenseFeatures", "extract_dense_features", "resolve_num_classes"]

#: float32 features above this many bytes (per dataset, all layers) are stored as float16
FLOAT16_ABOVE_BYTES = 4 * 2**30


@dataclass
class DenseFeatures:
    """Features and masks of one dataset.

    ``features[layer]``: ``(N, C, gh, gw)`` on CPU (float32, or float16 when big); ``masks``:
    ``(N, H, W)`` on CPU (uint8 when labels and ignore fit, else int64); ``alignment[layer]``: mean
    patch / class-token cosine over the dataset, None without a class token.
    """

    layers: tuple[int, ...]
    features: dict[int, torch.Tensor]
    masks: torch.Tensor
    alignment: dict[int, float | None]
    num_classes: int
    ignore_index: int

    @property
    def grid(self) -> tuple[int, int]:
        f = self.features[self.layers[0]]
        return int(f.shape[-2]), int(f.shape[-1])

    def __len__(self) -> int:
        return int(self.masks.shape[0])


def resolve_num_classes(dataset: Any, num_classes: int | None) -> int:
    """``num_classes``, else ``dataset.num_seg_classes`` (also looked up through a ``Subset``)."""
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
        return num_classes
    d = dataset
    while d is not None:
        k = getattr(d, "num_seg_classes", None)
        if k is not None:
            return int(k)
        d = getattr(d, "dataset", None)  # torch.utils.data.Subset
    raise ValueError(
        f"the dataset ({type(dataset).__name__}) has no num_seg_classes attribute: pass num_classes="
    )


def _collate(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(items[0], tuple | list) or len(items[0]) < 2:
        raise ValueError("dataset items must be (image, ..., mask) tuples: image first, mask last")
    images = torch.stack([torch.as_tensor(it[0]) for it in items])
    masks = torch.stack([torch.as_tensor(it[-1]) for it in items])
    return images, masks


def _mask_dtype(num_classes: int, ignore_index: int) -> torch.dtype:
    return torch.uint8 if num_classes <= 255 and 0 <= ignore_index <= 255 else torch.int64


def _check_masks(masks: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    if masks.is_floating_point():
        raise ValueError(f"masks must hold integer labels, got {masks.dtype}")
    bad = ((masks < 0) | (masks >= num_classes)) & (masks != ignore_index)
    if bool(bad.any()):
        raise ValueError(
            f"mask holds label {int(masks[bad][0])} outside [0, num_classes={num_classes}) that is not "
            f"ignore_index={ignore_index}"
        )


def extract_dense_features(
    backbone: Backbone,
    dataset: Dataset,
    *,
    layers: Sequence[int] = (-1,),
    num_classes: int,
    ignore_index: int = 255,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    norm: bool = True,
    progress: bool = True,
    desc: str = "features",
) -> DenseFeatures:
    """Run the frozen ``backbone`` once over ``dataset`` (items ``(image, ..., mask)``).

    Each batch of images goes to ``device`` (default: the backbone's), through ``transform`` (batched,
    e.g. a normalization), then :func:`~vitattn.probe.patch_features`. Masks are checked against
    ``[0, num_classes) ∪ {ignore_index}``; images whose size is not a multiple of the backbone's patch
    size are refused (:func:`~vitattn.probe.features.check_image_size`: the patch embedding would
    drop the pixels past the last whole patch, and with them the mask's).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = dataset_length(dataset)
    if n == 0:
        raise ValueError(f"the dataset ({type(dataset).__name__}) is empty")
    idx = block_indices(layers, backbone_depth(backbone), "layers")
    dev = torch.device(device) if device is not None else device_of(backbone)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_collate)
    feats: dict[int, torch.Tensor] = {}
    masks: torch.Tensor | None = None
    align: dict[int, list[float]] = {i: [0.0, 0.0] for i in idx}
    has_cls = True
    start = 0
    with Progress(len(loader), desc, progress) as bar:
        for images, m in loader:
            _check_masks(m, num_classes, ignore_index)
            x = images.to(dev, torch.float32)
            if transform is not None:
                x = transform(x)
            if masks is None and isinstance(backbone, torch.nn.Module):  # the first batch: sizes fixed
                check_image_size(backbone, tuple(x.shape[-2:]), "image size")
            maps = patch_features(backbone, x, idx, norm=norm)
            b = images.shape[0]
            if masks is None:
                masks = torch.empty((n, *m.shape[1:]), dtype=_mask_dtype(num_classes, ignore_index))
                per_image = sum(f.patches[0].numel() for f in maps.values()) * 4
                dtype = torch.float16 if per_image * n > FLOAT16_ABOVE_BYTES else torch.float32
                feats = {i: torch.empty((n, *f.patches.shape[1:]), dtype=dtype) for i, f in maps.items()}
            masks[start : start + b] = m.to(masks.dtype)
            for i, f in maps.items():
                feats[i][start : start + b] = f.patches.to("cpu", feats[i].dtype)
                if f.cls is None:
                    has_cls = False
                else:
                    s, c = alignment_sum(f.patches, f.cls)
                    align[i][0] += s
                    align[i][1] += c
            start += b
            bar.update()
    assert masks is not None
    alignment = {i: (a[0] / a[1] if has_cls and a[1] else None) for i, a in align.items()}
    return DenseFeatures(idx, feats, masks, alignment, num_classes, ignore_index)


def device_of(backbone: Backbone) -> torch.device:
    """The device of ``backbone``'s first parameter (CPU for a callable or a module without any)."""
    if isinstance(backbone, torch.nn.Module):
        p = next(iter(backbone.parameters()), None)
        if p is not None:
            return p.device
    return torch.device("cpu")
