"""The key (or query) tiles a kernel's inner loop visits: every tile, or a compact list of live tiles
(block sparsity: the entmax-1.5 output pass and backward, neighbourhood windows), as a small change to the
loop header: ``n_iter, row = tile_list(...)`` before the loop, ``tile = tile_index(row, it, ...)`` in it,
and ``coords_jump`` for the Gaussian coordinates of a tile that does not follow the previous one; and
``listed_scores``, the scores of one visited key tile in every pass of the list forward kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    _coords_advance,
    _kv,
    _qk_tile,
    _qv,
    _score_tile,
    _tile_ptrs,
    add_outer,
    col_factors,
    load_tile_at,
    row_factors,
    warp_uniform,
)


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
        return listed(LIST, CNT, n_list_cols, n_programs * bh + tl.program_id(0), UNIFORM)
    else:
        return tl.cdiv(n_inner, BLOCK), LIST


@triton.jit
def listed(LIST, CNT, n_list_cols, slot, UNIFORM: tl.constexpr = False):
    """``(count, row)`` of list ``slot``: ``CNT[slot]`` tiles listed in ``LIST[slot, :]`` (int32
    ``(lists, n_list_cols)``), the count marked warp-uniform with ``UNIFORM``."""
    slot = slot.to(tl.int64)
    return warp_uniform(tl.load(CNT + slot), UNIFORM), LIST + slot * n_list_cols


@triton.jit
def listed_with_last(LIST, CNT, n_list_cols, slot, last, UNIFORM: tl.constexpr = False):
    """``(count, row, has_last)``: list ``slot`` as :func:`listed` without its tile ``last`` (the largest
    index a list may hold: a partial tile the loop visits apart, with bound masks) and whether it was
    listed (a list is in increasing order)."""
    slot = slot.to(tl.int64)
    row = LIST + slot * n_list_cols
    count = tl.load(CNT + slot)
    has_last = (count > 0) & (tl.load(row + tl.maximum(count - 1, 0)) == last)
    return warp_uniform(count - has_last.to(tl.int32), UNIFORM), row, has_last


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
def coords_start_small(offs, num_prefix, grid_w):
    """:func:`_common._coords_start` of tokens ``offs`` below 2^23, in 32-bit integers converted by
    :func:`small_int_to_float` (no ``I2F``, no 64-bit division held beside the loop)."""
    lift = (num_prefix + grid_w - 1) // grid_w
    idx = offs.to(tl.int32) - num_prefix + lift * grid_w
    row = idx // grid_w
    return small_int_to_float(row) - lift.to(tl.float32), small_int_to_float(idx - row * grid_w)


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
    """``(ctr_r, half_r, ctr_c, half_c)`` of the queries ``offs``: the centre and the half-width plus 1/2
    of each query's window, in window coordinates, along the rows and the columns
    (``windows.window_table`` rows 0-3, float32 ``(6, n)``; padded queries keep everything)."""
    ok = offs < n
    ctr_r = tl.load(WIN + offs, mask=ok, other=0.0)
    half_r = tl.load(WIN + n + offs, mask=ok, other=float("inf"))
    ctr_c = tl.load(WIN + 2 * n + offs, mask=ok, other=0.0)
    half_c = tl.load(WIN + 3 * n + offs, mask=ok, other=float("inf"))
    return ctr_r, half_r, ctr_c, half_c


@triton.jit
def window_cols(WIN, offs, n):
    """``(wr, wc)`` of the keys ``offs``: their own row and column window coordinates
    (``windows.window_table`` rows 4-5; NaN for a prefix key and past ``n``)."""
    ok = offs < n
    wr = tl.load(WIN + 4 * n + offs, mask=ok, other=float("nan"))
    wc = tl.load(WIN + 5 * n + offs, mask=ok, other=float("nan"))
    return wr, wc


@triton.jit
def window_penalty(ctr_r, half_r, ctr_c, half_c, wr, wc, TRANS: tl.constexpr):
    """A tile's window test as a float: ``max(|wr - ctr_r| - half_r, |wc - ctr_c| - half_c)``, at most
    -1/2 where the key (window coordinates ``wr, wc``: :func:`window_cols`) lies in its query's window
    (:func:`window_rows`), at least 1/2 outside, NaN for a prefix key. The coordinates fold a dilation in
    (``windows``: one range test per axis, no sub-grid test). Queries along rows (columns if ``TRANS``).
    Two subtractions per axis and a maximum per score, no predicate: a tile of compares' results does not
    fit the predicate registers, and ptxas packed them into general registers and back."""
    d_r = tl.abs(_kv(wr, TRANS) - _qv(ctr_r, TRANS)) - _qv(half_r, TRANS)
    d_c = tl.abs(_kv(wc, TRANS) - _qv(ctr_c, TRANS)) - _qv(half_c, TRANS)
    return tl.maximum(d_r, d_c)


@triton.jit
def window_mask(z, penalty):
    """``z`` with ``-inf`` outside the window (``penalty`` from :func:`window_penalty`): ``min(z, -inf *
    penalty)`` is ``z`` inside (``+inf``) and ``-inf`` outside; a prefix key's NaN keeps ``z`` (the
    minimum ignores a NaN operand, on the GPU and in the interpreter). A multiply and a minimum."""
    return tl.minimum(z, penalty * float("-inf"))


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
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFS32: tl.constexpr,
):
    """``(z, offs_n)``: the key tile of ``BLOCK_N`` keys from ``start_n`` loaded and scored against the query
    tile ``q`` (:func:`~vitattn.kernels._common._score_tile` in the normalizer's ``unit``), ``-inf`` outside
    the window (``WINDOW``). ``masks = (add_base, s_am, s_an, keep_base, s_mm, s_mn)``, ``gq = (qr, qc, cr,
    fr, cc, fc, alpha)`` (alpha in ``unit``), ``win = (ctr_r, half_r, ctr_c, half_c, WIN)`` (the queries'
    windows, :func:`window_rows`, and the window table whose key coordinates :func:`window_cols` loads);
    ``kr, kc`` the tile's key grid coordinates (the Gaussian bias'). Every pass of the list forward
    kernels calls it once per visited tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_tile_at(k_base, start_n, k_tile, offs_n, offs_d, n_k, head_d, EVEN_N, EVEN_D, OFFS32)
    add_base, s_am, s_an, keep_base, s_mm, s_mn = masks
    qr, qc, cr, fr, cc, fc, alpha = gq
    z, _e = _score_tile(q, k, offs_m, offs_n, n_q, n_k, scale, unit, add_base, s_am, s_an, keep_base, s_mm,
                        s_mn, qr, qc, cr, fr, cc, fc, alpha, kr, kc, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, False,
                        EVEN_M, EVEN_N)  # fmt: skip
    if WINDOW:
        ctr_r, half_r, ctr_c, half_c, WIN = win
        wr, wc = window_cols(WIN, offs_n, n_k)
        z = window_mask(z, window_penalty(ctr_r, half_r, ctr_c, half_c, wr, wc, False))
    return z, offs_n


