"""Shared ``@triton.jit`` helpers of every attention kernel: tile loads, the score tile (``q kᵀ`` scaled,
plus the in-kernel Gaussian bias, the additive mask and the boolean mask) and the probabilities from
the saved row statistic. Every formula of the pipeline lives here once; the kernels only loop.

Conventions: a score tile is ``(BLOCK_M, BLOCK_N)`` float32, queries along rows and keys along columns,
``-inf`` wherever a key is masked or out of range (``TRANS``: the transposed ``(BLOCK_N, BLOCK_M)`` tile
``k qᵀ`` of the dK/dV kernel). Tiles are in the normalizer's unit: base 2 for softmax (``log2(e)``
folded into the scale), ``z / 2`` for entmax-1.5. Masked loads fill with 0 (and padded head-dim
columns are zero in both operands, so they add nothing to ``q kᵀ``).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# Newton's stopping tolerance for the entmax threshold: sqrt(float32 eps), as in the torch path.
NEWTON_TOL: tl.constexpr = tl.constexpr(3.4526698e-04)
# A bound on the Newton passes over the keys (typically 2-8 are needed), not a tuning knob.
NEWTON_MAX_STEPS: tl.constexpr = tl.constexpr(32)
# exp(x) is exactly 0 in float32 below about -103.3; a Gaussian exponent below this bound is 0 with margin.
GAUSS_ZERO: tl.constexpr = tl.constexpr(-120.0)
# softmax scales an additive mask by log2(e): values below -2^127 are raised to it first (no overflow).
ADD_FLOOR: tl.constexpr = tl.constexpr(-1.7014118346046923e38)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """``a @ b`` accumulated in float32. ``F32_DOT`` (see ``backend.dot_mode``): 0 = the operands' own
    dot (fp16 / bf16 tensor cores), 1 = both upcast, IEEE float32, 2 = float32 operands as TF32."""
    if F32_DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _offset(base, b, h, stride_b, stride_h):
    """Pointer to the ``(b, h)`` slice, in 64-bit arithmetic (large masks overflow int32)."""
    return base + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c):
    """``base + offs_r * stride_r + offs_c * stride_c`` in 64-bit arithmetic: with a permuted layout (a
    row stride of B * H * D, a transposed operand) or a flat row index over B * H * N rows, the products
    pass 2^31 long before any tensor does."""
    return base + offs_r.to(tl.int64)[:, None] * stride_r + offs_c.to(tl.int64)[None, :] * stride_c


@triton.jit
def _load_tile(base, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    """``(len(offs_r), len(offs_c))`` tile with zeros outside ``n_r x n_c``."""
    ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    return tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)


@triton.jit
def _store_tile(base, value, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c))


@triton.jit
def _program(n_heads):
    """``(bh, b, h)`` of this program (axis 1 of every grid runs over batch x heads)."""
    bh = tl.program_id(1)
    return bh, bh // n_heads, bh % n_heads


@triton.jit
def _bases(Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh):
    """The ``(b, h)`` slices of q, k, v, the additive mask and the keep-mask (64-bit offsets)."""
    return (
        _offset(Q, b, h, s_qb, s_qh), _offset(K, b, h, s_kb, s_kh), _offset(V, b, h, s_vb, s_vh),
        _offset(ADD, b, h, s_ab, s_ah), _offset(KEEP, b, h, s_mb, s_mh),
    )


@triton.jit
def _row_stats(STAT, DELTA, row, offs_m, n_q):
    """The saved row statistic (``+inf`` on padded rows) and the row term of ``offs_m``."""
    stat = tl.load(STAT + row + offs_m, mask=offs_m < n_q, other=float("inf"))
    delta = tl.load(DELTA + row + offs_m, mask=offs_m < n_q, other=0.0)
    return stat, delta


@triton.jit
def _qv(x, TRANS: tl.constexpr):
    """A per-query vector broadcast over a tile: along rows, or along columns if ``TRANS``."""
    if TRANS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _kv(x, TRANS: tl.constexpr):
    """A per-key vector broadcast over a tile: along columns, or along rows if ``TRANS``."""
    if TRANS:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _gauss_rows(den_base, alpha_base, offs_m, n_q, num_prefix, s_dp, s_dc, s_ap):
    """Per query row: ``1 / den_row``, ``1 / den_col`` and ``alpha`` (alpha = 0 on prefix / padded rows).

    ``den`` is ``(.., Np, 2)`` = ``r * sigma + eps``; ``alpha`` is ``(.., Np)``; row ``i`` is patch ``i - P``.
    """
    p = offs_m - num_prefix
    ok = (p >= 0) & (offs_m < n_q)
    p = tl.where(ok, p, 0).to(tl.int64)
    inv_r = 1.0 / tl.load(den_base + p * s_dp, mask=ok, other=1.0).to(tl.float32)
    inv_c = 1.0 / tl.load(den_base + p * s_dp + s_dc, mask=ok, other=1.0).to(tl.float32)
    alpha = tl.load(alpha_base + p * s_ap, mask=ok, other=0.0).to(tl.float32)
    return inv_r, inv_c, alpha


@triton.jit
def _row_bias(
    DEN, ALPHA, b, h, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, offs_m, n_q, num_prefix,
    GAUSS: tl.constexpr,
):
    """:func:`_gauss_rows` of this ``(b, h)`` (zeros without a Gaussian bias)."""
    inv_r, inv_c, alpha = 0.0, 0.0, 0.0
    if GAUSS:
        inv_r, inv_c, alpha = _gauss_rows(
            _offset(DEN, b, h, s_db, s_dh), _offset(ALPHA, b, h, s_alb, s_alh),
            offs_m, n_q, num_prefix, s_dp, s_dc, s_alp,
        )
    return inv_r, inv_c, alpha


@triton.jit
def _gauss_exponent(pm, pn, inv_r, inv_c, grid_w, clamp):
    """``a_row, a_col`` of query patches ``pm`` against key patches ``pn`` (broadcast tensors):
    ``a_m = max(-(coord_p,m - coord_t,m)^2 / 2, clamp) / den_p,m``."""
    d_row = (pm // grid_w - pn // grid_w).to(tl.float32)
    d_col = (pm % grid_w - pn % grid_w).to(tl.float32)
    a_row = tl.maximum(-0.5 * d_row * d_row, clamp) * inv_r
    a_col = tl.maximum(-0.5 * d_col * d_col, clamp) * inv_c
    return a_row, a_col


@triton.jit
def _gauss_tile(offs_m, offs_n, n_k, inv_r, inv_c, alpha, num_prefix, grid_w, clamp, TRANS: tl.constexpr):
    """GAug bias of a tile: ``(bias, e, a_row, a_col)`` with ``bias = alpha * e``, ``e = exp(a_row + a_col)``
    (:func:`_gauss_exponent`); zero on prefix rows / columns. Keys along rows if ``TRANS``."""
    pm = _qv(tl.maximum(offs_m - num_prefix, 0), TRANS)
    pn = _kv(tl.maximum(offs_n - num_prefix, 0), TRANS)
    a_row, a_col = _gauss_exponent(pm, pn, _qv(inv_r, TRANS), _qv(inv_c, TRANS), grid_w, clamp)
    keys = _kv(offs_n, TRANS)
    inside = (_qv(offs_m, TRANS) >= num_prefix) & (keys >= num_prefix) & (keys < n_k)
    e = tl.where(inside, tl.exp(a_row + a_col), 0.0)
    return _qv(alpha, TRANS) * e, e, a_row, a_col


@triton.jit
def _gauss_reaches(offs_m, n_lo, n_hi, n_q, inv_r, inv_c, num_prefix, grid_w, clamp):
    """Whether the GAug bias can be nonzero anywhere on the tile of queries ``offs_m`` x keys
    ``[n_lo, n_hi)`` (a scalar). False only where every ``exp(a_row + a_col)`` is exactly 0 in float32.

    Per query row, the bound is :func:`_gauss_exponent` at the smallest grid distance to the tile's
    keys (the key patches form one range: its grid rows ``[r_lo, r_hi]``, its columns a range if it
    lies in one grid row, else all of them). Every float operation there is monotone, so the bound is
    >= every element's computed exponent; below ``GAUSS_ZERO`` (-120: ``e^-120`` is 1e-52, far under
    float32's smallest subnormal 1.4e-45) every ``exp`` of the tile, and so the bias, is exactly 0.
    """
    lo = tl.maximum(n_lo - num_prefix, 0)
    hi = n_hi - 1 - num_prefix
    r_lo = lo // grid_w
    r_hi = hi // grid_w
    one_row = r_lo == r_hi
    c_lo = tl.where(one_row, lo % grid_w, 0)
    c_hi = tl.where(one_row, hi % grid_w, grid_w - 1)
    pm = tl.maximum(offs_m - num_prefix, 0)
    qr = pm // grid_w
    qc = pm % grid_w
    dr = tl.maximum(tl.maximum(r_lo - qr, qr - r_hi), 0)
    dc = tl.maximum(tl.maximum(c_lo - qc, qc - c_hi), 0)
    a_row = tl.maximum(-0.5 * dr.to(tl.float32) * dr.to(tl.float32), clamp) * inv_r
    a_col = tl.maximum(-0.5 * dc.to(tl.float32) * dc.to(tl.float32), clamp) * inv_c
    rows = (offs_m >= num_prefix) & (offs_m < n_q)
    bound = tl.max(tl.where(rows, a_row + a_col, float("-inf")), 0)
    return (hi >= lo) & (bound > GAUSS_ZERO)


@triton.jit
def _scores(
    qk, gbias, offs_m, offs_n, n_q, n_k, scale,
    add_base, s_am, s_an, keep_base, s_km, s_kn,
    GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr, ENTMAX: tl.constexpr,
    TRANS: tl.constexpr,
):
    """``z = qk * scale (+ gaussian) (+ unit * additive)``, ``-inf`` where masked or out of range.

    The tile is in the normalizer's unit (see :func:`_probs`): ``scale`` and the Gaussian ``gbias``
    come pre-multiplied by it (``0.5`` for entmax-1.5, ``log2(e)`` for softmax). For softmax an
    additive mask below ``-2^127`` is raised to ``-2^127`` first (``-inf`` stays), so ``log2(e)``
    times it stays finite: ``torch.finfo(torch.float32).min`` masks rows as the torch path does.
    Keys along rows (``qk`` is ``k qᵀ``) if ``TRANS``.
    """
    z = qk * scale
    if GAUSS:
        z += gbias
    valid = (_qv(offs_m, TRANS) < n_q) & (_kv(offs_n, TRANS) < n_k)
    if HAS_ADD:
        if TRANS:
            ptrs = _tile_ptrs(add_base, offs_n, offs_m, s_an, s_am)
        else:
            ptrs = _tile_ptrs(add_base, offs_m, offs_n, s_am, s_an)
        add = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
        if ENTMAX:
            z += 0.5 * add
        else:
            add = tl.where((add < ADD_FLOOR) & (add > float("-inf")), ADD_FLOOR, add)
            z += LOG2E * add
    if HAS_KEEP:
        if TRANS:
            ptrs = _tile_ptrs(keep_base, offs_n, offs_m, s_kn, s_km)
        else:
            ptrs = _tile_ptrs(keep_base, offs_m, offs_n, s_km, s_kn)
        keep = tl.load(ptrs, mask=valid, other=0)
        valid = valid & (keep != 0)
    return tl.where(valid, z, float("-inf"))


@triton.jit
def _probs(z, stat, ENTMAX: tl.constexpr, TRANS: tl.constexpr):
    """``(p, g)`` of a score tile ``z`` (in the normalizer's unit, see :func:`_scores`) from the row
    statistic ``stat`` in the same unit.

    softmax: ``z`` and ``stat`` (the log-sum-exp) in base 2, ``p = 2^(z - stat)``, ``g = p``.
    entmax-1.5: ``z`` in units of ``z / 2``, ``stat`` = the threshold tau, ``g = (z - tau)_+``, ``p = g^2``.
    Dead rows carry ``stat = +inf`` and give zeros. Queries along columns if ``TRANS``.
    """
    if ENTMAX:
        g = tl.maximum(z - _qv(stat, TRANS), 0.0)
        return g * g, g
    else:
        p = tl.exp2(z - _qv(stat, TRANS))
        return p, p


@triton.jit
def _score_block(
    a, b, offs_m, offs_n, n_lo, n_q, n_k, scale,
    add_base, s_am, s_an, keep_base, s_mm, s_mn,
    inv_r, inv_c, alpha, num_prefix, grid_w, clamp,
    GAUSS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_KEEP: tl.constexpr, F32_DOT: tl.constexpr,
    ENTMAX: tl.constexpr, TRANS: tl.constexpr,
):
    """The masked score tile ``z`` (:func:`_scores`) of query tile ``a = q (BLOCK_M, D)`` against key tile
    ``b = k (BLOCK_N, D)``; with ``TRANS``, ``a = k`` and ``b = q`` and the tile is ``(BLOCK_N, BLOCK_M)``.

    ``scale`` and ``alpha`` in the normalizer's unit; ``n_lo`` = the first key of the tile. The Gaussian
    bias is computed only where :func:`_gauss_reaches` says it can be nonzero (bit-exact skip).
    """
    gbias = 0.0
    if GAUSS:
        if TRANS:
            n_hi = tl.minimum(n_lo + a.shape[0], n_k)
        else:
            n_hi = tl.minimum(n_lo + b.shape[0], n_k)
        gbias = tl.zeros([a.shape[0], b.shape[0]], tl.float32)
        if _gauss_reaches(offs_m, n_lo, n_hi, n_q, inv_r, inv_c, num_prefix, grid_w, clamp):
            gbias, _e, _ar, _ac = _gauss_tile(
                offs_m, offs_n, n_k, inv_r, inv_c, alpha, num_prefix, grid_w, clamp, TRANS
            )
    return _scores(
        _dot(a, tl.trans(b), F32_DOT), gbias, offs_m, offs_n, n_q, n_k, scale,
        add_base, s_am, s_an, keep_base, s_mm, s_mn, GAUSS, HAS_ADD, HAS_KEEP, ENTMAX, TRANS,
    )


@triton.jit
def _block_live(w0, w1, w2, w3, w4, w5, w6, w7, blk):
    """Whether key block ``blk`` is still live: bit ``blk`` of the 512-bit set ``w0..w7`` (int64 scalars)
    of dropped blocks is clear (blocks past 511 are never dropped)."""
    i = blk // 64
    shift = blk % 64 + tl.zeros([], tl.int64)
    word = tl.where(i == 0, w0, tl.where(i == 1, w1, tl.where(i == 2, w2, tl.where(i == 3, w3, tl.where(
        i == 4, w4, tl.where(i == 5, w5, tl.where(i == 6, w6, w7)))))))
    return (i >= 8) | (((word >> shift) & 1) == 0)


@triton.jit
def _block_drop(w0, w1, w2, w3, w4, w5, w6, w7, blk):
    """``w0..w7`` with key block ``blk`` dropped (its bit set; no-op past block 511)."""
    i = blk // 64
    bit = tl.full([], 1, tl.int64) << (blk % 64 + tl.zeros([], tl.int64))
    return (
        tl.where(i == 0, w0 | bit, w0), tl.where(i == 1, w1 | bit, w1),
        tl.where(i == 2, w2 | bit, w2), tl.where(i == 3, w3 | bit, w3),
        tl.where(i == 4, w4 | bit, w4), tl.where(i == 5, w5 | bit, w5),
        tl.where(i == 6, w6 | bit, w6), tl.where(i == 7, w7 | bit, w7),
    )


@triton.jit
def _fwd_prologue(
    Q, K, V, ADD, KEEP, DEN, ALPHA,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh,
    s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, n_heads, n_q, head_d, scale, num_prefix,
    UNIT: tl.constexpr, GAUSS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The common start of the forward kernels, for query block ``program_id(0)`` of ``(b, h)``.

    Returns ``(bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, inv_r, inv_c,
    scale * UNIT, alpha * UNIT)``: ``q`` the ``(BLOCK_M, BLOCK_D)`` query tile, the slices of
    :func:`_bases`, the Gaussian row terms of :func:`_row_bias` (``alpha`` and ``scale`` taken to the
    normalizer's unit ``UNIT``: ``log2(e)`` for softmax, ``0.5`` for entmax-1.5).
    """
    bh, b, h = _program(n_heads)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    q = _load_tile(q_base, offs_m, offs_d, s_qm, s_qd, n_q, head_d)
    inv_r, inv_c, alpha = _row_bias(
        DEN, ALPHA, b, h, s_db, s_dh, s_dp, s_dc, s_alb, s_alh, s_alp, offs_m, n_q, num_prefix, GAUSS
    )
    return (
        bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, inv_r, inv_c,
        scale * UNIT, alpha * UNIT,
    )

