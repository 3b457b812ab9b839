"""Forward kernel of fused softmax attention over compact key-tile lists: a neighbourhood window (its
key tiles per query tile, :mod:`.windows`), flash-style tiling and online softmax. Without a window the
softmax forward is :mod:`.softmax` (grid-aligned Gaussian tiles, the bias factorised per tile, TMA); here
the Gaussian bias is built per score (two ``exp2`` per score with softmax's own,
:func:`~vitattn.kernels._common.gauss_tile`), and the per-row rescaling factor is computed on the FMA
units (:func:`~vitattn.kernels._common.exp2_fma`).

Saved for backward: ``STAT`` = the row log-sum-exp ``lse = m + log l`` (natural log), float32
``(B, H, Nq)``; ``+inf`` for a row whose keys are all masked (its output row is 0). The backward
(:mod:`.backward_lists`) recomputes ``p = exp(z - lse)`` tile by tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    _coords_advance,
    _coords_start,
    _coords_step,
    _dot,
    _fwd_prologue,
    _store_tile,
    exp2_fma,
    load_tile_at,
    row_partial_sums,
    tile_offsets,
)
from ._tiles import coords_jump, listed_scores, tile_index, tile_list, window_rows


@triton.jit
def _fwd_softmax_kernel(
    Q,
    K,
    V,
    O,
    STAT,
    ADD,
    KEEP,
    DEN,
    ALPHA,
    s_qb,
    s_qh,
    s_qm,
    s_qd,
    s_kb,
    s_kh,
    s_kn,
    s_kd,
    s_vb,
    s_vh,
    s_vn,
    s_vd,
    s_ab,
    s_ah,
    s_am,
    s_an,
    s_mb,
    s_mh,
    s_mm,
    s_mn,
    s_db,
    s_dh,
    s_dp,
    s_dc,
    s_alb,
    s_alh,
    s_alp,
    n_heads,
    n_q,
    n_k,
    head_d,
    head_dv,
    scale,
    num_prefix,
    grid_w,
    clamp,
    WLIST,
    WCNT,
    n_wcols,
    WIN,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROW_PARTS: tl.constexpr = 8,
    UNIFORM: tl.constexpr = False,
    OFFS32: tl.constexpr = False,
):
    """``O[b, h, rows] = softmax(z) V`` and ``STAT = lse`` for one block of query rows.

    Shapes: Q ``(B, H, Nq, D)``, K ``(B, H, Nk, D)``, V ``(B, H, Nk, Dv)`` (any strides); O contiguous
    ``(B, H, Nq, Dv)``; STAT contiguous float32 ``(B, H, Nq)``. ``WINDOW``: a neighbourhood window, whose
    key tiles per query tile are listed in ``WLIST`` / ``WCNT`` (``windows.window_tiles``, shared by every
    (b, h)) and whose table ``WIN`` (``windows.window_table``: per query its window's bounds, per key its
    window coordinates) masks the scores inside a kept tile (:func:`~vitattn.kernels._tiles.window_out`).
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)  # the row sums' partial sums (row_partial_sums)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    prologue = _fwd_prologue(Q, K, V, ADD, KEEP, DEN, ALPHA, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_vb, s_vh,
                             s_ab, s_ah, s_mb, s_mh, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, n_heads,
                             n_q, head_d, num_prefix, grid_w, clamp, GAUSS, BLOCK_M, BLOCK_D, BLOCK_DV,
                             EVEN_M, EVEN_D)  # fmt: skip
    bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, qr, qc, cr, fr, cc, fc, alpha = (
        prologue
    )
    # a key tile's offsets from its first key (the tiles' loads add them to a scalar pointer)
    k_tile = tile_offsets(tl.arange(0, BLOCK_N), offs_d, s_kn, s_kd, OFFS32)
    v_tile = tile_offsets(tl.arange(0, BLOCK_N), offs_dv, s_vn, s_vd, OFFS32)
    # every tile is in base 2: log2(e) folded once into the scale and the Gaussian amplitude
    alpha2 = alpha * LOG2E
    kr, kc = _coords_start(tl.arange(0, BLOCK_N), num_prefix, grid_w)
    step_r, step_c, gw = _coords_step(BLOCK_N, grid_w)
    kr0, kc0 = kr, kc
    ctr_r, half_r, ctr_c, half_c = 0.0, 0.0, 0.0, 0.0
    if WINDOW:
        ctr_r, half_r, ctr_c, half_c = window_rows(WIN, offs_m, n_q)
    n_iter, wrow = tile_list(WLIST, WCNT, n_wcols, 0, tl.cdiv(n_q, BLOCK_M), n_k, BLOCK_N, WINDOW, UNIFORM)
    masks = (add_base, s_am, s_an, keep_base, s_mm, s_mn)  # listed_scores' operands
    gq = (qr, qc, cr, fr, cc, fc, alpha2)
    win = (ctr_r, half_r, ctr_c, half_c, WIN)
    for it in range(0, n_iter):
        tile = tile_index(wrow, it, WINDOW)
        start_n = tile * BLOCK_N
        if WINDOW and GAUSS:  # a listed tile's grid coordinates (the Gaussian bias')
            kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
        z, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d, scale,
                                  LOG2E, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, WINDOW,
                                  EVEN_M, EVEN_N, EVEN_D, BLOCK_N, OFFS32)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(z - m_safe[:, None])
        corr = exp2_fma(m_i - m_safe)  # per row, off the exp unit (m_i = -inf gives 0)
        l_i = l_i * corr[:, None] + row_partial_sums(p, BLOCK_M, BLOCK_N, ROW_PARTS)
        v = load_tile_at(v_base, start_n, v_tile, offs_n, offs_dv, n_k, head_dv, EVEN_N, EVEN_D, OFFS32)
        acc = acc * corr[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
        m_i = m_new
        if GAUSS and not WINDOW:
            kr, kc = _coords_advance(kr, kc, step_r, step_c, gw)

    l_i = tl.sum(l_i, 1)
    dead = l_i == 0.0
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    # the natural log-sum-exp: m_i is in base 2
    lse = tl.where(dead, float("inf"), (m_i + tl.log2(tl.where(dead, 1.0, l_i))) / LOG2E)
    row = bh.to(tl.int64) * n_q
    _store_tile(O + row * head_dv, out, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
    if EVEN_M:
        tl.store(STAT + row + offs_m, lse)
    else:
        tl.store(STAT + row + offs_m, lse, mask=offs_m < n_q)
