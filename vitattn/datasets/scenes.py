"""``DigitScenes``: procedural scenes of scikit-learn digits with per-pixel segmentation masks.

Each scene is a textured, noisy background with clutter, one large *main* digit (the image label)
and up to two smaller *distractor* digits, all labelled in a mask. Nothing is downloaded: the glyphs
are scikit-learn's bundled 8×8 digits. Scenes are generated in float64 numpy from a per-scene
``numpy.random.default_rng`` seeded by ``(seed, split, index)`` only, with arithmetic restricted to
IEEE-exact operations (no BLAS, no transcendental functions, no library resampling), so the bytes are
the same on every machine. Built arrays are cached as ``.npz``. See ``docs/datasets.md``.
"""

from __future__ import annotations

import functools
import operator
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import cache_dir

__all__ = ["DigitScenes", "majority_patch_labels"]

#: The generator's versions (each part of the scene seeds and of the cache key). Version 3 places the
#: main digit near the centre (see :func:`_main_box`); everything else is drawn as in version 2.
VERSIONS: tuple[int, ...] = (2, 3)
#: The version ``DigitScenes`` builds unless told otherwise.
FORMAT_VERSION = 2
#: Per-channel mean / std of each version's default train split (5000 scenes, 32 px, seed 0).
STATISTICS: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    2: ((0.4992, 0.4997, 0.5006), (0.1990, 0.1993, 0.1991)),
    3: ((0.4980, 0.4994, 0.5008), (0.2054, 0.2043, 0.2051)),
}

SPLITS: tuple[str, ...] = ("train", "val", "test")
DEFAULT_SIZES: dict[str, int] = {"train": 5000, "val": 1000, "test": 1000}
_SPLIT_ID = {"train": 0, "val": 1, "test": 2}
_SCENE_TAG = 0x5CE7E5  # domain separation of the scene seeds from other uses of the same seed
_POOL_SEED = 20240611  # fixed seed of the glyph-pool split (independent of ``seed``)
_POOL_PERCENT = (70, 15)  # train / val percent per class; test gets the rest

#: Glyph alpha thresholds of the mask: ``alpha >= HI`` is the digit, ``LO <= alpha < HI`` is ignored.
ALPHA_LO = 0.25
ALPHA_HI = 0.6
IGNORE_INDEX = 255


# --------------------------------------------------------------------------------------------- glyphs


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(alpha (1797, 8, 8) float64 in [0, 1], target (1797,) int64)``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("DigitScenes needs scikit-learn: pip install 'vitattn[study]'") from err
    digits = load_digits()
    alpha = np.asarray(digits.images, dtype=np.float64) / 16.0
    target = np.asarray(digits.target, dtype=np.int64)
    alpha.setflags(write=False)
    target.setflags(write=False)
    return alpha, target


@functools.lru_cache(maxsize=1)
def _glyph_pools() -> dict[str, tuple[np.ndarray, ...]]:
    """Fixed stratified split of the sklearn indices: ``{split: (class-0 indices, ..., class-9 indices)}``.

    Per class, the indices are permuted with a fixed seed; the first 70 % (rounded) go to train, the
    next 15 % to val, the rest to test. Each per-class array is sorted.
    """
    _, target = _digits()
    rng = np.random.default_rng(_POOL_SEED)
    pools: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(target == c))
        n = len(idx)
        n_train = (_POOL_PERCENT[0] * n + 50) // 100
        n_val = (_POOL_PERCENT[1] * n + 50) // 100
        pools["train"].append(np.sort(idx[:n_train]))
        pools["val"].append(np.sort(idx[n_train : n_train + n_val]))
        pools["test"].append(np.sort(idx[n_train + n_val :]))
    return {s: tuple(p) for s, p in pools.items()}


# ------------------------------------------------------------------------------------ exact resampling


