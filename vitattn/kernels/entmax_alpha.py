"""Forward kernel of fused alpha-entmax attention with a tensor of alphas (one per head, per batch entry or
per query row): a per-row threshold search over the key blocks, then the output pass.

With ``a = alpha - 1`` and ``beta = 1 / a`` of the row, ``alpha-entmax(z) = (y - tau)_+^beta`` with
``y = a z`` and ``tau`` making the row sum to 1. Per block of query rows, on the max-shifted scores
``x = a (z - m)`` (``x <= 0``, ``m`` the row max; the root lies in ``[-1, -n^-a]`` for ``n`` finite keys):

1. one pass over the keys: the row max ``m`` and the count ``n`` of the finite scores (with a mask only);
2. Newton passes on ``h(tau) = ||(x - tau)_+||_beta - 1`` from ``tau = -1``: each gathers ``S = sum u^beta``
   and ``T = sum u^(beta - 1)`` (``u = (x - tau)_+``), and Newton's step on ``h`` is
   ``(S - S^(1 - a)) / T``. For ``beta >= 1`` (alpha <= 2) ``h`` is convex and decreasing, so every iterate
   from the left stays a lower bound and the steps shrink quadratically near the root (the norm is
   nearly linear in ``tau`` far from it: few passes). Each pass also narrows a bracket ``[lo, hi]`` of the
   root (``S >= 1``: ``tau`` is at or below it); a step that leaves the bracket, or (alpha > 2, where ``h``
   is not convex and Newton can cycle) does not halve the step of two passes before, is replaced by the
   bracket's midpoint. A row is done once its step is below ``2^-21`` (a few
   float32 ulps of the row's scale 1; the step is applied); the passes end when every row of the tile is
   done (``ALPHA_MAX_PASSES`` at most);
3. the output pass accumulates ``p V`` and ``sum p`` with ``p = u^beta`` and writes ``p V / sum p`` (the
   weights renormalized: what is left of the search's rounding is a relative error of the row sum).

Per score one ``log2`` and one ``exp2``: ``g = u^(beta - 1) = exp2((beta - 1) log2(u))`` (0 where ``u = 0``)
and ``p = g u`` (:func:`alpha_powers`). No key loop branches on data.

Saved for backward: ``STAT`` = ``a m + tau``, the threshold in units of ``a z`` (``+inf`` for a row whose
keys are all masked; the backward forms ``u = (a z - STAT)_+``), and, when a gradient is needed, ``OG`` =
``sum_j g_j v_j / sum_j g_j`` with ``g = u^(beta - 1)``: the backward's row term is ``delta = dO . OG``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    _coords_start,
    _coords_step,
    _dot,
    _fwd_prologue,
    _offset,
    _program,
    _store_tile,
    key_slots,
    load_tile_at,
    threshold_excess,
    tile_offsets,
)
from ._tiles import (
    coords_jump,
    grid_chunk,
    grid_scores,
    grid_tile,
    listed_scores,
    load_slots,
    prefix_tile,
    tile_index,
    tile_list,
    window_rows,
)
from .env import interpret_requested

# A Newton step below this (2^-21, in units of the row's scale 1) ends the row's search.
ALPHA_TOL: tl.constexpr = tl.constexpr(4.76837158203125e-07)
# A bound on the passes over the keys (typically 3-6 are needed), not a tuning knob.
ALPHA_MAX_PASSES: tl.constexpr = tl.constexpr(40)


if interpret_requested():  # the interpreter has no libdevice: numpy's exact log2

    @triton.jit
    def fast_log2(x):
        """``log2(x)`` (``-inf`` at 0)."""
        return tl.log2(x)

else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def fast_log2(x):
        """``log2(x)`` on the special-function unit (``lg2.approx``, ``-inf`` at 0): ``tl.log2`` is the exact
        software form (an integer-to-float conversion and a polynomial, ~20 instructions)."""
        return libdevice.fast_log2f(x)


@triton.jit
def alpha_rows(ENT, b, h, s_eb, s_eh, s_em, offs_m, n_q):
    """``(a, beta)`` of the query rows ``offs_m``: ``a = alpha - 1`` from the alphas ``ENT`` (strides
    ``s_e*``, 0 on broadcast dims) and ``beta = 1 / a``; padded rows get alpha = 2."""
    return alpha_rows_at(_offset(ENT, b, h, s_eb, s_eh), s_em, offs_m, n_q)


@triton.jit
def alpha_rows_at(ent_base, s_em, offs_m, n_q):
    """:func:`alpha_rows` from the ``(b, h)`` row's base pointer ``ent_base``."""
    a = tl.load(ent_base + offs_m.to(tl.int64) * s_em, mask=offs_m < n_q, other=2.0).to(tl.float32) - 1.0
    return a, 1.0 / a


LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def alpha_grad_weights(u, l):
    """``w = u (1 - ln2 l)`` where ``u > 0``, else 0 (``l = log2 u``, :func:`alpha_powers`): per score, the
    factor of ``dZ`` in the backward's sum for the alphas' gradient (:func:`alpha_grad`)."""
    return tl.where(u > 0.0, u - LN2 * (u * l), 0.0)


@triton.jit
def alpha_grad(beta, sum_dz_w, sum_p, delta):
    """The gradient to each row's alpha from the backward's sums: ``beta^2 (sum dZ w + delta (sum p - 1))``,
    ``entmax_alpha``'s closed form ``beta^2 (sum dP p - delta) - beta (sum dP p ln p - delta H)`` written
    with ``dZ = g (dP - delta)``, ``p = g u`` and ``ln p = beta ln2 log2 u``: no difference of two nearly
    equal sums."""
    return beta * beta * (sum_dz_w + delta * (sum_p - 1.0))


@triton.jit
def alpha_powers(u, beta):
    """``(p, g, l)`` of a tile ``u >= 0`` with ``beta`` broadcast to it: ``g = u^(beta - 1)`` (0 where
    ``u = 0``), ``p = u^beta = g u`` and ``l = log2(u)`` (``-inf`` where ``u = 0``): one ``log2`` and one
    ``exp2`` per score."""
    l = fast_log2(u)
    g = tl.where(u > 0.0, tl.exp2(l * (beta - 1.0)), 0.0)
    return g * u, g, l


@triton.jit
def _alpha_max(z, m, count, MASKED: tl.constexpr):
    """The first pass over one key tile ``z``: the row max and (``MASKED``) the finite keys' count."""
    m = tl.maximum(m, tl.max(z, 1))
    if MASKED:
        count += tl.sum(tl.where(z > float("-inf"), 1.0, 0.0), 1)
    return m, count


@triton.jit
def _alpha_sums(z, m, a, beta, tau, s_p, s_g, FOLD: tl.constexpr):
    """A Newton pass over one key tile ``z`` at the thresholds ``a m + tau``: ``S += sum u^beta``,
    ``T += sum u^(beta - 1)``."""
    u = tl.maximum(threshold_excess(z, m, a, tau, FOLD), 0.0)
    p, g, _l = alpha_powers(u, beta[:, None])
    return s_p + tl.sum(p, 1), s_g + tl.sum(g, 1)


