"""Forward kernel of fused entmax-1.5 attention: a per-row threshold search over the key blocks, then
the output pass.

With ``y = z / 2`` (z = the masked, biased scores; the 1/2 is folded into the scale), ``entmax15(z) =
(y - tau)_+^2`` where ``tau`` makes the row sum to 1. Per block of query rows, as in the torch path
(:mod:`vitattn.functional.entmax15`), on the max-shifted scores ``x = y - m`` (``x <= 0``):

1. one pass over the keys: the row max ``m``, the count ``n`` of the finite ``y`` and a lower bound on
   ``sum max(x, -1)`` (kept a lower bound while the running max grows);
2. ``tau`` starts at the lower bound ``max(-1, mean - 1/sqrt(n))`` and is capped at ``hi = -1/sqrt(n)``;
   each Newton pass over the keys gathers ``k = |{x > tau}|``, ``s1 = sum (x - tau)_+`` and
   ``s2 = sum (x - tau)_+^2`` and steps on ``h = sqrt(s2) - 1`` from the left (convex, decreasing:
   every iterate stays a lower bound), until every row's step is below ``sqrt(float32 eps)`` — relative
   to the row, since ``x`` spans ``[-1, 0]`` where it matters (at most ``NEWTON_MAX_STEPS`` passes). A
   row masked by a large finite value (``-1e6``) therefore converges like any other;
3. the closed form on the support of the last iterate (the smaller root of
   ``k d^2 - 2 s1 d + s2 - 1 = 0``) gives the exact ``tau``;
4. the output pass accumulates ``p V`` with ``p = (x - tau)_+^2``.

Skipped work (exact, since tau only grows): a key block with ``x <= tau`` on every row of the tile
(found in the row-max pass when ``x <= -1``, and in every Newton pass) is dropped from the remaining
passes, K load and ``q kᵀ`` included; the output pass also skips V on a block without support at
the final ``tau``.

Saved for backward: ``STAT`` = ``m + tau`` (the threshold in units of ``z / 2``), float32
``(B, H, Nq)`` (``+inf`` for a row whose keys are all masked), and, when a gradient is needed,
``OG`` = ``sum_j g_j v_j / sum_j g_j`` with ``g = (x - tau)_+ = sqrt(p)``, float32 ``(B, H, Nq, Dv)``:
the backward's row term is then
``delta = dO . OG`` (the entmax analogue of softmax's ``dO . O``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    NEWTON_MAX_STEPS,
    NEWTON_TOL,
    _block_drop,
    _block_live,
    _dot,
    _fwd_prologue,
    _load_tile,
    _probs,
    _score_block,
    _store_tile,
)


@triton.jit
def _entmax_block(
    q, k_base, start_n, offs_m, offs_d, s_kn, s_kd, n_q, n_k, head_d, scale_y,
    add_base, s_am, s_an, keep_base, s_mm, s_mn, inv_r, inv_c, alpha_y, num_prefix, grid_w, clamp,
    m, tau, GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block of an entmax-1.5 forward pass: ``(offs_n, p, g)``, ``(BLOCK_M, BLOCK_N)`` tiles of
    :func:`_probs` at threshold ``tau`` on the shifted scores ``y - m`` (``y`` in units of ``z / 2``:
    ``scale_y``, ``alpha_y`` include the 1/2), loading the K tile of keys ``start_n + [0, BLOCK_N)``.

    Defined here, not in ``_common``: its tiles count as this kernel's (``_score_block`` of this module)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
    y = _score_block(
        q, k, offs_m, offs_n, start_n, n_q, n_k, scale_y, add_base, s_am, s_an, keep_base, s_mm, s_mn,
        inv_r, inv_c, alpha_y, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, True, False,
    )
    p, g = _probs(y - m[:, None], tau, True, False)
    return offs_n, p, g


@triton.jit
def _fwd_entmax15_kernel(
    Q, K, V, O, STAT, ADD, KEEP, DEN, ALPHA, OG,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    s_ab, s_ah, s_am, s_an, s_mb, s_mh, s_mm, s_mn, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp,
    n_heads, n_q, n_k, head_d, head_dv, scale, num_prefix, grid_w, clamp,
    GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr, F32_DOT: tl.constexpr,
    STORE_OG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``O[b, h, rows] = entmax15(z) V``, ``STAT = tau`` (and ``OG``) for one block of query rows.

    Shapes as in the softmax kernel; OG contiguous float32 ``(B, H, Nq, Dv)`` (written if ``STORE_OG``).
    """
    # key blocks known to have no support for any row of this tile (tau only grows): bits of w0..w7
    w0 = tl.full([], 0, tl.int64)
    w1, w2, w3, w4, w5, w6, w7 = w0, w0, w0, w0, w0, w0, w0
    # every tile is y = z / 2 (the 1/2 of entmax-1.5 folded into the scale and the Gaussian amplitude)
    bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, inv_r, inv_c, scale_y, alpha_y = (
        _fwd_prologue(
            Q, K, V, ADD, KEEP, DEN, ALPHA, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah,
            s_mb, s_mh, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, n_heads, n_q, head_d, scale,
            num_prefix, 0.5, GAUSS, BLOCK_M, BLOCK_D, BLOCK_DV,
        )
    )

    # 1. row max m of y, the count n of finite y and a lower bound on sum max(y - m, -1)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    count = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        blk = start_n // BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
        y = _score_block(
            q, k, offs_m, offs_n, start_n, n_q, n_k, scale_y, add_base, s_am, s_an, keep_base, s_mm, s_mn,
            inv_r, inv_c, alpha_y, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, True, False,
        )
        finite = y > float("-inf")
        block_max = tl.max(y, 1)
        m_new = tl.maximum(m, block_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # max(y - m_new, -1) >= max(y - m, -1) - (m_new - m): the running sum stays a lower bound
        total -= count * (m_safe - tl.where(m == float("-inf"), m_safe, m))
        total += tl.sum(tl.where(finite, tl.maximum(y - m_safe[:, None], -1.0), 0.0), 1)
        count += tl.sum(finite.to(tl.float32), 1)
        m = m_new
        # y - m <= -1 <= tau - m for every row: no support now or later
        if tl.max(block_max - m_safe, 0) <= -1.0:
            w0, w1, w2, w3, w4, w5, w6, w7 = _block_drop(w0, w1, w2, w3, w4, w5, w6, w7, blk)
    dead = count == 0.0
    m = tl.where(dead, 0.0, m)
    # in the shifted scale x = y - m (x <= 0, the row's scale is 1) the root lies in [lo, hi]
    inv_sqrt_n = 1.0 / tl.sqrt(tl.maximum(count, 1.0))
    hi = -inv_sqrt_n
    tau = tl.minimum(tl.maximum(-1.0, total / tl.maximum(count, 1.0) - inv_sqrt_n), hi)

    # 2. Newton passes from the left on h(tau) = ||(x - tau)_+|| - 1, over the blocks still live
    s0 = tl.zeros([BLOCK_M], tl.float32)
    s1 = tl.zeros([BLOCK_M], tl.float32)
    s2 = tl.zeros([BLOCK_M], tl.float32)
    steps = tl.full([], 0, tl.int32)
    going = steps == 0
    while going:
        s0 = tl.zeros([BLOCK_M], tl.float32)
        s1 = tl.zeros([BLOCK_M], tl.float32)
        s2 = tl.zeros([BLOCK_M], tl.float32)
        for start_n in range(0, n_k, BLOCK_N):
            if _block_live(w0, w1, w2, w3, w4, w5, w6, w7, start_n // BLOCK_N):
                _n, p, g = _entmax_block(q, k_base, start_n, offs_m, offs_d, s_kn, s_kd, n_q, n_k, head_d,
                    scale_y, add_base, s_am, s_an, keep_base, s_mm, s_mn, inv_r, inv_c, alpha_y, num_prefix,
                    grid_w, clamp, m, tau, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, BLOCK_N)
                s0 += tl.sum((g > 0.0).to(tl.float32), 1)
                s1 += tl.sum(g, 1)
                s2 += tl.sum(p, 1)
                if tl.max(tl.max(g, 1), 0) == 0.0:
                    w0, w1, w2, w3, w4, w5, w6, w7 = _block_drop(
                        w0, w1, w2, w3, w4, w5, w6, w7, start_n // BLOCK_N
                    )
        norm = tl.sqrt(s2)
        step = tl.where(s1 > 0.0, (norm - 1.0) * norm / tl.where(s1 > 0.0, s1, 1.0), 0.0)
        step = tl.maximum(step, 0.0)
        steps += 1
        # the step is in the shifted scale, so the tolerance is relative to the row
        going = (tl.max(step, 0) > NEWTON_TOL) & (steps < NEWTON_MAX_STEPS)
        tau = tl.where(going, tl.minimum(tau + step, hi), tau)

    # 3. closed form on the support {x > tau}: tau += (s2 - 1) / (s1 + sqrt(s1^2 - k (s2 - 1)))
    disc = tl.maximum(s1 * s1 - s0 * (s2 - 1.0), 0.0)
    denom = s1 + tl.sqrt(disc)
    tau += tl.where(denom > 0.0, (s2 - 1.0) / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tau = tl.where(dead, float("inf"), tau)

    # 4. output pass over the live blocks; a block without support at the final tau skips V
    g_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        if _block_live(w0, w1, w2, w3, w4, w5, w6, w7, start_n // BLOCK_N):
            offs_n, p, g = _entmax_block(q, k_base, start_n, offs_m, offs_d, s_kn, s_kd, n_q, n_k, head_d,
                scale_y, add_base, s_am, s_an, keep_base, s_mm, s_mn, inv_r, inv_c, alpha_y, num_prefix,
                grid_w, clamp, m, tau, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, BLOCK_N)
            if tl.max(tl.max(g, 1), 0) > 0.0:
                v = _load_tile(v_base, offs_n, offs_dv, s_vn, s_vd, n_k, head_dv)
                acc += _dot(p.to(v.dtype), v, F32_DOT)
                if STORE_OG:
                    acc_g += _dot(g.to(v.dtype), v, F32_DOT)
                    g_sum += tl.sum(g, 1)

    row = bh.to(tl.int64) * n_q
    _store_tile(O + row * head_dv, acc, offs_m, offs_dv, head_dv, 1, n_q, head_dv)
    # the backward recomputes y and takes g = (y - STAT)_+: STAT = m + tau in units of z / 2
    tl.store(STAT + row + offs_m, m + tau, mask=offs_m < n_q)
    if STORE_OG:
        og = acc_g / tl.where(g_sum > 0.0, g_sum, 1.0)[:, None]
        _store_tile(OG + row * head_dv, og, offs_m, offs_dv, head_dv, 1, n_q, head_dv)
