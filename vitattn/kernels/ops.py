"""The fused attention kernels as ``torch.library`` custom ops, their launch wrappers and the tile
picker (this module imports triton).

The one path from a call to a kernel: :meth:`~vitattn.kernels.backend.TritonBackend.run` casts q, k,
v to the call's dtype and hands the ``AttentionCall``'s tensors and scalars to :func:`attention_call`:
the custom op ``torch.ops.vitattn.attention_fwd`` (:func:`attention_fwd`) under ``torch.compile``, a
dispatch mode or tensor subclasses, else the op's body under :class:`_EagerAttention` (the same
context and gradients, without the op's dispatch). In the body a :class:`KernelLaunch` holds them, and
:func:`_launch` picks a tile and launches under the inputs' CUDA device. The backward
(``register_autograd``) is the op ``torch.ops.vitattn.attention_bwd``. Both ops have fake
implementations, so ``torch.compile(fullgraph=True)`` traces them as single graph nodes.

Memory beyond the inputs and the output: the row statistic (float32 ``(B, H, Nq)``), for entmax-1.5
with gradients ``OG`` (float32 ``(B, H, Nq, Dv)``), and in the backward the row term ``delta``
(float32 ``(B, H, Nq)``); never anything ``Nq x Nk`` (the only exception is the gradient of an
additive mask, which has the mask's own shape).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from ..cache import cache_dir
from ..functional.window import WindowMask
from . import configs, windows
from .env import dot_mode, interpret_requested

_MODULES = (
    "_common",
    "_tiles",
    "softmax",
    "softmax_lists",
    "entmax15",
    "entmax_alpha",
    "backward",
    "backward_lists",
    "tile_lists",
)
_KERNEL_ATTRS = {
    "fwd_softmax": ("softmax", "_fwd_softmax_kernel"),
    "fwd_entmax15": ("entmax15", "_fwd_entmax15_kernel"),
    "fwd_entmax_alpha": ("entmax_alpha", "_fwd_entmax_alpha_kernel"),
    "bwd_delta": ("backward", "_bwd_delta_kernel"),
    "bwd_factors": ("backward", "_bwd_factors_kernel"),
    "bwd_dkdv": ("backward", "_bwd_dkdv_kernel"),
    "bwd_dq": ("backward", "_bwd_dq_kernel"),
    # the list kernels: a window (softmax), entmax-1.5's live tiles, alpha-entmax (see KernelLaunch.lists)
    "fwd_softmax_lists": ("softmax_lists", "_fwd_softmax_kernel"),
    "bwd_rows": ("backward_lists", "_bwd_rows_kernel"),
    "bwd_dkdv_lists": ("backward_lists", "_bwd_dkdv_kernel"),
    "bwd_dq_lists": ("backward_lists", "_bwd_dq_kernel"),
    # entmax-1.5's backward tile lists, from the forward's live-tile map (live_lists, live_grid_lists)
    "tile_lists": ("tile_lists", "_tile_lists_kernel"),
}
_KERNELS: dict[bool, dict[str, Any]] = {}  # interpreter setting -> kernels, resolved once each


def kernels() -> dict[str, Any]:
    """The raw kernels by name (``JITFunction`` objects, or interpreted ones under ``TRITON_INTERPRET=1``).

    ``@triton.jit`` reads the interpreter flag when a kernel is defined, so the kernel modules are
    re-imported once when the flag (:func:`~vitattn.kernels.env.interpret_requested`) differs
    from the one they were imported under; the result is kept per setting.
    """
    interp = interpret_requested()
    found = _KERNELS.get(interp)
    if found is not None:
        return found
    from triton.runtime.interpreter import InterpretedFunction

    if interp and not isinstance(triton.language.zeros, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported: set it before importing it")
    mods = {name: importlib.import_module(f"{__package__}.{name}") for name in _MODULES}
    if isinstance(mods["softmax"]._fwd_softmax_kernel, InterpretedFunction) != interp:
        for name in _MODULES:
            mods[name] = importlib.reload(mods[name])
    found = _KERNELS[interp] = {key: getattr(mods[mod], attr) for key, (mod, attr) in _KERNEL_ATTRS.items()}
    return found


def launch_device(tensors: Iterable[Any]) -> torch.device | None:
    """The device of the first CUDA tensor among ``tensors`` (``None`` if none is on CUDA). Scans a
    launch's arguments (ints and floats among them) without building a ``torch.device`` per tensor."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return None


