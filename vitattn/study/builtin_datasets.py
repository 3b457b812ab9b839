"""The built-in sets of the study as datasets, and the check that their files are where the study looks.

- ``scenes``: :class:`ScenesDataset`, :class:`vitattn.datasets.DigitScenes` for the protocols'
  transforms (with :func:`probe_datasets`, the same scenes with their masks for the dense probe).
- ``digits``: :class:`DigitsDataset`, scikit-learn's bundled 8×8 digits, one fixed split.
- ``cifar10`` / ``cifar100``: torchvision's CIFAR under ``data_dir``.
- ``tinyimagenet``: Tiny-ImageNet-200 as image folders under ``data_dir``.

Their sizes and normalization are in :mod:`.dataset_specs`; image folders in :mod:`.imagefolder`.
Images come out as uint8 (PIL or ``(C, H, W)`` tensors) for the protocol's transforms.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from .dataset_specs import DATASETS, DatasetSpec

if TYPE_CHECKING:
    from ..datasets import DigitScenes

__all__ = [
    "DatasetMissingError",
    "DigitsDataset",
    "ScenesDataset",
    "check_dataset",
    "load_datasets",
    "probe_datasets",
]


class DatasetMissingError(FileNotFoundError):
    """A dataset is not where the study looks for it; the message says what to put where."""


Transform = Callable[[Any], torch.Tensor]


class DigitsDataset(Dataset):
    """scikit-learn's 8×8 digits as ``(uint8 image (1, 8, 8), label)`` pairs, one fixed split.

    Gray levels 0–16 are scaled to 0–255. The split is stratified, 20 % test, ``random_state=0``:
    1437 train and 360 test images whatever the run's seed.
    """

    def __init__(self, train: bool, transform: Transform | None = None) -> None:
        from ..analysis.images import sklearn_digits

        digits = sklearn_digits()  # checks that scikit-learn is there
        from sklearn.model_selection import train_test_split

        index = list(range(len(digits.target)))
        train_idx, test_idx = train_test_split(index, test_size=0.2, random_state=0, stratify=digits.target)
        chosen = sorted(train_idx if train else test_idx)
        images = torch.as_tensor(digits.images[chosen], dtype=torch.float32)
        self.images = (images * (255.0 / 16.0)).round().clamp(0, 255).to(torch.uint8)[:, None]  # (N, 1, 8, 8)
        self.targets = torch.as_tensor(digits.target[chosen], dtype=torch.int64)
        self.transform = transform

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.targets[i])


class ScenesDataset(Dataset):
    """:class:`vitattn.datasets.DigitScenes` as ``(uint8 image (3, 32, 32), label)`` pairs for
    the protocols' transforms (split ``train`` or ``test``, generator ``version``; the masks stay
    for the probe)."""

    def __init__(self, split: str, transform: Transform | None = None, version: int = 3) -> None:
        from ..datasets import DigitScenes

        self.scenes = DigitScenes(split, version=version)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image = self.scenes.images[i]
        return (self.transform(image) if self.transform else image), int(self.scenes.labels[i])


class _TinyImageNetVal(Dataset):
    """Tiny-ImageNet's original validation layout: ``val/images/*.JPEG`` + ``val/val_annotations.txt``."""

    def __init__(self, val_dir: Path, class_to_idx: dict[str, int], transform: Transform | None) -> None:
        from torchvision.datasets.folder import default_loader

        self.loader = default_loader
        self.samples = []
        for line in (val_dir / "val_annotations.txt").read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[1] in class_to_idx:
                self.samples.append((val_dir / "images" / parts[0], class_to_idx[parts[1]]))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.samples[i]
        image = self.loader(str(path))
        return (self.transform(image) if self.transform else image), label


_CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz"),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz"),
}


def _cifar_missing(spec: DatasetSpec, root: Path) -> DatasetMissingError:
    folder, archive = _CIFAR_FILES[spec.name]
    return DatasetMissingError(
        f"{spec.name} was not found under --data-dir {str(root)!r}: put torchvision's python version "
        f"there as {str(root / folder)}/ (the extracted {archive} from the CIFAR page), "
        "or pass --download to fetch it (about 170 MB)"
    )


def _cifar(
    spec: DatasetSpec, root: Path, download: bool, train_tf: Transform, test_tf: Transform
) -> tuple[Dataset, Dataset]:
    from torchvision import datasets

    cls = datasets.CIFAR10 if spec.name == "cifar10" else datasets.CIFAR100
    try:
        return (
            cls(str(root), train=True, transform=train_tf, download=download),
            cls(str(root), train=False, transform=test_tf, download=False),
        )
    except RuntimeError as err:
        if "not found" not in str(err).lower() and "corrupted" not in str(err).lower():
            raise
        raise _cifar_missing(spec, root) from err


