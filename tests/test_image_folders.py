"""Image folders are listed once (`vitattn.analysis.images`): the study's checked folder datasets and
`vitattn analyze --images` see the classes and files in torchvision ``ImageFolder``'s order."""

from __future__ import annotations

from pathlib import Path

from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from vitattn.analysis.images import IMAGE_EXTENSIONS, class_folders, find_images, image_files
from vitattn.study.imagefolder import CheckedImageFolder, inspect_imagefolder

# case and numbers: plain string order, not a "natural" one (B < a, c10 < c2)
CLASSES = ("B", "a", "c10", "c2")
FILES = ("10.png", "2.png", "Z.PNG", "sub/1.jpg", "x/y/0.png")


def _folder(root: Path) -> Path:
    for name in CLASSES:
        for rel in FILES:
            path = root / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (4, 4), (len(rel), 0, 0)).save(path, format="PNG")
        (root / name / "notes.txt").write_text("not an image")
    return root


def test_listing_is_torchvisions_order(tmp_path):
    root = _folder(tmp_path / "d")
    reference = ImageFolder(str(root))
    assert class_folders(root) == reference.classes == list(CLASSES)
    files = image_files(root, IMG_EXTENSIONS)
    assert [str(p) for p in files] == [path for path, _ in reference.samples]
    assert len(files) == len(CLASSES) * len(FILES)


def test_study_folder_datasets_match_the_checks(tmp_path):
    root = tmp_path / "d"
    for split in ("train", "val"):
        _folder(root / split)
    summary = inspect_imagefolder(root, check_images=True)
    assert summary.classes == list(CLASSES) and summary.counts == {"train": 20, "val": 20}
    train = CheckedImageFolder(str(root / "train"))
    assert train.classes == summary.classes
    listed = image_files(root / "train", IMG_EXTENSIONS)
    assert [path for path, _ in train.samples] == [str(p) for p in listed]


def test_find_images_labels_by_class_folder(tmp_path):
    root = _folder(tmp_path / "d")
    Image.new("RGB", (4, 4)).save(root / "loose.png")  # not in a class folder: label -1
    (root / "empty").mkdir()  # a class folder without images still takes its label
    found = find_images(root)
    assert [path for path, _ in found] == sorted(image_files(root, IMAGE_EXTENSIONS))
    labels = {path.relative_to(root).parts[0]: label for path, label in found}
    assert labels == {"B": 0, "a": 1, "c10": 2, "c2": 3, "loose.png": -1}
    assert len(found) == len(CLASSES) * len(FILES) + 1
