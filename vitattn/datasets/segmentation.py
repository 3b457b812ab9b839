"""PASCAL VOC 2012 and ADE20K (SceneParsing, 150 classes) as ``(image, mask)`` pairs at a fixed size.

Items: ``image`` float32 ``(3, S, S)`` in [0, 1], resized bilinearly (antialiased) so that its short
side is ``S``, then centre-cropped; ``mask`` int64 ``(S, S)``, resized with nearest neighbour and
cropped the same way; ``ignore_index`` (255) marks unlabelled pixels. Nothing is downloaded unless
``VOCSegmentation(download=True)``; missing files raise :class:`SegmentationDatasetMissing` with the
folder expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["ADE20KSegmentation", "SegmentationDatasetMissing", "VOCSegmentation", "resize_crop"]

VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
    "tvmonitor",
)  # fmt: skip

ADE20K_CLASSES = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass",
    "cabinet", "sidewalk", "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair",
    "car", "water", "painting", "sofa", "shelf", "house", "sea", "mirror", "rug", "field", "armchair",
    "seat", "fence", "desk", "rock", "wardrobe", "lamp", "bathtub", "railing", "cushion", "base", "box",
    "column", "signboard", "chest of drawers", "counter", "sand", "sink", "skyscraper", "fireplace",
    "refrigerator", "grandstand", "path", "stairs", "runway", "case", "pool table", "pillow",
    "screen door", "stairway", "river", "bridge", "bookcase", "blind", "coffee table", "toilet",
    "flower", "book", "hill", "bench", "countertop", "stove", "palm", "kitchen island", "computer",
    "swivel chair", "boat", "bar", "arcade machine", "hovel", "bus", "towel", "light", "truck", "tower",
    "chandelier", "awning", "streetlight", "booth", "television receiver", "airplane", "dirt track",
    "apparel", "pole", "land", "bannister", "escalator", "ottoman", "bottle", "buffet", "poster",
    "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything",
    "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle",
    "oven", "ball", "food", "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle",
    "lake", "dishwasher", "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light",
    "tray", "ashcan", "fan", "pier", "crt screen", "plate", "monitor", "bulletin board", "shower",
    "radiator", "glass", "clock", "flag",
)  # fmt: skip

IGNORE_INDEX = 255


class SegmentationDatasetMissing(FileNotFoundError):
    """A segmentation dataset's files are not where expected; the message says how to get them."""


def _check_split(split: str) -> str:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return split


def _check_size(image_size: int) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be an int >= 1, got {image_size!r}")
    return image_size


def resize_crop(image: Any, mask: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL image + PIL label map -> ``(3, S, S)`` float32 in [0, 1] and ``(S, S)`` int64.

    Short side resized to ``size`` (image: bilinear with antialias; mask: nearest), then centre crop.
    """
    img = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).float() / 255
    lab = torch.from_numpy(np.array(mask, dtype=np.int64))
    if lab.ndim != 2 or lab.shape != img.shape[1:]:
        raise ValueError(f"mask of shape {tuple(lab.shape)} does not match the image {tuple(img.shape[1:])}")
    h, w = lab.shape
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    img = F.interpolate(img[None], size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)[0]
    lab = F.interpolate(lab[None, None].float(), size=(nh, nw), mode="nearest")[0, 0].long()
    top, left = (nh - size) // 2, (nw - size) // 2
    img = img[:, top : top + size, left : left + size].clamp(0, 1).contiguous()
    return img, lab[top : top + size, left : left + size].contiguous()


class VOCSegmentation(Dataset):
    """PASCAL VOC 2012 segmentation (21 classes, 255 on object borders) via torchvision.

    Expects ``root/VOCdevkit/VOC2012`` (``JPEGImages``, ``SegmentationClass``,
    ``ImageSets/Segmentation/{train,val}.txt``); ``download=True`` fetches it with torchvision.
    """

    num_seg_classes = len(VOC_CLASSES)
    ignore_index = IGNORE_INDEX
    class_names = VOC_CLASSES

    def __init__(self, root: str | Path, split: str = "train", image_size: int = 448, download: bool = False):
        self.root, self.split, self.image_size = Path(root), _check_split(split), _check_size(image_size)
        base = self.root / "VOCdevkit" / "VOC2012"
        listing = base / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not download and not listing.is_file():
            raise SegmentationDatasetMissing(
                f"PASCAL VOC 2012 not found: expected the folder {str(base)!r} (with JPEGImages, "
                f"SegmentationClass and ImageSets/Segmentation/{split}.txt); pass --download "
                f"(download=True) to fetch it, or extract VOCtrainval_11-May-2012.tar so that "
                f"VOCdevkit/VOC2012 lies under {str(self.root)!r}"
            )
        from torchvision.datasets import VOCSegmentation as TVVOC

        kwargs: dict[str, Any] = {"download": True} if download else {}
        self._data = TVVOC(str(self.root), year="2012", image_set=split, **kwargs)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self._data[i]
        return resize_crop(image, mask, self.image_size)


class ADE20KSegmentation(Dataset):
    """ADE20K SceneParsing (150 classes): label 0 ("other") becomes 255, label k becomes k − 1.

    Expects ``root/ADEChallengeData2016/images/{training,validation}/*.jpg`` and
    ``root/ADEChallengeData2016/annotations/{training,validation}/*.png`` (same file stems).
    """

    num_seg_classes = len(ADE20K_CLASSES)
    ignore_index = IGNORE_INDEX
    class_names = ADE20K_CLASSES

    def __init__(self, root: str | Path, split: str = "train", image_size: int = 448):
        self.root, self.split, self.image_size = Path(root), _check_split(split), _check_size(image_size)
        folder = {"train": "training", "val": "validation"}[split]
        base = self.root / "ADEChallengeData2016"
        images, labels = base / "images" / folder, base / "annotations" / folder
        hint = (
            f"ADE20K not found: expected the folder {str(base)!r} with images/{folder}/*.jpg and "
            f"annotations/{folder}/*.png; download ADEChallengeData2016.zip (the MIT SceneParsing "
            f"benchmark, http://sceneparsing.csail.mit.edu) and unzip it under {str(self.root)!r}"
        )
        if not images.is_dir() or not labels.is_dir():
            raise SegmentationDatasetMissing(hint)
        self.samples: list[tuple[Path, Path]] = []
        for img in sorted(images.glob("*.jpg")):
            ann = labels / f"{img.stem}.png"
            if ann.is_file():
                self.samples.append((img, ann))
        if not self.samples:
            raise SegmentationDatasetMissing(hint + " (no .jpg with a matching .png was found)")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        img_path, ann_path = self.samples[i]
        with Image.open(img_path) as im, Image.open(ann_path) as an:
            image, mask = resize_crop(im, an, self.image_size)
        mask = torch.where(mask == 0, torch.full_like(mask, IGNORE_INDEX), mask - 1)
        return image, mask
