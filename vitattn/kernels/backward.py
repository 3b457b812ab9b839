"""Backward kernels, shared by softmax and entmax-1.5 (``ENTMAX`` switches the row statistic).

With ``dP = dO Vᵀ`` and the saved statistic (see :func:`vitattn.kernels._common._probs`), the score
gradient of both normalizers has one form::

    dZ = g * (dP - delta),   softmax: g = p,            delta = rowsum(dO * O)
                             entmax-1.5: g = sqrt(p),    delta = rowsum(dO * OG),  OG = g V / sum g

Then ``dV = Pᵀ dO``, ``dK = scale dZᵀ Q``, ``dQ = scale dZ K``; the additive mask's gradient is ``dZ``
(reduced over its broadcast dims); the Gaussian bias ``S = alpha e`` gives per query row
``d alpha = sum_t dZ e`` and ``d den_m = -alpha / den_m * sum_t dZ e a_m``.

Three kernels: ``_bwd_delta_kernel`` (the row term), ``_bwd_dkdv_kernel`` (one program per key block,
looping over the queries) and ``_bwd_dq_kernel`` (one program per query block, looping over the keys;
it also writes the mask and Gaussian gradients). No atomics except for a broadcast additive mask.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    _bases,
    _dot,
    _gauss_reaches,
    _gauss_tile,
    _load_tile,
    _offset,
    _probs,
    _program,
    _row_bias,
    _row_stats,
    _score_block,
    _store_tile,
    _tile_ptrs,
)


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, n_rows, head_dv, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``DELTA[r] = sum_d O[r, d] * DO[r, d]`` over ``n_rows`` contiguous rows of width ``head_dv``.

    The flat row index runs over B * H * Nq rows: ``offs_m * head_dv`` is taken in 64 bits.
    """
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_DV)
    o = _load_tile(O, offs_m, offs_d, head_dv, 1, n_rows, head_dv).to(tl.float32)
    do = _load_tile(DO, offs_m, offs_d, head_dv, 1, n_rows, head_dv).to(tl.float32)
    tl.store(DELTA + offs_m, tl.sum(o * do, 1), mask=offs_m < n_rows)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, STAT, DELTA, DK, DV, ADD, KEEP, DEN, ALPHA,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    s_ab, s_ah, s_am, s_an, s_mb, s_mh, s_mm, s_mn, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp,
    n_heads, n_q, n_k, head_d, head_dv, scale, num_prefix, grid_w, clamp,
    ENTMAX: tl.constexpr, GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``DK``, ``DV`` (contiguous, like K and V) for one block of keys. DO contiguous ``(B, H, Nq, Dv)``.

    Keys are the M dimension of every tile (``k qᵀ``, ``(BLOCK_N, BLOCK_M)``), so ``dV += Pᵀ dO`` and
    ``dK += dSᵀ q`` take the tiles as they come (no transpose of p or dS). For entmax-1.5 a query block
    without support on this key block skips everything past the score tile.
    """
    bh, b, h = _program(n_heads)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    start_n = tl.program_id(0) * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
    v = _load_tile(v_base, offs_n, offs_dv, s_vn, s_vd, n_k, head_dv)
    row = bh.to(tl.int64) * n_q
    do_base = DO + row * head_dv
    if ENTMAX:
        unit = 0.5
        stat_unit = 1.0
    else:
        unit = LOG2E
        stat_unit = LOG2E
    scale_u = scale * unit

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for start_m in range(0, n_q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_base, offs_m, offs_d, s_qm, s_qd, n_q, head_d)
        stat, delta = _row_stats(STAT, DELTA, row, offs_m, n_q)
        inv_r, inv_c, alpha = _row_bias(
            DEN, ALPHA, b, h, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, offs_m, n_q, num_prefix, GAUSS
        )
        z_t = _score_block(
            k, q, offs_m, offs_n, start_n, n_q, n_k, scale_u, add_base, s_am, s_an, keep_base, s_mm, s_mn,
            inv_r, inv_c, alpha * unit, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT,
            ENTMAX, True,
        )
        p_t, g_t = _probs(z_t, stat * stat_unit, ENTMAX, True)
        live = True
        if ENTMAX:
            live = tl.max(tl.max(g_t, 1), 0) > 0.0
        if live:
            do = _load_tile(do_base, offs_m, offs_dv, head_dv, 1, n_q, head_dv)
            dv += _dot(p_t.to(do.dtype), do, F32_DOT)
            dp_t = _dot(v, tl.trans(do), F32_DOT)
            ds_t = g_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, F32_DOT)

    out_row = bh.to(tl.int64) * n_k
    _store_tile(DK + out_row * head_d, dk * scale, offs_n, offs_d, head_d, 1, n_k, head_d)
    _store_tile(DV + out_row * head_dv, dv, offs_n, offs_dv, head_dv, 1, n_k, head_dv)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, STAT, DELTA, DQ, DADD, DDEN, DALPHA, ADD, KEEP, DEN, ALPHA,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    s_ab, s_ah, s_am, s_an, s_mb, s_mh, s_mm, s_mn, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp,
    s_gb, s_gh, s_gm, s_gn,
    n_heads, n_q, n_k, head_d, head_dv, scale, num_prefix, grid_w, clamp,
    ENTMAX: tl.constexpr, GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr, ADD_GRAD: tl.constexpr, GAUSS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``DQ`` (contiguous like Q) for one block of queries, plus the bias gradients.

    ``ADD_GRAD``: 0 = none, 1 = store ``dZ`` into DADD (strides ``s_g*``), 2 = atomically add it (the
    mask broadcasts over some dim, whose stride is 0). ``GAUSS_GRAD``: write DDEN contiguous float32
    ``(B, H, Np, 2)`` and DALPHA contiguous float32 ``(B, H, Np)``.
    """
    bh, b, h = _program(n_heads)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = bh.to(tl.int64) * n_q
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    q = _load_tile(q_base, offs_m, offs_d, s_qm, s_qd, n_q, head_d)
    do = _load_tile(DO + row * head_dv, offs_m, offs_dv, head_dv, 1, n_q, head_dv)
    stat, delta = _row_stats(STAT, DELTA, row, offs_m, n_q)
    dadd_base = _offset(DADD, b, h, s_gb, s_gh)
    inv_r, inv_c, alpha = _row_bias(
        DEN, ALPHA, b, h, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, offs_m, n_q, num_prefix, GAUSS
    )
    if ENTMAX:
        unit = 0.5
        stat_u = stat
    else:
        unit = LOG2E
        stat_u = stat * LOG2E
    scale_u = scale * unit
    alpha_u = alpha * unit

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    g_alpha = tl.zeros([BLOCK_M], tl.float32)
    g_row = tl.zeros([BLOCK_M], tl.float32)
    g_col = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
        z = _score_block(
            q, k, offs_m, offs_n, start_n, n_q, n_k, scale_u, add_base, s_am, s_an, keep_base, s_mm, s_mn,
            inv_r, inv_c, alpha_u, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, ENTMAX,
            False,
        )
        p, g = _probs(z, stat_u, ENTMAX, False)
        live = True
        if ENTMAX:
            live = tl.max(tl.max(g, 1), 0) > 0.0
        ds = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if live:
            v = _load_tile(v_base, offs_n, offs_dv, s_vn, s_vd, n_k, head_dv)
            dp = _dot(do, tl.trans(v), F32_DOT)
            ds = g * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, F32_DOT)
            if ADD_GRAD == 2:
                inside = (offs_m[:, None] < n_q) & (offs_n[None, :] < n_k)
                tl.atomic_add(_tile_ptrs(dadd_base, offs_m, offs_n, s_gm, s_gn), ds, mask=inside)
            if GAUSS_GRAD:
                # recomputed here rather than kept from the score tile: fewer live registers
                reach = _gauss_reaches(
                    offs_m, start_n, tl.minimum(start_n + BLOCK_N, n_k), n_q, inv_r, inv_c, num_prefix,
                    grid_w, clamp,
                )
                if reach:
                    _b, e, a_row, a_col = _gauss_tile(
                        offs_m, offs_n, n_k, inv_r, inv_c, alpha, num_prefix, grid_w, clamp, False
                    )
                    dse = ds * e
                    g_alpha += tl.sum(dse, 1)
                    g_row += tl.sum(dse * a_row, 1)
                    g_col += tl.sum(dse * a_col, 1)
        if ADD_GRAD == 1:  # every element is written (zeros where the tile was skipped)
            inside = (offs_m[:, None] < n_q) & (offs_n[None, :] < n_k)
            tl.store(_tile_ptrs(dadd_base, offs_m, offs_n, s_gm, s_gn), ds, mask=inside)

    _store_tile(DQ + row * head_d, dq * scale, offs_m, offs_d, head_d, 1, n_q, head_d)
    if GAUSS_GRAD:
        n_p = n_q - num_prefix
        p_idx = offs_m - num_prefix
        ok = (p_idx >= 0) & (offs_m < n_q)
        p_idx = tl.where(ok, p_idx, 0)
        patch = bh.to(tl.int64) * n_p + p_idx
        tl.store(DALPHA + patch, g_alpha, mask=ok)
        tl.store(DDEN + 2 * patch, -alpha * inv_r * g_row, mask=ok)
        tl.store(DDEN + 2 * patch + 1, -alpha * inv_c * g_col, mask=ok)