@functools.lru_cache(maxsize=256)
def _interp(n_in: int, n_out: int, zero_pad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1-D bilinear taps ``(i0, i1, w)``, each ``(n_out,)``, to resample ``n_in`` -> ``n_out`` pixels.

    Output pixel ``j`` samples input coordinate ``(j + 0.5) * n_in / n_out - 0.5``. With ``zero_pad`` the
    input is read as padded with one zero on each side (indices refer to the padded array of
    ``n_in + 2``), otherwise the coordinate is clamped to the edge.
    """
    src = ((np.arange(n_out, dtype=np.float64) + 0.5) * n_in) / n_out - 0.5
    if zero_pad:
        src = src + 1.0
        hi = n_in + 1
    else:
        src = np.clip(src, 0.0, n_in - 1.0)
        hi = n_in - 1
    i0 = np.floor(src)
    w = src - i0
    i0 = i0.astype(np.int64)
    i1 = np.minimum(i0 + 1, hi)
    return i0, i1, w


def _bilinear(a: np.ndarray, out_h: int, out_w: int, zero_pad: bool = False) -> np.ndarray:
    """Bilinear resize of the last two axes of ``a (..., h, w)`` to ``(..., out_h, out_w)`` (float64).

    Written with elementwise numpy only (each product and sum a separate IEEE operation), so the
    result is bit-identical everywhere.
    """
    if zero_pad:
        a = np.pad(a, [(0, 0)] * (a.ndim - 2) + [(1, 1), (1, 1)])
        h, w = a.shape[-2] - 2, a.shape[-1] - 2
    else:
        h, w = a.shape[-2:]
    y0, y1, wy = _interp(h, out_h, zero_pad)
    x0, x1, wx = _interp(w, out_w, zero_pad)
    wy = wy[:, None]
    rows = a[..., y0, :] * (1.0 - wy) + a[..., y1, :] * wy
    return rows[..., x0] * (1.0 - wx) + rows[..., x1] * wx


# ---------------------------------------------------------------------------------------------- scenes


def _contrast_colour(rng: np.random.Generator, patch: np.ndarray, margin: float) -> np.ndarray:
    """A random RGB colour ``(3,)`` whose every channel is ``margin`` away from the mean of ``patch``.

    The mean luminance ``L`` of ``patch (3, h, w)`` is taken from its values rounded to 1/255 and
    summed as integers (exact). Channels are uniform in ``[0, L - margin]`` if ``L >= 0.5``, else in
    ``[L + margin, 1]``.
    """
    q = np.round(patch * 255.0).astype(np.int64)
    lum = float(q.sum()) / (255.0 * q.size)
    lo, hi = (0.0, lum - margin) if lum >= 0.5 else (lum + margin, 1.0)
    return lo + (hi - lo) * rng.random(3)


def _background(rng: np.random.Generator, n: int, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Textured background with clutter, ``(3, n, n)`` float64 clipped to [0, 1]."""
    xn, yn = xs / (n - 1), ys / (n - 1)
    # 1. linear colour gradient between two colours in [0.15, 0.85]^3, random direction
    c0 = 0.15 + 0.7 * rng.random(3)
    c1 = 0.15 + 0.7 * rng.random(3)
    a, b = rng.random(2) * 2.0 - 1.0
    t_lo, t_hi = min(a, 0.0) + min(b, 0.0), max(a, 0.0) + max(b, 0.0)
    t = (a * xn + b * yn - t_lo) / (t_hi - t_lo) if t_hi > t_lo else np.full_like(xn, 0.5)
    bg = c0[:, None, None] + (c1 - c0)[:, None, None] * t
    # 2. low-frequency colour noise: a g×g grid (g in 3..5) of uniform values, upscaled bilinearly
    g = int(rng.integers(3, 6))
    amp = 0.03 + 0.05 * rng.random()
    bg = bg + _bilinear((rng.random((3, g, g)) * 2.0 - 1.0) * amp, n, n)
    # 3. texture: soft stripes (random direction, period 3-10 px) or a checkerboard (cells 2-8 px)
    if rng.integers(2) == 0:
        d = rng.random(2) * 2.0 - 1.0
        norm = float(np.sqrt(d[0] * d[0] + d[1] * d[1]))
        if norm < 1e-3:
            d, norm = np.array([1.0, 0.0]), 1.0
        period = 3.0 + 7.0 * rng.random()
        u = (d[0] * xs + d[1] * ys) / (norm * period) + rng.random()
        tri = np.abs(2.0 * (u - np.floor(u)) - 1.0)
        tex = tri * tri * (3.0 - 2.0 * tri)
    else:
        cell = int(rng.integers(2, 9))
        ox, oy = (int(v) for v in rng.integers(0, cell, 2))
        xi, yi = xs.astype(np.int64), ys.astype(np.int64)
        tex = (((xi + ox) // cell + (yi + oy) // cell) % 2).astype(np.float64)
    amp = 0.02 + 0.04 * rng.random()
    bg = bg + (amp * (rng.random(3) * 2.0 - 1.0))[:, None, None] * (2.0 * tex - 1.0)
    # 4. clutter: 0-2 semi-transparent rectangles, line segments or ellipses
    for _ in range(int(rng.integers(0, 3))):
        kind = int(rng.integers(3))
        colour = rng.random(3)
        alpha = 0.2 + 0.3 * rng.random()
        if kind == 0:  # rectangle, sides 2..n/3 px
            w, h = (int(v) for v in rng.integers(2, n // 3 + 1, 2))
            x0, y0 = int(rng.integers(0, n - w + 1)), int(rng.integers(0, n - h + 1))
            m = (xs >= x0) & (xs < x0 + w) & (ys >= y0) & (ys < y0 + h)
        elif kind == 1:  # line segment, half-width 0.5-1.5 px
            x0, y0, x1, y1 = rng.random(4) * (n - 1)
            hw = 0.5 + rng.random()
            dx, dy = x1 - x0, y1 - y0
            l2 = dx * dx + dy * dy
            s = np.clip(((xs - x0) * dx + (ys - y0) * dy) / l2, 0.0, 1.0) if l2 >= 1.0 else 0.0
            ex, ey = xs - (x0 + s * dx), ys - (y0 + s * dy)
            m = ex * ex + ey * ey <= hw * hw
        else:  # ellipse, radii 1.5..n/6 px
            cx, cy = rng.random(2) * (n - 1)
            rx, ry = 1.5 + (n / 6.0 - 1.5) * rng.random(2)
            ex, ey = (xs - cx) / rx, (ys - cy) / ry
            m = ex * ex + ey * ey <= 1.0
        bg = np.where(m, bg * (1.0 - alpha) + colour[:, None, None] * alpha, bg)
    return np.clip(bg, 0.0, 1.0)


def _stamp(mask: np.ndarray, alpha: np.ndarray, y0: int, x0: int, value: int) -> None:
    """Write one glyph into ``mask (n, n)`` in place: ``value`` where alpha >= HI, 255 on the soft edge."""
    s = alpha.shape[0]
    box = mask[y0 : y0 + s, x0 : x0 + s]
    box[(alpha >= ALPHA_LO) & (alpha < ALPHA_HI)] = IGNORE_INDEX
    box[alpha >= ALPHA_HI] = value


def _main_box(rng: np.random.Generator, n: int, version: int) -> tuple[int, int, int]:
    """``(side, y0, x0)`` of the main digit in an ``n``-pixel scene.

    Version 2: side ``{⌈0.6 n⌉..⌊0.9 n⌋}``, anywhere in the image. Version 3: side
    ``{⌈0.75 n⌉..⌊0.9 n⌋}``, centred, then shifted by ``{−j..j}`` pixels on each axis with
    ``j = min(n // 16, centring margin)`` (2 px at 32 px: half a 4-px patch).
    """
    if version == 2:
        s = int(rng.integers(-(-60 * n // 100), 90 * n // 100 + 1))
        return s, int(rng.integers(0, n - s + 1)), int(rng.integers(0, n - s + 1))
    s = int(rng.integers(-(-75 * n // 100), 90 * n // 100 + 1))
    c = (n - s) // 2
    j = min(n // 16, c)
    return s, c + int(rng.integers(-j, j + 1)), c + int(rng.integers(-j, j + 1))


def _scene(
    rng: np.random.Generator,
    n: int,
    glyphs: np.ndarray,
    pools: tuple[np.ndarray, ...],
    xs: np.ndarray,
    ys: np.ndarray,
    version: int = FORMAT_VERSION,
) -> tuple[np.ndarray, np.ndarray, int, list[int]]:
    """One scene: ``(image (3, n, n) uint8, mask (n, n) uint8, label, [main, d1, d2] sklearn indices)``."""
    bg = _background(rng, n, xs, ys)
    # main digit: uniform class, uniform glyph of that class in the pool, its box by version
    label = int(rng.integers(10))
    main = int(pools[label][rng.integers(len(pools[label]))])
    s, my, mx = _main_box(rng, n, version)
    main_alpha = _bilinear(glyphs[main], s, s, zero_pad=True)
    # distractors: 0-2 glyphs of other classes, side ceil(0.25 s)..floor(0.45 s) (at least 4 px), anywhere
    k = int(rng.integers(0, 3))
    d_min = max(4, -(-25 * s // 100))
    d_max = max(d_min, 45 * s // 100)
    for attempt in range(4):
        distractors = []  # (sklearn index, side, y0, x0, alpha)
        for _ in range(k):
            cls = (label + 1 + int(rng.integers(9))) % 10
            gi = int(pools[cls][rng.integers(len(pools[cls]))])
            sd = int(rng.integers(d_min, max(d_min, d_max - 2 * attempt) + 1))
            dy, dx = int(rng.integers(0, n - sd + 1)), int(rng.integers(0, n - sd + 1))
            distractors.append((gi, sd, dy, dx, _bilinear(glyphs[gi], sd, sd, zero_pad=True)))
        mask = np.zeros((n, n), dtype=np.uint8)
        for gi, _, dy, dx, alpha in distractors:
            _stamp(mask, alpha, dy, dx, _class_of(gi) + 1)
        _stamp(mask, main_alpha, my, mx, label + 1)
        counts = np.bincount(mask.ravel(), minlength=256)[1:11]
        if counts[label] > np.delete(counts, label).max():
            break
    else:  # the main digit never won: no distractors (not seen once in 7000 scenes at 32 px)
        distractors = []
        mask = np.zeros((n, n), dtype=np.uint8)
        _stamp(mask, main_alpha, my, mx, label + 1)
    # colours contrasting with the local background, then alpha compositing (distractors first)
    img = bg.copy()
    layers = [(sd, dy, dx, alpha, 0.3) for _, sd, dy, dx, alpha in distractors]
    layers.append((s, my, mx, main_alpha, 0.45))
    for side, y0, x0, alpha, margin in layers:
        colour = _contrast_colour(rng, bg[:, y0 : y0 + side, x0 : x0 + side], margin)
        box = img[:, y0 : y0 + side, x0 : x0 + side]
        img[:, y0 : y0 + side, x0 : x0 + side] = box * (1.0 - alpha) + colour[:, None, None] * alpha
    # pixel noise, uniform with amplitude 0.01-0.05, over the whole image
    sigma = 0.01 + 0.04 * rng.random()
    img = np.clip(img + sigma * (rng.random((3, n, n)) * 2.0 - 1.0), 0.0, 1.0)
    sources = [main] + [d[0] for d in distractors] + [-1] * (2 - len(distractors))
    return np.round(img * 255.0).astype(np.uint8), mask, label, sources


def _class_of(index: int) -> int:
    """Class 0-9 of sklearn digit ``index``."""
    return int(_digits()[1][index])


def _build_scenes(
    split: str, image_size: int, seed: int, size: int, version: int = FORMAT_VERSION
) -> dict[str, np.ndarray]:
    """Generate ``size`` scenes: ``images (N, 3, H, W) uint8``, ``masks (N, H, W) uint8``,
    ``labels (N,) int64``, ``sources (N, 3) int64`` (sklearn indices of main, distractor 1, 2; -1 = none).

    Scene ``i`` depends only on ``(seed, split, i, image_size)``, so a smaller ``size`` gives a prefix
    of a larger one.
    """
    glyphs, _ = _digits()
    pools = _glyph_pools()[split]
    n = image_size
    ys, xs = np.mgrid[0:n, 0:n].astype(np.float64)
    images = np.empty((size, 3, n, n), dtype=np.uint8)
    masks = np.empty((size, n, n), dtype=np.uint8)
    labels = np.empty(size, dtype=np.int64)
    sources = np.empty((size, 3), dtype=np.int64)
    for i in range(size):
        rng = np.random.default_rng([_SCENE_TAG, version, seed, _SPLIT_ID[split], i])
        images[i], masks[i], labels[i], sources[i] = _scene(rng, n, glyphs, pools, xs, ys, version)
    return {"images": images, "masks": masks, "labels": labels, "sources": sources}


# ----------------------------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """The scenes' ``.npz`` cache folder: :func:`vitattn.cache.cache_dir`."""
    return cache_dir()


def _meta(split: str, image_size: int, seed: int, size: int, version: int = FORMAT_VERSION) -> np.ndarray:
    return np.array([version, _SPLIT_ID[split], image_size, seed, size], dtype=np.int64)


def _load_cache(path: Path, meta: np.ndarray) -> dict[str, np.ndarray] | None:
    """The arrays of a cache file, or ``None`` if it is missing, unreadable or for another key."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            if not np.array_equal(f["meta"], meta):
                return None
            data = {k: f[k] for k in ("images", "masks", "labels", "sources")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    size, n = int(meta[4]), int(meta[2])
    shapes = {"images": (size, 3, n, n), "masks": (size, n, n), "labels": (size,), "sources": (size, 3)}
    if any(data[k].shape != shp for k, shp in shapes.items()):
        return None
    return data


def _save_cache(path: Path, meta: np.ndarray, data: dict[str, np.ndarray]) -> bool:
    """Write ``data`` atomically (temporary file in the same folder + ``os.replace``); False on failure."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, allow_pickle=False, meta=meta, **data)  # numeric arrays only, as _load_cache reads
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


# ---------------------------------------------------------------------------------------------- public


def majority_patch_labels(masks: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Majority non-ignore class per ``patch_size``² patch of ``masks (N, H, W)`` -> ``(N, H/p, W/p)`` int64.

    Classes are 0-10; 255 (ignore) pixels do not vote; a patch with only ignore pixels is 255. Ties go
    to the smallest class.
    """
    if masks.ndim != 3:
        raise ValueError(f"masks must be (N, H, W), got shape {tuple(masks.shape)}")
    p = operator.index(patch_size)
    n, h, w = masks.shape
    if p < 1 or h % p or w % p:
        raise ValueError(f"patch_size must be a positive divisor of the mask size {h}×{w}, got {patch_size}")
    patches = masks.reshape(n, h // p, p, w // p, p)
    counts = torch.stack([(patches == c).sum(dim=(2, 4)) for c in range(DigitScenes.num_seg_classes)], -1)
    best = counts.argmax(-1)
    return torch.where(counts.sum(-1) > 0, best, torch.full_like(best, IGNORE_INDEX))


class DigitScenes(torch.utils.data.Dataset):
    """Procedural digit scenes with segmentation masks (scikit-learn digits; no download).

    ``ds[i]`` is ``(image, label, mask)``: ``image (3, H, W)`` float32 in [0, 1] (or ``transform(image)``),
    ``label`` the int class 0-9 of the main (largest) digit, ``mask (H, W)`` int64 with 0 = background,
    1-10 = digit 0-9 and 255 = ignore (soft glyph edges). Stored as ``images (N, 3, H, W)`` uint8,
    ``labels (N,)`` int64, ``masks (N, H, W)`` uint8 and ``sources (N, 3)`` int64 (sklearn indices of
    the main digit and of up to two distractors, -1 = none). ``glyph_indices`` are the sorted sklearn
    indices this split draws from (disjoint between splits).

    Default sizes: train 5000, val 1000, test 1000. A split is built once, then read from its ``.npz``
    file in ``cache_dir`` (default :func:`vitattn.cache.cache_dir`); ``from_cache`` says which
    happened. The bytes are the same on every machine. ``version`` 3 (``vitattn study``'s) places the
    main digit near the centre; 2, the default, anywhere (:func:`_main_box`). ``mean`` / ``std`` are
    version 2's; :data:`STATISTICS` has each version's.
    """

    num_classes: int = 10
    num_seg_classes: int = 11
    ignore_index: int = IGNORE_INDEX
    class_names: tuple[str, ...] = ("background", *(str(d) for d in range(10)))
    #: Per-channel mean / std of the default train split at 32 px (5000 images, seed 0), in [0, 1] units.
    mean: tuple[float, float, float] = STATISTICS[FORMAT_VERSION][0]
    std: tuple[float, float, float] = STATISTICS[FORMAT_VERSION][1]

    def __init__(
        self,
        split: str,
        image_size: int = 32,
        seed: int = 0,
        *,
        size: int | None = None,
        transform: Callable[[torch.Tensor], Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        version: int = FORMAT_VERSION,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
        if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)):
            raise ValueError(f"image_size must be an int, got {image_size!r}")
        if image_size < 16 or image_size % 8:
            raise ValueError(f"image_size must be a multiple of 8 and >= 16, got {image_size}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if size is None:
            size = DEFAULT_SIZES[split]
        elif isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size must be a positive int or None, got {size!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable or None, got {transform!r}")
        if isinstance(version, bool) or version not in VERSIONS:
            raise ValueError(f"version must be one of {', '.join(map(str, VERSIONS))}, got {version!r}")
        self.split, self.image_size, self.seed, self.size = split, int(image_size), int(seed), int(size)
        #: The generator's version (:data:`VERSIONS`; default :data:`FORMAT_VERSION`).
        self.version: int = int(version)
        self.transform = transform
        pools = _glyph_pools()[split]
        #: Sorted sklearn indices of the glyphs this split may use, ``(G,)`` int64.
        self.glyph_indices: np.ndarray = np.sort(np.concatenate(pools))

        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        meta = _meta(self.split, self.image_size, self.seed, self.size, self.version)
        key = f"v{self.version}-{split}-{self.image_size}px-seed{self.seed}-n{self.size}"
        path = root / f"digitscenes-{key}.npz"
        data = _load_cache(path, meta)
        saved = False
        #: True if the arrays were read from the cache file.
        self.from_cache: bool = data is not None
        if data is None:
            data = _build_scenes(self.split, self.image_size, self.seed, self.size, self.version)
            saved = _save_cache(path, meta, data)
        #: The cache file read or written, or None if the cache folder was not writable.
        self.cache_path: Path | None = path if self.from_cache or saved else None
        self.images: torch.Tensor = torch.from_numpy(np.ascontiguousarray(data["images"]))
        self.masks: torch.Tensor = torch.from_numpy(np.ascontiguousarray(data["masks"]))
        self.labels: torch.Tensor = torch.from_numpy(np.ascontiguousarray(data["labels"]).astype(np.int64))
        self.sources: np.ndarray = np.asarray(data["sources"], dtype=np.int64)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, int, torch.Tensor]:
        """``(image (3, H, W) float32 in [0, 1] or transform(image), label int, mask (H, W) int64)``."""
        i = operator.index(index)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"index {index} out of range for DigitScenes of size {self.size}")
        image: Any = self.images[i].to(torch.float32).div_(255.0)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[i]), self.masks[i].to(torch.int64)

    def __repr__(self) -> str:
        return (
            f"DigitScenes(split={self.split!r}, size={self.size}, image_size={self.image_size}, "
            f"seed={self.seed}{'' if self.version == FORMAT_VERSION else f', version={self.version}'})"
        )

    def patch_labels(self, patch_size: int) -> torch.Tensor:
        """Majority non-ignore mask class per patch, ``(N, H/p, W/p)`` int64 (255 if all ignore)."""
        return majority_patch_labels(self.masks, patch_size)
