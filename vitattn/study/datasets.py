"""Datasets of the study, each sized so the ViT sees an 8×8 patch grid.

- ``scenes`` (default): :class:`vitattn.datasets.DigitScenes`, procedural 32 px scenes of
  scikit-learn digits on textured backgrounds (patch 4), with segmentation masks, so every run is
  also probed for dense quality; nothing is downloaded.
- ``digits``: scikit-learn's bundled 8×8 handwritten digits (1797 images, 10 classes), one pixel
  per patch; a fixed stratified split of 1437 train / 360 test images; nothing is downloaded.
- ``cifar10`` / ``cifar100``: torchvision's CIFAR (32 px, patch 4) under ``data_dir``.
- ``tinyimagenet``: Tiny-ImageNet-200 (64 px, patch 8) as image folders under ``data_dir``.
- ``imagefolder``: any ImageNet-layout folder ``data_dir/train/<class>/*``, ``data_dir/val/<class>/*``
  (classes from the folders, 224 px by default, timm's data pipeline: :mod:`.timm_data`).

Images come out as uint8 (PIL or ``(C, H, W)`` tensors) for the protocol's transforms.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from ..datasets import DigitScenes

__all__ = [
    "DATASETS",
    "DatasetMissingError",
    "DatasetSpec",
    "DigitsDataset",
    "ScenesDataset",
    "check_dataset",
    "load_datasets",
    "probe_datasets",
]


class DatasetMissingError(FileNotFoundError):
    """A dataset is not where the study looks for it; the message says what to put where."""


Transform = Callable[[Any], torch.Tensor]

# per-channel mean / std of DigitScenes' default train split, version 3 (the study's; a test checks
# them against vitattn.datasets.scenes.STATISTICS, which has every version's)
SCENES_MEAN = (0.4980, 0.4994, 0.5008)
SCENES_STD = (0.2054, 0.2043, 0.2051)


@dataclass(frozen=True)
class DatasetSpec:
    """Image size, patch size (``img_size / patch_size = 8``), channels, classes and normalization."""

    name: str
    img_size: int
    patch_size: int
    channels: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    color_augment: str = "autoaugment"  # what the protocol's "autoaugment" component means here
    # (imagefolder: "timm", the timm policy of StudyConfig.auto_augment); num_classes 0: from the folders
    batch_size: int = 128
    pos_embed_std: float = 0.02  # timm's init
    hflip: bool = True  # the baseline's horizontal flip
    has_masks: bool = False  # segmentation masks for the dense probe (scenes only)

    @property
    def grid_size(self) -> tuple[int, int]:
        g = self.img_size // self.patch_size
        return g, g


DATASETS: dict[str, DatasetSpec] = {
    # mean / std: version 3's (data_config takes the run's version's); no flip by default, as on
    # digits (a mirrored digit is mostly not a digit of its class)
    "scenes": DatasetSpec(
        "scenes", 32, 4, 3, 10, SCENES_MEAN, SCENES_STD, batch_size=64, hflip=False, has_masks=True
    ),
    # mean / std of the 1437 training digits scaled to [0, 1]
    # a one-pixel patch embeds a single gray level: position embeddings at timm's std 0.02 are too
    # faint next to it, and the ViT sits at chance for hundreds of steps; they start at std 1 here.
    # 1437 training images: batches of 32 give 44 steps per epoch. No flip by default: a mirrored
    # digit is mostly not a digit of its class (2, 3, 4, 5, 6, 7, 9), so the flip turns the task
    # into learning each class twice; --hflip restores it.
    "digits": DatasetSpec(
        "digits", 8, 1, 1, 10, (0.3054,), (0.3760,), batch_size=32, pos_embed_std=1.0, hflip=False
    ),
    "cifar10": DatasetSpec("cifar10", 32, 4, 3, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": DatasetSpec("cifar100", 32, 4, 3, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "tinyimagenet": DatasetSpec(
        "tinyimagenet", 64, 8, 3, 200, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "colorjitter"
    ),
    # timm's ImageNet mean / std (a pretrained timm model's own when --pretrained)
    "imagefolder": DatasetSpec(
        "imagefolder", 224, 28, 3, 0, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "timm"
    ),
}


class DigitsDataset(Dataset):
    """scikit-learn's 8×8 digits as ``(uint8 image (1, 8, 8), label)`` pairs, one fixed split.

    Gray levels 0–16 are scaled to 0–255. The split is stratified, 20 % test, ``random_state=0``:
    1437 train and 360 test images whatever the run's seed.
    """

    def __init__(self, train: bool, transform: Transform | None = None) -> None:
        try:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("the digits dataset needs scikit-learn (pip install 'vitattn[study]')") from err
        digits = load_digits()
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
