"""Tests of ``vitattn.datasets.DigitScenes`` (small sizes; every cache goes to a temporary folder)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sklearn")

from vitattn.datasets import DigitScenes, scenes  # noqa: E402

# SHA-256 of images[:4].tobytes() + masks[:4].tobytes() of DigitScenes("test", size=8), format v1.
PINNED_TEST_SHA256 = "b2189e38aaba1b56f14f6139e6a07e5cfd14c157ac4e752ad93361748fc5dbb6"
VALID_MASK_VALUES = set(range(11)) | {255}


@pytest.fixture(autouse=True)
def _no_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Never touch ``~/.cache``: the default cache folder of every test is its own temporary one."""
    monkeypatch.setenv("VITATTN_CACHE", str(tmp_path / "env-cache"))


@pytest.fixture(scope="module")
def train40(tmp_path_factory: pytest.TempPathFactory) -> DigitScenes:
    return DigitScenes("train", size=40, cache_dir=tmp_path_factory.mktemp("train40"))


def _digest(ds: DigitScenes, k: int = 4) -> str:
    return hashlib.sha256(ds.images[:k].numpy().tobytes() + ds.masks[:k].numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------------------- items and masks


def test_item_types_shapes_and_ranges(train40: DigitScenes) -> None:
    assert len(train40) == 40
    assert train40.images.shape == (40, 3, 32, 32) and train40.images.dtype == torch.uint8
    assert train40.masks.shape == (40, 32, 32) and train40.masks.dtype == torch.uint8
    assert train40.labels.shape == (40,) and train40.labels.dtype == torch.int64
    for i in (0, 17, 39):
        image, label, mask = train40[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert 0.0 <= image.min() and image.max() <= 1.0
        assert torch.equal(image, train40.images[i].float() / 255.0)
        assert type(label) is int and 0 <= label <= 9
        assert mask.shape == (32, 32) and mask.dtype == torch.int64
        assert torch.equal(mask, train40.masks[i].long())


def test_label_is_the_largest_mask_region(train40: DigitScenes) -> None:
    for i in range(len(train40)):
        _, label, mask = train40[i]
        counts = torch.bincount(mask.flatten(), minlength=256)[1:11]  # digit classes 0-9
        assert counts[label] > 0
        assert int(counts.argmax()) == label
        assert (counts[label] > torch.cat([counts[:label], counts[label + 1 :]])).all()


def test_mask_values_ignore_band_and_background(train40: DigitScenes) -> None:
    assert set(torch.unique(train40.masks).tolist()) <= VALID_MASK_VALUES
    per_image = train40.masks.flatten(1)
    assert ((per_image == 255).sum(1) > 0).all()
    assert ((per_image == 0).sum(1) > 0).all()
    # distractors are labelled too: some scene has a second digit class in its mask
    n_classes = [len(set(m.unique().tolist()) - {0, 255}) for m in train40.masks]
    assert max(n_classes) >= 2


def test_class_attributes() -> None:
    assert DigitScenes.num_classes == 10 and DigitScenes.num_seg_classes == 11
    assert DigitScenes.ignore_index == 255
    assert DigitScenes.class_names == ("background", *"0123456789")
    assert len(DigitScenes.mean) == 3 and len(DigitScenes.std) == 3


def test_indexing_transform_and_repr(tmp_path: Path) -> None:
    ds = DigitScenes("val", size=5, cache_dir=tmp_path, transform=lambda x: x * 2.0 - 1.0)
    image, label, mask = ds[-1]
    assert image.min() >= -1.0 and image.max() <= 1.0
    assert torch.equal(image, ds.images[4].float() / 255.0 * 2.0 - 1.0)
    assert label == int(ds.labels[4]) and torch.equal(mask, ds.masks[4].long())
    assert ds[np.int64(2)][1] == int(ds.labels[2])
    for bad in (5, -6):
        with pytest.raises(IndexError):
            ds[bad]
    assert repr(ds) == "DigitScenes(split='val', size=5, image_size=32, seed=0)"


def test_image_size_48(tmp_path: Path) -> None:
    ds = DigitScenes("test", image_size=48, size=6, cache_dir=tmp_path)
    image, label, mask = ds[0]
    assert image.shape == (3, 48, 48) and mask.shape == (48, 48)
    assert set(torch.unique(ds.masks).tolist()) <= VALID_MASK_VALUES
    for i in range(len(ds)):
        counts = torch.bincount(ds.masks[i].flatten().long(), minlength=256)[1:11]
        assert int(counts.argmax()) == int(ds.labels[i])
    assert ds.patch_labels(4).shape == (6, 12, 12)


# ------------------------------------------------------------------------------------------ determinism


def test_pinned_hash(tmp_path: Path) -> None:
    assert _digest(DigitScenes("test", size=8, cache_dir=tmp_path)) == PINNED_TEST_SHA256


def test_two_builds_equal_and_seed_changes_scenes(tmp_path: Path) -> None:
    a = DigitScenes("train", size=6, seed=3, cache_dir=tmp_path / "a")
    b = DigitScenes("train", size=6, seed=3, cache_dir=tmp_path / "b")
    assert not a.from_cache and not b.from_cache
    assert torch.equal(a.images, b.images) and torch.equal(a.masks, b.masks)
    assert torch.equal(a.labels, b.labels) and np.array_equal(a.sources, b.sources)
    c = DigitScenes("train", size=6, seed=4, cache_dir=tmp_path / "c")
    assert not torch.equal(a.images, c.images)
    assert not torch.equal(a.masks, c.masks)


def test_smaller_size_is_a_prefix(tmp_path: Path) -> None:
    small = DigitScenes("val", size=3, cache_dir=tmp_path)
    large = DigitScenes("val", size=7, cache_dir=tmp_path)
    assert torch.equal(small.images, large.images[:3]) and torch.equal(small.masks, large.masks[:3])


def test_splits_differ(tmp_path: Path) -> None:
    a = DigitScenes("val", size=4, cache_dir=tmp_path)
    b = DigitScenes("test", size=4, cache_dir=tmp_path)
    assert not torch.equal(a.images, b.images)


def test_bilinear_matches_torch_half_pixel_resize() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((3, 5, 5))
    ours = scenes._bilinear(a, 32, 32)
    ref = F.interpolate(torch.from_numpy(a)[None], size=(32, 32), mode="bilinear", align_corners=False)[0]
    np.testing.assert_allclose(ours, ref.numpy(), atol=1e-12)
    # zero_pad: the same as resizing the zero-padded glyph and cropping its centre
    g = rng.random((8, 8))
    padded = F.interpolate(torch.from_numpy(np.pad(g, 1))[None, None], size=(30, 30), mode="bilinear")[0, 0]
    ours = scenes._bilinear(g, 24, 24, zero_pad=True)
    np.testing.assert_allclose(ours, padded[3:27, 3:27].numpy(), atol=1e-12)


# ----------------------------------------------------------------------------------------- glyph pools


def test_glyph_pools_disjoint_and_complete(tmp_path: Path) -> None:
    pools = {s: DigitScenes(s, size=2, cache_dir=tmp_path).glyph_indices for s in ("train", "val", "test")}
    for s, idx in pools.items():
        assert np.array_equal(idx, np.sort(idx)) and len(np.unique(idx)) == len(idx), s
    assert not set(pools["train"]) & set(pools["val"])
    assert not set(pools["train"]) & set(pools["test"])
    assert not set(pools["val"]) & set(pools["test"])
    assert sorted(np.concatenate(list(pools.values())).tolist()) == list(range(1797))
    assert 0.68 < len(pools["train"]) / 1797 < 0.72
    assert 0.13 < len(pools["val"]) / 1797 < 0.17
    # stratified: every class is in every pool in about the same proportion
    _, target = scenes._digits()
    for idx in pools.values():
        per_class = np.bincount(target[idx], minlength=10)
        assert per_class.min() > 0.8 * per_class.mean()


def test_scenes_use_only_their_split_glyphs(tmp_path: Path) -> None:
    _, target = scenes._digits()
    for split in ("train", "val", "test"):
        ds = DigitScenes(split, size=30, cache_dir=tmp_path)
        assert ds.sources.shape == (30, 3) and ds.sources.dtype == np.int64
        used = ds.sources[ds.sources >= 0]
        assert set(used.tolist()) <= set(ds.glyph_indices.tolist()), split
        # the main glyph has the image's class; distractors are other classes
        assert np.array_equal(target[ds.sources[:, 0]], ds.labels.numpy())
        for row, label in zip(ds.sources, ds.labels.tolist(), strict=True):
            assert all(target[d] != label for d in row[1:] if d >= 0)
            assert not (row[1] < 0 and row[2] >= 0)  # -1 padding comes last
        assert (ds.sources[:, 1:] >= 0).any()  # some scenes do have distractors


# ----------------------------------------------------------------------------------------------- cache


def test_cache_is_written_and_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = DigitScenes("val", size=5, seed=1, cache_dir=tmp_path)
    assert not first.from_cache and first.cache_path is not None and first.cache_path.is_file()
    assert first.cache_path.parent == tmp_path and not list(tmp_path.glob("*.tmp"))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the builder must not run on a cache hit")

    monkeypatch.setattr(scenes, "_build_scenes", no_build)
    second = DigitScenes("val", size=5, seed=1, cache_dir=tmp_path)
    assert second.from_cache and second.cache_path == first.cache_path
    assert torch.equal(first.images, second.images) and torch.equal(first.masks, second.masks)
    assert torch.equal(first.labels, second.labels) and np.array_equal(first.sources, second.sources)
    with pytest.raises(AssertionError, match="must not run"):  # another key is a cache miss
        DigitScenes("val", size=6, seed=1, cache_dir=tmp_path)


def test_cache_dir_defaults_to_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VITATTN_CACHE", str(tmp_path / "from-env"))
    ds = DigitScenes("test", size=2)
    assert ds.cache_path is not None and ds.cache_path.parent == tmp_path / "from-env"
    monkeypatch.delenv("VITATTN_CACHE")
    assert scenes.default_cache_dir() == Path.home() / ".cache" / "vitattn"


def test_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    ds = DigitScenes("test", size=3, cache_dir=tmp_path)
    assert ds.cache_path is not None
    ds.cache_path.write_bytes(b"not a zip file")
    again = DigitScenes("test", size=3, cache_dir=tmp_path)
    assert not again.from_cache and torch.equal(again.images, ds.images)
    assert DigitScenes("test", size=3, cache_dir=tmp_path).from_cache  # rewritten


def test_unwritable_cache_dir_builds_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache folder should be")
    ds = DigitScenes("test", size=2, cache_dir=blocker / "sub")
    assert ds.cache_path is None and not ds.from_cache and len(ds) == 2
    assert _digest(ds, 2) == _digest(DigitScenes("test", size=2, cache_dir=tmp_path / "ok"), 2)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"split": "training"}, "split"),
        ({"split": "TRAIN"}, "split"),
        ({"split": "train", "image_size": 20}, "image_size"),
        ({"split": "train", "image_size": 8}, "image_size"),
        ({"split": "train", "image_size": 32.0}, "image_size"),
        ({"split": "train", "seed": -1}, "seed"),
        ({"split": "train", "size": 0}, "size"),
        ({"split": "train", "transform": 3}, "transform"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=name) as info:
        DigitScenes(cache_dir=tmp_path, **kwargs)  # type: ignore[arg-type]
    if name == "split":
        assert all(s in str(info.value) for s in ("'train'", "'val'", "'test'"))


