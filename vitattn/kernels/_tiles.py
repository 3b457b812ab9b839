"""The key (or query) tiles a kernel's inner loop visits: every tile, or a compact list of live tiles
(block sparsity: the entmax-1.5 output pass and backward, neighbourhood windows), as a small change to the
loop header: ``n_iter, row = tile_list(...)`` before the loop, ``tile = tile_index(row, it, ...)`` in it,
and ``coords_jump`` for the Gaussian coordinates of a tile that does not follow the previous one; and
``listed_scores``, the scores of one visited key tile in every pass of the list forward kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import _coords_advance, _kv, _qv, _score_tile, load_tile_at, warp_uniform


@triton.jit
def tile_list(
    LIST,
    CNT,
    n_list_cols,
    bh,
    n_programs,
    n_inner,
    BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    UNIFORM: tl.constexpr = False,
):
    """``(n_iter, list_row)`` of this program's inner loop: with ``SPARSE`` its live tiles (``CNT[bh,
    program]`` of them, listed in ``LIST[bh, program, :]``, int32 ``(B * H, n_programs, n_list_cols)``;
    the count marked warp-uniform with ``UNIFORM``: :func:`warp_uniform`), else every tile of ``n_inner``
    rows or keys."""
    if SPARSE:
        slot = (n_programs * bh + tl.program_id(0)).to(tl.int64)
        return warp_uniform(tl.load(CNT + slot), UNIFORM), LIST + slot * n_list_cols
    else:
        return tl.cdiv(n_inner, BLOCK), LIST


@triton.jit
def tile_index(list_row, it, SPARSE: tl.constexpr):
    """The inner loop's ``it``-th tile: the ``it``-th live one with ``SPARSE``, else ``it``."""
    if SPARSE:
        return tl.load(list_row + it)
    else:
        return it


# 2^23 as float32 bits: an integer 0 <= i < 2^23 in the low mantissa bits of 2^23 + i
EXACT_INT_BITS: tl.constexpr = tl.constexpr(0x4B000000)
EXACT_INT: tl.constexpr = tl.constexpr(8388608.0)


@triton.jit
def small_int_to_float(i):
    """``float(i)`` for an int32 ``0 <= i < 2^23`` without a conversion instruction (``I2F``): the bits of
    ``2^23 + i``, minus ``2^23`` (exact)."""
    return (i + EXACT_INT_BITS).to(tl.float32, bitcast=True) - EXACT_INT


@triton.jit
def coords_jump(r0, c0, tile, BLOCK: tl.constexpr, gw):
    """The Gaussian coordinates of tile ``tile`` (tokens from ``tile * BLOCK``), from those of tile 0 (a
    listed tile is not the previous one plus one). In float arithmetic on integers (no integer division,
    which compiles to a float reciprocal with conversions): ``row = floor((start + 1/2) / gw)`` is exact
    while ``start < 2^21`` (its rounding stays below ``1/(2 gw)``, the distance to the next integer), and
    ``col = start - row gw``."""
    start = small_int_to_float(tile) * BLOCK
    step_r = tl.floor((start + 0.5) / gw)
    return _coords_advance(r0, c0, step_r, start - step_r * gw, gw)


@triton.jit
def window_rows(WIN, offs, n):
    """``(r0, r1, c0, c1)`` of the queries ``offs``: the first and last grid row and column of each query's
    window (``windows.window_bounds``: float32 ``(4, n)``; padded queries keep everything)."""
    ok = offs < n
    r0 = tl.load(WIN + offs, mask=ok, other=float("-inf"))
    r1 = tl.load(WIN + n + offs, mask=ok, other=float("inf"))
    c0 = tl.load(WIN + 2 * n + offs, mask=ok, other=float("-inf"))
    c1 = tl.load(WIN + 3 * n + offs, mask=ok, other=float("inf"))
    return r0, r1, c0, c1


@triton.jit
def _on_subgrid(offset, dilation):
    """``offset`` (an integer in float, ``>= 0``) is a multiple of ``dilation``: ``round(offset / d) d``
    equals it (``offset / d`` within a few ulps of an integer rounds to it; ``inf`` stays ``inf``)."""
    return tl.floor(offset * (1.0 / dilation) + 0.5) * dilation == offset


@triton.jit
def window_keep(r0, r1, c0, c1, kr, kc, d_r, d_c, TRANS: tl.constexpr, DILATED: tl.constexpr):
    """The window's keep-mask of a tile: key ``(kr, kc)`` (float grid coordinates, a negative row for a
    prefix key, kept by every query) in the query's row and column ranges (:func:`window_rows`), on its
    sub-grid when ``DILATED``. Queries along rows (columns if ``TRANS``). No integer, no table: a few
    compares per score."""
    kr_t = _kv(kr, TRANS)
    kc_t = _kv(kc, TRANS)
    r0_t = _qv(r0, TRANS)
    c0_t = _qv(c0, TRANS)
    keep = (kr_t >= r0_t) & (kr_t <= _qv(r1, TRANS)) & (kc_t >= c0_t) & (kc_t <= _qv(c1, TRANS))
    if DILATED:
        keep = keep & _on_subgrid(kr_t - r0_t, d_r) & _on_subgrid(kc_t - c0_t, d_c)
    return keep | (kr_t < 0.0)


# ---- the list forward kernels' key tile (softmax_lists, entmax15, entmax_alpha) -------------------------


@triton.jit
def listed_scores(
    q,
    k_base,
    k_tile,
    start_n,
    offs_m,
    offs_d,
    n_q,
    n_k,
    head_d,
    scale,
    unit,
    masks,
    gq,
    kr,
    kc,
    win,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    DILATED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFS32: tl.constexpr,
):
    """``(z, offs_n)``: the key tile of ``BLOCK_N`` keys from ``start_n`` loaded and scored against the query
    tile ``q`` (:func:`~vitattn.kernels._common._score_tile` in the normalizer's ``unit``), ``-inf`` outside
    the window (``WINDOW``). ``masks = (add_base, s_am, s_an, keep_base, s_mm, s_mn)``, ``gq = (qr, qc, cr,
    fr, cc, fc, alpha)`` (alpha in ``unit``), ``win = (r0, r1, c0, c1, d_r, d_c)`` (:func:`window_rows`, the
    dilations); ``kr, kc`` the tile's key coordinates. Every pass of the list forward kernels calls it once
    per visited tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_tile_at(k_base, start_n, k_tile, offs_n, offs_d, n_k, head_d, EVEN_N, EVEN_D, OFFS32)
    add_base, s_am, s_an, keep_base, s_mm, s_mn = masks
    qr, qc, cr, fr, cc, fc, alpha = gq
    z, _e = _score_tile(q, k, offs_m, offs_n, n_q, n_k, scale, unit, add_base, s_am, s_an, keep_base, s_mm,
                        s_mn, qr, qc, cr, fr, cc, fc, alpha, kr, kc, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, False,
                        EVEN_M, EVEN_N)  # fmt: skip
    if WINDOW:
        r0, r1, c0, c1, d_r, d_c = win
        z = tl.where(window_keep(r0, r1, c0, c1, kr, kc, d_r, d_c, False, DILATED), z, float("-inf"))
    return z, offs_n
