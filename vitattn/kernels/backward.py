"""Backward kernels, shared by softmax and entmax-1.5 (``ENTMAX`` switches the row statistic).

With ``dP = dO Vᵀ`` and the saved statistic (see :func:`vitattn.kernels._common._probs`), the score
gradient of both normalizers has one form::

    dZ = g * (dP - delta),   softmax: g = p,            delta = rowsum(dO * O)
                             entmax-1.5: g = sqrt(p),    delta = rowsum(dO * OG),  OG = g V / sum g

Then ``dV = Pᵀ dO``, ``dK = scale dZᵀ Q``, ``dQ = scale dZ K``; the additive mask's gradient is ``dZ``
(reduced over its broadcast dims); the Gaussian bias ``S = alpha e``, ``e = R C`` (the row and column
factors ``R = 2^(t_row)``, ``C = 2^(t_col)``, see ``_common``'s grid-aligned key tiles), gives per query
``d alpha = sum_t dZ e`` and ``d den_m = -alpha / den_m * sum_t dZ e a_m`` (``a_m = t_m / log2(e)`` the
floored per-axis exponent; where the floor binds its derivative is 0 and the kept term is below
``40 e^-40`` of a score's).

Five kernels: ``_bwd_delta_kernel`` (the row term), ``_bwd_factors_kernel`` (with a Gaussian bias: the
column factors ``C`` of every query and grid column and its row factors ``R alpha / scale`` of every
grid row, ``O(N (gh + gw))`` floats per head), ``_bwd_dkdv_kernel`` (one program per key block,
looping over the queries: it loads the factors of each query tile and adds ``R ⊗ C`` to ``k qᵀ``, one
multiply-add per score) and ``_bwd_dq_kernel`` (one program per query block, looping over the keys in
grid-aligned tiles like the forward: its column factors once per chunk of grid columns, its row factors
once per tile; it also writes the mask and Gaussian gradients, from two accumulators per query and
grid column, ``W = sum_rows R dZ`` and ``W2 = sum_rows t_row R dZ``: two multiply-adds per score, the
reductions over the columns once per chunk). No loop branches on data: every tile's loads are
unconditional. Atomics only for a broadcast additive mask, after reducing the tile over the broadcast
rows or columns.

Besides softmax, entmax-1.5 and alpha-entmax with a Gaussian bias and no window run here (``ENTMAX`` 1
and 2; the other entmax backwards are :mod:`.backward_lists`). alpha-entmax's bias is added after the
scale, its forward's order (the factors ``C alpha`` and ``R``: ``_bwd_factors_kernel``'s ``SCALED``), and
dQ also writes the alphas' gradient. entmax-1.5 visits its live tiles only (``SPARSE``): lists built from
the forward's live-tile map for these kernels' own grid-aligned tiles (``ops.grid_tile_lists``), per key
block its query tiles (dK/dV) and per query block its prefix tiles and, per chunk of grid columns, its
tiles of grid rows (dQ; a partial last tile, when listed, visited apart with its bound masks as without
lists).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    _bases,
    _block_offsets,
    _coords_start,
    _dot,
    _load_kv,
    _load_tile,
    _offset,
    _probs,
    _program,
    _qk_tile,
    _row_stats,
    _store_tile,
    _tile_ptrs,
    add_outer,
    axis_exponent,
    col_factors,
    gauss_rows,
    key_slots,
    row_factors,
    tile_offsets,
    tile_ptrs_at,
)
from ._tiles import listed, listed_with_last, small_int_to_float, tile_index, tile_list
from .entmax_alpha import alpha_grad, alpha_grad_weights, alpha_powers, alpha_rows, alpha_rows_at


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, n_rows, head_dv, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``DELTA[r] = sum_d O[r, d] * DO[r, d]`` over ``n_rows`` contiguous rows of width ``head_dv``.

    The flat row index runs over B * H * Nq rows: ``offs_m * head_dv`` is taken in 64 bits.
    """
    offs_m = _block_offsets(BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    o = _load_tile(O, offs_m, offs_d, head_dv, 1, n_rows, head_dv, False, False).to(tl.float32)
    do = _load_tile(DO, offs_m, offs_d, head_dv, 1, n_rows, head_dv, False, False).to(tl.float32)
    tl.store(DELTA + offs_m, tl.sum(o * do, 1), mask=offs_m < n_rows)


@triton.jit
def _bwd_factors_kernel(
    DEN,
    ALPHA,
    FACT,
    s_db,
    s_dh,
    s_dp,
    s_dc,
    s_alb,
    s_alh,
    s_alp,
    n_heads,
    n_q,
    n_qp,
    n_fr,
    num_prefix,
    grid_w,
    clamp,
    scale,
    GWP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SCALED: tl.constexpr = False,
):
    """The Gaussian factors of every query, once: ``FACT`` contiguous float32 ``(B * H, n_fr, n_qp)``
    (queries padded to ``n_qp``): rows ``0 .. GWP - 1`` the column factors ``C = 2^(t_col)`` of grid
    column ``b`` (any value past the grid width), rows ``GWP + a`` the row factors ``R alpha / scale``
    of grid row ``a`` (0 past the grid's rows; the last rows are all 0: the factors of prefix keys).
    The dK/dV kernel loads them per query tile instead of recomputing them per key block. ``SCALED``
    (alpha-entmax, whose bias is added after the scale): ``C alpha`` and ``R`` instead, the products its
    forward forms."""
    bh, b, h = _program(n_heads)
    offs_m = _block_offsets(BLOCK_M)
    qr, qc = _coords_start(offs_m, num_prefix, grid_w)
    cr, fr, cc, fc, alpha = gauss_rows(
        DEN,
        ALPHA,
        b,
        h,
        s_db,
        s_dh,
        s_dp,
        s_dc,
        s_alb,
        s_alh,
        s_alp,
        offs_m,
        n_q,
        num_prefix,
        grid_w,
        clamp,
    )
    ptrs = FACT + bh.to(tl.int64) * n_fr * n_qp + offs_m
    ok = offs_m < n_qp
    col = 0.0
    for _b in range(GWP):
        c = tl.exp2(axis_exponent(qc - col, cc, fc))
        if SCALED:
            c = c * alpha
        tl.store(ptrs, c, mask=ok)
        ptrs += n_qp
        col += 1.0
    n_rows = (n_q - num_prefix) // grid_w
    amp = alpha / scale
    row = 0.0
    for a in range(n_fr - GWP):
        f = tl.exp2(axis_exponent(qr - row, cr, fr))
        if not SCALED:
            f = f * amp
        tl.store(ptrs, tl.where(a < n_rows, f, 0.0), mask=ok)
        ptrs += n_qp
        row += 1.0


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    q_ld,
    do_ld,
    r_ld,
    c_ld,
    offs_m,
    k,
    v,
    offs_n,
    offs_d,
    offs_dv,
    n_q,
    n_k,
    head_d,
    head_dv,
    scale,
    su,
    STAT,
    DELTA,
    row,
    add_base,
    s_am,
    s_an,
    keep_base,
    s_mm,
    s_mn,
    ent_base,
    s_em,
    ENTMAX: tl.constexpr,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    WHOLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NR: tl.constexpr,
    TILE_W: tl.constexpr,
):
    """One query tile (rows ``offs_m``; its Q, dO and, with ``GAUSS``, factor pointers ``*_ld``) of the
    key block ``k``, ``v``: ``(dk, dv)`` updated. alpha-entmax (``ENTMAX == 2``): the tile's alphas from
    ``ent_base`` (stride ``s_em``), the bias added after the scale."""
    if EVEN_M and EVEN_D:
        q = tl.load(q_ld)
        do = tl.load(do_ld)
    elif EVEN_M:
        q = tl.load(q_ld, mask=(offs_d < head_d)[None, :], other=0.0)
        do = tl.load(do_ld, mask=(offs_dv < head_dv)[None, :], other=0.0)
    else:
        q = tl.load(q_ld, mask=(offs_m < n_q)[:, None] & (offs_d < head_d)[None, :], other=0.0)
        do = tl.load(do_ld, mask=(offs_m < n_q)[:, None] & (offs_dv < head_dv)[None, :], other=0.0)
    stat, delta = _row_stats(STAT, DELTA, row, offs_m, n_q, EVEN_M)
    s_t = _qk_tile(
        k, q, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
        HAS_ADD, HAS_KEEP, F32_DOT, True, EVEN_M, WHOLE,
    )  # fmt: skip
    if ENTMAX == 2:
        a_q, beta_q = alpha_rows_at(ent_base, s_em, offs_m, n_q)
        z_t = s_t * su
        if GAUSS:
            z_t = add_outer(z_t, tl.load(r_ld), tl.load(c_ld), BLOCK_M, NR, TILE_W, True)
        u_t = tl.maximum(z_t * a_q[None, :] - stat[None, :], 0.0)
        p_t, g_t, _l = alpha_powers(u_t, beta_q[None, :])
    else:
        if GAUSS:
            s_t = add_outer(s_t, tl.load(r_ld), tl.load(c_ld), BLOCK_M, NR, TILE_W, True)
        p_t, g_t = _probs(s_t * su, stat, ENTMAX, True)
    dv += _dot(p_t.to(do.dtype), do, F32_DOT)
    dp_t = _dot(v, tl.trans(do), F32_DOT)
    ds_t = g_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, F32_DOT)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    STAT,
    DELTA,
    FACT,
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
    n_qp,
    n_fr,
    ENT,
    s_eb,
    s_eh,
    s_em,
    LIST,
    CNT,
    n_list_cols,
    ENTMAX: tl.constexpr,
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
    GRID_TW: tl.constexpr = 16,
    OFFS32: tl.constexpr = False,
    SPARSE: tl.constexpr = False,
    UNIFORM: tl.constexpr = False,
):
    """``DK``, ``DV`` (contiguous, like K and V) for one block of keys. DO contiguous ``(B, H, Nq, Dv)``.

    Keys are the M dimension of every tile (``k qᵀ``, ``(BLOCK_N, BLOCK_M)``), so ``dV += Pᵀ dO`` and
    ``dK += dSᵀ q`` take the tiles as they come (no transpose of p or dS). With a Gaussian bias the key
    block is a grid-aligned tile (program ``i``: the prefix keys' blocks first, then ``NR`` grid rows of
    one chunk of ``TILE_W`` columns) and each query tile's factors are loaded from ``FACT``
    (:func:`_bwd_factors_kernel`, ``n_fr`` rows of ``n_qp`` queries). Keys outside the grid or past
    ``Nk`` load zeros and are never stored: their scores need no mask (each key's gradient reads only
    its own scores). ``GWP``, ``PAD_W``, ``GRID_TW``, ``EVEN_N`` as in the softmax forward. ``SPARSE``:
    only the query tiles listed in ``LIST`` (int32 ``(B * H, key blocks, n_list_cols)``, ``CNT`` of them,
    ``ops.grid_tile_lists``); ``UNIFORM``: the count marked warp-uniform (``_common.warp_uniform``).
    """
    WHOLE: tl.constexpr = EVEN_N and not PAD_W  # every key of every block is valid
    bh, b, h = _program(n_heads)
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    if GAUSS:
        TILE_W: tl.constexpr = GRID_TW
        CH: tl.constexpr = GWP // TILE_W
        NR: tl.constexpr = BLOCK_N // TILE_W
        n_pre = (num_prefix + BLOCK_N - 1) // BLOCK_N
        g = tl.maximum(pid - n_pre, 0)
        ch = g % CH
        slot_off, col = key_slots(BLOCK_N, TILE_W, grid_w)
        tok = num_prefix + (g // CH) * NR * grid_w + ch * TILE_W + slot_off
        pre = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = tl.where(pid < n_pre, pre, tok)
        ok_n = tl.where(pid < n_pre, pre < num_prefix, ((ch * TILE_W + col) < grid_w) & (tok < n_k))
        # this block's factor rows: its chunk's columns, its grid rows (the last, all-zero rows: prefix keys)
        r_row = tl.where(pid < n_pre, n_fr - NR, GWP + (g // CH) * NR)
        fact = FACT + bh.to(tl.int64) * n_fr * n_qp
        offs_f = tl.arange(0, BLOCK_M)
        c_rows = ch * TILE_W + tl.arange(0, TILE_W)
        r_rows = r_row + tl.arange(0, NR)
        c_tile = tile_offsets(c_rows, offs_f, n_qp, 1, OFFS32)
        r_tile = tile_offsets(r_rows, offs_f, n_qp, 1, OFFS32)
        # without OFFS32: 64-bit pointer tiles, advanced per query tile
        c_ptrs = _tile_ptrs(fact, c_rows, offs_f, n_qp, 1)
        r_ptrs = _tile_ptrs(fact, r_rows, offs_f, n_qp, 1)
    else:
        TILE_W: tl.constexpr = BLOCK_N  # type: ignore[no-redef]
        NR: tl.constexpr = 1  # type: ignore[no-redef]
        offs_n = _block_offsets(BLOCK_N)
        ok_n = offs_n < n_k
    if WHOLE and EVEN_D:
        k = tl.load(_tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd))
        v = tl.load(_tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd))
    else:
        k = tl.load(
            _tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd),
            mask=ok_n[:, None] & (offs_d < head_d)[None, :],
            other=0.0,
        )
        v = tl.load(
            _tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd),
            mask=ok_n[:, None] & (offs_dv < head_dv)[None, :],
            other=0.0,
        )
    row = bh.to(tl.int64) * n_q
    # softmax: scores and the saved log-sum-exp in base 2; entmax-1.5: in units of z / 2; alpha-entmax: z
    if ENTMAX == 2:
        unit = 1.0
    elif ENTMAX:
        unit = 0.5
    else:
        unit = LOG2E
    su = scale * unit
    ent_base = _offset(ENT, b, h, s_eb, s_eh)
    offs_mb = tl.arange(0, BLOCK_M)
    # one query tile's offsets; the loop advances the scalar pointers q_at, do_at (and the factors' start_m)
    q_tile = tile_offsets(offs_mb, offs_d, s_qm, s_qd, OFFS32)
    do_tile = tile_offsets(offs_mb, offs_dv, head_dv, 1, OFFS32)
    q_at = q_base
    do_at = DO + row * head_dv
    # without OFFS32: 64-bit pointer tiles, advanced per tile
    q_ptrs = _tile_ptrs(q_base, offs_mb, offs_d, s_qm, s_qd)
    do_ptrs = _tile_ptrs(do_at, offs_mb, offs_dv, head_dv, 1)
    q_step = tl.cast(BLOCK_M, tl.int64) * s_qm
    do_step = tl.cast(BLOCK_M, tl.int64) * head_dv

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if SPARSE:  # entmax-1.5: the query tiles listed for this key block (ops.grid_tile_lists)
        n_iter, list_row = tile_list(
            LIST, CNT, n_list_cols, bh, tl.num_programs(0), n_q, BLOCK_M, True, UNIFORM
        )
        for it in range(0, n_iter):
            start_m = tl.load(list_row + it) * BLOCK_M
            q_off = tl.cast(start_m, tl.int64) * s_qm
            do_off = tl.cast(start_m, tl.int64) * head_dv
            q_ld = tile_ptrs_at(q_at + q_off, q_tile, q_ptrs + q_off, OFFS32)
            do_ld = tile_ptrs_at(do_at + do_off, do_tile, do_ptrs + do_off, OFFS32)
            r_ld, c_ld = 0, 0
            if GAUSS:
                r_ld = tile_ptrs_at(fact + start_m, r_tile, r_ptrs + start_m, OFFS32)
                c_ld = tile_ptrs_at(fact + start_m, c_tile, c_ptrs + start_m, OFFS32)
            dk, dv = _dkdv_tile(
                dk, dv, q_ld, do_ld, r_ld, c_ld, start_m + offs_mb, k, v, offs_n, offs_d, offs_dv, n_q, n_k,
                head_d, head_dv, scale, su, STAT, DELTA, row, add_base, s_am, s_an, keep_base, s_mm, s_mn,
                ent_base, s_em, ENTMAX, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, EVEN_M, EVEN_D, WHOLE, BLOCK_M, NR,
                TILE_W,
            )  # fmt: skip
    else:
        for start_m in range(0, n_q, BLOCK_M):
            q_ld = tile_ptrs_at(q_at, q_tile, q_ptrs, OFFS32)
            do_ld = tile_ptrs_at(do_at, do_tile, do_ptrs, OFFS32)
            r_ld, c_ld = 0, 0
            if GAUSS:
                r_ld = tile_ptrs_at(fact + start_m, r_tile, r_ptrs, OFFS32)
                c_ld = tile_ptrs_at(fact + start_m, c_tile, c_ptrs, OFFS32)
                if not OFFS32:
                    r_ptrs += BLOCK_M
                    c_ptrs += BLOCK_M
            dk, dv = _dkdv_tile(
                dk, dv, q_ld, do_ld, r_ld, c_ld, start_m + offs_mb, k, v, offs_n, offs_d, offs_dv, n_q, n_k,
                head_d, head_dv, scale, su, STAT, DELTA, row, add_base, s_am, s_an, keep_base, s_mm, s_mn,
                ent_base, s_em, ENTMAX, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, EVEN_M, EVEN_D, WHOLE, BLOCK_M, NR,
                TILE_W,
            )  # fmt: skip
            if OFFS32:
                q_at += q_step
                do_at += do_step
            else:
                q_ptrs += q_step
                do_ptrs += do_step

    out_row = bh.to(tl.int64) * n_k
    dk_ptrs = _tile_ptrs(DK + out_row * head_d, offs_n, offs_d, head_d, 1)
    dv_ptrs = _tile_ptrs(DV + out_row * head_dv, offs_n, offs_dv, head_dv, 1)
    if WHOLE and EVEN_D:
        tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))
    else:
        tl.store(
            dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=ok_n[:, None] & (offs_d < head_d)[None, :]
        )
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=ok_n[:, None] & (offs_dv < head_dv)[None, :])