@triton.jit
def _alpha_output(z, v, m, a, beta, tau, acc, acc_g, p_sum, g_sum, FOLD: tl.constexpr,
                  STORE_OG: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    """The output pass over one key tile: ``acc += p V``, ``p_sum += sum p`` (and, with ``STORE_OG``,
    ``acc_g += g V``, ``g_sum += sum g``)."""
    u = tl.maximum(threshold_excess(z, m, a, tau, FOLD), 0.0)
    p, g, _l = alpha_powers(u, beta[:, None])
    acc += _dot(p.to(v.dtype), v, F32_DOT)
    p_sum += tl.sum(p, 1)
    if STORE_OG:
        acc_g += _dot(g.to(v.dtype), v, F32_DOT)
        g_sum += tl.sum(g, 1)
    return acc, acc_g, p_sum, g_sum


@triton.jit
def _fwd_entmax_alpha_kernel(
    Q,
    K,
    V,
    O,
    STAT,
    ADD,
    KEEP,
    DEN,
    ALPHA,
    OG,
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
    grid_h,
    WLIST,
    WCNT,
    n_wcols,
    WIN,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    STORE_OG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    UNIFORM: tl.constexpr = False,
    OFFS32: tl.constexpr = False,
    GWP: tl.constexpr = 16,
    PAD_W: tl.constexpr = False,
    GRID_TW: tl.constexpr = 16,
):
    """``O[b, h, rows] = alpha-entmax(z) V``, ``STAT`` (and ``OG``) for one block of query rows.

    Shapes as in the softmax kernel; ``ENT`` float32 alphas ``(B, H, Nq)`` (strides ``s_e*``); OG contiguous
    float32 ``(B, H, Nq, Dv)`` (written if ``STORE_OG``). With a Gaussian bias and no window the passes
    visit grid-aligned key tiles (``GWP``, ``PAD_W``, ``GRID_TW``, ``grid_h`` as in the softmax kernel;
    ``EVEN_N`` then means no prefix keys and whole tiles of grid rows), else tiles of ``BLOCK_N`` tokens.
    """
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
    _bh, b, h = _program(n_heads)
    a, beta = alpha_rows(ENT, b, h, s_eb, s_eh, s_em, offs_m, n_q)
    kr0, kc0 = _coords_start(tl.arange(0, BLOCK_N), num_prefix, grid_w)
    _step_r, _step_c, gw = _coords_step(BLOCK_N, grid_w)
    ctr_r, half_r, ctr_c, half_c = 0.0, 0.0, 0.0, 0.0
    if WINDOW:  # the window's key tiles (every tile without one) and its bounds per query
        ctr_r, half_r, ctr_c, half_c = window_rows(WIN, offs_m, n_q)
    n_wit, wrow = tile_list(WLIST, WCNT, n_wcols, 0, tl.cdiv(n_q, BLOCK_M), n_k, BLOCK_N, WINDOW, UNIFORM)
    masked = HAS_ADD or HAS_KEEP or WINDOW
    FOLD: tl.constexpr = not HAS_ADD  # threshold_excess: a m + tau formed once per row
    masks = (add_base, s_am, s_an, keep_base, s_mm, s_mn)  # listed_scores' operands
    gq = (qr, qc, cr, fr, cc, fc, alpha)
    win = (ctr_r, half_r, ctr_c, half_c, WIN)
    # grid-aligned key tiles (a Gaussian bias without a window; _common, "grid-aligned key tiles"), as in
    # the entmax-1.5 forward: the prefix keys' tiles (no bias), then per chunk of TILE_W grid columns (its
    # column factors once) the tiles of NR whole grid rows (their row factors once per tile)
    GRID: tl.constexpr = GAUSS and not WINDOW
    TILE_W: tl.constexpr = GRID_TW
    CH: tl.constexpr = GWP // GRID_TW
    NR: tl.constexpr = BLOCK_N // GRID_TW
    MASKED_G: tl.constexpr = PAD_W or not EVEN_N  # grid slots past the grid width or the keys
    slot_off, col = key_slots(BLOCK_N, TILE_W, grid_w)
    kg_tile = tile_offsets(slot_off, offs_d, s_kn, s_kd, OFFS32)
    vg_tile = tile_offsets(slot_off, offs_dv, s_vn, s_vd, OFFS32)
    n_pre = tl.cdiv(num_prefix, BLOCK_N)
    n_gt = tl.cdiv(grid_h, NR)
    # the column factors carry alpha itself: grid_scores adds the bias after the scale (SCALED_BIAS), in the
    # order of the backward's scores, at the same instruction count (the scale's multiply is not fused here:
    # a multiply-add with a follows), so a key at a support's edge rounds as in the backward (dα of alpha = 2
    # rows, where g = 1 on the support)

    # 1. the row max m (natural units) and the finite keys
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    count = tl.zeros([BLOCK_M], tl.float32)
    if GRID:
        if not EVEN_N:  # prefix keys
            for t in range(0, n_pre):
                tok0, offs_n, ok = prefix_tile(t, num_prefix, BLOCK_N)
                z = grid_scores(q, k_base, k_tile, tok0, offs_n, ok, offs_m, offs_d,
                                n_q, n_k, head_d, scale, 1.0, masks, 0.0, 0.0, False, HAS_ADD, HAS_KEEP,
                                F32_DOT, True, EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, False)  # fmt: skip
                m, count = _alpha_max(z, m, count, masked)
        for ch in tl.static_range(CH):
            c, col_ok = grid_chunk(qc, cc, fc, alpha, col, ch, grid_w, TILE_W)
            a0 = 0.0
            for i in range(0, n_gt):
                r, tok0, offs_n, ok = grid_tile(qr, cr, fr, a0, ch, i, slot_off, col_ok, num_prefix,
                                                grid_w, n_k, TILE_W, NR)  # fmt: skip
                z = grid_scores(q, k_base, kg_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d, scale,
                                1.0, masks, r, c, True, HAS_ADD, HAS_KEEP, F32_DOT, MASKED_G, EVEN_M, EVEN_D,
                                BLOCK_M, NR, TILE_W, OFFS32, True)  # fmt: skip
                m, count = _alpha_max(z, m, count, masked)
                a0 += NR
    else:
        for it in range(0, n_wit):
            tile = tile_index(wrow, it, WINDOW)
            start_n = tile * BLOCK_N
            kr, kc = kr0, kc0
            if WINDOW and GAUSS:  # a listed tile's grid coordinates (the Gaussian bias')
                kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
            z, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d, scale,
                                      1.0, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, WINDOW,
                                      EVEN_M, EVEN_N, EVEN_D, BLOCK_N, OFFS32)  # fmt: skip
            m, count = _alpha_max(z, m, count, masked)
    if masked:
        dead = m == float("-inf")
    else:
        count = tl.full([BLOCK_M], 1.0, tl.float32) * n_k
        dead = count == 0.0
    m = tl.where(dead, 0.0, m)
    # the root lies in [-1, -n^-a] (shifted scale x = a (z - m) <= 0)
    lo = tl.full([BLOCK_M], -1.0, tl.float32)
    hi = -tl.exp2(-a * tl.log2(tl.maximum(count, 1.0)))
    tau = lo
    # rtsafe's safeguard where h is not convex (beta < 1): a Newton step must halve the step taken two
    # passes before, else the bracket is bisected (Newton alone can cycle there)
    prev = tl.full([BLOCK_M], float("inf"), tl.float32)
    prev2 = prev

    # 2. Newton passes on the beta-norm, inside a bracket of the root
    done = dead
    steps = tl.full([], 0, tl.int32)
    going = steps == 0
    while going:
        s_p = tl.zeros([BLOCK_M], tl.float32)
        s_g = tl.zeros([BLOCK_M], tl.float32)
        if GRID:
            if not EVEN_N:  # prefix keys
                for t in range(0, n_pre):
                    tok0, offs_n, ok = prefix_tile(t, num_prefix, BLOCK_N)
                    z = grid_scores(q, k_base, k_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k,
                                    head_d, scale, 1.0, masks, 0.0, 0.0, False, HAS_ADD, HAS_KEEP, F32_DOT,
                                    True, EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, False)  # fmt: skip
                    s_p, s_g = _alpha_sums(z, m, a, beta, tau, s_p, s_g, FOLD)
            for ch in tl.static_range(CH):
                c, col_ok = grid_chunk(qc, cc, fc, alpha, col, ch, grid_w, TILE_W)
                a0 = 0.0
                for i in range(0, n_gt):
                    r, tok0, offs_n, ok = grid_tile(qr, cr, fr, a0, ch, i, slot_off, col_ok, num_prefix,
                                                    grid_w, n_k, TILE_W, NR)  # fmt: skip
                    z = grid_scores(q, k_base, kg_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d,
                                    scale, 1.0, masks, r, c, True, HAS_ADD, HAS_KEEP, F32_DOT, MASKED_G,
                                    EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, OFFS32, True)  # fmt: skip
                    s_p, s_g = _alpha_sums(z, m, a, beta, tau, s_p, s_g, FOLD)
                    a0 += NR
        else:
            for it in range(0, n_wit):
                tile = tile_index(wrow, it, WINDOW)
                start_n = tile * BLOCK_N
                kr, kc = kr0, kc0
                if WINDOW and GAUSS:
                    kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
                z, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d,
                                          scale, 1.0, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP,
                                          F32_DOT, WINDOW, EVEN_M, EVEN_N, EVEN_D, BLOCK_N,
                                          OFFS32)  # fmt: skip
                s_p, s_g = _alpha_sums(z, m, a, beta, tau, s_p, s_g, FOLD)
        steps += 1
        below = s_p >= 1.0  # tau is at or below the root
        lo = tl.where(below, tau, lo)
        hi = tl.where(below, hi, tau)
        # Newton's step on h = S^(1/beta) - 1: (S - S^(1 - a)) / T (S > 0 on [-1, root])
        s_pos = tl.maximum(s_p, 1e-30)
        step = (s_pos - tl.exp2((1.0 - a) * fast_log2(s_pos))) / tl.maximum(s_g, 1e-30)
        fin = (tl.abs(step) <= ALPHA_TOL) | (hi - lo <= ALPHA_TOL)
        nxt = tau + step
        newton = (nxt > lo) & (nxt < hi) & ((beta >= 1.0) | (2.0 * tl.abs(step) <= tl.abs(prev2)))
        nxt = tl.where(newton | fin, nxt, 0.5 * (lo + hi))
        prev2 = prev
        prev = nxt - tau
        tau = tl.where(done, tau, nxt)
        done = done | fin
        going = (tl.max(tl.where(done, 0, 1), 0) > 0) & (steps < ALPHA_MAX_PASSES)

    # 3. output pass: p V / sum p (and g V / sum g)
    p_sum = tl.zeros([BLOCK_M], tl.float32)
    g_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if GRID:
        if not EVEN_N:  # prefix keys
            for t in range(0, n_pre):
                tok0, offs_n, ok = prefix_tile(t, num_prefix, BLOCK_N)
                z = grid_scores(q, k_base, k_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d,
                                scale, 1.0, masks, 0.0, 0.0, False, HAS_ADD, HAS_KEEP, F32_DOT, True, EVEN_M,
                                EVEN_D, BLOCK_M, NR, TILE_W, False)  # fmt: skip
                v = load_slots(v_base, tok0, v_tile, offs_n, ok, offs_dv, head_dv, True, EVEN_D, False)
                acc, acc_g, p_sum, g_sum = _alpha_output(z, v, m, a, beta, tau, acc, acc_g, p_sum, g_sum,
                                                         FOLD, STORE_OG, F32_DOT)  # fmt: skip
        for ch in tl.static_range(CH):
            c, col_ok = grid_chunk(qc, cc, fc, alpha, col, ch, grid_w, TILE_W)
            a0 = 0.0
            for i in range(0, n_gt):
                r, tok0, offs_n, ok = grid_tile(qr, cr, fr, a0, ch, i, slot_off, col_ok, num_prefix,
                                                grid_w, n_k, TILE_W, NR)  # fmt: skip
                z = grid_scores(q, k_base, kg_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d, scale,
                                1.0, masks, r, c, True, HAS_ADD, HAS_KEEP, F32_DOT, MASKED_G, EVEN_M, EVEN_D,
                                BLOCK_M, NR, TILE_W, OFFS32, True)  # fmt: skip
                v = load_slots(v_base, tok0, vg_tile, offs_n, ok, offs_dv, head_dv, MASKED_G, EVEN_D, OFFS32)
                acc, acc_g, p_sum, g_sum = _alpha_output(z, v, m, a, beta, tau, acc, acc_g, p_sum, g_sum,
                                                         FOLD, STORE_OG, F32_DOT)  # fmt: skip
                a0 += NR
    else:
        for it in range(0, n_wit):
            tile = tile_index(wrow, it, WINDOW)
            start_n = tile * BLOCK_N
            kr, kc = kr0, kc0
            if WINDOW and GAUSS:  # a listed tile's grid coordinates (the Gaussian bias')
                kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
            z, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d, scale,
                                      1.0, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, WINDOW,
                                      EVEN_M, EVEN_N, EVEN_D, BLOCK_N, OFFS32)  # fmt: skip
            v = load_tile_at(v_base, start_n, v_tile, offs_n, offs_dv, n_k, head_dv, EVEN_N, EVEN_D, OFFS32)
            acc, acc_g, p_sum, g_sum = _alpha_output(z, v, m, a, beta, tau, acc, acc_g, p_sum, g_sum, FOLD,
                                                     STORE_OG, F32_DOT)  # fmt: skip

    row = bh.to(tl.int64) * n_q
    out = acc / tl.where(p_sum > 0.0, p_sum, 1.0)[:, None]
    _store_tile(O + row * head_dv, out, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
    stat = tl.where(dead, float("inf"), a * m + tau)
    if EVEN_M:
        tl.store(STAT + row + offs_m, stat)
    else:
        tl.store(STAT + row + offs_m, stat, mask=offs_m < n_q)
    if STORE_OG:
        og = acc_g / tl.where(g_sum > 0.0, g_sum, 1.0)[:, None]
        _store_tile(OG + row * head_dv, og, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
