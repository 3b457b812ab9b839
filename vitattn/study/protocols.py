"""Training protocols of the study: which of AutoAugment, CutMix and label smoothing are on.

The baseline is random crop + horizontal flip + cross-entropy; every protocol adds a subset of three
components on top. All augmentations come from torchvision (``transforms.v2``); the loss is torch's
cross-entropy, whose ``label_smoothing`` also applies to CutMix's soft targets.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .dataset_specs import DatasetSpec

if TYPE_CHECKING:
    from torchvision.transforms import v2

__all__ = [
    "ABLATION",
    "COMPONENTS",
    "PROTOCOLS",
    "Protocol",
    "build_criterion",
    "build_cutmix",
    "build_test_transform",
    "build_train_transform",
    "resolve_protocols",
]

COMPONENTS = ("autoaugment", "cutmix", "label_smoothing")
_SHORT = {"autoaugment": "aa", "cutmix": "cm", "label_smoothing": "ls"}


@dataclass(frozen=True)
class Protocol:
    """One training protocol: the baseline plus the components switched on.

    ``autoaugment`` means torchvision's AutoAugment (CIFAR-10 policy) on digits and CIFAR, and
    ColorJitter on Tiny-ImageNet (see :attr:`DatasetSpec.color_augment`).
    """

    autoaugment: bool = False
    cutmix: bool = False
    label_smoothing: bool = False

    @property
    def name(self) -> str:
        """``baseline`` (none), ``modern`` (all three), else e.g. ``aa+cm`` (aa, cm, ls)."""
        on = [c for c in COMPONENTS if getattr(self, c)]
        if not on:
            return "baseline"
        if len(on) == len(COMPONENTS):
            return "modern"
        return "+".join(_SHORT[c] for c in on)

    def components(self) -> dict[str, bool]:
        """``{"autoaugment": bool, "cutmix": bool, "label_smoothing": bool}`` (the results schema)."""
        return asdict(self)


ABLATION: tuple[Protocol, ...] = tuple(
    Protocol(*flags)
    for flags in sorted(
        itertools.product((False, True), repeat=3), key=lambda f: (sum(f), [not x for x in f])
    )
)
"""All 8 combinations: baseline, aa, cm, ls, aa+cm, aa+ls, cm+ls, modern."""

PROTOCOLS: dict[str, Protocol] = {p.name: p for p in ABLATION}


def resolve_protocols(names: Sequence[str]) -> list[Protocol]:
    """Protocols by name: ``baseline``, ``modern`` or components joined by ``+`` in any order
    (``aa``, ``cm``, ``ls``, e.g. ``cm+aa``; ``aa+cm+ls`` is ``modern``). Order kept, no repeats."""
    by_short = {v: k for k, v in _SHORT.items()}
    out: list[Protocol] = []
    for name in names:
        key = name.strip().lower()
        if key in PROTOCOLS:
            protocol = PROTOCOLS[key]
        else:
            parts = set(key.split("+"))
            if not parts <= set(by_short):
                raise ValueError(f"unknown protocol {name!r}; known: {', '.join(PROTOCOLS)}")
            protocol = Protocol(**{by_short[p]: True for p in parts})
        if protocol not in out:
            out.append(protocol)
    if not out:
        raise ValueError("no protocol given")
    return out


def _resize(spec: DatasetSpec, size: int | None) -> list[nn.Module]:
    """A resize to ``size`` when it differs from the dataset's own image size (nothing otherwise)."""
    from torchvision.transforms import v2

    return [] if size is None or size == spec.img_size else [v2.Resize(size, antialias=True)]


def build_train_transform(
    protocol: Protocol,
    spec: DatasetSpec,
    hflip: bool = True,
    *,
    size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> v2.Compose:
    """Per-image training transform: uint8 image (PIL or ``(C, H, W)`` tensor) -> normalized float.

    Random crop with ``size // 8`` pixels of zero padding (4 on 32 px CIFAR, 1 on 8 px digits), a
    horizontal flip (``hflip``), then AutoAugment (CIFAR-10 policy) or, where the dataset says so,
    ColorJitter(0.4, 0.4, 0.4) when ``protocol.autoaugment``. AutoAugment runs on uint8 tensors,
    one channel included. ``size`` (default: the dataset's) resizes first; ``mean`` / ``std``
    (default: the dataset's) normalize.
    """
    from torchvision.transforms import v2

    side = spec.img_size if size is None else int(size)
    ops: list[nn.Module] = [
        v2.ToImage(),
        *_resize(spec, size),
        v2.RandomCrop(side, padding=max(1, side // 8)),
    ]
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    if protocol.autoaugment:
        if spec.color_augment == "colorjitter":
            ops.append(v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4))
        else:
            ops.append(v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10))
    ops += [v2.ToDtype(torch.float32, scale=True), _normalize(spec, mean, std)]
    return v2.Compose(ops)


def _normalize(spec: DatasetSpec, mean: Sequence[float] | None, std: Sequence[float] | None) -> nn.Module:
    from torchvision.transforms import v2

    return v2.Normalize(list(spec.mean if mean is None else mean), list(spec.std if std is None else std))


def build_test_transform(
    spec: DatasetSpec,
    *,
    size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> v2.Compose:
    """Evaluation transform: uint8 image -> normalized float ``(C, H, W)``, no augmentation (a resize
    to ``size`` when it differs from the dataset's)."""
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.ToImage(),
            *_resize(spec, size),
            v2.ToDtype(torch.float32, scale=True),
            _normalize(spec, mean, std),
        ]
    )


def build_cutmix(protocol: Protocol, num_classes: int, alpha: float = 1.0) -> v2.CutMix | None:
    """torchvision's batch CutMix (``(B, C, H, W)``, ``(B,)`` -> same images, ``(B, K)`` soft labels),
    applied to every batch; None when the protocol has no CutMix."""
    if not protocol.cutmix:
        return None
    from torchvision.transforms import v2

    return v2.CutMix(num_classes=num_classes, alpha=alpha)


def build_criterion(protocol: Protocol, smoothing: float = 0.1) -> nn.CrossEntropyLoss:
    """Cross-entropy, with ``label_smoothing=smoothing`` when the protocol has it (hard or soft targets)."""
    return nn.CrossEntropyLoss(label_smoothing=smoothing if protocol.label_smoothing else 0.0)