@triton.jit
def _add_grad(
    dadd_base,
    ds,
    offs_m,
    offs_n,
    ok_n,
    n_q,
    s_gm,
    s_gn,
    ADD_GRAD: tl.constexpr,
    BCAST_M: tl.constexpr,
    BCAST_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The additive mask's gradient of one tile: stored (``ADD_GRAD == 1``), or added atomically
    (``2``: the mask broadcasts over B, H or a tile dimension) after summing the tile over the query rows
    (``BCAST_M``) and / or the keys (``BCAST_N``) it broadcasts over. ``ds`` is 0 outside the tile's
    bounds (padded queries have zero probabilities, masked keys ``-inf`` scores); ``ok_n``: the tile's
    valid keys (``MASKED``: a slot past the grid width holds another row's token)."""
    if MASKED:
        key_ok = ok_n
    else:
        key_ok = offs_n >= 0
    if ADD_GRAD == 1:
        ptrs = _tile_ptrs(dadd_base, offs_m, offs_n, s_gm, s_gn)
        if EVEN_M and not MASKED:
            tl.store(ptrs, ds)
        else:
            tl.store(ptrs, ds, mask=(offs_m[:, None] < n_q) & key_ok[None, :])
    elif ADD_GRAD == 2:
        if BCAST_M and BCAST_N:
            tl.atomic_add(dadd_base, tl.sum(tl.sum(ds, 1), 0))
        elif BCAST_M:
            tl.atomic_add(dadd_base + offs_n.to(tl.int64) * s_gn, tl.sum(ds, 0), mask=key_ok)
        elif BCAST_N:
            tl.atomic_add(dadd_base + offs_m.to(tl.int64) * s_gm, tl.sum(ds, 1), mask=offs_m < n_q)
        else:
            ptrs = _tile_ptrs(dadd_base, offs_m, offs_n, s_gm, s_gn)
            tl.atomic_add(ptrs, ds, mask=(offs_m[:, None] < n_q) & key_ok[None, :])


@triton.jit
def _dq_row_terms(dr, cr, fr, NR: tl.constexpr, ROW_PAIR: tl.constexpr):
    """``(R, t_row R)`` of a dQ key tile's ``NR`` grid rows (:func:`row_factors`, ``dr = qr - a0``): two
    ``(BLOCK_M,)`` vectors each for ``NR == 2`` with ``ROW_PAIR`` (a pair: :func:`_dq_tile` adds and reduces
    the two grid rows apart; on sm_90 a ``(BLOCK_M, 2)`` tensor took a trip through shared memory per tile
    to be split), else ``(BLOCK_M, NR)`` tensors (sm_80: the pair spills, ``configs.DQ_ROW_PAIR_BY_ARCH``)."""
    if NR == 2 and ROW_PAIR:
        t0 = axis_exponent(dr, cr, fr)
        t1 = axis_exponent(dr - 1.0, cr, fr)
        r0 = tl.exp2(t0)
        r1 = tl.exp2(t1)
        return (r0, r1), (r0 * t0, r1 * t1)
    else:
        r, t = row_factors(dr, cr, fr, NR)
        return r, r * t


@triton.jit
def _dq_tile(
    dq,
    w,
    w2,
    q,
    do,
    k,
    v,
    ok,
    offs_m,
    offs_n,
    n_q,
    n_k,
    scale,
    su,
    stat_u,
    delta,
    add_base,
    s_am,
    s_an,
    keep_base,
    s_mm,
    s_mn,
    dadd_base,
    s_gm,
    s_gn,
    r,
    r_t,
    c,
    a,
    beta,
    e_s,
    e_t,
    ENTMAX: tl.constexpr,
    BIAS: tl.constexpr,
    GRAD: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    ADD_GRAD: tl.constexpr,
    DADD_BCAST_M: tl.constexpr,
    DADD_BCAST_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NR: tl.constexpr,
    TILE_W: tl.constexpr,
    ROW_PAIR: tl.constexpr,
    ENT_GRAD: tl.constexpr = False,
):
    """One key tile (``k``, ``v``) of dQ: ``(dq, w, w2, e_s, e_t)`` updated. ``r`` (``R``), ``c`` (``C alpha
    / scale``; alpha-entmax, ``ENTMAX == 2``: ``C alpha``, the bias added after the scale): the bias factors
    of :func:`add_outer` (``BIAS``; ``r`` and ``r_t`` pairs of vectors for ``NR == 2``,
    :func:`_dq_row_terms`); with ``GRAD`` the Gaussian gradient accumulators ``w = sum_rows R dZ`` and
    ``w2 = sum_rows t_row R dZ``, ``(BLOCK_M, TILE_W)``: per query and grid column, summed over the tile's
    grid rows (``r_t = t_row R``). alpha-entmax: ``a = alpha - 1``, ``beta = 1 / a`` per row; with
    ``ENT_GRAD`` the alphas' gradient sums ``e_s = sum p``, ``e_t = sum dZ u (1 - ln2 log2 u)``."""
    s = _qk_tile(
        q, k, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
        HAS_ADD, HAS_KEEP, F32_DOT, False, EVEN_M, not MASKED,
    )  # fmt: skip
    if ENTMAX == 2:  # z, the bias added after the scale (the forward's order)
        s = s * su
    if BIAS:
        if NR == 2 and ROW_PAIR:  # the pair of _dq_row_terms: each grid row's half of the tile apart
            r0, r1 = r
            s0, s1 = tl.split(tl.permute(tl.reshape(s, (BLOCK_M, NR, TILE_W)), (0, 2, 1)))
            s = tl.join(s0 + r0[:, None] * c, s1 + r1[:, None] * c)
            s = tl.reshape(tl.permute(s, (0, 2, 1)), (BLOCK_M, NR * TILE_W))
        else:
            s = add_outer(s, r, c, BLOCK_M, NR, TILE_W, False)
    if MASKED:
        s = tl.where(ok[None, :], s, float("-inf"))
    if ENTMAX == 2:
        u = tl.maximum(s * a[:, None] - stat_u[:, None], 0.0)
        p, g, l2 = alpha_powers(u, beta[:, None])
        if ENT_GRAD:
            e_s += tl.sum(p, 1)
            w_ent = alpha_grad_weights(u, l2)
    else:
        p, g = _probs(s * su, stat_u, ENTMAX, False)
    dp = _dot(do, tl.trans(v), F32_DOT)
    ds = g * (dp - delta[:, None])
    if ENT_GRAD:
        e_t += tl.sum(ds * w_ent, 1)
    dq += _dot(ds.to(k.dtype), k, F32_DOT)
    _add_grad(
        dadd_base,
        ds,
        offs_m,
        offs_n,
        ok,
        n_q,
        s_gm,
        s_gn,
        ADD_GRAD,
        DADD_BCAST_M,
        DADD_BCAST_N,
        EVEN_M,
        MASKED,
    )
    if GRAD:  # per grid column: the sums over the tile's grid rows of dZ R and dZ t_row R
        ds3 = tl.reshape(ds, (BLOCK_M, NR, TILE_W))
        if NR == 2 and ROW_PAIR:  # the two rows apart: one multiply-add per score into each accumulator
            d0, d1 = tl.split(tl.permute(ds3, (0, 2, 1)))
            r0, r1 = r
            u0, u1 = r_t
            w = (w + d0 * r0[:, None]) + d1 * r1[:, None]
            w2 = (w2 + d0 * u0[:, None]) + d1 * u1[:, None]
        else:
            w += tl.sum(ds3 * r[:, :, None], 1)
            w2 += tl.sum(ds3 * r_t[:, :, None], 1)
    return dq, w, w2, e_s, e_t


@triton.jit
def _grid_tile_at(
    tile, key0, step, slot_off, offs_d, offs_dv, k_base, v_base, s_kn, s_kd, s_vn, s_vd, k_ptrs, v_ptrs,
    NR: tl.constexpr, OFFS32: tl.constexpr,
):  # fmt: skip
    """Where dQ's ``tile``-th tile of grid rows of a chunk (first key ``key0``, ``step`` keys per tile)
    lies: ``(a0, offs_n, k_at, v_at, k_ptrs, v_ptrs)``, its first grid row (float), its key slots and its K
    / V scalar pointers (``OFFS32``; ``k_ptrs``, ``v_ptrs`` returned as they are) or pointer tiles, as the
    dense loop carries them."""
    first = key0 + tile * step
    k_at = k_base + tl.cast(first, tl.int64) * s_kn
    v_at = v_base + tl.cast(first, tl.int64) * s_vn
    offs_n = first + slot_off
    if not OFFS32:
        k_ptrs = _tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd)
        v_ptrs = _tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd)
    return small_int_to_float(tile * NR), offs_n, k_at, v_at, k_ptrs, v_ptrs


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
    ENTMAX: tl.constexpr,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    ADD_GRAD: tl.constexpr,
    GAUSS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DADD_BCAST_M: tl.constexpr,
    DADD_BCAST_N: tl.constexpr,
    GWP: tl.constexpr,
    PAD_W: tl.constexpr,
    GRID_TW: tl.constexpr = 16,
    OFFS32: tl.constexpr = False,
    ROW_PAIR: tl.constexpr = True,
    SPARSE: tl.constexpr = False,
    UNIFORM: tl.constexpr = False,
    ENT_GRAD: tl.constexpr = False,
):
    """``DQ`` (contiguous like Q) for one block of queries, plus the bias gradients.

    ``ADD_GRAD``: 0 = none, 1 = store ``dZ`` into DADD (strides ``s_g*``), 2 = atomically add it (the
    mask broadcasts over some dim, whose stride is 0; ``DADD_BCAST_M`` / ``_N``: over the query rows /
    the keys, summed over the tile first). ``GAUSS_GRAD``: write DDEN contiguous float32
    ``(B, H, Np, 2)`` and DALPHA contiguous float32 ``(B, H, Np)``. The keys are visited as in the
    softmax forward (``GWP``, ``PAD_W``, ``GRID_TW``, ``EVEN_N`` as there), its K / V tiles through
    pointers (on sm_90 TMA descriptors cost more instructions here than they save: the loads are not its
    registers' problem). ``SPARSE``: only the key tiles listed in ``LIST`` (int32 ``(B * H, query blocks *
    (CH + 1), n_list_cols)``, ``CNT`` per list: the prefix tiles, then each chunk's tiles of grid rows,
    ``ops.grid_tile_lists``); ``UNIFORM`` as in dK/dV. alpha-entmax (``ENTMAX == 2``): the alphas ``ENT``
    (strides ``s_e*``) and, with ``ENT_GRAD``, their gradient written to ``DENT`` (float32 ``(B, H, Nq)``).
    """
    bh, b, h = _program(n_heads)
    offs_m = _block_offsets(BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < head_d
    dv_ok = offs_dv < head_dv
    row = bh.to(tl.int64) * n_q
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    q = _load_tile(q_base, offs_m, offs_d, s_qm, s_qd, n_q, head_d, EVEN_M, EVEN_D)
    do = _load_tile(DO + row * head_dv, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
    stat, delta = _row_stats(STAT, DELTA, row, offs_m, n_q, EVEN_M)
    dadd_base = _offset(DADD, b, h, s_gb, s_gh)
    # softmax: scores and the saved log-sum-exp in base 2; entmax-1.5: in units of z / 2; alpha-entmax: z
    stat_u = stat
    a, beta = 0.0, 0.0
    if ENTMAX == 2:
        unit = 1.0
        a, beta = alpha_rows(ENT, b, h, s_eb, s_eh, s_em, offs_m, n_q)
    elif ENTMAX:
        unit = 0.5
    else:
        unit = LOG2E
    su = scale * unit
    if GAUSS:
        TILE_W: tl.constexpr = GRID_TW
        CH: tl.constexpr = GWP // TILE_W
        row_w = grid_w
        n_rows = (n_k - num_prefix) // grid_w
        first = num_prefix
        qr, qc = _coords_start(offs_m, num_prefix, grid_w)
        cr, fr, cc, fc, alpha = gauss_rows(
            DEN,
            ALPHA,
            b,
            h,
            s_db,
            s_dh,
            s_dp,
            s_dc,
            s_alb,
            s_alh,
            s_alp,
            offs_m,
            n_q,
            num_prefix,
            grid_w,
            clamp,
        )
        amp = alpha / scale
        if ENTMAX == 2:  # the column factors carry alpha itself (the bias added after the scale)
            amp = alpha
    else:
        TILE_W: tl.constexpr = BLOCK_N  # type: ignore[no-redef]
        CH: tl.constexpr = 1  # type: ignore[no-redef]
        row_w = BLOCK_N
        n_rows = n_k // BLOCK_N
        first = 0
    NR: tl.constexpr = BLOCK_N // TILE_W
    slot_off, col = key_slots(BLOCK_N, TILE_W, row_w)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    g_alpha = tl.zeros([BLOCK_M], tl.float32)
    g_row = tl.zeros([BLOCK_M], tl.float32)
    g_col = tl.zeros([BLOCK_M], tl.float32)
    e_s = tl.zeros([BLOCK_M], tl.float32)  # alpha's gradient: sum p, sum dZ u (1 - ln2 log2 u)
    e_t = tl.zeros([BLOCK_M], tl.float32)
    # with SPARSE (entmax-1.5) the tiles of ops.grid_tile_lists: per query block a list of the prefix
    # tiles, then one per chunk of its tiles of grid rows
    lists = (bh * tl.num_programs(0) + tl.program_id(0)) * (CH + 1)
    if GAUSS and not EVEN_N:  # the prefix keys: tiles of their own, no bias
        n_pre_it, pre_row = tl.cdiv(num_prefix, BLOCK_N), LIST
        if SPARSE:
            n_pre_it, pre_row = listed(LIST, CNT, n_list_cols, lists, UNIFORM)
        for it in range(0, n_pre_it):
            offs_n = tile_index(pre_row, it, SPARSE) * BLOCK_N + tl.arange(0, BLOCK_N)
            k_ptrs = _tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd)
            v_ptrs = _tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd)
            k, v = _load_kv(k_ptrs, v_ptrs, offs_n < num_prefix, d_ok, dv_ok, True, EVEN_D)
            dq, _w, _w2, e_s, e_t = _dq_tile(
                dq, 0.0, 0.0, q, do, k, v, offs_n < num_prefix, offs_m, offs_n, n_q, n_k, scale, su,
                stat_u, delta, add_base, s_am, s_an, keep_base, s_mm, s_mn, dadd_base, s_gm, s_gn,
                0.0, 0.0, 0.0, a, beta, e_s, e_t,
                ENTMAX, False, False, HAS_ADD, HAS_KEEP, F32_DOT, ADD_GRAD, DADD_BCAST_M, DADD_BCAST_N,
                True, EVEN_M, BLOCK_M, NR, TILE_W, ROW_PAIR, ENT_GRAD,
            )  # fmt: skip

    n_main = n_rows // NR
    step = NR * row_w
    for ch in range(CH):  # a loop, not unrolled: one copy of the key loop's code (fewer moves in it)
        c = 0.0
        w = 0.0
        w2 = 0.0
        if GAUSS:
            c, _t_c = col_factors(qc, cc, fc, ch * TILE_W * 1.0, TILE_W, False)
            c = c * amp[:, None]  # the bias in units of q kᵀ: alpha / scale R C
            if GAUSS_GRAD:
                w = tl.zeros([BLOCK_M, TILE_W], tl.float32)
                w2 = tl.zeros([BLOCK_M, TILE_W], tl.float32)
        ok = (ch * TILE_W + col) < row_w
        key0 = first + ch * TILE_W
        offs_n = key0 + slot_off
        # the tile's offsets from its first key; the loop advances the scalar pointers k_at, v_at
        k_tile = tile_offsets(slot_off, offs_d, s_kn, s_kd, OFFS32)
        v_tile = tile_offsets(slot_off, offs_dv, s_vn, s_vd, OFFS32)
        k_at = k_base + tl.cast(key0, tl.int64) * s_kn
        v_at = v_base + tl.cast(key0, tl.int64) * s_vn
        # without OFFS32: 64-bit pointer tiles, advanced per tile
        k_ptrs = _tile_ptrs(k_base, offs_n, offs_d, s_kn, s_kd)
        v_ptrs = _tile_ptrs(v_base, offs_n, offs_dv, s_vn, s_vd)
        k_step = tl.cast(step, tl.int64) * s_kn
        v_step = tl.cast(step, tl.int64) * s_vn
        a0 = 0.0
        n_it = n_main
        if SPARSE:  # its listed tiles, the partial one (index n_main) apart
            n_it, list_row, partial = listed_with_last(
                LIST, CNT, n_list_cols, lists + 1 + ch, n_main, UNIFORM
            )
        for it in range(n_it):
            if SPARSE:  # the listed tile of grid rows
                a0, offs_n, k_at, v_at, k_ptrs, v_ptrs = _grid_tile_at(
                    tl.load(list_row + it), key0, step, slot_off, offs_d, offs_dv, k_base, v_base, s_kn, s_kd,
                    s_vn, s_vd, k_ptrs, v_ptrs, NR, OFFS32,
                )  # fmt: skip
            r = 0.0
            r_t = 0.0
            if GAUSS:
                r, r_t = _dq_row_terms(qr - a0, cr, fr, NR, ROW_PAIR)
            k_ld = tile_ptrs_at(k_at, k_tile, k_ptrs, OFFS32)
            v_ld = tile_ptrs_at(v_at, v_tile, v_ptrs, OFFS32)
            k, v = _load_kv(k_ld, v_ld, ok, d_ok, dv_ok, PAD_W, EVEN_D)
            dq, w, w2, e_s, e_t = _dq_tile(
                dq, w, w2, q, do, k, v, ok, offs_m, offs_n, n_q, n_k, scale, su, stat_u, delta,
                add_base, s_am, s_an, keep_base, s_mm, s_mn, dadd_base, s_gm, s_gn, r, r_t, c, a, beta, e_s,
                e_t, ENTMAX, GAUSS, GAUSS_GRAD, HAS_ADD, HAS_KEEP, F32_DOT, ADD_GRAD, DADD_BCAST_M,
                DADD_BCAST_N, PAD_W, EVEN_M, BLOCK_M, NR, TILE_W, ROW_PAIR, ENT_GRAD,
            )  # fmt: skip
            if not SPARSE:
                if OFFS32:
                    k_at += k_step
                    v_at += v_step
                else:
                    k_ptrs += k_step
                    v_ptrs += v_step
                offs_n += step
                a0 += NR
        if not EVEN_N:  # the last, partial tile
            if SPARSE:
                a0, offs_n, k_at, v_at, k_ptrs, v_ptrs = _grid_tile_at(
                    n_main, key0, step, slot_off, offs_d, offs_dv, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
                    k_ptrs, v_ptrs, NR, OFFS32,
                )  # fmt: skip
            else:
                partial = first + n_main * step < n_k
            if partial:
                r = 0.0
                r_t = 0.0
                if GAUSS:
                    r, r_t = _dq_row_terms(qr - a0, cr, fr, NR, ROW_PAIR)
                ok_t = ok & (offs_n < n_k)
                k_ld = tile_ptrs_at(k_at, k_tile, k_ptrs, OFFS32)
                v_ld = tile_ptrs_at(v_at, v_tile, v_ptrs, OFFS32)
                k, v = _load_kv(k_ld, v_ld, ok_t, d_ok, dv_ok, True, EVEN_D)
                dq, w, w2, e_s, e_t = _dq_tile(
                    dq, w, w2, q, do, k, v, ok_t, offs_m, offs_n, n_q, n_k, scale, su,
                    stat_u, delta, add_base, s_am, s_an, keep_base, s_mm, s_mn, dadd_base, s_gm, s_gn,
                    r, r_t, c, a, beta, e_s, e_t,
                    ENTMAX, GAUSS, GAUSS_GRAD, HAS_ADD, HAS_KEEP, F32_DOT, ADD_GRAD, DADD_BCAST_M,
                    DADD_BCAST_N, True, EVEN_M, BLOCK_M, NR, TILE_W, ROW_PAIR, ENT_GRAD,
                )  # fmt: skip
        if GAUSS_GRAD:  # the column factors again, without alpha / scale, and their exponents
            c, t_c = col_factors(qc, cc, fc, ch * TILE_W * 1.0, TILE_W, False)
            cw = c * w
            g_alpha += tl.sum(cw, 1)
            g_col += tl.sum(cw * t_c, 1)
            g_row += tl.sum(c * w2, 1)

    _store_tile(DQ + row * head_d, dq * scale, offs_m, offs_d, head_d, 1, n_q, head_d, EVEN_M, EVEN_D)
    if ENT_GRAD:
        tl.store(DENT + row + offs_m, alpha_grad(beta, e_t, e_s, delta), mask=offs_m < n_q)
    if GAUSS_GRAD:
        n_p = n_q - num_prefix
        p_idx = offs_m - num_prefix
        ok_p = (p_idx >= 0) & (offs_m < n_q)
        p_idx = tl.where(ok_p, p_idx, 0)
        patch = bh.to(tl.int64) * n_p + p_idx
        # the exponents are in log2 units: a_m = t_m / log2(e); d den_m = -alpha / den_m sum dZ e a_m,
        # with 1 / den_m = -2 coef_m / log2(e)
        tl.store(DALPHA + patch, g_alpha, mask=ok_p)
        tl.store(DDEN + 2 * patch, alpha * cr * g_row * (2.0 / (LOG2E * LOG2E)), mask=ok_p)
        tl.store(DDEN + 2 * patch + 1, alpha * cc * g_col * (2.0 / (LOG2E * LOG2E)), mask=ok_p)
