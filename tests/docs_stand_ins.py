"""Local stand-ins for what the docs' offline blocks would download (see :mod:`tests.test_docs`).

Random weights stand in for pretrained ones, tiny models for Hub models and tiny folders for datasets;
nothing is fetched:

- timm: ``pretrained=True`` keeps the model's random init (``load_pretrained`` does nothing), and an
  ``hf-hub:owner/name`` model reads a ``config.json`` written here in timm's form for the registered
  architecture ``name`` (without its ``.tag``);
- transformers: ``from_pretrained(X)`` of a model, config or image processor, where ``X`` is not a
  local path (a Hub id, or ``path/to/dinov2`` that does not exist), loads a tiny random model of X's
  family (:mod:`tests.hf_tiny`: DINOv2, ViT, DeiT, ViT-MAE, CLIP, SigLIP; guessed from the name, ViT
  by default) saved to a folder, with a 32 px image processor; ``vitattn.hf.from_pretrained`` and
  ``vitattn.hf.load_model("hf:X")`` likewise;
- ``vitattn.datasets.VOCSegmentation`` / ``ADE20KSegmentation`` on a root without the data: a tiny
  folder of that layout is written there first (1 image per split, random pixels and labels) and
  the real loader reads it.

:func:`offline_stand_ins` installs all of them for a ``with`` block and yields the list of stand-ins
used, one line each (an offline-marked block that used none does not need the marker).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

#: substrings of a Hub id -> tiny family (first match wins; "vit" when none matches)
HF_FAMILIES: tuple[tuple[str, str], ...] = (
    ("with-registers", "dinov2_reg"),
    ("dinov2", "dinov2"),
    ("mae", "vit_mae"),
    ("deit", "deit"),
    ("siglip", "siglip"),
    ("clip", "clip"),
)
DATASET_IMAGES = 1  # per split
DATASET_SIZE = 48  # pixels, before the loader resizes


def hf_family(ident: str) -> str:
    name = ident.lower()
    return next((family for key, family in HF_FAMILIES if key in name), "vit")


def hf_folder(ident: str, root: Path) -> Path:
    """A ``save_pretrained`` folder under ``root`` standing in for ``ident`` (built once)."""
    from transformers import ViTImageProcessor

    from .hf_tiny import SIZE, tiny_model

    folder = root / "hf" / re.sub(r"[^\w.-]+", "--", ident)
    if not (folder / "config.json").is_file():
        model = tiny_model(hf_family(ident))
        model.config._attn_implementation = None  # let the loader choose, as with a Hub model
        model.save_pretrained(folder)
        ViTImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(folder)
    return folder


def timm_hub_config(model_id: str, root: Path) -> Path:
    """A timm-style ``config.json`` for ``hf-hub:model_id``: the registered architecture of its name."""
    import timm

    arch = model_id.split("@")[0].split("/")[-1].split(".")[0]
    if not timm.is_model(arch):
        raise FileNotFoundError(f"offline stand-in: no registered timm model {arch!r} for hf-hub:{model_id}")
    cfg = timm.models.get_pretrained_cfg(arch)
    pretrained = dict(cfg.to_dict()) if cfg is not None else {}
    path = root / "timm-hub" / re.sub(r"[^\w.-]+", "--", model_id) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "architecture": arch,
        "num_classes": pretrained.get("num_classes", 1000),
        "pretrained_cfg": pretrained,
    }
    path.write_text(json.dumps(config, default=list))
    return path


def _write_image(path: Path, rng: np.random.Generator) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (DATASET_SIZE, DATASET_SIZE, 3), dtype=np.uint8)).save(path)


def _write_labels(path: Path, rng: np.random.Generator, classes: int, border: int | None) -> None:
    """A PNG of labels ``0 .. classes - 1``; ``border`` fills the first two columns (VOC's 255)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    values = rng.integers(0, classes, (DATASET_SIZE, DATASET_SIZE), dtype=np.uint8)
    if border is not None:
        values[:, :2] = border
    Image.fromarray(values).save(path)


def voc_folder(root: Path) -> None:
    """``root/VOCdevkit/VOC2012`` with ``DATASET_IMAGES`` random images per split, 21 classes."""
    base = Path(root) / "VOCdevkit" / "VOC2012"
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        names = [f"{split}_{i}" for i in range(DATASET_IMAGES)]
        listing = base / "ImageSets" / "Segmentation" / f"{split}.txt"
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text("".join(f"{n}\n" for n in names))
        for n in names:
            _write_image(base / "JPEGImages" / f"{n}.jpg", rng)
            _write_labels(base / "SegmentationClass" / f"{n}.png", rng, 21, border=255)


def ade20k_folder(root: Path) -> None:
    """``root/ADEChallengeData2016`` with ``DATASET_IMAGES`` random images per split, labels 0-150."""
    base = Path(root) / "ADEChallengeData2016"
    rng = np.random.default_rng(0)
    for split in ("training", "validation"):
        for i in range(DATASET_IMAGES):
            _write_image(base / "images" / split / f"{split}_{i}.jpg", rng)
            _write_labels(base / "annotations" / split / f"{split}_{i}.png", rng, 151, border=None)


def _wrap_classmethod(mp: pytest.MonkeyPatch, cls: type, swap: Callable[[Any], Any]) -> None:
    """``cls.from_pretrained(source, ...)`` with ``source`` replaced by ``swap(source)``."""
    original = cls.__dict__["from_pretrained"].__func__

    @functools.wraps(original)
    def from_pretrained(klass: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
        return original(klass, swap(source), *args, **kwargs)

    mp.setattr(cls, "from_pretrained", classmethod(from_pretrained))


def _timm(mp: pytest.MonkeyPatch, used: list[str], root: Path) -> None:
    import timm.models._builder as builder
    import timm.models._hub as hub

    def load_pretrained(model: Any, *args: Any, **kwargs: Any) -> None:
        used.append(f"timm pretrained weights of {type(model).__name__}: its random init")

    download = hub.download_from_hf

    def download_from_hf(model_id: str, filename: str, *args: Any, **kwargs: Any) -> Any:
        if filename != "config.json":
            return download(model_id, filename, *args, **kwargs)
        used.append(f"timm hf-hub:{model_id}: a config.json of the registered architecture")
        return timm_hub_config(model_id, root)

    mp.setattr(builder, "load_pretrained", load_pretrained)
    mp.setattr(hub, "download_from_hf", download_from_hf)


def _transformers(mp: pytest.MonkeyPatch, used: list[str], root: Path) -> None:
    try:
        import transformers
        from transformers.image_processing_base import ImageProcessingMixin
        from transformers.models.auto.auto_factory import _BaseAutoModelClass
    except ImportError:  # pragma: no cover - the hf extra is in the test extra
        return

    def swap(source: Any) -> Any:
        if not isinstance(source, (str, Path)) or Path(source).exists():
            return source
        folder = hf_folder(str(source), root)
        used.append(f"transformers {source}: a tiny random {hf_family(str(source))} model")
        return str(folder)

    for cls in (
        transformers.PreTrainedModel,
        _BaseAutoModelClass,
        transformers.AutoConfig,
        transformers.PretrainedConfig,
        transformers.AutoImageProcessor,
        ImageProcessingMixin,
    ):
        _wrap_classmethod(mp, cls, swap)

    import vitattn.hf
    import vitattn.hf.loading as loading

    original = loading.from_pretrained

    @functools.wraps(original)
    def from_pretrained(source: Any, *args: Any, **kwargs: Any) -> Any:
        return original(swap(source), *args, **kwargs)

    load = loading.load_model

    @functools.wraps(load)
    def load_model(spec: str) -> Any:
        prefix, _, source = spec.partition(":")
        return load(f"{prefix}:{swap(source)}" if prefix == "hf" and source else spec)

    for name, wrapper in (("from_pretrained", from_pretrained), ("load_model", load_model)):
        mp.setattr(loading, name, wrapper)
        mp.setattr(vitattn.hf, name, wrapper)


def _datasets(mp: pytest.MonkeyPatch, used: list[str]) -> None:
    from vitattn.datasets import segmentation

    def stand_in(cls: type, folder: str, write: Callable[[Path], None]) -> None:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, root: Any, *args: Any, **kwargs: Any) -> None:
            if not (Path(root) / folder).exists():
                write(Path(root))
                used.append(f"{cls.__name__}({str(root)!r}): a tiny folder of random images and labels")
            init(self, root, *args, **kwargs)

        mp.setattr(cls, "__init__", __init__)

    stand_in(segmentation.VOCSegmentation, "VOCdevkit", voc_folder)
    stand_in(segmentation.ADE20KSegmentation, "ADEChallengeData2016", ade20k_folder)


@contextlib.contextmanager
def offline_stand_ins(root: Path) -> Iterator[list[str]]:
    """All stand-ins, their files under ``root``, for the ``with`` block; yields the uses, one line each."""
    used: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        _timm(mp, used, root)
        _transformers(mp, used, root)
        _datasets(mp, used)
        yield used
