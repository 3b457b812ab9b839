"""ImageNet-layout folders (``DIR/train/<class>/*``, ``DIR/val/<class>/*``), checked before training.

:func:`inspect_imagefolder` finds the classes and raises :class:`DataFolderError` naming the path
and what was expected when ``train/`` or ``val/`` is missing, a class folder is in one split but not
the other, a class folder holds no image, or (with ``check_images``) an image cannot be opened (it
names the file and its index in the split). :class:`CheckedImageFolder` is torchvision's
``ImageFolder`` whose read errors name the file and its index too. Files and classes are listed by
:func:`vitattn.analysis.images.image_files` / ``class_folders``, in ``ImageFolder``'s order. timm's
folder reader is not used: it orders classes another way (case-insensitive, numbers by value),
labels an image by its innermost folder and skips unreadable images.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..analysis.images import class_folders, image_files
from .builtin_datasets import DatasetMissingError

__all__ = [
    "AUTO_CHECK_LIMIT",
    "CheckedImageFolder",
    "DataFolderError",
    "FolderSummary",
    "imagefolder_datasets",
    "inspect_imagefolder",
]

SPLITS = ("train", "val")
#: ``check_images=None`` opens every image first when the two splits hold at most this many files.
AUTO_CHECK_LIMIT = 50_000


class DataFolderError(DatasetMissingError):
    """An image folder that does not have the ImageNet layout, or an image that cannot be read."""


@dataclass(frozen=True)
class FolderSummary:
    """``classes`` (sorted folder names, the label order) and the image count of each split."""

    root: Path
    classes: list[str]
    counts: dict[str, int]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def inspect_imagefolder(root: str | os.PathLike[str], check_images: bool | None = None) -> FolderSummary:
    """Check ``root`` holds ``train/<class>/*`` and ``val/<class>/*`` with the same class folders,
    each with at least one image; with ``check_images`` (None: when there are at most
    :data:`AUTO_CHECK_LIMIT` images) open every image (``PIL.Image.verify``).

    Raises:
        DataFolderError: what is wrong and where, e.g. ``'data/val' is missing``, ``class folder(s)
            ['dog'] in 'data/train' but not in 'data/val'``, ``'data/train/cat' holds no image``,
            ``image 17 of 'data/train' ('data/train/cat/x.jpg') cannot be read: ...``.
    """
    base = Path(root)
    layout = f"expected {str(base / 'train')}/<class>/<image> and {str(base / 'val')}/<class>/<image>"
    if not base.is_dir():
        raise DataFolderError(f"--data-dir {str(base)!r} is not a folder; {layout}")
    for split in SPLITS:
        if not (base / split).is_dir():
            raise DataFolderError(f"{str(base / split)!r} is missing; {layout}")
    folders = {split: class_folders(base / split) for split in SPLITS}
    if not folders["train"]:
        raise DataFolderError(f"{str(base / 'train')!r} holds no class folders; {layout}")
    for this, other in (("train", "val"), ("val", "train")):
        extra = sorted(set(folders[this]) - set(folders[other]))
        if extra:
            raise DataFolderError(
                f"class folder(s) {extra[:5]} in {str(base / this)!r} but not in {str(base / other)!r}: "
                "both splits need the same class folders"
            )
    extensions = tuple(IMG_EXTENSIONS)
    files: dict[str, list[Path]] = {}
    for split in SPLITS:
        files[split] = []
        for name in folders[split]:
            found = image_files(base / split / name, extensions)
            if not found:
                raise DataFolderError(
                    f"{str(base / split / name)!r} holds no image (files ending in {', '.join(extensions)})"
                )
            files[split] += found
    total = sum(len(f) for f in files.values())
    if check_images or (check_images is None and total <= AUTO_CHECK_LIMIT):
        for split in SPLITS:
            for index, path in enumerate(files[split]):
                _check_image(path, index, base / split)
    return FolderSummary(base, folders["train"], {s: len(f) for s, f in files.items()})


def _check_image(path: Path, index: int, split_dir: Path) -> None:
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()
    except Exception as err:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError)
        raise DataFolderError(
            f"image {index} of {str(split_dir)!r} ({str(path)!r}) cannot be read: {type(err).__name__}: {err}"
        ) from err


class CheckedImageFolder(ImageFolder):
    """torchvision's ``ImageFolder``; an image that cannot be read raises :class:`DataFolderError`
    naming the file and its index."""

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        try:
            return super().__getitem__(index)
        except Exception as err:
            path = self.samples[index][0]
            raise DataFolderError(
                f"image {index} of {self.root!r} ({path!r}) cannot be read: {type(err).__name__}: {err}"
            ) from err


def imagefolder_datasets(
    summary: FolderSummary, train_transform: Callable[[Any], Any], test_transform: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """``(train, val)`` datasets of a checked folder giving ``(transformed image, label)``."""
    train = CheckedImageFolder(str(summary.root / "train"), transform=train_transform)
    val = CheckedImageFolder(str(summary.root / "val"), transform=test_transform)
    if (
        train.classes != summary.classes or val.classes != summary.classes
    ):  # pragma: no cover - checked before
        raise DataFolderError(f"{str(summary.root)!r}: the class folders changed since they were checked")
    return train, val
