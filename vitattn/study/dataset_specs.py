"""The study's datasets as specs: each one's image size, patch size (an 8×8 patch grid), channels,
classes, normalization and defaults.

- ``scenes`` (default): :class:`vitattn.datasets.DigitScenes`, procedural 32 px scenes of
  scikit-learn digits on textured backgrounds (patch 4), with segmentation masks, so every run is
  also probed for dense quality; nothing is downloaded.
- ``digits``: scikit-learn's bundled 8×8 handwritten digits (1797 images, 10 classes), one pixel
  per patch; a fixed stratified split of 1437 train / 360 test images; nothing is downloaded.
- ``cifar10`` / ``cifar100``: torchvision's CIFAR (32 px, patch 4) under ``data_dir``.
- ``tinyimagenet``: Tiny-ImageNet-200 (64 px, patch 8) as image folders under ``data_dir``.
- ``imagefolder``: any ImageNet-layout folder ``data_dir/train/<class>/*``, ``data_dir/val/<class>/*``
  (classes from the folders, 224 px by default, timm's data pipeline: :mod:`.timm_protocols`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DATASETS", "DatasetSpec"]

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