def _tinyimagenet_dirs(root: Path, download: bool) -> tuple[Path, Path]:
    """``(train, val)`` folders of Tiny-ImageNet under ``root``; :class:`DatasetMissingError` when absent."""
    base = root / "tiny-imagenet-200" if (root / "tiny-imagenet-200").is_dir() else root
    train_dir, val_dir = base / "train", base / "val"
    if download:
        raise DatasetMissingError(
            "tinyimagenet cannot be downloaded by vitattn: fetch tiny-imagenet-200.zip yourself and "
            f"unzip it under --data-dir {str(root)!r}"
        )
    if not train_dir.is_dir() or not val_dir.is_dir():
        raise DatasetMissingError(
            f"tinyimagenet was not found under --data-dir {str(root)!r}: expected "
            f"{str(root / 'tiny-imagenet-200')}/train/<wnid>/... and .../val/ (either the original "
            "val/images + val/val_annotations.txt, or val/<wnid>/... image folders); unzip "
            "tiny-imagenet-200.zip there"
        )
    return train_dir, val_dir


def check_dataset(name: str, data_dir: str | os.PathLike[str] = "data", download: bool = False) -> None:
    """Raise :class:`DatasetMissingError` (saying what to put where) when the files of ``name`` are not
    under ``data_dir``: a quick look at the folders, before a study writes anything. The built-in sets
    need nothing; CIFAR passes when ``download`` will fetch it; image folders are inspected by
    :func:`~.imagefolder.inspect_imagefolder`."""
    root = Path(data_dir)
    if name in _CIFAR_FILES and not download and not (root / _CIFAR_FILES[name][0]).is_dir():
        raise _cifar_missing(DATASETS[name], root)
    if name == "tinyimagenet":
        _tinyimagenet_dirs(root, download)


def _tinyimagenet(
    spec: DatasetSpec, root: Path, download: bool, train_tf: Transform, test_tf: Transform
) -> tuple[Dataset, Dataset]:
    from torchvision.datasets import ImageFolder

    train_dir, val_dir = _tinyimagenet_dirs(root, download)
    train = ImageFolder(str(train_dir), transform=train_tf)
    if (val_dir / "val_annotations.txt").is_file() and (val_dir / "images").is_dir():
        test: Dataset = _TinyImageNetVal(val_dir, train.class_to_idx, test_tf)
    else:
        folders = ImageFolder(str(val_dir), transform=test_tf)
        if folders.class_to_idx != train.class_to_idx:
            raise DatasetMissingError(f"{str(val_dir)!r} and {str(train_dir)!r} hold different class folders")
        test = folders
    if len(train.classes) != spec.num_classes:
        raise DatasetMissingError(
            f"{str(train_dir)!r} holds {len(train.classes)} class folders; "
            f"Tiny-ImageNet has {spec.num_classes}"
        )
    return train, test


def load_datasets(
    name: str,
    train_transform: Transform,
    test_transform: Transform,
    data_dir: str | os.PathLike[str] = "data",
    download: bool = False,
    scenes_version: int = 3,
) -> tuple[Dataset, Dataset]:
    """``(train, test)`` datasets of ``name`` giving ``(transformed image, int label)``
    (``scenes_version``: the DigitScenes generator of ``scenes``).

    Raises:
        ValueError: unknown dataset name.
        DatasetMissingError: the files are not under ``data_dir`` (the message says what to put where).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    if name == "scenes":
        return (
            ScenesDataset("train", train_transform, scenes_version),
            ScenesDataset("test", test_transform, scenes_version),
        )
    if name == "digits":
        return DigitsDataset(True, train_transform), DigitsDataset(False, test_transform)
    root = Path(data_dir)
    if name in ("cifar10", "cifar100"):
        return _cifar(spec, root, download, train_transform, test_transform)
    return _tinyimagenet(spec, root, download, train_transform, test_transform)


def probe_datasets(name: str, scenes_version: int = 3) -> tuple[DigitScenes, DigitScenes] | None:
    """``(train, test)`` segmentation datasets of ``name`` for the dense probe — items
    ``(float image (3, H, W) in [0, 1], label, mask (H, W))`` — or None when it has no masks."""
    if not DATASETS[name].has_masks:
        return None
    from ..datasets import DigitScenes

    return DigitScenes("train", version=scenes_version), DigitScenes("test", version=scenes_version)