# ---- grid-aligned key tiles in the list forward (entmax15): slots of whole grid rows ------------------


@triton.jit
def load_slots(base, tok0, tile, offs_n, ok, offs_c, n_c, MASKED: tl.constexpr, EVEN_C: tl.constexpr,
               OFFS32: tl.constexpr):  # fmt: skip
    """The ``(BLOCK_N, C)`` tile of the key slots ``offs_n`` (tokens; ``tok0`` the first slot's, ``tile``
    their :func:`~vitattn.kernels._common.tile_offsets` from it), columns ``offs_c`` of ``base``: zeros
    where ``ok`` is false (``MASKED``) or past ``n_c`` (unless ``EVEN_C``)."""
    offs, stride_r, stride_c = tile
    if OFFS32:
        ptrs = base + tl.cast(tok0, tl.int64) * stride_r + offs
    else:
        ptrs = _tile_ptrs(base, offs_n, offs_c, stride_r, stride_c)
    if MASKED:
        if EVEN_C:
            return tl.load(ptrs, mask=ok[:, None], other=0.0)
        return tl.load(ptrs, mask=ok[:, None] & (offs_c < n_c)[None, :], other=0.0)
    if EVEN_C:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_c < n_c)[None, :], other=0.0)


@triton.jit
def grid_scores(
    q,
    k_base,
    k_tile,
    tok0,
    offs_n,
    ok,
    offs_m,
    offs_d,
    n_q,
    n_k,
    head_d,
    scale,
    unit,
    masks,
    r,
    c,
    BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NR: tl.constexpr,
    TILE_W: tl.constexpr,
    OFFS32: tl.constexpr,
    SCALED_BIAS: tl.constexpr = False,
):
    """The ``(BLOCK_M, BLOCK_N)`` scores ``z`` of a grid-aligned key tile (``_common``, "grid-aligned key
    tiles") in the normalizer's ``unit``: the key slots ``offs_n`` loaded (:func:`load_slots`), ``q kᵀ``
    plus the masks (``masks`` as in :func:`listed_scores`) times ``scale * unit``, plus the Gaussian bias
    ``r ⊗ c`` (``BIAS``; :func:`~vitattn.kernels._common.add_outer`: one multiply-add per score), ``c`` in
    units of ``q kᵀ`` (added before the scale: a multiply-add the caller's next subtraction fuses with the
    scale's multiply) or, with ``SCALED_BIAS``, of ``z`` (added after it, in the order of the list
    kernels' :func:`~vitattn.kernels._common._score_tile`); ``-inf`` where ``ok`` is false (``MASKED``:
    slots past the grid width or the keys)."""
    k = load_slots(k_base, tok0, k_tile, offs_n, ok, offs_d, head_d, MASKED, EVEN_D, OFFS32)
    add_base, s_am, s_an, keep_base, s_mm, s_mn = masks
    s = _qk_tile(q, k, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
                 HAS_ADD, HAS_KEEP, F32_DOT, False, EVEN_M, not MASKED)  # fmt: skip
    if BIAS and not SCALED_BIAS:
        s = add_outer(s, r, c, BLOCK_M, NR, TILE_W, False)
    z = s * (scale * unit)
    if BIAS and SCALED_BIAS:
        z = add_outer(z, r, c, BLOCK_M, NR, TILE_W, False)
    if MASKED:
        z = tl.where(ok[None, :], z, float("-inf"))
    return z


