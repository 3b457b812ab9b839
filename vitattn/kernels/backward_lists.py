"""Backward kernels over compact tile lists: entmax-1.5 (its live tiles), alpha-entmax (a tensor of
alphas) and neighbourhood windows (their tiles), for every bias kind but a Gaussian one without a window.
The softmax backward without a window and the entmaxes' with a Gaussian bias and no window (entmax-1.5's
over lists of its live grid-aligned tiles) are :mod:`.backward` (grid-aligned Gaussian tiles, the bias
factorised per tile); here the Gaussian bias (with a window) is still built per score, from row terms
saved once per query.

With ``dP = dO Vᵀ`` and the saved statistic (see :func:`vitattn.kernels._common._probs`), the score
gradient of every normalizer has one form::

    dZ = g * (dP - delta),   softmax: g = p,            delta = rowsum(dO * O)
                             entmax-1.5: g = sqrt(p),    delta = rowsum(dO * OG),  OG = g V / sum g

Then ``dV = Pᵀ dO``, ``dK = scale dZᵀ Q``, ``dQ = scale dZ K``; the additive mask's gradient is ``dZ``
(reduced over its broadcast dims); the Gaussian bias ``S = alpha e``, ``e = exp(a_row + a_col)``, gives
per query row ``d alpha = sum_t dZ e`` and ``d den_m = -alpha / den_m * sum_t dZ e a_m`` (``a_m`` the
floored per-axis exponent; where the floor binds its derivative is 0 and the kept term is below
``40 e^-40`` of a score's).

Three kernels (the row term is :mod:`.backward`'s ``_bwd_delta_kernel``): ``_bwd_rows_kernel`` (the
Gaussian row terms, once per query), ``_bwd_dkdv_kernel`` (one program per key block, looping over its
listed query tiles) and ``_bwd_dq_kernel`` (one program per query block, looping over its listed key
tiles; it also writes the mask, Gaussian and alpha gradients). The softmax statistic here is the natural
log-sum-exp (:mod:`.softmax_lists`' forward).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    _bases,
    _block_offsets,
    _coords_advance,
    _coords_start,
    _coords_step,
    _dot,
    _kv,
    _load_tile,
    _offset,
    _probs,
    _program,
    _qv,
    _row_stats,
    _score_tile,
    _store_tile,
    _tile_ptrs,
    axis_exponent,
    gauss_rows,
    load_tile_at,
    tile_offsets,
)
from ._tiles import (
    coords_jump,
    coords_start_small,
    tile_index,
    tile_list,
    window_cols,
    window_mask,
    window_penalty,
    window_rows,
)
from .entmax_alpha import alpha_grad, alpha_grad_weights, alpha_powers, alpha_rows


@triton.jit
def _bwd_rows_kernel(
    DEN,
    ALPHA,
    ROWS,
    s_db,
    s_dh,
    s_dp,
    s_dc,
    s_alb,
    s_alh,
    s_alp,
    n_heads,
    n_q,
    num_prefix,
    grid_w,
    clamp,
    BLOCK_M: tl.constexpr,
):
    """The Gaussian row terms of :func:`~vitattn.kernels._common.gauss_rows` for every query of every
    ``(b, h)``, once: ``ROWS`` contiguous float32 ``(B * H, 5, Nq)``, planes ``cr, fr, cc, fc, alpha``.
    The dK/dV kernel reads them per query tile instead of recomputing them (two divisions and a dozen
    operations per query, repeated by every key block)."""
    bh, b, h = _program(n_heads)
    offs_m = _block_offsets(BLOCK_M)
    cr, fr, cc, fc, alpha = gauss_rows(DEN, ALPHA, b, h, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, offs_m,
                                       n_q, num_prefix, grid_w, clamp)  # fmt: skip
    base = ROWS + bh.to(tl.int64) * 5 * n_q + offs_m
    ok = offs_m < n_q
    tl.store(base, cr, mask=ok)
    tl.store(base + n_q, fr, mask=ok)
    tl.store(base + 2 * n_q, cc, mask=ok)
    tl.store(base + 3 * n_q, fc, mask=ok)
    tl.store(base + 4 * n_q, alpha, mask=ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    STAT,
    DELTA,
    ROWS,
    DK,
    DV,
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
    ENT,
    s_eb,
    s_eh,
    s_em,
    LIST,
    CNT,
    n_list_cols,
    list_bh,
    WIN,
    ENTMAX: tl.constexpr,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    SPARSE: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    UNIFORM: tl.constexpr = False,
    OFFS32: tl.constexpr = False,
):
    """``DK``, ``DV`` (contiguous, like K and V) for one block of keys. DO contiguous ``(B, H, Nq, Dv)``.

    Keys are the M dimension of every tile (``k qᵀ``, ``(BLOCK_N, BLOCK_M)``), so ``dV += Pᵀ dO`` and
    ``dK += dSᵀ q`` take the tiles as they come (no transpose of p or dS). The query tile's Gaussian
    terms are loaded from ``ROWS`` (:func:`_bwd_rows_kernel`; DEN and ALPHA are not read here); its
    coordinates are carried from tile to tile in float.
    """
    bh, b, h = _program(n_heads)
    offs_n = _block_offsets(BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d, EVEN_N, EVEN_D)
    v = _load_tile(v_base, offs_n, offs_dv, s_vn, s_vd, n_k, head_dv, EVEN_N, EVEN_D)
    row = bh.to(tl.int64) * n_q
    do_base = DO + row * head_dv
    if ENTMAX == 2:
        unit = 1.0
        stat_unit = 1.0
    elif ENTMAX:
        unit = 0.5
        stat_unit = 1.0
    else:
        unit = LOG2E
        stat_unit = LOG2E
    win_r, win_c = 0.0, 0.0
    if WINDOW:  # this key block's window coordinates (windows.window_table)
        win_r, win_c = window_cols(WIN, offs_n, n_k)
        # the Gaussian coordinates from 32-bit indices: the 64-bit ones left the grid width's sign word
        # spilled beside the window (16x64 at head dim 128, bound masks); without a window the 32-bit form
        # spills the entmax-1.5 dK/dV at 64x64, head dim 64 (8 bytes) instead
        kr, kc = coords_start_small(offs_n, num_prefix, grid_w)
    else:
        kr, kc = _coords_start(offs_n, num_prefix, grid_w)
    qr, qc = _coords_start(tl.arange(0, BLOCK_M), num_prefix, grid_w)
    step_r, step_c, gw = _coords_step(BLOCK_M, grid_w)
    rows_base = ROWS + bh.to(tl.int64) * 5 * n_q

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    n_iter, list_row = tile_list(
        LIST, CNT, n_list_cols, bh * list_bh, tl.cdiv(n_k, BLOCK_N), n_q, BLOCK_M, SPARSE, UNIFORM
    )
    qr0, qc0 = qr, qc
    # a query tile's offsets from its first query (the loads add them to a scalar pointer)
    q_tile = tile_offsets(tl.arange(0, BLOCK_M), offs_d, s_qm, s_qd, OFFS32)
    do_tile = tile_offsets(tl.arange(0, BLOCK_M), offs_dv, head_dv, 1, OFFS32)
    for it in range(0, n_iter):
        tile = tile_index(list_row, it, SPARSE)
        start_m = tile * BLOCK_M
        if SPARSE and GAUSS:
            qr, qc = coords_jump(qr0, qc0, tile, BLOCK_M, gw)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile_at(q_base, start_m, q_tile, offs_m, offs_d, n_q, head_d, EVEN_M, EVEN_D, OFFS32)
        stat, delta = _row_stats(STAT, DELTA, row, offs_m, n_q, EVEN_M)
        if GAUSS:
            ok = offs_m < n_q
            cr = tl.load(rows_base + offs_m, mask=ok, other=0.0)
            fr = tl.load(rows_base + n_q + offs_m, mask=ok, other=0.0)
            cc = tl.load(rows_base + 2 * n_q + offs_m, mask=ok, other=0.0)
            fc = tl.load(rows_base + 3 * n_q + offs_m, mask=ok, other=0.0)
            alpha = tl.load(rows_base + 4 * n_q + offs_m, mask=ok, other=0.0)
        else:
            cr, fr, cc, fc, alpha = 0.0, 0.0, 0.0, 0.0, 0.0
        z_t, _e = _score_tile(k, q, offs_m, offs_n, n_q, n_k, scale, unit, add_base, s_am, s_an, keep_base,
                              s_mm, s_mn, qr, qc, cr, fr, cc, fc, alpha * unit, kr, kc, GAUSS, HAS_ADD,
                              HAS_KEEP, F32_DOT, True, EVEN_M, EVEN_N)  # fmt: skip
        if WINDOW:
            ctr_r, half_r, ctr_c, half_c = window_rows(WIN, offs_m, n_q)
            z_t = window_mask(z_t, window_penalty(ctr_r, half_r, ctr_c, half_c, win_r, win_c, True))
        if ENTMAX == 2:
            a_q, beta_q = alpha_rows(ENT, b, h, s_eb, s_eh, s_em, offs_m, n_q)
            u_t = tl.maximum(z_t * a_q[None, :] - stat[None, :], 0.0)
            p_t, g_t, _l = alpha_powers(u_t, beta_q[None, :])
        else:
            p_t, g_t = _probs(z_t, stat * stat_unit, ENTMAX, True)
        do = load_tile_at(do_base, start_m, do_tile, offs_m, offs_dv, n_q, head_dv, EVEN_M, EVEN_D, OFFS32)
        dv += _dot(p_t.to(do.dtype), do, F32_DOT)
        dp_t = _dot(v, tl.trans(do), F32_DOT)
        ds_t = g_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, F32_DOT)
        if GAUSS and not SPARSE:
            qr, qc = _coords_advance(qr, qc, step_r, step_c, gw)

    if WINDOW:
        # the block's rows as 32-bit offsets from its first key and a 32-bit bound, under a scalar 64-bit
        # base (n_k zero-extended, n_k >= 0): with a window and a Gaussian bias at head dim 128 the 64-bit
        # rows of offs_n and n_k's sign word, held across the loop, spilled (104 B); without a window this
        # form spilled the Gaussian 64x64 tile at head dim 64 instead (8 B), so it keeps the 64-bit rows
        first = tl.program_id(0) * BLOCK_N
        out_row = bh.to(tl.int64) * n_k.to(tl.uint32).to(tl.int64) + first
        rows = tl.arange(0, BLOCK_N)
        n_left = n_k - first
    else:
        out_row = bh.to(tl.int64) * n_k
        rows = offs_n
        n_left = n_k
    _store_tile(DK + out_row * head_d, dk * scale, rows, offs_d, head_d, 1, n_left, head_d, EVEN_N, EVEN_D)
    _store_tile(DV + out_row * head_dv, dv, rows, offs_dv, head_dv, 1, n_left, head_dv, EVEN_N, EVEN_D)


@triton.jit
def _add_grad(
    dadd_base,
    ds,
    offs_m,
    offs_n,
    n_q,
    n_k,
    s_gm,
    s_gn,
    ADD_GRAD: tl.constexpr,
    BCAST_M: tl.constexpr,
    BCAST_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """The additive mask's gradient of one tile: stored (``ADD_GRAD == 1``), or added atomically
    (``2``: the mask broadcasts over B, H or a tile dimension) after summing the tile over the query rows
    (``BCAST_M``) and / or the keys (``BCAST_N``) it broadcasts over. ``ds`` is 0 outside the tile's
    bounds (padded queries have zero probabilities, padded keys ``-inf`` scores)."""
    if ADD_GRAD == 1:
        ptrs = _tile_ptrs(dadd_base, offs_m, offs_n, s_gm, s_gn)
        if EVEN_M and EVEN_N:
            tl.store(ptrs, ds)
        else:
            tl.store(ptrs, ds, mask=(offs_m[:, None] < n_q) & (offs_n[None, :] < n_k))
    elif ADD_GRAD == 2:
        if BCAST_M and BCAST_N:
            tl.atomic_add(dadd_base, tl.sum(tl.sum(ds, 1), 0))
        elif BCAST_M:
            tl.atomic_add(dadd_base + offs_n.to(tl.int64) * s_gn, tl.sum(ds, 0), mask=offs_n < n_k)
        elif BCAST_N:
            tl.atomic_add(dadd_base + offs_m.to(tl.int64) * s_gm, tl.sum(ds, 1), mask=offs_m < n_q)
        else:
            ptrs = _tile_ptrs(dadd_base, offs_m, offs_n, s_gm, s_gn)
            tl.atomic_add(ptrs, ds, mask=(offs_m[:, None] < n_q) & (offs_n[None, :] < n_k))


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    STAT,
    DELTA,
    DQ,
    DADD,
    DDEN,
    DALPHA,
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
    s_gb,
    s_gh,
    s_gm,
    s_gn,
    n_heads,
    n_q,
    n_k,
    head_d,
    head_dv,
    scale,
    num_prefix,
    grid_w,
    clamp,
    ENT,
    DENT,
    s_eb,
    s_eh,
    s_em,
    LIST,
    CNT,
    n_list_cols,
    list_bh,
    WIN,
    ENTMAX: tl.constexpr,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    ADD_GRAD: tl.constexpr,
    GAUSS_GRAD: tl.constexpr,
    ENT_GRAD: tl.constexpr,
    SPARSE: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DADD_BCAST_M: tl.constexpr,
    DADD_BCAST_N: tl.constexpr,
    UNIFORM: tl.constexpr = False,
    OFFS32: tl.constexpr = False,
):
    """``DQ`` (contiguous like Q) for one block of queries, plus the bias gradients.

    ``ADD_GRAD``: 0 = none, 1 = store ``dZ`` into DADD (strides ``s_g*``), 2 = atomically add it (the
    mask broadcasts over some dim, whose stride is 0; ``DADD_BCAST_M`` / ``_N``: over the query rows /
    the keys, summed over the tile first). ``GAUSS_GRAD``: write DDEN contiguous float32
    ``(B, H, Np, 2)`` and DALPHA contiguous float32 ``(B, H, Np)``.
    """
    bh, b, h = _program(n_heads)
    offs_m = _block_offsets(BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = bh.to(tl.int64) * n_q
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    q = _load_tile(q_base, offs_m, offs_d, s_qm, s_qd, n_q, head_d, EVEN_M, EVEN_D)
    do = _load_tile(DO + row * head_dv, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
    stat, delta = _row_stats(STAT, DELTA, row, offs_m, n_q, EVEN_M)
    dadd_base = _offset(DADD, b, h, s_gb, s_gh)
    qr, qc, cr, fr, cc, fc, alpha = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    if GAUSS:
        qr, qc = _coords_start(offs_m, num_prefix, grid_w)
        cr, fr, cc, fc, alpha = gauss_rows(DEN, ALPHA, b, h, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp,
                                           offs_m, n_q, num_prefix, grid_w, clamp)  # fmt: skip
    a, beta = tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M], tl.float32)
    if ENTMAX == 2:
        unit = 1.0
        stat_u = stat
        a, beta = alpha_rows(ENT, b, h, s_eb, s_eh, s_em, offs_m, n_q)
    elif ENTMAX:
        unit = 0.5
        stat_u = stat
    else:
        unit = LOG2E
        stat_u = stat * LOG2E
    kr, kc = _coords_start(tl.arange(0, BLOCK_N), num_prefix, grid_w)
    step_r, step_c, gw = _coords_step(BLOCK_N, grid_w)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    g_alpha = tl.zeros([BLOCK_M], tl.float32)
    g_row = tl.zeros([BLOCK_M], tl.float32)
    g_col = tl.zeros([BLOCK_M], tl.float32)
    e_s = tl.zeros([BLOCK_M], tl.float32)  # alpha's gradient: sum p, sum dZ u (1 - ln2 log2 u)
    e_t = tl.zeros([BLOCK_M], tl.float32)
    n_iter, list_row = tile_list(
        LIST, CNT, n_list_cols, bh * list_bh, tl.cdiv(n_q, BLOCK_M), n_k, BLOCK_N, SPARSE, UNIFORM
    )
    if WINDOW:
        ctr_r, half_r, ctr_c, half_c = window_rows(WIN, offs_m, n_q)
    kr0, kc0 = kr, kc
    # a key tile's offsets from its first key (the loads add them to a scalar pointer)
    k_tile = tile_offsets(tl.arange(0, BLOCK_N), offs_d, s_kn, s_kd, OFFS32)
    v_tile = tile_offsets(tl.arange(0, BLOCK_N), offs_dv, s_vn, s_vd, OFFS32)
    for it in range(0, n_iter):
        tile = tile_index(list_row, it, SPARSE)
        start_n = tile * BLOCK_N
        if SPARSE and GAUSS:
            kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile_at(k_base, start_n, k_tile, offs_n, offs_d, n_k, head_d, EVEN_N, EVEN_D, OFFS32)
        z, e = _score_tile(q, k, offs_m, offs_n, n_q, n_k, scale, unit, add_base, s_am, s_an, keep_base, s_mm,
                           s_mn, qr, qc, cr, fr, cc, fc, alpha * unit, kr, kc, GAUSS, HAS_ADD, HAS_KEEP,
                           F32_DOT, False, EVEN_M, EVEN_N)  # fmt: skip
        if WINDOW:
            win_r, win_c = window_cols(WIN, offs_n, n_k)
            z = window_mask(z, window_penalty(ctr_r, half_r, ctr_c, half_c, win_r, win_c, False))
        if ENTMAX == 2:
            u = tl.maximum(z * a[:, None] - stat_u[:, None], 0.0)
            p, g, l2 = alpha_powers(u, beta[:, None])
            if ENT_GRAD:  # two tiles (g, w) live across the dot instead of three (g, u, log2 u)
                e_s += tl.sum(p, 1)
                w = alpha_grad_weights(u, l2)
        else:
            p, g = _probs(z, stat_u, ENTMAX, False)
        v = load_tile_at(v_base, start_n, v_tile, offs_n, offs_dv, n_k, head_dv, EVEN_N, EVEN_D, OFFS32)
        dp = _dot(do, tl.trans(v), F32_DOT)
        ds = g * (dp - delta[:, None])
        if ENT_GRAD:
            e_t += tl.sum(ds * w, 1)
        dq += _dot(ds.to(k.dtype), k, F32_DOT)
        _add_grad(dadd_base, ds, offs_m, offs_n, n_q, n_k, s_gm, s_gn, ADD_GRAD, DADD_BCAST_M, DADD_BCAST_N,
                  EVEN_M, EVEN_N)  # fmt: skip
        if GAUSS_GRAD:
            # the tile's e is kept; its exponents are recomputed (no exp): fewer live registers
            dse = ds * e
            t_r = axis_exponent(_qv(qr, False) - _kv(kr, False), _qv(cr, False), _qv(fr, False))
            t_c = axis_exponent(_qv(qc, False) - _kv(kc, False), _qv(cc, False), _qv(fc, False))
            g_alpha += tl.sum(dse, 1)
            g_row += tl.sum(dse * t_r, 1)
            g_col += tl.sum(dse * t_c, 1)
        if GAUSS and not SPARSE:
            kr, kc = _coords_advance(kr, kc, step_r, step_c, gw)

    _store_tile(DQ + row * head_d, dq * scale, offs_m, offs_d, head_d, 1, n_q, head_d, EVEN_M, EVEN_D)
    if ENT_GRAD:
        tl.store(DENT + row + offs_m, alpha_grad(beta, e_t, e_s, delta), mask=offs_m < n_q)
    if GAUSS_GRAD:
        n_p = n_q - num_prefix
        p_idx = offs_m - num_prefix
        ok = (p_idx >= 0) & (offs_m < n_q)
        p_idx = tl.where(ok, p_idx, 0)
        patch = bh.to(tl.int64) * n_p + p_idx
        # the exponents are in log2 units: a_m = t_m / log2(e); d den_m = -alpha / den_m sum dZ e a_m,
        # with 1 / den_m = -2 coef_m / log2(e)
        tl.store(DALPHA + patch, g_alpha, mask=ok)
        tl.store(DDEN + 2 * patch, alpha * cr * g_row * (2.0 / (LOG2E * LOG2E)), mask=ok)
        tl.store(DDEN + 2 * patch + 1, alpha * cc * g_col * (2.0 / (LOG2E * LOG2E)), mask=ok)
