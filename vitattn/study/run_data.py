"""The data of a run: its training and test sets with the protocol's transforms, the batch mix
(CutMix), the loss, and the transform the dense probe and the plots apply to raw scenes.

The built-in sets (scenes, digits, CIFAR, Tiny-ImageNet) keep the study's torchvision protocols
(:mod:`.protocols`), resized first when ``img_size`` differs from the dataset's own; image folders use
timm's pipeline (:mod:`.timm_protocols`). Mean and std are the dataset's, or a pretrained timm model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset, Subset

from ..datasets.sized import dataset_length
from .builtin_datasets import load_datasets
from .config import StudyConfig
from .protocols import Protocol, build_criterion, build_cutmix, build_test_transform, build_train_transform
from .timm_protocols import TimmData, timm_criterion, timm_data_config, timm_mixup, timm_transforms

__all__ = ["RunData", "data_config", "probe_transform", "run_data", "subset"]


def subset(dataset: Dataset, limit: int | None) -> Dataset:
    """The first ``limit`` items of ``dataset`` (all when None)."""
    n = dataset_length(dataset)
    return dataset if limit is None or limit >= n else Subset(dataset, range(limit))


def data_config(config: StudyConfig) -> TimmData:
    """Input size, mean / std (the dataset's — the scenes' of the run's version — or a pretrained
    timm model's), interpolation, crop."""
    spec = config.spec
    mean, std = spec.mean, spec.std
    if config.dataset == "scenes":
        from ..datasets.scenes import STATISTICS

        mean, std = STATISTICS[config.scenes_version]
    return timm_data_config(config.input_size, config.model, config.pretrained, mean, std)


@dataclass
class RunData:
    """``train`` / ``test`` sets giving ``(normalized image (C, S, S), label)``, the batch mix
    (``(x, y) -> (x, soft y)`` or None) and the loss."""

    train: Dataset
    test: Dataset
    mix: Callable[[Any, Any], tuple[Any, Any]] | None
    criterion: nn.Module


def run_data(config: StudyConfig, protocol: Protocol) -> RunData:
    """The datasets, mix and loss of a run under ``protocol`` (limits applied)."""
    spec = config.spec
    data = data_config(config)
    if config.dataset == "imagefolder":
        from .imagefolder import imagefolder_datasets, inspect_imagefolder

        train_tf, test_tf = timm_transforms(data, protocol, bool(config.hflip), config.auto_augment)
        summary = inspect_imagefolder(Path(config.data_dir), check_images=False)  # checked at the start
        train, test = imagefolder_datasets(summary, train_tf, test_tf)
        mix = timm_mixup(
            protocol, config.classes, config.cutmix_alpha, config.mixup_alpha, config.label_smoothing
        )
        criterion = timm_criterion(protocol, config.label_smoothing)
    else:
        train, test = load_datasets(
            config.dataset,
            build_train_transform(
                protocol, spec, hflip=bool(config.hflip), size=data.size, mean=data.mean, std=data.std
            ),
            build_test_transform(spec, size=data.size, mean=data.mean, std=data.std),
            config.data_dir,
            config.download,
            config.scenes_version,
        )
        mix = build_cutmix(protocol, config.classes, config.cutmix_alpha)
        criterion = build_criterion(protocol, config.label_smoothing)
    return RunData(subset(train, config.limit_train), subset(test, config.limit_test), mix, criterion)


def probe_transform(config: StudyConfig) -> Callable[[Any], Any]:
    """What the dense probe and the plots apply to a raw float scene ``(C, H, W)`` in [0, 1]: a
    resize to the input size (when it differs) and the run's normalization."""
    from torchvision.transforms import v2

    data = data_config(config)
    ops: list[nn.Module] = []
    if data.size != config.spec.img_size:
        ops.append(v2.Resize(data.size, antialias=True))
    ops.append(v2.Normalize(list(data.mean), list(data.std)))
    return v2.Compose(ops)