@triton.jit
def prefix_tile(t, num_prefix, BLOCK_N: tl.constexpr):
    """``(tok0, offs_n, ok)`` of the prefix keys' tile ``t``: its first token, its tokens, and those that
    are prefix keys (the tile has no Gaussian bias)."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    return t * BLOCK_N, offs_n, offs_n < num_prefix


@triton.jit
def grid_chunk(qc, cc, fc, amp, col, ch, grid_w, TILE_W: tl.constexpr):
    """``(c, col_ok)`` of chunk ``ch`` of grid columns: its column factors times ``amp`` (per query row;
    :func:`~vitattn.kernels._common.col_factors`) and which key slots lie inside the grid width (``col``
    from :func:`~vitattn.kernels._common.key_slots`)."""
    c, _t = col_factors(qc, cc, fc, ch * TILE_W * 1.0, TILE_W, False)
    return c * amp[:, None], (ch * TILE_W + col) < grid_w


@triton.jit
def grid_tile(qr, cr, fr, row0, ch, i, slot_off, col_ok, num_prefix, grid_w, n_k, TILE_W: tl.constexpr,
              NR: tl.constexpr):  # fmt: skip
    """``(r, tok0, offs_n, ok)`` of tile ``i`` of chunk ``ch`` (grid rows from ``row0``, a float): its row
    factors (:func:`~vitattn.kernels._common.row_factors`), its first slot's token, its slots' tokens
    (``slot_off`` from :func:`~vitattn.kernels._common.key_slots`) and the slots inside the grid width
    (``col_ok``) and the keys."""
    r, _t = row_factors(qr - row0, cr, fr, NR)
    tok0 = num_prefix + ch * TILE_W + i * (NR * grid_w)
    offs_n = tok0 + slot_off
    return r, tok0, offs_n, col_ok & (offs_n < n_k)
