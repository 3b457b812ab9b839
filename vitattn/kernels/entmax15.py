"""Forward kernel of fused entmax-1.5 attention: a per-row threshold search over the key blocks, then
the output pass.

With ``y = z / 2`` (z = the masked, biased scores), ``entmax15(z) = (y - tau)_+^2`` where ``tau`` makes
the row sum to 1. Per block of query rows, as in the torch path (:mod:`vitattn.functional.entmax15`):

1. one pass over the keys: the row max ``m``, the sum and count ``n`` of the finite ``y``;
2. ``tau`` starts at the lower bound ``max(m - 1, mean(y) - 1/sqrt(n))`` and is capped at
   ``hi = m - 1/sqrt(n)``; each Newton pass over the keys gathers ``k = |{y > tau}|``,
   ``s1 = sum (y - tau)_+`` and ``s2 = sum (y - tau)_+^2`` and steps on ``h = sqrt(s2) - 1`` from the
   left (convex, decreasing: every iterate stays a lower bound), until every row's step is below
   ``sqrt(float32 eps)`` (at most ``NEWTON_MAX_STEPS`` passes);
3. the closed form on the support of the last iterate (the smaller root of
   ``k d^2 - 2 s1 d + s2 - 1 = 0``) gives the exact ``tau``;
4. the output pass accumulates ``p V`` with ``p = (y - tau)_+^2``.

Saved for backward: ``STAT`` = ``tau`` in units of ``z / 2``, float32 ``(B, H, Nq)`` (``+inf`` for a row
whose keys are all masked), and, when a gradient is needed, ``OG`` = ``sum_j g_j v_j / sum_j g_j`` with
``g = (y - tau)_+ = sqrt(p)``, float32 ``(B, H, Nq, Dv)``: the backward's row term is then
``delta = dO . OG`` (the entmax analogue of softmax's ``dO . O``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    NEWTON_MAX_STEPS,
    NEWTON_TOL,
    _dot,
    _gauss_rows,
    _load_tile,
    _offset,
    _probs,
    _score_block,
    _store_tile,
)


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
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(_offset(Q, b, h, s_qb, s_qh), offs_m, offs_d, s_qm, s_qd, n_q, head_d)
    k_base = _offset(K, b, h, s_kb, s_kh)
    v_base = _offset(V, b, h, s_vb, s_vh)
    add_base = _offset(ADD, b, h, s_ab, s_ah)
    keep_base = _offset(KEEP, b, h, s_mb, s_mh)
    inv_r, inv_c, alpha = 0.0, 0.0, 0.0
    if GAUSS:
        inv_r, inv_c, alpha = _gauss_rows(
            _offset(DEN, b, h, s_db, s_dh), _offset(ALPHA, b, h, s_alb, s_alh),
            offs_m, n_q, num_prefix, s_dp, s_dc, s_alp,
        )

    # 1. row max, sum and count of the finite y = z / 2
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    count = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
        y = 0.5 * _score_block(
            q, k, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
            inv_r, inv_c, alpha, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT,
        )
        finite = y > float("-inf")
        m = tl.maximum(m, tl.max(y, 1))
        total += tl.sum(tl.where(finite, y, 0.0), 1)
        count += tl.sum(finite.to(tl.float32), 1)
    dead = count == 0.0
    m = tl.where(dead, 0.0, m)
    inv_sqrt_n = 1.0 / tl.sqrt(tl.maximum(count, 1.0))
    hi = m - inv_sqrt_n
    tau = tl.minimum(tl.maximum(m - 1.0, total / tl.maximum(count, 1.0) - inv_sqrt_n), hi)

    # 2. Newton passes from the left on h(tau) = ||(y - tau)_+|| - 1
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
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
            z = _score_block(
                q, k, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
                inv_r, inv_c, alpha, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT,
            )
            p, g = _probs(z, tau, True)
            s0 += tl.sum((g > 0.0).to(tl.float32), 1)
            s1 += tl.sum(g, 1)
            s2 += tl.sum(p, 1)
        norm = tl.sqrt(s2)
        step = tl.where(s1 > 0.0, (norm - 1.0) * norm / tl.where(s1 > 0.0, s1, 1.0), 0.0)
        step = tl.maximum(step, 0.0)
        steps += 1
        going = (tl.max(step, 0) > NEWTON_TOL) & (steps < NEWTON_MAX_STEPS)
        tau = tl.where(going, tl.minimum(tau + step, hi), tau)

    # 3. closed form on the support {y > tau}: tau += (s2 - 1) / (s1 + sqrt(s1^2 - k (s2 - 1)))
    disc = tl.maximum(s1 * s1 - s0 * (s2 - 1.0), 0.0)
    denom = s1 + tl.sqrt(disc)
    tau += tl.where(denom > 0.0, (s2 - 1.0) / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tau = tl.where(dead, float("inf"), tau)

    # 4. output pass
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    g_sum = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, s_kn, s_kd, n_k, head_d)
        z = _score_block(
            q, k, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
            inv_r, inv_c, alpha, num_prefix, grid_w, clamp, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT,
        )
        p, g = _probs(z, tau, True)
        v = _load_tile(v_base, offs_n, offs_dv, s_vn, s_vd, n_k, head_dv)
        acc += _dot(p.to(v.dtype), v, F32_DOT)
        if STORE_OG:
            acc_g += _dot(g.to(v.dtype), v, F32_DOT)
            g_sum += tl.sum(g, 1)

    row = bh.to(tl.int64) * n_q
    _store_tile(O + row * head_dv, acc, offs_m, offs_dv, head_dv, 1, n_q, head_dv)
    tl.store(STAT + row + offs_m, tau, mask=offs_m < n_q)
    if STORE_OG:
        og = acc_g / tl.where(g_sum > 0.0, g_sum, 1.0)[:, None]
        _store_tile(OG + row * head_dv, og, offs_m, offs_dv, head_dv, 1, n_q, head_dv)