def test_missing_sklearn_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    scenes._digits.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'vitattn\[study\]'"):
            scenes._digits()
    finally:
        scenes._digits.cache_clear()


# ------------------------------------------------------------------------------------- statistics, patches


def test_mean_std_constants(tmp_path: Path) -> None:
    ds = DigitScenes("train", cache_dir=tmp_path)  # the default split: 5000 images at 32 px
    assert len(ds) == 5000
    x = ds.images.to(torch.float64) / 255.0
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3), unbiased=False)
    np.testing.assert_allclose(mean.numpy(), DigitScenes.mean, atol=1e-3)
    np.testing.assert_allclose(std.numpy(), DigitScenes.std, atol=1e-3)


def test_patch_labels_by_hand() -> None:
    m = torch.tensor(
        [
            [0, 0, 3, 3],
            [0, 5, 255, 3],
            [255, 255, 7, 8],
            [255, 255, 8, 7],
        ],
        dtype=torch.uint8,
    )[None]
    # patches: top-left {0,0,0,5} -> 0; top-right {3,3,3,255} -> 3; bottom-left all ignore -> 255;
    # bottom-right {7,8,8,7} tie -> smallest class 7
    expected = torch.tensor([[[0, 3], [255, 7]]])
    got = scenes.majority_patch_labels(m, 2)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert torch.equal(scenes.majority_patch_labels(m, 1), m.long())
    assert torch.equal(scenes.majority_patch_labels(m, 4), torch.tensor([[[0]]]))  # 0 and 3 tie, 3 votes each
    with pytest.raises(ValueError, match="patch_size"):
        scenes.majority_patch_labels(m, 3)


def test_patch_labels_method(train40: DigitScenes) -> None:
    pl = train40.patch_labels(4)
    assert pl.shape == (40, 8, 8) and pl.dtype == torch.int64
    assert set(pl.unique().tolist()) <= VALID_MASK_VALUES
    # one patch recomputed by hand
    patch = train40.masks[7, 8:12, 12:16].flatten().tolist()
    votes = [v for v in patch if v != 255]
    want = 255 if not votes else min(set(votes), key=lambda c: (-votes.count(c), c))
    assert int(pl[7, 2, 3]) == want
