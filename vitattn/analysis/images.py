"""Images for analysis, sized for a model: its input spec, scikit-learn's 8×8 digits, image folders.

:func:`class_folders` and :func:`image_files` list an image folder (classes, files in torchvision
``ImageFolder``'s order); the study's image-folder checks (``vitattn.study.imagefolder``) use them too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageFolderBatches",
    "InputSpec",
    "class_folders",
    "digits_images",
    "find_images",
    "image_files",
    "image_folder_batches",
    "input_spec",
    "load_image",
    "sklearn_digits",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class InputSpec:
    """What a model expects: ``size = (H, W)``, channels, and the per-channel mean / std."""

    size: tuple[int, int]
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` in [0, 1] -> normalized with ``mean`` / ``std``."""
        mean = torch.tensor(self.mean[: self.channels], dtype=images.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.std[: self.channels], dtype=images.dtype).view(1, -1, 1, 1)
        return (images - mean) / std


def input_spec(model: nn.Module) -> InputSpec:
    """Input size and normalization of a timm-style model (``patch_embed`` and ``pretrained_cfg``)."""
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None) or tuple(cfg.get("input_size", (3, 224, 224))[-2:])
    proj = getattr(embed, "proj", None)
    channels = int(getattr(proj, "in_channels", cfg.get("input_size", (3,))[0]))
    mean = tuple(float(v) for v in cfg.get("mean", (0.5,) * channels))
    std = tuple(float(v) for v in cfg.get("std", (0.5,) * channels))
    if len(mean) < channels:
        mean, std = mean * channels, std * channels
    return InputSpec((int(size[0]), int(size[1])), channels, mean, std)


def sklearn_digits() -> Any:
    """scikit-learn's bundled 8×8 digits (``images`` (1797, 8, 8) gray levels 0–16, ``target`` (1797,));
    an ``ImportError`` naming the extra to install when scikit-learn is missing."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the digits dataset needs scikit-learn (pip install 'vitattn[study]')") from err
    return load_digits()


def digits_images(
    size: Sequence[int] = (8, 8),
    channels: int = 3,
    max_images: int | None = None,
    spec: InputSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8×8 digits (1797 images, bundled, no download) as ``(images, labels)``.

    Images are ``(N, channels, H, W)`` float32 in [0, 1], bilinearly resized to ``size`` with the
    gray level replicated over channels; with ``spec`` its size, channels and normalization are used.
    Labels are ``(N,)`` int64 digits 0–9.
    """
    digits = sklearn_digits()
    n = len(digits.target) if max_images is None else min(int(max_images), len(digits.target))
    images = torch.as_tensor(digits.images[:n], dtype=torch.float32)[:, None] / 16.0
    labels = torch.as_tensor(digits.target[:n], dtype=torch.int64)
    if spec is not None:
        size, channels = spec.size, spec.channels
    h, w = int(size[0]), int(size[1])
    if (h, w) != (8, 8):
        images = F.interpolate(images, size=(h, w), mode="bilinear", align_corners=False).clamp_(0, 1)
    images = images.expand(-1, channels, -1, -1).contiguous()
    return (spec.normalize(images) if spec is not None else images), labels


def class_folders(root: str | os.PathLike[str]) -> list[str]:
    """Names of the folders in ``root`` (links followed), sorted: an image folder's classes in label order."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=True))


def image_files(folder: str | os.PathLike[str], extensions: Sequence[str]) -> list[Path]:
    """Files under ``folder`` (recursively, links followed) whose lower-cased names end in one of
    ``extensions``, in torchvision ``ImageFolder``'s order: folders sorted, then the files of each."""
    ends = tuple(extensions)
    out = []
    for root, _, files in sorted(os.walk(folder, followlinks=True)):
        out += [Path(root) / f for f in sorted(files) if f.lower().endswith(ends)]
    return out


def find_images(root: str | Path) -> list[tuple[Path, int]]:
    """Image files under ``root`` with labels: an ImageFolder layout (``root/<class>/...``) gives the
    class index (sorted class folders); images directly in ``root`` get label -1. Sorted paths."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {str(root)!r} does not exist or is not a directory")
    index = {name: i for i, name in enumerate(class_folders(root))}
    files = sorted(image_files(root, IMAGE_EXTENSIONS))
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {str(root)!r}")
    out = []
    for path in files:
        rel = path.relative_to(root).parts
        out.append((path, index[rel[0]] if len(rel) > 1 else -1))
    return out


def load_image(path: str | Path, spec: InputSpec) -> torch.Tensor:
    """One image file as a ``(C, H, W)`` float tensor resized to ``spec.size`` and normalized."""
    from PIL import Image

    with Image.open(path) as file:
        img = file.convert("L" if spec.channels == 1 else "RGB").resize(
            (spec.size[1], spec.size[0]), Image.Resampling.BILINEAR
        )
        data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    x = data.view(spec.size[0], spec.size[1], -1).permute(2, 0, 1).float() / 255.0
    if x.shape[0] != spec.channels:  # a 1-channel image for a model of more channels
        x = x[:1].expand(spec.channels, -1, -1)
    return spec.normalize(x[None])[0]


class ImageFolderBatches:
    """``(images, labels)`` batches of the images under ``root`` (see :func:`find_images`), loaded
    lazily with :func:`load_image`; ``num_images`` says how many it will give."""

    def __init__(
        self, root: str | Path, spec: InputSpec, batch_size: int = 16, max_images: int | None = None
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.files = find_images(root)[:max_images]
        self.spec = spec
        self.batch_size = batch_size

    @property
    def num_images(self) -> int:
        return len(self.files)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.files), self.batch_size):
            chunk = self.files[start : start + self.batch_size]
            images = torch.stack([load_image(path, self.spec) for path, _ in chunk])
            yield images, torch.tensor([label for _, label in chunk], dtype=torch.int64)


def image_folder_batches(
    root: str | Path, spec: InputSpec, batch_size: int = 16, max_images: int | None = None
) -> ImageFolderBatches:
    """Lazy ``(images, labels)`` batches of an image folder, sized and normalized for ``spec``."""
    return ImageFolderBatches(root, spec, batch_size, max_images)
