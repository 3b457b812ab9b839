"""Forward kernel of fused softmax attention (flash-style tiling, online softmax).

One program computes ``BLOCK_M`` query rows of one ``(b, h)``: it streams the keys in ``BLOCK_N`` blocks,
keeps the running row max ``m`` and sum ``l`` and rescales the output accumulator, so nothing of size
``Nq x Nk`` is ever stored. The key loop has no data-dependent branch (its K / V loads pipeline) and
one ``exp2`` per score. As in the Triton tutorial's kernel, the scale is applied in the multiply-add that
also subtracts the row max (``s * su - m``), and the rescale of the running sums is one ``exp2`` per row.

With a Gaussian bias the keys are visited in grid-aligned tiles (see ``_common``, "grid-aligned key
tiles"): the column factors of the query block are computed once per chunk of grid columns, the row
factors once per tile (one ``exp2`` per query row and tile row), and the bias costs one multiply-add per
score (:func:`~vitattn.kernels._common.add_outer`). Prefix keys are visited first, in tiles of their own,
without bias; the tiles of whole grid rows (or, without a bias, of ``BLOCK_N`` whole keys) run in a loop
without bounds checks and a last partial tile after it.

Saved for backward: ``STAT`` = the row log-sum-exp in base 2, ``lse2 = m + log2 l`` (``m`` the row max
of the base-2 scores), float32 ``(B, H, Nq)``; ``+inf`` for a row whose keys are all masked (its output
row is 0). The backward recomputes ``p = 2^(z log2(e) - lse2)`` tile by tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    _dot,
    _fwd_prologue,
    _load_kv,
    _qk_tile,
    _store_tile,
    _tile_ptrs,
    add_outer,
    col_factors,
    key_slots,
    row_factors,
    row_partial_sums,
)


@triton.jit
def _fwd_tile(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    ok,
    offs_m,
    offs_n,
    n_q,
    n_k,
    scale,
    su,
    add_base,
    s_am,
    s_an,
    keep_base,
    s_mm,
    s_mn,
    r,
    c,
    BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NR: tl.constexpr,
    TILE_W: tl.constexpr,
    ROW_PARTS: tl.constexpr,
):
    """One key tile (``k``, ``v``) of the online softmax: ``(acc, m, l)`` updated. ``ok``: the tile's valid
    keys (``MASKED``); ``r``, ``c``: the bias factors of :func:`add_outer` (``BIAS``). Scores in units of
    ``q kᵀ`` until the multiply-add ``s * su - m`` (``su = scale * log2(e)``, ``m`` the base-2 row max)."""
    s = _qk_tile(
        q, k, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
        HAS_ADD, HAS_KEEP, F32_DOT, False, EVEN_M, not MASKED,
    )  # fmt: skip
    if BIAS:
        s = add_outer(s, r, c, BLOCK_M, NR, TILE_W, False)
    if MASKED:
        s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * su)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp2(s * su - m_safe[:, None])
    corr = tl.exp2(m_i - m_safe)  # m_i = -inf gives 0
    l_i = l_i * corr[:, None] + row_partial_sums(p, BLOCK_M, NR * TILE_W, ROW_PARTS)
    acc = acc * corr[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
    return acc, m_new, l_i


@triton.jit
def _grid_kv(
    KT,
    VT,
    KG,
    VG,
    k_ptrs,
    v_ptrs,
    ok,
    d_ok,
    dv_ok,
    b_idx,
    h_idx,
    tile,
    col0,
    key0,
    row_w,
    GAUSS: tl.constexpr,
    KV_TMA: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NR: tl.constexpr,
):
    """The K and V tiles of key tile ``tile`` of the main loop: by TMA (``KV_TMA``) from the grid view
    ``KG``, ``VG`` (``NR`` grid rows from row ``tile * NR``, columns from ``col0``; with ``GAUSS``) or the
    flat ``KT``, ``VT`` (keys from ``tile * BLOCK_N``), else through the pointers (:func:`_load_kv`,
    ``ok`` masking the keys if ``MASKED``). A Gaussian tile of one whole grid row of an unpadded grid
    (``NR == 1``, not ``MASKED``) is ``BLOCK_N`` consecutive keys from ``key0 + tile * row_w`` (``key0``
    the chunk's first key): it takes the flat descriptors, whose 4-D loads take fewer instructions."""
    if KV_TMA:
        if GAUSS and NR == 1 and not MASKED:
            k = tl.reshape(KT.load([b_idx, h_idx, key0 + tile * row_w, 0]), (BLOCK_N, BLOCK_D))
            v = tl.reshape(VT.load([b_idx, h_idx, key0 + tile * row_w, 0]), (BLOCK_N, BLOCK_DV))
        elif GAUSS:
            k = tl.reshape(KG.load([b_idx, h_idx, tile * NR, col0, 0]), (BLOCK_N, BLOCK_D))
            v = tl.reshape(VG.load([b_idx, h_idx, tile * NR, col0, 0]), (BLOCK_N, BLOCK_DV))
        else:
            k = tl.reshape(KT.load([b_idx, h_idx, tile * BLOCK_N, 0]), (BLOCK_N, BLOCK_D))
            v = tl.reshape(VT.load([b_idx, h_idx, tile * BLOCK_N, 0]), (BLOCK_N, BLOCK_DV))
        return k, v
    return _load_kv(k_ptrs, v_ptrs, ok, d_ok, dv_ok, MASKED, EVEN_D)


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
    KT,
    VT,
    KG,
    VG,
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
    grid_h,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    GWP: tl.constexpr,
    PAD_W: tl.constexpr,
    KV_TMA: tl.constexpr,
    GRID_TW: tl.constexpr = 16,
    ROW_PARTS: tl.constexpr = 8,
):
    """``O[b, h, rows] = softmax(z) V`` and ``STAT = lse`` for one block of query rows.

    Shapes: Q ``(B, H, Nq, D)``, K ``(B, H, Nk, D)``, V ``(B, H, Nk, Dv)`` (any strides); O contiguous
    ``(B, H, Nq, Dv)``; STAT contiguous float32 ``(B, H, Nq)``. ``GWP``: the padded grid width of the
    Gaussian bias (a power of two >= ``grid_w``); ``PAD_W``: ``grid_w < GWP`` (slots past the grid width
    are masked); ``grid_h``: the grid rows of the patch keys, ``(Nk - num_prefix) // grid_w`` (given: a
    division is no uniform-register operation, and a loop bound in a vector register makes every TMA
    load's address a vector one); ``GRID_TW``: ``TILE_W``, the grid columns of a key tile
    (``configs.grid_tile_w``; unused without a bias). ``EVEN_N``: no prefix keys and no partial tile (the
    grid rows fill whole tiles; without a bias, ``Nk`` is a multiple of ``BLOCK_N``). ``KV_TMA``: K and V
    tiles by TMA (sm_90) through the tensor descriptors ``KT``, ``VT`` (``(B, H, Nk, D)``, blocks of
    ``BLOCK_N`` keys) and, with a Gaussian bias, ``KG``, ``VG`` (the patch keys as ``(B, H, gh, gw, D)``,
    blocks of ``NR`` grid rows x ``TILE_W`` columns; past the grid width or height they read zeros); else
    through pointers (``K``, ``V``). ``ROW_PARTS``: the row sums' partial sums (:func:`row_partial_sums`).
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)  # the row sums' partial sums (row_partial_sums)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, qr, qc, cr, fr, cc, fc, alpha = (
        _fwd_prologue(
            Q,
            K,
            V,
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
            s_vb,
            s_vh,
            s_ab,
            s_ah,
            s_mb,
            s_mh,
            s_db,
            s_dh,
            s_dp,
            s_dc,
            s_alb,
            s_alh,
            s_alp,
            n_heads,
            n_q,
            head_d,
            num_prefix,
            grid_w,
            clamp,
            GAUSS,
            BLOCK_M,
            BLOCK_D,
            BLOCK_DV,
            EVEN_M,
            EVEN_D,
        )
    )
    su = scale * LOG2E  # scores in units of q kᵀ until exp2(s * su - m)
    d_ok = offs_d < head_d
    dv_ok = offs_dv < head_dv
    if GAUSS:
        TILE_W: tl.constexpr = GRID_TW
        CH: tl.constexpr = GWP // TILE_W
        row_w = grid_w
        n_rows = grid_h  # given, not (n_k - num_prefix) // grid_w: a division is no uniform-register op
        first = num_prefix
        amp = alpha / scale
    else:
        TILE_W: tl.constexpr = BLOCK_N  # type: ignore[no-redef]
        CH: tl.constexpr = 1  # type: ignore[no-redef]
        row_w = BLOCK_N
        n_rows = n_k // BLOCK_N
        first = 0
        amp = 0.0
    NR: tl.constexpr = BLOCK_N // TILE_W
    slot_off, col = key_slots(BLOCK_N, TILE_W, row_w)

    b_idx = bh // n_heads
    h_idx = bh % n_heads
    if GAUSS and not EVEN_N:  # the prefix keys: tiles of their own, no bias
        for t0 in range(0, num_prefix, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            if KV_TMA:
                k = tl.reshape(KT.load([b_idx, h_idx, t0, 0]), (BLOCK_N, BLOCK_D))
                v = tl.reshape(VT.load([b_idx, h_idx, t0, 0]), (BLOCK_N, BLOCK_DV))
            else:
                k_ptrs = _tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd)
                v_ptrs = _tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd)
                k, v = _load_kv(k_ptrs, v_ptrs, offs_n < num_prefix, d_ok, dv_ok, True, EVEN_D)
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k, v, offs_n < num_prefix, offs_m, offs_n, n_q, n_k, scale, su,
                add_base, s_am, s_an, keep_base, s_mm, s_mn, 0.0, 0.0,
                False, HAS_ADD, HAS_KEEP, F32_DOT, True, EVEN_M, BLOCK_M, NR, TILE_W, ROW_PARTS,
            )  # fmt: skip

    n_main = n_rows // NR  # tiles of whole rows
    step = NR * row_w
    for ch in tl.static_range(CH):
        c = 0.0
        if GAUSS:
            c, _t_c = col_factors(qc, cc, fc, ch * TILE_W * 1.0, TILE_W, False)
            c = c * amp[:, None]  # the bias in units of q kᵀ: alpha / scale R C
        ok = (ch * TILE_W + col) < row_w  # slots inside the grid width (all of them unless PAD_W)
        offs_n = first + ch * TILE_W + slot_off
        k_ptrs = _tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd)
        v_ptrs = _tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd)
        k_step = tl.cast(step, tl.int64) * s_kn
        v_step = tl.cast(step, tl.int64) * s_vn
        a0 = 0.0  # the tile's first grid row, carried in float
        for i in range(n_main):
            r = 0.0
            if GAUSS:
                r, _t_r = row_factors(qr - a0, cr, fr, NR)
            k, v = _grid_kv(
                KT, VT, KG, VG, k_ptrs, v_ptrs, ok, d_ok, dv_ok, b_idx, h_idx, i, ch * TILE_W,
                first + ch * TILE_W, row_w, GAUSS, KV_TMA, PAD_W, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV, NR,
            )  # fmt: skip
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, k, v, ok, offs_m, offs_n, n_q, n_k, scale, su,
                add_base, s_am, s_an, keep_base, s_mm, s_mn, r, c,
                GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, PAD_W, EVEN_M, BLOCK_M, NR, TILE_W, ROW_PARTS,
            )  # fmt: skip
            k_ptrs += k_step
            v_ptrs += v_step
            offs_n += step
            a0 += NR
        if not EVEN_N:  # the last, partial tile: rows past the grid (or keys past Nk) masked
            if first + n_main * step < n_k:
                r = 0.0
                if GAUSS:
                    r, _t_r = row_factors(qr - a0, cr, fr, NR)
                ok_t = ok & (offs_n < n_k)
                k, v = _grid_kv(
                    KT, VT, KG, VG, k_ptrs, v_ptrs, ok_t, d_ok, dv_ok, b_idx, h_idx, n_main, ch * TILE_W,
                    first + ch * TILE_W, row_w, GAUSS, KV_TMA, True, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV, NR,
                )  # fmt: skip
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, k, v, ok_t, offs_m, offs_n, n_q, n_k, scale, su,
                    add_base, s_am, s_an, keep_base, s_mm, s_mn, r, c,
                    GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, True, EVEN_M, BLOCK_M, NR, TILE_W, ROW_PARTS,
                )  # fmt: skip

    l_i = tl.sum(l_i, 1)  # the row sums
    dead = l_i == 0.0
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    # the log-sum-exp in base 2 (the unit of the backward's exp2(s * su - lse))
    lse = tl.where(dead, float("inf"), m_i + tl.log2(tl.where(dead, 1.0, l_i)))
    row = bh.to(tl.int64) * n_q
    _store_tile(O + row * head_dv, out, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
    if EVEN_M:
        tl.store(STAT + row + offs_m, lse)
    else:
        tl.store(STAT + row + offs_m, lse, mask=offs_m < n_q)