def device_guard(tensors: Iterable[Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(index)`` of the tensors' CUDA device (a no-op on CPU / in the interpreter).

    Triton launches on the *current* device and its current stream: without the guard a tensor on
    ``cuda:1`` while device 0 is current is read by a kernel running on device 0.
    """
    dev = launch_device(tensors)
    if dev is None:
        return contextlib.nullcontext()
    return torch.cuda.device(dev.index)


# ---- tile choice: bucketed autotuning, cached across processes, never inside CUDA-graph capture ----------

TILES_ENV = "VITATTN_TRITON_TILES"  # "first" or an index: that usable tile, no tuning (tests, memcheck)
COMPILE_ONLY_ENV = "VITATTN_TRITON_COMPILE_ONLY"  # "1": compile what would run, launch nothing (warm-up)
BENCH_WARMUP_MS, BENCH_REP_MS = 10, 40
# a second timing pass, in reverse order, for every tile within this factor of the best first time; a
# tile's time is the lower of its two (a transient slowdown during one pass no longer decides the pick)
RETIME_WITHIN = 1.3
_TUNED: dict[str, configs.TileConfig] = {}  # tuning key -> tile picked in (or read by) this process
_TUNING_LOG: dict[str, dict[str, Any]] = {}  # tuning key -> how this process got its tile (tuning_log)
_DISK: dict[str, Any] = {}  # the loaded autotune.json, "entries" -> {scope: {key: [bm, bn, warps, stages]}}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. The host code's own: ``triton.cdiv`` is a ``ConstexprFunction`` since
    Triton 3.5, a few microseconds a call, and a launch computes dozens (docs/kernels.md, host time)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); ``triton.next_power_of_2`` without its
    call overhead (see :func:`cdiv`)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def seq_bucket(n: int) -> int:
    """The sequence-length bucket of the tuning key: ``next_pow2(n)``, at least 16 (197 and
    256 tokens share a tile; 257 does not)."""
    return max(16, next_pow2(int(n)))


def tune_key(
    name: str, dtype: torch.dtype, batch_heads: int, n_q: int, n_k: int, meta: dict[str, Any]
) -> str:
    """The tuning key of a launch: kernel, dtype, ``B·H`` (the grid's second axis), the bucketed Nq and
    Nk (:func:`seq_bucket`) and every constexpr flag (padded head dims included)."""
    flags = ",".join(f"{k}={int(v)}" for k, v in sorted(meta.items()))
    sizes = f"bh={batch_heads}|q={seq_bucket(n_q)}|k={seq_bucket(n_k)}"
    return f"{name}|{str(dtype).removeprefix('torch.')}|{sizes}|{flags}"


def autotune_cache_path() -> Path:
    """``autotune.json`` in :func:`vitattn.cache.cache_dir` (``$VITATTN_CACHE`` or ``~/.cache/vitattn``)."""
    return cache_dir() / "autotune.json"


def _cache_scope() -> str:
    """The part of the disk key that invalidates old picks: the GPU, triton, and the kernels' sources."""
    import hashlib

    digest = hashlib.sha256()
    for name in _MODULES:
        digest.update((Path(__file__).parent / f"{name}.py").read_bytes())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no-cuda"
    return f"{device}|triton {triton.__version__}|{digest.hexdigest()[:16]}"


def _disk_entries() -> dict[str, list[int]]:
    if not _DISK:
        try:
            _DISK.update(json.loads(autotune_cache_path().read_text()))
        except (OSError, ValueError):
            _DISK["entries"] = {}
        if not isinstance(_DISK.get("entries"), dict):
            _DISK["entries"] = {}
    return _DISK["entries"].setdefault(_cache_scope(), {})


def _disk_store(key: str, tile: configs.TileConfig) -> None:
    """Record ``key -> tile`` in autotune.json (re-read first, written atomically; errors ignored)."""
    path = autotune_cache_path()
    scope = _cache_scope()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    entries = data.setdefault("entries", {}) if isinstance(data.get("entries"), dict) else {}
    data["entries"] = entries
    entries.setdefault(scope, {})[key] = _tile_list(tile)
    _disk_entries()[key] = entries[scope][key]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        pass


def _tile_list(tile: configs.TileConfig) -> list[int]:
    return [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages]


def _capturing() -> bool:
    """A CUDA graph is being captured on the current stream (benchmarking would break the capture)."""
    return torch.cuda.is_current_stream_capturing()


def forced_tile(candidates: Sequence[configs.TileConfig]) -> configs.TileConfig | None:
    """The tile ``VITATTN_TRITON_TILES`` asks for (``first``, or an index into the usable tiles, the last
    one past the end), the only one when there is one, else ``None`` (tune)."""
    mode = os.environ.get(TILES_ENV, "").strip()
    if mode == "first" or len(candidates) == 1:
        return candidates[0]
    if mode.isdigit():
        return candidates[min(int(mode), len(candidates) - 1)]
    return None


def compile_only() -> bool:
    """``VITATTN_TRITON_COMPILE_ONLY=1``: every launch compiles the tiles it would run (all candidates where
    it would tune) into the Triton cache and launches nothing; outputs are left uninitialized. For
    ``benchmarks/warm_kernels.py``, which warms the GPU check's kernels on all CPU cores at once."""
    return os.environ.get(COMPILE_ONLY_ENV, "") == "1"


def pick_tile(
    key: str, candidates: Sequence[configs.TileConfig], bench: Callable[[configs.TileConfig], float]
) -> configs.TileConfig:
    """The tile of ``candidates`` for the launch ``key``: the one :func:`forced_tile` names; else a pick
    known in this process or from autotune.json; else, inside CUDA-graph capture, the first (default)
    tile, not remembered; else the fastest by ``bench`` (ms; two passes, :func:`_time_tiles`), remembered
    here and on disk."""
    forced = forced_tile(candidates)
    if forced is not None:
        _log_pick(key, forced, "forced")
        return forced
    known = _TUNED.get(key)
    source = "memory"
    if known is None:
        stored = _disk_entries().get(key)
        known = next((c for c in candidates if _tile_list(c) == stored), None)
        source = "disk"
    if known is not None and known in candidates:
        _TUNED[key] = known
        _log_pick(key, known, source)
        return known
    if _capturing():
        _log_pick(key, candidates[0], "capture")
        return candidates[0]
    timings = _time_tiles(candidates, bench)
    best = min(candidates, key=lambda tile: min(timings[tile]))
    _TUNED[key] = best
    _log_pick(key, best, "timed", timings)
    _disk_store(key, best)
    return best


def _time_tiles(
    candidates: Sequence[configs.TileConfig], bench: Callable[[configs.TileConfig], float]
) -> dict[configs.TileConfig, list[float]]:
    """Each candidate's times (ms): one pass over all, then a second pass, in reverse order, over those
    within :data:`RETIME_WITHIN` of the best first time. A tile that does not fit is infinitely slow."""

    def timed(tile: configs.TileConfig) -> float:
        try:
            return float(bench(tile))
        except triton.runtime.errors.OutOfResources:
            return math.inf

    timings = {tile: [timed(tile)] for tile in candidates}
    best = min(t[0] for t in timings.values())
    if math.isfinite(best):
        for tile in reversed(candidates):
            if timings[tile][0] <= best * RETIME_WITHIN:
                timings[tile].append(timed(tile))
    return timings


def _log_pick(
    key: str,
    tile: configs.TileConfig,
    source: str,
    timings: dict[configs.TileConfig, list[float]] | None = None,
) -> None:
    """Record in :func:`tuning_log` how the launch ``key`` got ``tile`` (the first record of a key stays,
    unless a later one timed)."""
    if key in _TUNING_LOG and source != "timed":
        return
    entry: dict[str, Any] = {"tile": tile_name(tile), "source": source}
    if timings is not None:
        entry["ms"] = {tile_name(t): [round(v, 5) for v in ms] for t, ms in timings.items()}
    _TUNING_LOG[key] = entry


def tile_name(tile: configs.TileConfig) -> str:
    """``"128x64 w8 s3"``: a tile's block sizes, warps and stages."""
    return f"{tile.block_m}x{tile.block_n} w{tile.num_warps} s{tile.num_stages}"


def tuning_log() -> dict[str, dict[str, Any]]:
    """How this process got the tile of each tuning key (:func:`tune_key`), in first-use order: ``tile``
    (:func:`tile_name`), ``source`` (``timed``: benchmarked here, ``ms`` then holds each candidate's
    times, one or two passes; ``disk``: autotune.json; ``memory``; ``forced``: ``VITATTN_TRITON_TILES``
    or a single candidate; ``capture``: the default inside CUDA-graph capture). For benchmark reports:
    a tile that differs between processes shows here."""
    return {key: dict(entry) for key, entry in _TUNING_LOG.items()}


_ASSUMED_ARCH: list[int] = []  # set by assume_arch (the ahead-of-time builder has no device)


@contextlib.contextmanager
def assume_arch(arch: int) -> Any:
    """Within the block :func:`device_arch` answers ``arch`` (``configs.arch_of`` of it)."""
    _ASSUMED_ARCH.append(configs.arch_of(arch))
    try:
        yield
    finally:
        _ASSUMED_ARCH.pop()


def device_arch(tensors: Iterable[Any]) -> int:
    """The config-list arch (:func:`configs.arch_of`) of the tensors' CUDA device, or
    ``configs.DEFAULT_ARCH`` when there is none (CPU, fake CUDA tensors without a driver)."""
    if _ASSUMED_ARCH:
        return _ASSUMED_ARCH[-1]
    dev = launch_device(tensors)
    if dev is None:  # no CUDA tensor: not the current device's arch (and no CUDA query per launch)
        return configs.DEFAULT_ARCH
    try:
        major, minor = torch.cuda.get_device_capability(dev)
    except (AssertionError, RuntimeError, ValueError):
        return configs.DEFAULT_ARCH
    return configs.arch_of(10 * major + minor)


def tile_candidates(
    name: str, meta: dict[str, Any], arch: int, ragged: bool = False
) -> tuple[configs.TileConfig, ...]:
    """The autotune list of kernel ``name`` on ``arch`` usable at the launch's padded head dims and flags
    (``ragged``: :func:`configs.ragged`)."""
    block_d = max(meta["BLOCK_D"], meta["BLOCK_DV"])
    traits = configs.launch_traits(
        masked=bool(meta["HAS_ADD"] or meta["HAS_KEEP"]),
        gauss=bool(meta.get("GAUSS", False)),
        alpha_entmax=meta.get("ENTMAX") == 2,
        window=bool(meta.get("WINDOW")),
        fp32=bool(meta["F32_DOT"]),  # on a GPU: float32 operands (TF32 or IEEE)
        ragged=ragged,
    )
    tiles = configs.autotune_list(name, block_d, traits, arch=arch)
    if not tiles:
        raise RuntimeError(f"no tile config of {name} serves head dim {block_d} ({traits}, sm_{arch})")
    return tiles


def grid_pad(grid_w: int) -> int:
    """The padded grid width ``GWP`` of the grid-aligned key tiles: a power of two, at least 16."""
    return max(16, next_pow2(int(grid_w)))


class PerTile:
    """A kernel argument that depends on the tile (a tensor descriptor's block shape): resolved by
    :func:`_launch` with ``fn(BLOCK_M, BLOCK_N)`` for each tile it compiles or runs."""

    def __init__(self, fn: Callable[[int, int], Any]) -> None:
        self.fn = fn


def resolve_args(args: Sequence[Any], block_m: int, block_n: int) -> list[Any]:
    """``args`` with every :class:`PerTile` resolved for the tile ``block_m x block_n``."""
    return [a.fn(block_m, block_n) if isinstance(a, PerTile) else a for a in args]


def args_at(
    args: Sequence[Any], tile_args: Callable[[configs.TileConfig], list[Any]] | None, tile: configs.TileConfig
) -> list[Any]:
    """A launch's arguments at ``tile``: ``args`` resolved (:func:`resolve_args`), then
    ``tile_args(tile)``."""
    extra = tile_args(tile) if tile_args is not None else []
    return [*resolve_args(args, tile.block_m, tile.block_n), *extra]


KV_TMA_ENV = "VITATTN_KV_TMA"  # "0": K / V tiles through pointers everywhere (the tests run both paths)


def tma_strides(t: torch.Tensor) -> list[int] | None:
    """``t``'s strides for a TMA descriptor, or ``None`` where TMA cannot read it: the last dim
    contiguous, the base and every other stride 16-byte aligned (a size-1 dim's stride is free: replaced
    by 16 bytes' worth; a broadcast dim of size > 1, stride 0, is refused)."""
    elem = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
        return None
    out = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        if size == 1:
            stride = max(16 // elem, 1)
        if stride <= 0 or (stride * elem) % 16 != 0:
            return None
        out.append(stride)
    return [*out, 1]


def kv_tma(launch: KernelLaunch) -> tuple[list[int], list[int]] | None:
    """K's and V's :func:`tma_strides` where the softmax forward loads their tiles by TMA: sm_90 and newer
    (and in the interpreter, which runs that path) for K and V that it accepts; else ``None``.
    ``VITATTN_KV_TMA=0`` forces pointers."""
    if os.environ.get(KV_TMA_ENV, "") == "0":
        return None
    if not interpret_requested() and device_arch([launch.q]) < 90:
        return None
    k_strides, v_strides = tma_strides(launch.k), tma_strides(launch.v)
    if k_strides is None or v_strides is None:
        return None
    return k_strides, v_strides


def kv_descriptors(launch: KernelLaunch, strides: tuple[list[int], list[int]]) -> list[Any]:
    """``[KT, VT, KG, VG]`` (:class:`PerTile` tensor descriptors, see the softmax forward): K and V as
    ``(B, H, Nk, D)`` in blocks of ``BLOCK_N`` keys and, with a Gaussian bias, their patch keys as
    ``(B, H, gh, gw, D)`` in blocks of ``NR`` grid rows x ``TILE_W`` columns (:meth:`GridKeys.tile_w`).
    ``strides``: K's and V's, from :func:`kv_tma`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kv = (
        (launch.k, block_dim(launch.q.shape[3]), strides[0]),
        (launch.v, block_dim(launch.v.shape[3]), strides[1]),
    )
    out: list[Any] = []
    for t, bd, ts in kv:

        def flat_desc(bm: int, bn: int, t: torch.Tensor = t, s: list[int] = ts, bd: int = bd) -> Any:
            return TensorDescriptor(t, list(t.shape), s, [1, 1, bn, bd])

        out.append(PerTile(flat_desc))
    keys = launch.grid_keys("fwd_softmax")
    if keys is not None:
        p, gw = launch.num_prefix, launch.grid_w
        for t, bd, ts in kv:
            s_b, s_h, s_n, _ = ts
            shape = [t.shape[0], t.shape[1], (t.shape[2] - p) // gw, gw, t.shape[3]]

            def grid_desc(
                bm: int, bn: int, t=t, shape=shape, s=(s_b, s_h, gw * s_n, s_n, 1), bd=bd, keys=keys
            ) -> Any:
                tile_w = keys.tile_w(bm, bn)
                return TensorDescriptor(t[:, :, p:], shape, list(s), [1, 1, bn // tile_w, tile_w, bd])

            out.append(PerTile(grid_desc))
    return out


I32_LIMIT = 2**31


def offsets_fit_i32(launch: KernelLaunch, factor_slab: int = 0) -> bool:
    """Whether the loops' tile offsets fit in 32 bits (``OFFS32``, ``_common.tile_offsets``): for q,
    k and v (the gradient of the output is contiguous like v), the offset of any row a tile can reach
    (every row, plus a tile of ``128`` grid rows of padded width past the end) and any column; and a
    Gaussian factor buffer's slab of ``factor_slab`` floats per ``(b, h)``."""
    n = max(launch.q.shape[2], launch.k.shape[2]) + 128 * max(launch.grid_w, 1)
    spans = [n * t.stride(2) + t.shape[3] * t.stride(3) for t in (launch.q, launch.k, launch.v)]
    spans.append(n * launch.v.shape[3])
    return max(*spans, factor_slab) < I32_LIMIT


def tile_offsets_pay(launch: KernelLaunch, lists: bool = True) -> bool:
    """Whether the kernels hold each tile's 32-bit offsets (``OFFS32``, ``_common.tile_offsets``), where
    they fit: at head dims up to 64, and in the list kernels (``lists``: the launch's kernels are, where
    it has them) without a Gaussian bias or alpha-entmax. Those offsets are registers for the whole loop:
    the full static report measured spills where they were held at head dim 128 (the plain dK/dV at
    64x128 w8, entmax-1.5's masked forwards at 64x32) and in the list kernels' Gaussian and alpha-entmax
    dK/dV at head dim 64 (docs/kernels.md)."""
    if launch.q.shape[3] > 64 or launch.v.shape[3] > 64:
        return False
    return not (lists and launch.lists and (launch.den is not None or launch.ent is not None))


def use_tile_offsets(launch: KernelLaunch, factor_slab: int = 0, lists: bool = True) -> bool:
    """The ``OFFS32`` flag of a launch: its tile offsets fit in 32 bits (:func:`offsets_fit_i32`, with a
    Gaussian factor slab of ``factor_slab`` floats per ``(b, h)``) and holding them pays
    (:func:`tile_offsets_pay`; ``lists=False``: for the grid-aligned backward kernels)."""
    return offsets_fit_i32(launch, factor_slab) and tile_offsets_pay(launch, lists)


def factor_rows(n_q: int, num_prefix: int, grid_w: int) -> tuple[int, int]:
    """``(n_qp, n_fr)`` of the backward's Gaussian factor buffer ``(B * H, n_fr, n_qp)``: the queries
    padded to a multiple of 128 (the largest query tile), and ``GWP`` column rows plus the grid rows
    padded to a multiple of 8 (the most grid rows a key tile covers) and 8 zero rows (prefix keys)."""
    rows = (n_q - num_prefix) // grid_w
    return cdiv(n_q, 128) * 128, grid_pad(grid_w) + cdiv(rows, 8) * 8 + 8


@dataclass(frozen=True)
class GridKeys:
    """How ``kernel`` visits the keys in grid-aligned tiles (a Gaussian bias, see ``_common``): the prefix
    keys and the grid width."""

    num_prefix: int
    grid_w: int
    kernel: str

    def tile_w(self, block_m: int, block_n: int) -> int:
        """``TILE_W`` at a ``block_m x block_n`` tile (:func:`configs.grid_tile_w`)."""
        return configs.grid_tile_w(grid_pad(self.grid_w), block_m, block_n, self.kernel)


def tile_flags(
    tile_m: int, tile_n: int, n_q: int, n_k: int, even_d: bool, grid: GridKeys | None = None
) -> dict[str, Any]:
    """The constexpr flags of a launch that depend on the tile: ``EVEN_M`` / ``EVEN_N`` / ``EVEN_D`` (the
    queries are whole tiles, the keys are whole tiles, the head dims their padded size: the kernels then
    leave those bound masks out) and, for a kernel with grid-aligned key tiles, ``GRID_TW`` (their
    ``TILE_W``, :func:`configs.grid_tile_w`).

    ``grid`` (:class:`GridKeys`) for the kernels that visit the keys in grid-aligned tiles (a
    Gaussian bias, see ``_common``): the keys are whole tiles when there are no prefix keys and the grid
    rows fill whole tiles of ``BLOCK_N // TILE_W`` rows (:func:`configs.grid_tile_w`)."""
    flags: dict[str, Any] = dict(EVEN_M=n_q % tile_m == 0, EVEN_D=even_d)
    if grid is None:
        flags["EVEN_N"] = n_k % tile_n == 0
    else:
        tile_w = grid.tile_w(tile_m, tile_n)
        rows = (n_k - grid.num_prefix) // grid.grid_w
        flags["EVEN_N"] = grid.num_prefix == 0 and rows % (tile_n // tile_w) == 0
        flags["GRID_TW"] = tile_w
    return flags


def _launch(
    name: str,
    grid: Callable[[int, int], tuple[int, ...]],
    args: Sequence[Any],
    meta: dict[str, Any],
    shape: tuple[int, int, int],
    even_d: bool,
    reset: Callable[[], object] | None = None,
    grid_keys: GridKeys | None = None,
    tile_args: Callable[[configs.TileConfig], list[Any]] | None = None,
) -> None:
    """Launch kernel ``name`` over ``grid(BLOCK_M, BLOCK_N)`` under the arguments' CUDA device.

    ``shape`` is ``(B·H, Nq, Nk)`` for the tuning key and the tile's flags (:func:`tile_flags`);
    ``reset`` restores an accumulated output (the additive mask's gradient, the live-tile map) after
    benchmarking; ``grid_keys``: :class:`GridKeys` where the kernel visits grid-aligned key tiles;
    ``tile_args(tile)`` are arguments that depend on the tile (the live-tile lists), after ``args``. The
    interpreter runs ``configs.INTERPRET``.
    """
    fn = kernels()[name]
    _, n_q, n_k = shape
    if _CAPTURE is not None:
        _CAPTURE.append(Captured(name, fn, list(args), dict(meta), shape, even_d, grid_keys, tile_args))
        return
    with device_guard(args):
        if interpret_requested():
            if compile_only():  # nothing to compile in the interpreter
                return
            c = configs.INTERPRET
            even = tile_flags(c.block_m, c.block_n, n_q, n_k, even_d, grid_keys)
            fn[grid(c.block_m, c.block_n)](
                *args_at(args, tile_args, c), BLOCK_M=c.block_m, BLOCK_N=c.block_n, **meta, **even
            )
            return

        def run(tile: configs.TileConfig, warm: bool = False) -> None:
            even = tile_flags(tile.block_m, tile.block_n, n_q, n_k, even_d, grid_keys)
            kw = dict(
                BLOCK_M=tile.block_m,
                BLOCK_N=tile.block_n,
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
                **meta,
                **even,
            )
            tile_args_ = args_at(args, tile_args, tile)
            if warm:
                fn.warmup(*tile_args_, grid=grid(tile.block_m, tile.block_n), **kw)
            else:
                fn[grid(tile.block_m, tile.block_n)](*tile_args_, **kw)

        benched: list[configs.TileConfig] = []

        def bench(tile: configs.TileConfig) -> float:
            import triton.testing

            benched.append(tile)

            def step() -> None:
                if reset is not None:
                    reset()
                run(tile)

            return float(
                triton.testing.do_bench(step, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median")
            )

        key = tune_key(name, args[0].dtype, *shape, meta)
        candidates = tile_candidates(name, meta, device_arch(args), configs.ragged(n_q, n_k, even_d))
        if compile_only():
            forced = forced_tile(candidates)
            for tile in [forced] if forced is not None else candidates:
                run(tile, warm=True)
            return
        tile = pick_tile(key, candidates, bench)
        if benched and reset is not None:
            reset()
        run(tile)


@dataclass
class Captured:
    """One launch recorded by :func:`capture` instead of run: the kernel, its arguments and constexpr
    flags (without the tile's), and what its tile-dependent flags need."""

    name: str
    fn: Any
    args: list[Any]
    meta: dict[str, Any]
    shape: tuple[int, int, int]
    even_d: bool
    grid_keys: GridKeys | None
    tile_args: Callable[[configs.TileConfig], list[Any]] | None = None

    def tile_flags(self, block_m: int, block_n: int) -> dict[str, Any]:
        """The tile-dependent flags of this launch at a tile (:func:`tile_flags`)."""
        _, n_q, n_k = self.shape
        return tile_flags(block_m, block_n, n_q, n_k, self.even_d, self.grid_keys)

    def args_at(self, block_m: int, block_n: int) -> list[Any]:
        """The arguments at a tile of ``block_m x block_n`` (:func:`args_at`)."""
        return args_at(self.args, self.tile_args, configs.TileConfig(block_m, block_n, 4, 1))


_CAPTURE: list[Captured] | None = None


@contextlib.contextmanager
def capture() -> Any:
    """Record every kernel launch inside the block instead of running it (the ahead-of-time builder
    compiles them with the arguments a real call passes, hence the JIT's own specialization)."""
    global _CAPTURE
    previous, _CAPTURE = _CAPTURE, []
    try:
        yield _CAPTURE
    finally:
        _CAPTURE = previous


def block_dim(d: int) -> int:
    """Head dims are padded (with masks) to a power of two >= 16: the smallest ``tl.dot`` operand."""
    return max(16, next_pow2(d))


def _run_or_warm(
    fn: Any, grid: tuple[int, ...], args: Sequence[Any], device_of: Sequence[Any], **meta: Any
) -> None:
    """Launch an untuned kernel (one fixed block size) under its tensors' device, or only compile it
    (:func:`compile_only`; nothing to compile in the interpreter)."""
    if _CAPTURE is not None:
        name = next(key for key, f in kernels().items() if f is fn)
        _CAPTURE.append(Captured(name, fn, list(args), dict(meta), (0, 0, 0), True, None))
        return
    with device_guard(device_of):
        if compile_only():
            if not interpret_requested():
                fn.warmup(*args, grid=grid, **meta)
        else:
            fn[grid](*args, **meta)


def _bcast_strides(t: torch.Tensor) -> list[int]:
    """Strides of a 4-D operand with 0 on its size-1 (broadcast) dims."""
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True)]


@dataclass(frozen=True)
class KernelLaunch:
    """The launch description of one fused attention call: what every kernel of its forward and
    backward reads besides the per-pass buffers.

    q ``(B, H, Nq, D)``, k ``(B, H, Nk, D)``, v ``(B, H, Nk, Dv)`` in one dtype, any strides; ``add``
    a 4-D additive float mask and ``keep`` a 4-D boolean keep-mask (broadcast dims of size 1);
    ``window`` a neighbourhood window (on the layout ``num_prefix``, ``grid_w``);
    ``den`` float32 ``(B, H, Np, 2)`` = ``r * sigma + eps`` and ``alpha`` float32 ``(B, H, Np)``
    (expanded views); ``ent`` float32 ``(B, H, Nq)``: the alphas of alpha-entmax (an expanded view; the
    normalizer is then alpha-entmax whatever ``entmax`` says); ``tf32``: TF32 dots for float32 operands on
    a GPU.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    add: torch.Tensor | None
    keep: torch.Tensor | None
    den: torch.Tensor | None
    alpha: torch.Tensor | None
    scale: float
    num_prefix: int
    grid_w: int
    clamp: float
    entmax: bool
    tf32: bool
    ent: torch.Tensor | None = None
    window: WindowMask | None = None

    @property
    def lists(self) -> bool:
        """Whether the kernels iterate tile lists (``*_lists`` kernels, the Gaussian bias per score): a
        window, entmax-1.5 (its live tiles) or alpha-entmax; plain softmax runs the grid-aligned kernels."""
        return self.normalizer != "softmax" or self.window is not None

    @property
    def list_backward(self) -> bool:
        """Whether the backward runs the list kernels (``*_lists``): as :attr:`lists`, but entmax-1.5 and
        alpha-entmax with a Gaussian bias and no window run the grid-aligned kernels (:mod:`.backward`, the
        bias per tile; entmax-1.5 over lists of its live grid-aligned tiles, :func:`grid_tile_lists`)."""
        grid = self.normalizer != "softmax" and self.den is not None and self.window is None
        return self.lists and not grid

    @property
    def normalizer(self) -> str:
        """``"softmax"``, ``"entmax15"`` or ``"entmax_alpha"`` (a tensor of alphas)."""
        if self.ent is not None:
            return "entmax_alpha"
        return "entmax15" if self.entmax else "softmax"

    @property
    def entmax_code(self) -> int:
        """The backward kernels' ``ENTMAX`` constexpr: 0 softmax, 1 entmax-1.5, 2 alpha-entmax."""
        return {"softmax": 0, "entmax15": 1, "entmax_alpha": 2}[self.normalizer]

    def ent_args(self, dummy: torch.Tensor) -> list[Any]:
        """``ENT, s_eb, s_eh, s_em``: the alphas and their strides (a dummy and zeros without them)."""
        if self.ent is None:
            return [dummy, 0, 0, 0]
        return [self.ent, *_bcast_strides(self.ent.unsqueeze(-1))[:3]]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B·H, Nq, Nk)``: the tuning key's sizes."""
        return self.q.shape[0] * self.q.shape[1], self.q.shape[2], self.k.shape[2]

    def operands(self, dummy: torch.Tensor) -> list[Any]:
        """``ADD, KEEP, DEN, ALPHA`` pointers (a dummy where absent; the keep-mask as uint8)."""
        keep = None if self.keep is None else self.keep.view(torch.uint8)
        return [dummy if t is None else t for t in (self.add, keep, self.den, self.alpha)]

    def strides(self) -> list[int]:
        out = [*self.q.stride(), *self.k.stride(), *self.v.stride()]
        out += _bcast_strides(self.add) if self.add is not None else [0] * 4
        out += _bcast_strides(self.keep) if self.keep is not None else [0] * 4
        return out + self.gauss_strides()

    def gauss_strides(self) -> list[int]:
        """The strides of ``den`` (4) and ``alpha`` (3), zeros without a Gaussian bias."""
        out = list(self.den.stride()) if self.den is not None else [0] * 4
        return out + (list(self.alpha.stride()) if self.alpha is not None else [0] * 3)

    def scalars(self) -> list[Any]:
        q, v = self.q, self.v
        return [
            q.shape[1],
            q.shape[2],
            self.k.shape[2],
            q.shape[3],
            v.shape[3],
            self.scale,
            self.num_prefix,
            self.grid_w,
            self.clamp,
        ]

    def grid_rows(self) -> int:
        """The grid rows of the patch keys, ``(Nk - num_prefix) // grid_w`` (0 without a layout)."""
        return (self.k.shape[2] - self.num_prefix) // self.grid_w if self.grid_w > 0 else 0

    @property
    def even_d(self) -> bool:
        """Both head dims are their padded size (no head-dim masks)."""
        return block_dim(self.q.shape[3]) == self.q.shape[3] and block_dim(self.v.shape[3]) == self.v.shape[3]

    def grid_keys(self, kernel: str) -> GridKeys | None:
        """With a Gaussian bias, how ``kernel`` visits the keys in grid-aligned tiles; else ``None``."""
        if self.den is None:
            return None
        return GridKeys(self.num_prefix, self.grid_w, kernel)

    def key_blocks(self, block_m: int, block_n: int) -> int:
        """The dK/dV programs per ``(b, h)`` for key blocks of ``block_n``: plain blocks of the keys, or
        with a Gaussian bias the prefix keys' blocks and the grid-aligned blocks (``NR`` grid rows of
        one chunk of ``TILE_W`` columns, :func:`configs.grid_tile_w`)."""
        n_k = self.k.shape[2]
        if self.den is None:
            return cdiv(n_k, block_n)
        keys = self.grid_keys(self.dkdv_tiles)
        assert keys is not None
        tile_w = keys.tile_w(block_m, block_n)
        rows = self.grid_rows()
        chunks = grid_pad(self.grid_w) // tile_w
        return cdiv(self.num_prefix, block_n) + chunks * cdiv(rows, block_n // tile_w)

    @property
    def dkdv_tiles(self) -> str:
        """The key of dK/dV's grid-aligned tile width (:data:`configs.GRID_TILE_W`): entmax-1.5's own
        (over its live tiles), else ``"bwd_dkdv"``."""
        return "bwd_dkdv_entmax15" if self.normalizer == "entmax15" else "bwd_dkdv"

    def grid_flags(self) -> dict[str, Any]:
        """``GWP`` (the padded grid width; 16 without a Gaussian bias) and ``PAD_W`` (it exceeds the
        grid width) of the kernels with grid-aligned key tiles."""
        gwp = grid_pad(self.grid_w) if self.den is not None else 16
        return dict(GWP=gwp, PAD_W=self.den is not None and gwp != self.grid_w)

    def flags(self) -> dict[str, Any]:
        q = self.q
        return dict(
            GAUSS=self.den is not None,
            HAS_ADD=self.add is not None,
            HAS_KEEP=self.keep is not None,
            F32_DOT=dot_mode(q.dtype, q.device.type, self.tf32, interpret_requested()),
            BLOCK_D=block_dim(q.shape[3]),
            BLOCK_DV=block_dim(self.v.shape[3]),
            WINDOW=self.window is not None,
        )

    def window_args(self, block_m: int, block_n: int, by_keys: bool, dummy: torch.Tensor) -> list[Any]:
        """``WLIST, WCNT, n_wcols, WIN``: the window's tile lists for tiles of ``block_m`` queries x
        ``block_n`` keys (per query tile its key tiles, or per key tile its query tiles if ``by_keys``),
        shared by every (b, h), and its table: per query its window's centre and half-width, per key its
        window coordinates (:func:`~vitattn.kernels.windows.window_table`)."""
        if self.window is None:
            return [dummy, dummy, 0, dummy]
        order, count = _window_lists(self.window, block_m, block_n, by_keys, self.q.device)
        return [order, count, order.shape[-1], windows.window_table(self.window, self.q.device)]


_WINDOW_LISTS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _window_lists(
    window: WindowMask, block_m: int, block_n: int, by_keys: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`windows.compact` of :func:`windows.window_tiles` (transposed if ``by_keys``), on ``device``,
    cached (no host copy after the first call of a window and tile)."""
    key = (window, block_m, block_n, by_keys, device)
    found = _WINDOW_LISTS.get(key)
    if found is None:
        tiles = windows.window_tiles(window, block_m, block_n)
        found = windows.compact((tiles.T if by_keys else tiles)[None].to(device))
        _WINDOW_LISTS[key] = found
    return found


def live_grain() -> int:
    """The side of the live-tile map's cells (:func:`_forward`): the smallest tile side of the arch lists
    (16 in the interpreter, where the tests shrink the tiles to 16)."""
    return configs.INTERPRET_LIVE_GRAIN if interpret_requested() else configs.LIVE_GRAIN


def live_shape(
    b: int, h: int, n_q: int, n_k: int, grid: tuple[int, int] | None = None
) -> tuple[int, int, int, int]:
    """The shape of the live-tile map of an entmax-1.5 forward: uint8 ``(B, H, cells of Nq, cells of the
    keys)``. The keys are tokens, or with grid-aligned key tiles (``grid``: the prefix tokens and the grid
    width; a Gaussian bias without a window) the prefix tokens and then the padded grid
    (:func:`live_key_index`)."""
    grain = live_grain()
    if grid is None:
        return b, h, -(-n_q // grain), -(-n_k // grain)
    prefix, grid_w = grid
    rows = (n_k - prefix) // grid_w
    return b, h, -(-n_q // grain), -(-prefix // grain) + -(-rows * grid_pad(grid_w) // grain)


def live_key_index(keys: torch.Tensor, prefix: int, grid_w: int) -> torch.Tensor:
    """The position of key tokens ``keys`` along the key axis of a live map with grid-aligned key tiles
    (:func:`live_shape`): a prefix token's own index, a grid key's ``P + row * GWP + col`` with ``P`` the
    prefix tokens rounded up to whole cells and ``GWP`` the padded grid width (a cell never holds keys
    of two grid-aligned tiles that the kernels' tiles keep apart)."""
    grain = live_grain()
    first = -(-prefix // grain) * grain
    patch = keys - prefix
    return torch.where(patch < 0, keys, first + patch // grid_w * grid_pad(grid_w) + patch % grid_w)


def tile_lists(
    live: torch.Tensor, block_rows: int, block_cols: int, n_rows: int, n_cols: int, by_cols: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LIST, CNT)`` of the backward's inner loops from the live-tile map ``live`` (uint8 ``(B, H, cells
    of the queries, cells of the keys)``): a tile of ``block_rows`` queries x ``block_cols`` keys is live
    when a cell it covers is, or (a tile side below the cell's) the cell it lies in. Per program (query
    tile, or key tile if ``by_cols``: the dK/dV kernel's transposed list), its live inner tiles in order,
    int32 ``(B * H, programs, inner tiles)``, and their count, int32 ``(B * H, programs)``."""
    cells = _pool_cells(live.flatten(0, 1), 1, block_rows, n_rows)
    tiles = _pool_cells(cells, 2, block_cols, n_cols) != 0
    return windows.compact(tiles.transpose(1, 2) if by_cols else tiles)


def _pool_cells(cells: torch.Tensor, dim: int, block: int, n: int) -> torch.Tensor:
    """``cells`` (dimension ``dim`` in cells of :func:`live_grain` tokens, ``n`` tokens) pooled into tiles
    of ``block`` tokens along ``dim``: a tile is marked when a cell it covers is, or (a tile finer than a
    cell: sm_90's 16-query dK/dV and 16-key dQ tiles) the cell it lies in: ``cdiv(n, block)`` along ``dim``,
    non-zero where marked; a view of ``cells`` where the tiles are its cells."""
    grain = live_grain()
    cells = cells.movedim(dim, -1)
    if grain > block:  # each cell covers several tiles
        cells = cells.repeat_interleave(grain // block, dim=-1)
    per = max(block // grain, 1)
    want = -(-n // block) * per  # cells (or sub-cells) of the tiles, padded to whole tiles
    if cells.shape[-1] < want:
        cells = torch.nn.functional.pad(cells, (0, want - cells.shape[-1]))
    elif cells.shape[-1] > want:
        cells = cells[..., :want]
    if per > 1:
        cells = cells.unflatten(-1, (want // per, per)).amax(-1)
    return cells.movedim(-1, dim)


def grid_key_tiles(
    grid: GridKeys, n_k: int, block_m: int, block_n: int, by_chunks: bool, device: torch.device | None = None
) -> torch.Tensor:
    """The keys of each grid-aligned key tile of ``grid.kernel`` at a ``block_m x block_n`` tile (``_common``,
    "grid-aligned key tiles"): int64 ``(tiles, block_n)`` on ``device`` (the CPU by default), -1 in slots
    past the prefix keys, the grid width or the grid rows. The prefix keys' tiles first, then the tiles of
    ``NR`` grid rows of each chunk of ``TILE_W`` columns: chunk-major (``by_chunks``: dQ's order) or, as
    dK/dV's programs, row-major."""
    tile_w = grid.tile_w(block_m, block_n)
    p, w = grid.num_prefix, grid.grid_w
    rows = (n_k - p) // w
    nr = block_n // tile_w
    pre = torch.arange(-(-p // block_n) * block_n, device=device).view(-1, block_n)
    pre = torch.where(pre < p, pre, -1)
    chunk, row_tile = grid_pad(w) // tile_w, -(-rows // nr)
    ch = torch.arange(chunk, device=device).view(chunk, 1, 1, 1)
    rt = torch.arange(row_tile, device=device).view(1, row_tile, 1, 1)
    r = rt * nr + torch.arange(nr, device=device).view(1, 1, nr, 1)
    c = ch * tile_w + torch.arange(tile_w, device=device).view(1, 1, 1, tile_w)
    keys = torch.where((r < rows) & (c < w), p + r * w + c, -1)  # (chunk, row tile, nr, tile_w)
    if not by_chunks:
        keys = keys.transpose(0, 1)
    return torch.cat([pre, keys.reshape(-1, block_n)])


_GRID_MEMBERS: dict[tuple[Any, ...], torch.Tensor] = {}


def _grid_members(
    grid: GridKeys, n_k: int, block_m: int, block_n: int, by_keys: bool, cells: int, device: torch.device
) -> torch.Tensor:
    """float32 ``(cells, tiles)`` on ``device``: 1 where a cell of the live map holds a key of a
    grid-aligned key tile (:func:`grid_key_tiles`, dQ's order unless ``by_keys``); built by device ops (no
    host copy: a first call may come during a CUDA-graph capture), cached per layout and tile
    (:func:`_kept`)."""
    key = (grid, n_k, block_m, block_n, by_keys, cells, device)
    found = _GRID_MEMBERS.get(key)
    if found is None:
        grain = live_grain()
        keys = grid_key_tiles(grid, n_k, block_m, block_n, by_chunks=not by_keys, device=device)
        index = torch.where(keys < 0, cells * grain, live_key_index(keys, grid.num_prefix, grid.grid_w))
        member = torch.zeros(keys.shape[0], cells + 1, device=device).scatter_(1, index // grain, 1.0)
        found = _kept(_GRID_MEMBERS, key, member[:, :cells].T.contiguous())
    return found


def grid_tile_lists(
    live: torch.Tensor, grid: GridKeys, n_q: int, n_k: int, block_m: int, block_n: int, by_keys: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LIST, CNT)`` of the grid-aligned backward of entmax-1.5 (a Gaussian bias, no window) from the
    forward's live-tile map ``live`` (:func:`live_shape` with ``grid``): a grid-aligned key tile
    (:func:`grid_key_tiles`) is live for a query tile when a cell holding one of its keys is. ``by_keys``
    (dK/dV): per key tile (program) its live query tiles, as :func:`tile_lists`. Else (dQ) per query tile
    ``CH + 1`` lists, int32 ``(B * H, query tiles * (CH + 1), longest)``: its live prefix tiles, then per
    chunk of grid columns its live tiles of grid rows (by index in the chunk), and their counts
    ``(B * H, query tiles * (CH + 1))``."""
    member = _grid_members(grid, n_k, block_m, block_n, by_keys, live.shape[3], live.device)
    rows = _pool_cells(live.flatten(0, 1), 1, block_m, n_q)  # (B * H, query tiles, key cells)
    tiles = (rows.float() @ member) > 0  # (B * H, query tiles, key tiles)
    if by_keys:
        return windows.compact(tiles.transpose(1, 2))
    n_pre = -(-grid.num_prefix // block_n)
    chunk = grid_pad(grid.grid_w) // grid.tile_w(block_m, block_n)
    main = tiles[..., n_pre:].unflatten(-1, (chunk, -1))  # (B * H, query tiles, CH, row tiles)
    longest = max(n_pre, main.shape[-1], 1)
    pad = lambda t: torch.nn.functional.pad(t, (0, longest - t.shape[-1]))  # noqa: E731
    sections = torch.cat([pad(tiles[..., None, :n_pre]), pad(main)], dim=2)
    return windows.compact(sections.flatten(1, 2))


# ---- the backward's tile lists in one launch (kernels/tile_lists.py) ---------------------------------------

_LIST_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}
LIST_CHUNK = 64  # inner tiles the list kernel reads per step


def _kept(
    cache: dict[tuple[Any, ...], torch.Tensor], key: tuple[Any, ...], table: torch.Tensor
) -> torch.Tensor:
    """``table``, stored in ``cache`` under ``key`` unless a CUDA graph is being captured: ops captured
    are recorded, not run, so a table built then holds its values only inside the graph's replays (a
    CPU or meta table never is: the question is not asked of CUDA there)."""
    if table.device.type != "cuda" or not _capturing():
        cache[key] = table
    return table


def _padded_table(cells: torch.Tensor) -> torch.Tensor:
    """int32 ``cells`` (tiles, k) widened to a power of two with -1 (the kernel's ``tl.arange``)."""
    width = next_pow2(max(cells.shape[1], 1))
    pad = cells.new_full((cells.shape[0], width - cells.shape[1]), -1)
    return torch.cat([cells, pad], dim=1).to(torch.int32).contiguous()


def _token_tile_cells(block: int, n: int, cells: int, device: torch.device) -> torch.Tensor:
    """int32 ``(cdiv(n, block), k)``: the live map's cells (``cells`` of them along the axis) that each
    tile of ``block`` tokens covers, -1 past the map or the tile; a tile finer than a cell takes the cell it
    lies in (the rule of :func:`_pool_cells`). Built by device ops (no host copy: a first call may come
    during a CUDA-graph capture), cached per geometry and device (:func:`_kept`)."""
    grain = live_grain()
    key = ("tokens", block, n, cells, grain, device)
    found = _LIST_TABLES.get(key)
    if found is None:
        tile = torch.arange(cdiv(n, block), device=device).view(-1, 1)
        part = torch.arange(max(block // grain, 1), device=device).view(1, -1)
        cell = (tile * block + part * grain) // grain
        found = _kept(_LIST_TABLES, key, _padded_table(torch.where(cell < cells, cell, -1)))
    return found


def _grid_tile_cells(
    grid: GridKeys, n_k: int, block_m: int, block_n: int, by_keys: bool, cells: int, device: torch.device
) -> torch.Tensor:
    """int32 ``(grid-aligned key tiles, k)``: the live map's key cells holding a key of each tile
    (:func:`_grid_members`' columns, in the same order), -1 past them. ``k`` is a bound read from the
    geometry, not from the tensors (no device sync): a prefix tile covers at most ``max(block_n / grain,
    1)`` cells, a tile of ``NR`` grid rows at most ``max(TILE_W / grain, 1)`` per row (its columns and each
    grid row start on a cell). Device ops, cached."""
    grain = live_grain()
    key = ("grid", grid, n_k, block_m, block_n, by_keys, cells, grain, device)
    found = _LIST_TABLES.get(key)
    if found is None:
        tile_w = grid.tile_w(block_m, block_n)
        width = min(max(block_n // grain, 1, block_n // tile_w * max(tile_w // grain, 1)), cells)
        member = _grid_members(grid, n_k, block_m, block_n, by_keys, cells, device).T > 0
        order, count = windows.compact(member[None])  # per tile its cells first, in order; their count
        order = order[0, :, :width]
        used = torch.arange(order.shape[1], device=device).view(1, -1) < count[0, :, None]
        found = _kept(_LIST_TABLES, key, _padded_table(torch.where(used, order, -1)))
    return found


def _sections(first: int, count: int, chunks: int, device: torch.device) -> torch.Tensor:
    """int32 ``(1 + chunks, 2)`` on ``device``: each section's first inner tile and count, the first
    ``[0, first)``, then ``chunks`` of ``count`` tiles from ``first`` on. Device ops, cached."""
    key = ("sections", first, count, chunks, device)
    found = _LIST_TABLES.get(key)
    if found is None:
        c = torch.arange(chunks + 1, device=device)
        start = torch.where(c == 0, 0, first + (c - 1) * count)
        found = _kept(
            _LIST_TABLES, key, torch.stack([start, torch.where(c == 0, first, count)], 1).to(torch.int32)
        )
    return found


def _build_lists(
    live: torch.Tensor,
    outer: torch.Tensor,
    inner: torch.Tensor,
    sections: torch.Tensor,
    outer_keys: bool,
    n_list_cols: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LIST, CNT)`` by one launch of the list kernel (:mod:`.tile_lists`): per ``(b, h)``, outer tile
    and section, the live inner tiles of ``live`` (uint8 ``(B, H, query cells, key cells)``), int32 ``(B * H,
    outer tiles * sections, n_list_cols)`` (entries past the count unspecified) and their count. On meta
    tensors (the ahead-of-time builder's calls) the empty outputs only."""
    bh = live.shape[0] * live.shape[1]
    programs = outer.shape[0] * sections.shape[0]
    order = torch.empty((bh, programs, n_list_cols), dtype=torch.int32, device=live.device)
    count = torch.empty((bh, programs), dtype=torch.int32, device=live.device)
    if live.device.type == "meta" or bh * programs == 0:
        return order, count
    flat = live.flatten(0, 1)
    _run_or_warm(
        kernels()["tile_lists"],
        (programs, bh),
        [flat, outer, inner, sections, order, count, *flat.stride(), sections.shape[0], n_list_cols],
        [live],
        OUTER_KEYS=outer_keys,
        OUTER_CELLS=outer.shape[1],
        INNER_CELLS=inner.shape[1],
        BLOCK_T=min(LIST_CHUNK, next_pow2(max(n_list_cols, 1))),
        num_warps=configs.LIST_WARPS,
        num_stages=configs.LIST_STAGES,
    )
    return order, count


def live_lists(
    live: torch.Tensor, block_rows: int, block_cols: int, n_rows: int, n_cols: int, by_cols: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile_lists`' lists (the live tiles of each program first, in order; their count) built by
    one kernel launch instead of torch ops; entries past a list's count are unspecified."""
    rows = _token_tile_cells(block_rows, n_rows, live.shape[2], live.device)
    cols = _token_tile_cells(block_cols, n_cols, live.shape[3], live.device)
    outer, inner = (cols, rows) if by_cols else (rows, cols)
    whole = _sections(inner.shape[0], 0, 0, live.device)
    return _build_lists(live, outer, inner, whole, by_cols, inner.shape[0])


def live_grid_lists(
    live: torch.Tensor, grid: GridKeys, n_q: int, n_k: int, block_m: int, block_n: int, by_keys: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grid_tile_lists`' lists built by one kernel launch (entries past a list's count
    unspecified): dK/dV's (``by_keys``) per key tile, dQ's per query tile ``CH + 1`` sections."""
    rows = _token_tile_cells(block_m, n_q, live.shape[2], live.device)
    keys = _grid_tile_cells(grid, n_k, block_m, block_n, by_keys, live.shape[3], live.device)
    if by_keys:
        whole = _sections(rows.shape[0], 0, 0, live.device)
        return _build_lists(live, keys, rows, whole, True, rows.shape[0])
    n_pre = cdiv(grid.num_prefix, block_n)
    chunk = grid_pad(grid.grid_w) // grid.tile_w(block_m, block_n)
    per_chunk = (keys.shape[0] - n_pre) // chunk
    sections = _sections(n_pre, per_chunk, chunk, live.device)
    return _build_lists(live, rows, keys, sections, False, max(n_pre, per_chunk, 1))


def entmax_list_cols(launch: KernelLaunch, grid: GridKeys | None, block_m: int, block_n: int) -> int:
    """The width of a row of the entmax-1.5 forward's list scratch (per query tile, its live key tiles)
    at a ``block_m x block_n`` tile: one entry per key tile, or with grid-aligned key tiles (``grid``) the
    ``CH + 1`` counts (the prefix tiles', each chunk of grid columns') and the lists of the prefix tiles
    and of each chunk's tiles."""
    if grid is None:
        return cdiv(launch.k.shape[2], block_n)
    tile_w = grid.tile_w(block_m, block_n)
    chunks = grid_pad(grid.grid_w) // tile_w
    rows = cdiv(launch.grid_rows(), block_n // tile_w)
    return chunks + 1 + cdiv(grid.num_prefix, block_n) + chunks * rows


def _forward(
    launch: KernelLaunch, store_og: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, stat, og, live)``: out ``(B, H, Nq, Dv)`` in v's dtype, stat float32 ``(B, H, Nq)``, og
    float32 ``(B, H, Nq, Dv)`` for entmax-1.5 / alpha-entmax with ``store_og`` (else an empty ``(0,)``
    tensor), live the map of the key tiles the entmax-1.5 output pass visited (uint8 :func:`live_shape`;
    empty otherwise)."""
    q, v = launch.q, launch.v
    b, h, n_q, _ = q.shape
    dv = v.shape[3]
    dummy = q.new_empty(1, dtype=torch.float32)
    out = torch.empty(b, h, n_q, dv, device=q.device, dtype=v.dtype)
    stat = torch.empty(b, h, n_q, device=q.device, dtype=torch.float32)
    name = f"fwd_{launch.normalizer}"
    sparse = name != "fwd_softmax"
    if launch.window is not None and not sparse:
        name = "fwd_softmax_lists"
    store_og = store_og and sparse
    og = torch.empty(b, h, n_q, dv if store_og else 0, device=q.device, dtype=torch.float32)
    head = [q, launch.k, v, out, stat, *launch.operands(dummy)]
    meta = launch.flags()
    if name in configs.PARTIAL_ROW_SUMS:
        meta["ROW_PARTS"] = configs.ROW_PARTS_BY_ARCH[device_arch([q])]
    if name == "fwd_entmax15":
        meta["GAUSS_SQUARES"] = configs.ENTMAX_GAUSS_SQUARES_BY_ARCH[device_arch([q])]
    if name != "fwd_softmax":  # the list kernels: their counts marked warp-uniform (_common.warp_uniform)
        meta["UNIFORM"] = not interpret_requested()
        meta["OFFS32"] = use_tile_offsets(launch)
    if sparse:
        head.append(og if store_og else dummy)
        meta["STORE_OG"] = store_og
    elif name == "fwd_softmax":
        del meta["WINDOW"]
        meta.update(launch.grid_flags())
        tma = kv_tma(launch)
        meta["KV_TMA"] = tma is not None
        descs = kv_descriptors(launch, tma) if tma is not None else []
        head += descs + [dummy] * (4 - len(descs))
    args = [*head, *launch.strides(), *launch.scalars()]
    if name == "fwd_softmax":
        args.append(launch.grid_rows())
    if launch.ent is not None:
        args += launch.ent_args(dummy)
    live = q.new_empty(0, dtype=torch.uint8)
    n_k = launch.k.shape[2]
    grid_keys = launch.grid_keys(name) if name == "fwd_softmax" else None
    if name in ("fwd_entmax15", "fwd_entmax_alpha"):
        args.append(launch.grid_rows())
        if launch.window is None:  # a Gaussian bias: grid-aligned key tiles
            grid_keys = launch.grid_keys(name)
            meta.update(launch.grid_flags())
    if name == "fwd_entmax15":
        layout = (launch.num_prefix, launch.grid_w) if grid_keys is not None else None
        live = torch.zeros(live_shape(b, h, n_q, n_k, layout), device=q.device, dtype=torch.uint8)
        meta.update(SPARSE=True, GRAIN=live_grain())

    def tile_args(tile: configs.TileConfig) -> list[Any]:
        extra = []
        if name == "fwd_entmax15":  # the search's list (scratch) and the live map
            rows = b * h * cdiv(n_q, tile.block_m)
            cols = entmax_list_cols(launch, grid_keys, tile.block_m, tile.block_n)
            scratch = torch.empty(rows, cols, device=q.device, dtype=torch.int32)
            extra = [scratch, live, live.shape[2], live.shape[3]]
        if name == "fwd_softmax":  # the grid-aligned kernel: no window
            return extra
        return extra + launch.window_args(tile.block_m, tile.block_n, False, dummy)

    grid = lambda bm, bn: (cdiv(n_q, bm), b * h)  # noqa: E731
    _launch(
        name,
        grid,
        args,
        meta,
        launch.shape,
        launch.even_d,
        reset=live.zero_,
        grid_keys=grid_keys,
        tile_args=tile_args,
    )
    return out, stat, og, live


def _row_deltas(o_or_og: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """The backward's per-query ``delta`` (B, H, Nq), float32: the row sums of ``o_or_og * do``."""
    b, h, n_q, dv = do.shape
    delta = torch.empty(b, h, n_q, device=do.device, dtype=torch.float32)
    rows = configs.INTERPRET_DELTA_ROWS if interpret_requested() else configs.DELTA_ROWS
    delta_args = (o_or_og, do, delta, b * h * n_q, dv)
    _run_or_warm(
        kernels()["bwd_delta"],
        (cdiv(b * h * n_q, rows),),
        delta_args,
        [o_or_og],
        BLOCK_M=rows,
        BLOCK_DV=block_dim(dv),
    )
    return delta


def _gaussian_terms(launch: KernelLaunch, dummy: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """What dK/dV reads of the Gaussian bias, computed once per query: the list kernels' row terms
    ``(B·H, 5, Nq)``, or the grid-aligned kernels' factors ``(B·H, n_fr, n_qp)`` with ``n_qp, n_fr``;
    ``(dummy, 0, 0)`` without a Gaussian bias."""
    q = launch.q
    b, h, n_q, _ = q.shape
    fact, n_qp, n_fr = dummy, 0, 0
    if launch.den is not None and launch.list_backward:  # the list kernels' row terms, once per query
        assert launch.alpha is not None
        fact = torch.empty(b * h, 5, n_q, device=q.device, dtype=torch.float32)
        block = configs.INTERPRET_DELTA_ROWS if interpret_requested() else configs.ROW_TERMS_ROWS
        rows_args = (
            launch.den,
            launch.alpha,
            fact,
            *launch.gauss_strides(),
            h,
            n_q,
            launch.num_prefix,
            launch.grid_w,
            launch.clamp,
        )
        _run_or_warm(kernels()["bwd_rows"], (cdiv(n_q, block), b * h), rows_args, [launch.den], BLOCK_M=block)
    elif launch.den is not None:  # the Gaussian factors of every query, once (read by dK/dV)
        assert launch.alpha is not None
        n_qp, n_fr = factor_rows(n_q, launch.num_prefix, launch.grid_w)
        gwp = grid_pad(launch.grid_w)
        fact = torch.empty(b * h, n_fr, n_qp, device=q.device, dtype=torch.float32)
        block = configs.INTERPRET_DELTA_ROWS if interpret_requested() else configs.ROW_TERMS_ROWS
        fact_args = (
            launch.den,
            launch.alpha,
            fact,
            *launch.gauss_strides(),
            h,
            n_q,
            n_qp,
            n_fr,
            launch.num_prefix,
            launch.grid_w,
            launch.clamp,
            launch.scale,
        )
        _run_or_warm(
            kernels()["bwd_factors"],
            (cdiv(n_qp, block), b * h),
            fact_args,
            [launch.den],
            GWP=gwp,
            BLOCK_M=block,
            SCALED=launch.normalizer == "entmax_alpha",  # its bias added after the scale
        )
    return fact, n_qp, n_fr


def _list_tile_args(
    launch: KernelLaunch, live: torch.Tensor, by_keys: bool, dummy: torch.Tensor
) -> Callable[[configs.TileConfig], list[Any]]:
    """The list kernels' tile-dependent arguments of a backward pass (dK/dV ``by_keys``, else dQ): the
    visited tiles (entmax-1.5's ``live`` map turned into per-tile lists, or a window's range) per tile."""
    n_q, n_k = launch.q.shape[2], launch.k.shape[2]

    def tile_args(tile: configs.TileConfig) -> list[Any]:
        win = launch.window_args(tile.block_m, tile.block_n, by_keys, dummy)
        if live.numel() == 0:
            return [*win[:3], 0, *win[3:]]
        order, count = live_lists(live, tile.block_m, tile.block_n, n_q, n_k, by_keys)
        return [order, count, order.shape[-1], 1, *win[3:]]

    return tile_args


def _grid_list_args(
    launch: KernelLaunch, live: torch.Tensor, by_keys: bool
) -> Callable[[configs.TileConfig], list[Any]]:
    """The grid-aligned backward's tile lists (:func:`grid_tile_lists`) per tile: ``LIST, CNT, n_list_cols``
    of dK/dV (``by_keys``) or dQ."""
    n_q, n_k = launch.q.shape[2], launch.k.shape[2]
    grid = launch.grid_keys(launch.dkdv_tiles if by_keys else "bwd_dq")
    assert grid is not None

    def tile_args(tile: configs.TileConfig) -> list[Any]:
        order, count = live_grid_lists(live, grid, n_q, n_k, tile.block_m, tile.block_n, by_keys)
        return [order, count, order.shape[-1]]

    return tile_args


def _additive_grad(
    add: torch.Tensor | None, shape: tuple[int, int, int, int], none: torch.Tensor
) -> tuple[int, torch.Tensor, list[int], bool, bool]:
    """dQ's handling of the additive mask's gradient for scores of ``shape`` (B, H, Nq, Nk): the mode
    (0 none, 1 stored per score, 2 added atomically: ``add`` broadcasts), the zeroed float32 gradient in
    ``add``'s shape (``none`` without one), its strides, and whether it broadcasts over the queries / the
    keys."""
    if add is None:
        return 0, none, [0] * 4, False, False
    dadd = torch.zeros(add.shape, device=add.device, dtype=torch.float32)
    broadcast = [s for s, t in zip(add.shape, shape, strict=True) if s == 1 and t > 1]
    mode = 2 if broadcast else 1
    return mode, dadd, _bcast_strides(dadd), mode == 2 and add.shape[2] == 1, mode == 2 and add.shape[3] == 1


def _backward(
    launch: KernelLaunch,
    grad_out: torch.Tensor,
    o_or_og: torch.Tensor,
    stat: torch.Tensor,
    live: torch.Tensor,
    add_grad: bool,
    gauss_grad: bool,
    ent_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv, dadd, dden, dalpha, dent)`` in the shapes of q, k, v (their dtypes) and of add, den,
    alpha, ent (float32); ``dadd`` / ``dden``, ``dalpha`` / ``dent`` are empty ``(0,)`` tensors unless
    asked for."""
    q, k, v, add = launch.q, launch.k, launch.v, launch.add
    if launch.normalizer != "softmax" and o_or_og.shape[-1] != v.shape[-1]:
        raise RuntimeError(f"attention_bwd: the {launch.normalizer} forward ran with store_og=False")
    b, h, n_q, d = q.shape
    n_k, dv = k.shape[2], v.shape[3]
    do = grad_out.contiguous()
    dummy = q.new_empty(1, dtype=torch.float32)

    def empty() -> torch.Tensor:  # a fresh one per output: custom-op outputs must not alias
        return q.new_empty(0, dtype=torch.float32)

    delta = _row_deltas(o_or_og, do)
    lists = launch.list_backward
    fact, n_qp, n_fr = _gaussian_terms(launch, dummy)

    dq = torch.empty(b, h, n_q, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(b, h, n_k, d, device=q.device, dtype=k.dtype)
    dvv = torch.empty(b, h, n_k, dv, device=q.device, dtype=v.dtype)
    add_mode, dadd, g_strides, bcast_m, bcast_n = _additive_grad(
        add if add_grad else None, (b, h, n_q, n_k), empty()
    )
    gauss_grad = gauss_grad and launch.den is not None
    dden, dalpha = empty(), empty()
    if gauss_grad:
        assert launch.den is not None and launch.alpha is not None
        dden = torch.empty(launch.den.shape, device=q.device, dtype=torch.float32)
        dalpha = torch.empty(launch.alpha.shape, device=q.device, dtype=torch.float32)

    ent_grad = ent_grad and launch.ent is not None
    dent = q.new_empty(b, h, n_q, dtype=torch.float32) if ent_grad else empty()
    ent_args = launch.ent_args(dummy)

    meta = launch.flags()
    meta["ENTMAX"] = launch.entmax_code
    strides, scalars, operands = launch.strides(), launch.scalars(), launch.operands(dummy)
    if lists:
        # the inner loops iterate lists: entmax-1.5's live tiles (per (b, h)), else a window's (shared)
        meta["SPARSE"] = live.numel() > 0 or launch.window is not None
        meta["UNIFORM"] = not interpret_requested()  # the counts marked warp-uniform (_common.warp_uniform)
        meta["OFFS32"] = use_tile_offsets(launch)

        dkdv_args = [q, k, v, do, stat, delta, fact, dk, dvv, *operands, *strides, *scalars, *ent_args]
        dkdv_blocks = lambda bm, bn: (cdiv(n_k, bn), b * h)  # noqa: E731
        dkdv_extra: dict[str, Any] = dict(tile_args=_list_tile_args(launch, live, True, dummy))
        dq_tail = [ent_args[0], dent if ent_grad else dummy, *ent_args[1:]]
        dq_meta: dict[str, Any] = dict(ENT_GRAD=ent_grad)
        dq_extra: dict[str, Any] = dict(tile_args=_list_tile_args(launch, live, False, dummy))
    else:  # softmax, and the entmaxes with a Gaussian bias: grid-aligned Gaussian tiles
        del meta["WINDOW"]
        meta.update(launch.grid_flags())
        meta["OFFS32"] = use_tile_offsets(launch, n_qp * n_fr, lists=False)
        dkdv_args = [q, k, v, do, stat, delta, fact, dk, dvv, *operands, *strides, *scalars, n_qp, n_fr,
                     *ent_args]  # fmt: skip
        dkdv_blocks = lambda bm, bn: (launch.key_blocks(bm, bn), b * h)  # noqa: E731
        dkdv_extra = dict(grid_keys=launch.grid_keys(launch.dkdv_tiles))
        dq_tail = [ent_args[0], dent if ent_grad else dummy, *ent_args[1:]]
        dq_extra = dict(grid_keys=launch.grid_keys("bwd_dq"))
        dq_meta = {"ROW_PAIR": configs.DQ_ROW_PAIR_BY_ARCH[device_arch([q])], "ENT_GRAD": ent_grad}
        if launch.normalizer == "entmax15":  # the live grid-aligned tiles of the forward's map
            meta["SPARSE"] = True
            meta["UNIFORM"] = not interpret_requested()
            dkdv_extra["tile_args"] = _grid_list_args(launch, live, True)
            dq_extra["tile_args"] = _grid_list_args(launch, live, False)
        else:
            dkdv_args += [dummy, dummy, 0]
            dq_tail += [dummy, dummy, 0]
    suffix = "_lists" if lists else ""
    _launch("bwd_dkdv" + suffix, dkdv_blocks, dkdv_args, meta, launch.shape, launch.even_d, **dkdv_extra)
    dq_extra["reset"] = dadd.zero_ if add_mode == 2 else None  # atomics accumulate: reset after benchmarking
    grads = (dadd if add_mode else dummy, *((dden, dalpha) if gauss_grad else (dummy, dummy)))
    dq_args = [q, k, v, do, stat, delta, dq, *grads, *operands, *strides, *g_strides, *scalars, *dq_tail]
    dq_flags = {**meta, **dq_meta, "ADD_GRAD": add_mode, "GAUSS_GRAD": gauss_grad, "DADD_BCAST_M": bcast_m,
                "DADD_BCAST_N": bcast_n}  # fmt: skip
    dq_blocks = lambda bm, bn: (cdiv(n_q, bm), b * h)  # noqa: E731
    _launch("bwd_dq" + suffix, dq_blocks, dq_args, dq_flags, launch.shape, launch.even_d, **dq_extra)
    return dq, dk, dvv, dadd, dden, dalpha, dent


# ---- the custom ops ------------------------------------------------------------------------------------

_OPERANDS = "Tensor q, Tensor k, Tensor v, Tensor? add, Tensor? keep, Tensor? den, Tensor? alpha, Tensor? ent"
_SCALARS = "float scale, int num_prefix, int grid_w, float clamp, bool entmax, bool tf32"
FWD_SCHEMA = f"({_OPERANDS}, {_SCALARS}, bool store_og, int[] window=[]) -> (Tensor, Tensor, Tensor, Tensor)"
BWD_SCHEMA = (
    f"(Tensor grad_out, Tensor o_or_og, Tensor stat, Tensor live, {_OPERANDS}, {_SCALARS}, bool add_grad,"
    " bool gauss_grad,"
    " bool ent_grad, int[] window=[]) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _fwd_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    add: torch.Tensor | None,
    keep: torch.Tensor | None,
    den: torch.Tensor | None,
    alpha: torch.Tensor | None,
    ent: torch.Tensor | None,
    scale: float,
    num_prefix: int,
    grid_w: int,
    clamp: float,
    entmax: bool,
    tf32: bool,
    store_og: bool,
    window: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``normalize(q kᵀ · scale + gaussian + add, masked by keep) v``: ``(out, stat, og, live)``
    (:func:`_forward`); the body of the custom op :data:`attention_fwd` (eager calls run it directly).

    Operands as in :class:`KernelLaunch` (one dtype for q, k, v); differentiable in q, k, v, add, den,
    alpha and ent (through ``attention_bwd``) when ``store_og`` is set for entmax-1.5 / alpha-entmax.
    """
    win = WindowMask.from_ints(list(window)) if window else None
    launch = KernelLaunch(
        q, k, v, add, keep, den, alpha, scale, num_prefix, grid_w, clamp, entmax, tf32, ent, win
    )
    return _forward(launch, store_og)


attention_fwd = torch.library.custom_op("vitattn::attention_fwd", mutates_args=(), schema=FWD_SCHEMA)(
    _fwd_body
)


@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, add, keep, den, alpha, ent, scale, num_prefix, grid_w, clamp, entmax, tf32, store_og, window=()
):  # fmt: skip
    b, h, n_q, _ = q.shape
    dv = v.shape[3]
    out = q.new_empty(b, h, n_q, dv, dtype=v.dtype)
    stat = q.new_empty(b, h, n_q, dtype=torch.float32)
    og = q.new_empty(b, h, n_q, dv if store_og and (entmax or ent is not None) else 0, dtype=torch.float32)
    sparse = entmax and ent is None
    grid = (num_prefix, grid_w) if den is not None and not window else None  # grid-aligned key tiles
    live = q.new_empty(live_shape(b, h, n_q, k.shape[2], grid) if sparse else (0,), dtype=torch.uint8)
    return out, stat, og, live


def _bwd_body(
    grad_out: torch.Tensor,
    o_or_og: torch.Tensor,
    stat: torch.Tensor,
    live: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    add: torch.Tensor | None,
    keep: torch.Tensor | None,
    den: torch.Tensor | None,
    alpha: torch.Tensor | None,
    ent: torch.Tensor | None,
    scale: float,
    num_prefix: int,
    grid_w: int,
    clamp: float,
    entmax: bool,
    tf32: bool,
    add_grad: bool,
    gauss_grad: bool,
    ent_grad: bool,
    window: Sequence[int] = (),
) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv, dadd, dden, dalpha, dent)`` of :func:`_backward` for ``grad_out`` ``(B, H, Nq, Dv)``;
    ``o_or_og`` is the forward's out (softmax) or og (entmax-1.5, alpha-entmax), ``stat`` its row
    statistic."""
    win = WindowMask.from_ints(list(window)) if window else None
    launch = KernelLaunch(
        q, k, v, add, keep, den, alpha, scale, num_prefix, grid_w, clamp, entmax, tf32, ent, win
    )
    return _backward(launch, grad_out, o_or_og, stat, live, add_grad, gauss_grad, ent_grad)


attention_bwd = torch.library.custom_op("vitattn::attention_bwd", mutates_args=(), schema=BWD_SCHEMA)(
    _bwd_body
)


@attention_bwd.register_fake
def _attention_bwd_fake(
    grad_out,
    o_or_og,
    stat,
    live,
    q,
    k,
    v,
    add,
    keep,
    den,
    alpha,
    ent,
    scale,
    num_prefix,
    grid_w,
    clamp,
    entmax,
    tf32,
    add_grad,
    gauss_grad,
    ent_grad,
    window=(),
):
    gauss = gauss_grad and den is not None
    b, h, n_q, _ = q.shape
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        q.new_empty(add.shape if add is not None and add_grad else (0,), dtype=torch.float32),
        q.new_empty(den.shape if gauss else (0,), dtype=torch.float32),
        q.new_empty(alpha.shape if gauss else (0,), dtype=torch.float32),
        q.new_empty((b, h, n_q) if ent_grad and ent is not None else (0,), dtype=torch.float32),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    (
        q,
        k,
        v,
        add,
        keep,
        den,
        alpha,
        ent,
        scale,
        num_prefix,
        grid_w,
        clamp,
        entmax,
        tf32,
        _store_og,
        *window,
    ) = inputs
    out, stat, og, live = output
    ctx.scalars = (scale, num_prefix, grid_w, clamp, entmax, tf32)
    ctx.window = list(window[0]) if window else []
    saved = og if entmax or ent is not None else out
    ctx.save_for_backward(saved, stat, live, q, k, v, add, keep, den, alpha, ent)
    ctx.mark_non_differentiable(stat, og, live)
    ctx.set_materialize_grads(False)


def _attention_backward(ctx: Any, grad_out: torch.Tensor | None, *_stat_og_live: Any) -> tuple[Any, ...]:
    """``attention_fwd``'s autograd formula: the gradients of its 16 inputs through ``attention_bwd``."""
    return _input_grads(ctx, grad_out, attention_bwd)


def _input_grads(ctx: Any, grad_out: torch.Tensor | None, bwd: Callable[..., Any]) -> tuple[Any, ...]:
    """The gradients of the 16 inputs of ``attention_fwd`` from the context :func:`_setup_context` filled,
    the backward computed by ``bwd`` (the op ``attention_bwd``, or its body :func:`_bwd_body`)."""
    none = (None,) * 16
    if grad_out is None:
        return none
    o_or_og, stat, live, q, k, v, add, keep, den, alpha, ent = ctx.saved_tensors
    need = ctx.needs_input_grad
    add_grad = add is not None and need[3]
    gauss_grad = den is not None and (need[5] or need[6])
    ent_grad = ent is not None and need[7]
    grads = (add_grad, gauss_grad, ent_grad)
    dq, dk, dv, dadd, dden, dalpha, dent = bwd(
        grad_out, o_or_og, stat, live, q, k, v, add, keep, den, alpha, ent, *ctx.scalars, *grads, ctx.window
    )
    return (
        dq,
        dk,
        dv,
        dadd.to(add.dtype) if add_grad else None,
        None,
        dden if gauss_grad else None,
        dalpha if gauss_grad else None,
        dent if ent_grad else None,
        *none[8:],
    )


attention_fwd.register_autograd(_attention_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager calls' autograd: the same forward (:func:`_fwd_body`), saved context
    (:func:`_setup_context`) and gradients (:func:`_input_grads` through :func:`_bwd_body`) as the ops',
    without the custom ops' dispatch (torch's wrapper of a custom op with autograd cost about 150 us of
    host time per call; docs/kernels.md, "Host time per call")."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, ...]:
        output = _fwd_body(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, *_stat_og_live: Any) -> tuple[Any, ...]:
        return _input_grads(ctx, grad_out, _bwd_body)


def _plain_eager(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether a call may skip the custom ops: not traced by ``torch.compile``, no Python dispatch mode
    active (``FakeTensorMode``, FLOP counters: they see the op) and only plain tensors."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def attention_call(*inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, stat, og, live)`` of :data:`attention_fwd` for its 16 arguments (:func:`_fwd_body`'s, all
    given), differentiable as it is: through the custom op under ``torch.compile``, a dispatch mode or
    tensor subclasses; else, eagerly, the op's body under :class:`_EagerAttention` when a gradient is
    recorded, or the body alone."""
    if len(inputs) != 16:
        raise TypeError(f"attention_call takes attention_fwd's 16 arguments, got {len(inputs)}")
    tensors = inputs[:8]  # q, k, v, add, keep, den, alpha, ent
    if not _plain_eager(tensors):
        return attention_fwd(*inputs)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _EagerAttention.apply(*inputs)
    return _fwd_body(*inputs)
