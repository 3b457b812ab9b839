"""Shared ``@triton.jit`` helpers of every attention kernel: tile loads, the score tile (``q kᵀ`` scaled,
plus the in-kernel Gaussian bias, the additive mask and the boolean mask), the probabilities from the
saved row statistic, and the Gaussian bias' separable row and column terms. Every formula of the
pipeline lives here once; the kernels only loop.

Conventions: a score tile is ``(BLOCK_M, BLOCK_N)`` float32, queries along rows and keys along columns,
``-inf`` wherever a key is masked or out of range (``TRANS``: the transposed ``(BLOCK_N, BLOCK_M)`` tile
``k qᵀ`` of the dK/dV kernel). Tiles are in the normalizer's unit: base 2 for softmax (``log2(e)``
folded into the scale), ``z / 2`` for entmax-1.5. Masked loads fill with 0 (and padded head-dim
columns are zero in both operands, so they add nothing to ``q kᵀ``). ``EVEN_*`` constexprs say a
dimension is a whole number of tiles (``EVEN_M``: queries, ``EVEN_N``: keys, ``EVEN_D``: both head
dims equal their padded size): the bound masks of that dimension are then left out. Products of a
``tl.constexpr`` and a tensor are written tensor first (the interpreter wraps ``constexpr * tensor`` in a
constexpr).

Nothing inside a key loop branches on data or converts an integer to a float: the Gaussian coordinates
of a tile's keys (or queries) are float vectors carried from one tile to the next
(:func:`_coords_start`, :func:`_coords_advance`), and the per-row terms of the bias are computed once
per row (:func:`gauss_rows`); the per-score work of the bias is a few FMA-class operations and one
``exp2`` (:func:`gauss_tile`). ``python -m vitattn.kernels._build.aot --report`` checks it in the SASS.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..functional import gaussian

LOG2E: tl.constexpr = tl.constexpr(gaussian.LOG2E)
# Newton's stopping tolerance for the entmax threshold: sqrt(float32 eps), as in the torch path.
NEWTON_TOL: tl.constexpr = tl.constexpr(3.4526698e-04)
# A bound on the Newton passes over the keys (typically 2-4 are needed), not a tuning knob.
NEWTON_MAX_STEPS: tl.constexpr = tl.constexpr(32)
# The per-axis floor of the Gaussian exponent (natural log units): gaussian_exponent's.
EXP_FLOOR: tl.constexpr = tl.constexpr(gaussian.EXPONENT_FLOOR)
# An additive mask enters the q kᵀ dot as add / scale, raised to -2^127 / max(scale, 1) (finite once scaled).
ADD_FLOOR: tl.constexpr = tl.constexpr(-1.7014118346046923e38)
# 1.5 * 2^23: adding it to a float32 |x| < 2^22 rounds x to an integer held in the low mantissa bits.
ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
ROUND_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B400000)
# 2^f on [-1/2, 1/2]: degree-6 fit (relative error < 2e-9 in exact arithmetic), highest power first.
EXP2_C6: tl.constexpr = tl.constexpr(1.5469000e-04)
EXP2_C5: tl.constexpr = tl.constexpr(1.3333558e-03)
EXP2_C4: tl.constexpr = tl.constexpr(9.6180390e-03)
EXP2_C3: tl.constexpr = tl.constexpr(5.5504109e-02)
EXP2_C2: tl.constexpr = tl.constexpr(2.4022650e-01)
EXP2_C1: tl.constexpr = tl.constexpr(6.9314718e-01)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """``a @ b`` accumulated in float32. ``F32_DOT`` (see ``env.dot_mode``): 0 = the operands' own
    dot (fp16 / bf16 tensor cores), 1 = both upcast, IEEE float32, 2 = float32 operands as TF32."""
    if F32_DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, F32_DOT: tl.constexpr):
    """``acc + a @ b`` (``acc`` a float32 tile) with the operands of :func:`_dot`."""
    if F32_DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    elif F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def row_partial_sums(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """``(BLOCK_M, PARTS)``: ``p`` ``(BLOCK_M, BLOCK_N)`` summed over the columns of each residue mod
    ``PARTS`` (``BLOCK_N`` a multiple of it); ``tl.sum(., 1)`` of it is the row sum.

    The forwards keep their running row sums as such partial sums (``PARTS = 8``,
    ``configs.ROW_PARTS_BY_ARCH``): the MMA layouts give each thread two adjacent columns of every eight,
    so a tile adds into its partial sums inside the thread (no shuffles across the threads of a row per
    tile) and the rows are summed once after the key loop. ``PARTS = 1`` is the plain row sum."""
    return tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_N // PARTS, PARTS)), 1)


@triton.jit
def row_partial_mins(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """``(BLOCK_M, PARTS)``: the minima of ``x`` ``(BLOCK_M, BLOCK_N)`` over the columns of each residue mod
    ``PARTS``, as :func:`row_partial_sums`."""
    return tl.min(tl.reshape(x, (BLOCK_M, BLOCK_N // PARTS, PARTS)), 1)


@triton.jit
def threshold_excess(z, m, a, tau, FOLD: tl.constexpr):
    """``a (z - m) - tau`` per score of a ``(BLOCK_M, BLOCK_N)`` tile ``z`` (``m``, ``a``, ``tau`` per row;
    entmax-1.5 passes ``a = 1``): how far each score lies above the row's threshold, in the normalizer's
    shifted scale. With ``FOLD`` the threshold ``a m + tau`` is formed once per row (as the backward's
    ``STAT``) and each score costs one multiply-add; without it (an additive mask: a row masked by
    ``-1e6`` would lose ``tau`` to the rounding of ``a m + tau``, whose spacing there is ~0.06) the
    shifted score ``z - m`` comes first, exact near the row max."""
    if FOLD:
        return z * a[:, None] - (a * m + tau)[:, None]
    else:
        return (z - m[:, None]) * a[:, None] - tau[:, None]


@triton.jit
def warp_uniform(x, ASM: tl.constexpr):
    """``x``, an int32 scalar every thread holds the same value of (a loaded count, a reduction), marked
    warp-uniform for ptxas with ``ASM``: a loop bound ptxas cannot prove uniform makes the loop divergent,
    and then every pipeline stage index and wgmma descriptor in it lives in vector registers and is moved
    back (``R2UR``) per iteration. A shuffle from lane 0 is an identity it can prove uniform. Without ``ASM``
    (the interpreter, which runs no PTX) ``x`` itself."""
    if ASM:
        return tl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, 0, 0x1f, -1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return x


@triton.jit
def exp2_fma(x):
    """``2^x`` for ``x <= 0`` (``-inf`` included) without the special-function unit: Cody-Waite
    reduction ``x = n + f`` (``n`` an integer by float rounding, ``|f| <= 1/2``), a degree-6 polynomial
    for ``2^f`` and ``2^n`` written into the exponent bits. Within 2 ulp of ``2^x`` down to ``2^-126``;
    0 below ``-126.5``. For the per-row rescaling of online softmax: the one ``exp2`` per score keeps
    the ``MUFU`` pipe (two with the Gaussian bias)."""
    x = tl.maximum(x, -127.0)
    big = x + ROUND_MAGIC  # round(x) + 1.5 * 2^23, exact
    n = big - ROUND_MAGIC
    f = x - n
    p = f * EXP2_C6 + EXP2_C5
    p = p * f + EXP2_C4
    p = p * f + EXP2_C3
    p = p * f + EXP2_C2
    p = p * f + EXP2_C1
    p = p * f + 1.0
    bits = big.to(tl.int32, bitcast=True) - ROUND_MAGIC_BITS + 127  # n + 127 in [0, 127]
    return p * (bits << 23).to(tl.float32, bitcast=True)


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
def tile_offsets(offs_r, offs_c, stride_r, stride_c, OFFS32: tl.constexpr):
    """A tile's addressing ``(offs, stride_r, stride_c)`` for :func:`load_tile_at`: with ``OFFS32`` ``offs``
    is the ``(R, C)`` tile of 32-bit element offsets ``offs_r * stride_r + offs_c * stride_c`` from the
    tile's first row, computed once per program (each load's address is then one add to a scalar pointer,
    where a 64-bit pointer per element takes a register pair and two adds); without it ``0`` (the loads
    build 64-bit pointers per tile: tensors whose offsets pass 2^31 and the builds where holding the
    offsets costs registers, ``ops.use_tile_offsets``)."""
    if OFFS32:
        return offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, stride_r, stride_c
    else:
        return 0, stride_r, stride_c


@triton.jit
def _bounds(offs_r, offs_c, n_r, n_c, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
    """The in-bounds mask of a tile whose rows or columns (or both) are ragged (never both even)."""
    if EVEN_R:
        return offs_c[None, :] < n_c
    elif EVEN_C:
        return offs_r[:, None] < n_r
    else:
        return (offs_r[:, None] < n_r) & (offs_c[None, :] < n_c)


@triton.jit
def _load_tile(
    base,
    offs_r,
    offs_c,
    stride_r,
    stride_c,
    n_r,
    n_c,
    EVEN_R: tl.constexpr,
    EVEN_C: tl.constexpr,
):
    """``(len(offs_r), len(offs_c))`` tile with zeros outside ``n_r x n_c`` (no mask on even dims)."""
    ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    if EVEN_R and EVEN_C:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=_bounds(offs_r, offs_c, n_r, n_c, EVEN_R, EVEN_C), other=0.0)


@triton.jit
def tile_ptrs_at(at, tile, ptrs, OFFS32: tl.constexpr):
    """The pointers of a tile the loop advances: with ``OFFS32`` its first row's scalar pointer ``at``
    plus its :func:`tile_offsets` ``tile``, else ``ptrs``, the 64-bit pointer tile the loop advances."""
    offs, _stride_r, _stride_c = tile
    if OFFS32:
        return at + offs
    else:
        return ptrs


@triton.jit
def load_tile_at(
    base,
    start,
    tile,
    offs_r,
    offs_c,
    n_r,
    n_c,
    EVEN_R: tl.constexpr,
    EVEN_C: tl.constexpr,
    OFFS32: tl.constexpr,
):
    """The tile of rows ``offs_r = start + arange(R)``, columns ``offs_c`` of ``base`` (``tile`` its
    :func:`tile_offsets`): zeros outside ``n_r x n_c`` (no mask on even dims)."""
    offs, stride_r, stride_c = tile
    if OFFS32:
        ptrs = base + tl.cast(start, tl.int64) * stride_r + offs
    else:
        ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    if EVEN_R and EVEN_C:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=_bounds(offs_r, offs_c, n_r, n_c, EVEN_R, EVEN_C), other=0.0)


@triton.jit
def _store_tile(
    base, value, offs_r, offs_c, stride_r, stride_c, n_r, n_c, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr
):
    ptrs = _tile_ptrs(base, offs_r, offs_c, stride_r, stride_c)
    if EVEN_R and EVEN_C:
        tl.store(ptrs, value.to(base.dtype.element_ty))
    else:
        inside = _bounds(offs_r, offs_c, n_r, n_c, EVEN_R, EVEN_C)
        tl.store(ptrs, value.to(base.dtype.element_ty), mask=inside)


@triton.jit
def _load_kv(k_ptrs, v_ptrs, ok, d_ok, dv_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """The K and V tiles through pointers: ``ok`` masks the keys (``MASKED``), ``d_ok`` / ``dv_ok`` the
    head dims (unless ``EVEN_D``); masked elements are 0."""
    if MASKED:
        if EVEN_D:
            return tl.load(k_ptrs, mask=ok[:, None], other=0.0), tl.load(v_ptrs, mask=ok[:, None], other=0.0)
        k = tl.load(k_ptrs, mask=ok[:, None] & d_ok[None, :], other=0.0)
        return k, tl.load(v_ptrs, mask=ok[:, None] & dv_ok[None, :], other=0.0)
    if EVEN_D:
        return tl.load(k_ptrs), tl.load(v_ptrs)
    return tl.load(k_ptrs, mask=d_ok[None, :], other=0.0), tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)


@triton.jit
def _block_offsets(BLOCK: tl.constexpr):
    """``program_id(0) * BLOCK + arange(BLOCK)`` in 64 bits (the product passes 2^31 on long grids)."""
    return tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _program(n_heads):
    """``(bh, b, h)`` of this program (axis 1 of every grid runs over batch x heads)."""
    bh = tl.program_id(1)
    return bh, bh // n_heads, bh % n_heads


@triton.jit
def _bases(Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh):
    """The ``(b, h)`` slices of q, k, v, the additive mask and the keep-mask (64-bit offsets)."""
    return (
        _offset(Q, b, h, s_qb, s_qh),
        _offset(K, b, h, s_kb, s_kh),
        _offset(V, b, h, s_vb, s_vh),
        _offset(ADD, b, h, s_ab, s_ah),
        _offset(KEEP, b, h, s_mb, s_mh),
    )


@triton.jit
def _row_stats(STAT, DELTA, row, offs_m, n_q, EVEN_M: tl.constexpr):
    """The saved row statistic (``+inf`` on padded rows) and the row term of ``offs_m``."""
    if EVEN_M:
        return tl.load(STAT + row + offs_m), tl.load(DELTA + row + offs_m)
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


# ---- the Gaussian bias: S_pt = alpha_p exp(t_row + t_col), separable per axis ------------------------


@triton.jit
def axis_coefs(den, clamp):
    """``(coef, floor)`` of one axis of the Gaussian exponent, per query row, from ``den = r sigma + eps``
    (> 0): ``coef = -log2(e) / (2 den)``, ``floor = log2(e) max(clamp / den, -40)``.

    With them :func:`axis_exponent` gives the library's per-axis exponent
    ``max(max(-offset^2 / 2, clamp) / den, -40)`` (``vitattn.functional.gaussian``) in log2 units: for
    ``den > 0``, ``max(a, clamp) / den = max(a / den, clamp / den)``, and the floor folds into the same max.
    """
    inv = 1.0 / den
    return inv * (-0.5 * LOG2E), tl.maximum(clamp * inv, EXP_FLOOR) * LOG2E


@triton.jit
def axis_exponent(offset, coef, floor):
    """One axis of the Gaussian exponent in log2 units from :func:`axis_coefs`: ``max(offset^2 coef,
    floor)`` (``offset`` a float grid offset; a multiply, a multiply and a max per score)."""
    return tl.maximum(offset * offset * coef, floor)


@triton.jit
def _coords_start(offs, num_prefix, grid_w):
    """Float grid coordinates ``(row, col)`` of the tokens ``offs`` (token ``i`` is patch ``i - P``);
    prefix tokens get a negative row. Integer division on non-negative values only."""
    lift = (num_prefix + grid_w - 1) // grid_w  # whole grid rows covering the prefix
    idx = offs - num_prefix + lift * grid_w
    return (idx // grid_w - lift).to(tl.float32), (idx % grid_w).to(tl.float32)


@triton.jit
def _coords_step(BLOCK: tl.constexpr, grid_w):
    """The float row / column step of :func:`_coords_advance` for tiles of ``BLOCK`` tokens."""
    # "* 1.0", not ".to(float32)": the JIT passes a grid width of 1 (no Gaussian bias) as a constant int
    return (BLOCK // grid_w) * 1.0, (BLOCK % grid_w) * 1.0, grid_w * 1.0


@triton.jit
def _coords_advance(row, col, step_r, step_c, gw):
    """The coordinates ``BLOCK`` tokens further (steps from :func:`_coords_step`), in float arithmetic on
    integers below 2^24 (exact): the column wraps once at most since ``step_c < gw``."""
    col = col + step_c
    wrap = col >= gw
    return row + step_r + tl.where(wrap, 1.0, 0.0), tl.where(wrap, col - gw, col)


@triton.jit
def gauss_rows(
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
):
    """Per query row of ``offs_m``: ``(cr, fr, cc, fc, alpha)``, the :func:`axis_coefs` of both axes and
    the amplitude (0 on prefix and padded rows, where the bias is 0).

    ``den`` is ``(.., Np, 2)`` = ``r * sigma + eps``; ``alpha`` is ``(.., Np)``; row ``i`` is patch ``i - P``.
    """
    p = offs_m - num_prefix
    ok = (p >= 0) & (offs_m < n_q)
    p = tl.where(ok, p, 0).to(tl.int64)
    den_base = _offset(DEN, b, h, s_db, s_dh)
    den_r = tl.load(den_base + p * s_dp, mask=ok, other=1.0).to(tl.float32)
    den_c = tl.load(den_base + p * s_dp + s_dc, mask=ok, other=1.0).to(tl.float32)
    alpha = tl.load(_offset(ALPHA, b, h, s_alb, s_alh) + p * s_alp, mask=ok, other=0.0).to(tl.float32)
    cr, fr = axis_coefs(den_r, clamp)
    cc, fc = axis_coefs(den_c, clamp)
    return cr, fr, cc, fc, alpha


@triton.jit
def gauss_tile(qr, qc, cr, fr, cc, fc, kr, kc, TRANS: tl.constexpr):
    """``e = exp(t_row + t_col)`` of a tile (one ``exp2`` per score), zero on prefix keys (``kr < 0``):
    query coordinates and terms per row, key coordinates per column (swapped if ``TRANS``)."""
    t_r = axis_exponent(_qv(qr, TRANS) - _kv(kr, TRANS), _qv(cr, TRANS), _qv(fr, TRANS))
    t_c = axis_exponent(_qv(qc, TRANS) - _kv(kc, TRANS), _qv(cc, TRANS), _qv(fc, TRANS))
    return tl.where(_kv(kr >= 0.0, TRANS), tl.exp2(t_r + t_c), 0.0)


# ---- scores and probabilities --------------------------------------------------------------------------


@triton.jit
def _mask_tile(
    offs_m,
    offs_n,
    n_q,
    n_k,
    scale,
    add_base,
    s_am,
    s_an,
    keep_base,
    s_km,
    s_kn,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    TRANS: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """The masks of a tile as one additive tile in units of ``q kᵀ``: ``add / scale`` (raised to
    ``-2^127 / max(scale, 1)`` where below it, ``-inf`` kept) and ``-inf`` where the keep-mask is 0. It
    is the accumulator of the tile's ``q kᵀ`` dot, so the mask tiles are converted to the dot's layout
    once instead of the score tile's arithmetic running in the load layout. ``scale`` is the unscaled
    softmax scale (> 0). With bound masks the loads are clamped, not masked: a query past ``n_q`` reads the
    last query's row and a key past ``n_k`` the last key's column (both are in bounds for ``n_q, n_k >= 1``;
    padded query rows are never used and every caller sets the scores of keys past ``n_k`` to ``-inf`` or
    never stores them). The bound masks' predicates held more registers than the loads: the masked
    forwards with a window spilled at head dim 128."""
    if not EVEN_M:  # in 32 bits (the indices are < 2^31; _tile_ptrs widens them): no sign word of n_q
        offs_m = tl.minimum(offs_m.to(tl.int32), n_q - 1)
    if not EVEN_N:
        offs_n = tl.minimum(offs_n.to(tl.int32), n_k - 1)
    pen = 0.0
    if HAS_ADD:
        if TRANS:
            ptrs = _tile_ptrs(add_base, offs_n, offs_m, s_an, s_am)
        else:
            ptrs = _tile_ptrs(add_base, offs_m, offs_n, s_am, s_an)
        add = tl.load(ptrs).to(tl.float32)
        floor = ADD_FLOOR / tl.maximum(scale, 1.0)
        pen = tl.where(add == float("-inf"), add, tl.maximum(add * (1.0 / scale), floor))
    if HAS_KEEP:
        if TRANS:
            ptrs = _tile_ptrs(keep_base, offs_n, offs_m, s_kn, s_km)
        else:
            ptrs = _tile_ptrs(keep_base, offs_m, offs_n, s_km, s_kn)
        keep = tl.load(ptrs)
        pen = tl.where(keep != 0, pen, float("-inf"))
    return pen


@triton.jit
def _probs(z, stat, ENTMAX: tl.constexpr, TRANS: tl.constexpr):
    """``(p, g)`` of a score tile ``z`` (in the normalizer's unit, see :func:`_score_tile`) from the row
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


# ---- the grid-aligned kernels' shared tile steps (softmax.py, backward.py; also used by _score_tile) ------


@triton.jit
def _qk_tile(
    a,
    b,
    offs_m,
    offs_n,
    n_q,
    n_k,
    scale,
    add_base,
    s_am,
    s_an,
    keep_base,
    s_mm,
    s_mn,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    TRANS: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """``a bᵀ`` plus the masks of the tile (:func:`_mask_tile`, in units of ``q kᵀ``) as the dot's
    accumulator: ``(BLOCK_M, BLOCK_N)`` float32 for ``a = q``, ``b = k`` (``(BLOCK_N, BLOCK_M)`` for
    ``a = k``, ``b = q`` with ``TRANS``); no mask without ``HAS_ADD`` / ``HAS_KEEP``."""
    if HAS_ADD or HAS_KEEP:
        pen = _mask_tile(
            offs_m,
            offs_n,
            n_q,
            n_k,
            scale,
            add_base,
            s_am,
            s_an,
            keep_base,
            s_mm,
            s_mn,
            HAS_ADD,
            HAS_KEEP,
            TRANS,
            EVEN_M,
            EVEN_N,
        )
        return _dot_acc(a, tl.trans(b), pen, F32_DOT)
    return _dot(a, tl.trans(b), F32_DOT)


@triton.jit
def _score_tile(
    a,
    b,
    offs_m,
    offs_n,
    n_q,
    n_k,
    scale,
    unit,
    add_base,
    s_am,
    s_an,
    keep_base,
    s_mm,
    s_mn,
    qr,
    qc,
    cr,
    fr,
    cc,
    fc,
    alpha,
    kr,
    kc,
    GAUSS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    F32_DOT: tl.constexpr,
    TRANS: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """``(z, e)``: the masked score tile of query tile ``a = q (BLOCK_M, D)`` against key tile
    ``b = k (BLOCK_N, D)`` (with ``TRANS``, ``a = k``, ``b = q`` and the tile is ``(BLOCK_N, BLOCK_M)``),
    and the Gaussian factor ``e`` of :func:`gauss_tile` (0 without ``GAUSS``).

    ``z = (q kᵀ + masks / scale) * scale * unit + alpha * e`` (:func:`_mask_tile`), ``-inf`` where a key
    is masked or past ``n_k``, in the normalizer's unit ``unit`` (see :func:`_probs`: ``log2(e)`` for
    softmax, ``1/2`` for entmax-1.5): ``alpha`` comes pre-multiplied by it. ``qr, qc, cr, fr, cc, fc``
    per query, ``kr, kc`` per key (see :func:`gauss_rows`, :func:`_coords_start`). On a row masked
    entirely by a finite value ``M`` the scores are rounded at ``|M|``, as the reference's float32
    scores are (for a power-of-two scale, exactly as there).
    """
    qk = _qk_tile(
        a, b, offs_m, offs_n, n_q, n_k, scale, add_base, s_am, s_an, keep_base, s_mm, s_mn,
        HAS_ADD, HAS_KEEP, F32_DOT, TRANS, EVEN_M, EVEN_N,
    )  # fmt: skip
    z = qk * (scale * unit)
    e = 0.0
    if GAUSS:
        e = gauss_tile(qr, qc, cr, fr, cc, fc, kr, kc, TRANS)
        z = z + _qv(alpha, TRANS) * e
    if not EVEN_N:
        z = tl.where(_kv(offs_n < n_k, TRANS), z, float("-inf"))
    return z, e


@triton.jit
def _fwd_prologue(
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
    GAUSS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """The common start of the forward kernels, for query block ``program_id(0)`` of ``(b, h)``.

    Returns ``(bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, qr, qc, cr, fr, cc,
    fc, alpha)`` with ``q`` the ``(BLOCK_M, BLOCK_D)`` query tile, the slices of :func:`_bases`, the
    query coordinates and :func:`gauss_rows` (zeros without a Gaussian bias).
    """
    bh, b, h = _program(n_heads)
    offs_m = _block_offsets(BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base, k_base, v_base, add_base, keep_base = _bases(
        Q, K, V, ADD, KEEP, b, h, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_mb, s_mh
    )
    q = _load_tile(q_base, offs_m, offs_d, s_qm, s_qd, n_q, head_d, EVEN_M, EVEN_D)
    qr, qc, cr, fr, cc, fc, alpha = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    if GAUSS:
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
    return bh, offs_m, offs_d, offs_dv, q, k_base, v_base, add_base, keep_base, qr, qc, cr, fr, cc, fc, alpha


# ---- grid-aligned key tiles: the Gaussian bias as per-tile factors -------------------------------------
#
# With a Gaussian bias, the patch keys are visited in tiles that cover whole rows of a grid whose width is
# padded to ``GWP`` (a power of two >= the grid width): a tile is ``NR = BLOCK_N // TILE_W`` grid rows of
# ``TILE_W = min(GWP, BLOCK_N, widest chunk)`` slots each (the kernel's constexpr ``GRID_TW``, chosen
# per kernel and tile by ``configs.grid_tile_w``),
# slot ``(j, b)`` of the tile at rows ``a0 + j`` and column ``c * TILE_W + b`` (chunk ``c`` of
# ``CH = GWP // TILE_W``), i.e. token ``P + (a0 + j) * gw + c * TILE_W + b``; slots past the grid width are
# masked. The bias of a score factorises per axis,
# ``alpha e = alpha 2^(t_row) 2^(t_col)``: the column factors ``C`` of a query block depend on the chunk only
# (computed once per chunk, outside the key loop), the row factors ``R`` on the tile's rows (one ``exp2``
# per query row and tile row), and the bias adds ``R ⊗ C`` to the ``q kᵀ`` accumulator: one multiply-add
# per score. Prefix keys (class / register tokens) are a tile of their own without bias. Without a
# Gaussian bias the same loop visits plain tiles of ``BLOCK_N`` tokens (one "row" of width ``BLOCK_N``).


@triton.jit
def col_factors(qc, cc, fc, b0, TILE_W: tl.constexpr, TRANS: tl.constexpr):
    """``(C, t)``, the column factors ``C = 2^t``, ``t = max(cc (qc - b)^2, fc)`` of grid columns
    ``b = b0 + arange(TILE_W)`` (``b0`` a float) for the queries of ``qc, cc, fc``: ``(BLOCK_M, TILE_W)``,
    ``(TILE_W, BLOCK_M)`` if ``TRANS``."""
    b = b0 + tl.arange(0, TILE_W).to(tl.float32)
    if TRANS:
        t = axis_exponent(qc[None, :] - b[:, None], cc[None, :], fc[None, :])
    else:
        t = axis_exponent(qc[:, None] - b[None, :], cc[:, None], fc[:, None])
    return tl.exp2(t), t


@triton.jit
def row_factors(dr, cr, fr, NR: tl.constexpr):
    """``(R, t)``, the row factors ``R = 2^t``, ``t = max(cr (dr - j)^2, fr)`` of the tile's grid rows
    ``j = 0 .. NR - 1``, ``dr = qr - a0`` the query rows' offsets from its first grid row ``a0`` (floats
    holding integers, so ``dr - j`` equals ``qr - (a0 + j)`` exactly): ``(BLOCK_M, NR)``."""
    d = dr[:, None] - tl.arange(0, NR).to(tl.float32)[None, :]
    t = axis_exponent(d, cr[:, None], fr[:, None])
    return tl.exp2(t), t


@triton.jit
def add_outer(s, r, c, BLOCK_M: tl.constexpr, NR: tl.constexpr, TILE_W: tl.constexpr, TRANS: tl.constexpr):
    """``s + r ⊗ c`` on a grid-aligned tile: ``s`` ``(BLOCK_M, NR * TILE_W)`` with ``r`` ``(BLOCK_M, NR)``,
    ``c`` ``(BLOCK_M, TILE_W)``; with ``TRANS`` ``s`` is ``(NR * TILE_W, BLOCK_M)``, ``r`` ``(NR, BLOCK_M)``
    and ``c`` ``(TILE_W, BLOCK_M)``. Seen as ``(.., NR, TILE_W, ..)`` the product broadcasts, so every
    thread multiplies only the factors of its own scores (one multiply-add per score)."""
    if TRANS:
        s3 = tl.reshape(s, (NR, TILE_W, BLOCK_M))
        s3 = s3 + r[:, None, :] * c[None, :, :]
        return tl.reshape(s3, (NR * TILE_W, BLOCK_M))
    else:
        s3 = tl.reshape(s, (BLOCK_M, NR, TILE_W))
        s3 = s3 + r[:, :, None] * c[:, None, :]
        return tl.reshape(s3, (BLOCK_M, NR * TILE_W))


@triton.jit
def sum_rows_of_tile(x, BLOCK_M: tl.constexpr, NR: tl.constexpr, TILE_W: tl.constexpr):
    """``(BLOCK_M, TILE_W)``: a ``(BLOCK_M, NR * TILE_W)`` tile summed over its ``NR`` grid rows."""
    return tl.sum(tl.reshape(x, (BLOCK_M, NR, TILE_W)), 1)


@triton.jit
def key_slots(BLOCK_N: tl.constexpr, TILE_W: tl.constexpr, row_w):
    """``(offset, col)`` of the slots of a tile: token offset from the tile's first token
    (``j * row_w + b``) and the column ``b`` within the tile's chunk."""
    slot = tl.arange(0, BLOCK_N)
    col = slot % TILE_W
    row = ((slot // TILE_W).to(tl.int64) * row_w).to(tl.int32)  # < BLOCK_N * grid_w: no overflow
    return row + col, col
