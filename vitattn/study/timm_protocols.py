"""timm's data pipeline for image folders: the study's protocols as ``create_transform`` and ``Mixup``.

How a protocol maps onto timm's options (``--dataset imagefolder``):

==================  ===============================================================================
baseline            ``create_transform(is_training=True)``: RandomResizedCrop (scale 0.08–1) and a
                    horizontal flip (``hflip``), no colour jitter, no random erasing
+ autoaugment       ``auto_augment=StudyConfig.auto_augment`` (default ``rand-m9-mstd0.5-inc1``:
                    RandAugment; ``original`` is AutoAugment's ImageNet policy)
+ cutmix            timm ``Mixup(cutmix_alpha, mixup_alpha)`` on every batch (``mixup_alpha`` 0 by
                    default: CutMix alone; > 0 switches between the two per batch)
+ label_smoothing   ``Mixup(label_smoothing=...)`` soft targets, or the cross-entropy's smoothing
                    without CutMix
evaluation          ``create_transform(is_training=False)``: resize to ``size / crop_pct``, centre crop
==================  ===============================================================================

Mean, std, interpolation and crop_pct are timm's ImageNet defaults, or a pretrained model's own
(``timm.data.resolve_data_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .protocols import Protocol

__all__ = ["TimmData", "timm_criterion", "timm_data_config", "timm_mixup", "timm_transforms"]


@dataclass(frozen=True)
class TimmData:
    """What timm's transforms need: input size, mean / std, interpolation, eval crop fraction."""

    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bicubic"
    crop_pct: float = 0.875


def timm_data_config(
    size: int, model: str | None, pretrained: bool, mean: tuple[float, ...], std: tuple[float, ...]
) -> TimmData:
    """The data settings of a run at ``size`` px: a pretrained timm model's own mean / std /
    interpolation / crop_pct (``timm.data.resolve_data_config`` of its pretrained cfg), else the
    given ``mean`` / ``std`` with timm's defaults."""
    if model is not None and pretrained:
        import timm
        from timm.data import resolve_data_config

        pretrained_cfg = timm.models.get_pretrained_cfg(model)
        if pretrained_cfg is None:
            raise ValueError(f"timm has no pretrained weights for {model!r}")
        cfg = resolve_data_config({}, pretrained_cfg=pretrained_cfg.to_dict())
        return TimmData(
            size, tuple(cfg["mean"]), tuple(cfg["std"]), str(cfg["interpolation"]), float(cfg["crop_pct"])
        )
    return TimmData(size, tuple(mean), tuple(std))


def timm_transforms(data: TimmData, protocol: Protocol, hflip: bool, auto_augment: str) -> tuple[Any, Any]:
    """``(train, eval)`` transforms (PIL image -> normalized ``(3, size, size)`` float) of ``protocol``."""
    from timm.data import create_transform

    common: dict[str, Any] = dict(
        input_size=(3, data.size, data.size), interpolation=data.interpolation, mean=data.mean, std=data.std
    )
    train = create_transform(
        is_training=True,
        hflip=0.5 if hflip else 0.0,
        auto_augment=auto_augment if protocol.autoaugment else None,
        color_jitter=None,  # type: ignore[arg-type]  # timm takes None: no colour jitter
        re_prob=0.0,
        **common,
    )
    test = create_transform(is_training=False, crop_pct=data.crop_pct, **common)
    return train, test


def timm_mixup(
    protocol: Protocol, num_classes: int, cutmix_alpha: float, mixup_alpha: float, smoothing: float
) -> Any | None:
    """timm's ``Mixup`` for a protocol with CutMix (``(B, C, H, W)``, ``(B,)`` -> mixed images,
    ``(B, K)`` soft targets, smoothed when the protocol has label smoothing); None without CutMix.
    The batch size on each rank must be even."""
    if not protocol.cutmix:
        return None
    from timm.data import Mixup

    return Mixup(
        mixup_alpha=mixup_alpha,
        cutmix_alpha=cutmix_alpha,
        label_smoothing=smoothing if protocol.label_smoothing else 0.0,
        num_classes=num_classes,
    )


def timm_criterion(protocol: Protocol, smoothing: float) -> nn.Module:
    """The loss next to :func:`timm_mixup`: cross-entropy on its soft targets (their smoothing is in
    the targets), or with ``label_smoothing`` on hard labels when there is no CutMix."""
    if protocol.cutmix:
        return nn.CrossEntropyLoss()
    return nn.CrossEntropyLoss(label_smoothing=smoothing if protocol.label_smoothing else 0.0)
