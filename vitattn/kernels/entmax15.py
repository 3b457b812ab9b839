"""Forward kernel of fused entmax-1.5 attention: a per-row threshold search over the key blocks, then
the output pass.

With ``y = z / 2`` (z = the masked, biased scores; the 1/2 is folded into the scale), ``entmax15(z) =
(y - tau)_+^2`` where ``tau`` makes the row sum to 1. Per block of query rows, on the max-shifted scores
``x = y - m`` (``x <= 0``; the root lies in ``[-1, hi]``, ``hi = -1/sqrt(n)`` for ``n`` finite keys):

1. one pass over the keys: the row max ``m``, the count ``n`` of the finite ``y`` (with a mask only),
   and ``S1 = sum (x + 1)_+``, ``S2 = sum (x + 1)_+^2`` relative to the running max: when the max
   grows by ``d``, ``S2`` drops by ``2 d S1`` at most, so ``S2`` is kept as a lower bound and ``S1``
   (never decreased) as an upper bound. The first Newton step from ``-1`` taken with them
   (``(sqrt(S2) - 1) sqrt(S2) / S1``) is no longer than the exact one, so the start
   ``tau = -1 + step`` is a lower bound; it is the torch path's first iterate when the max comes first;
2. Newton passes on ``h(tau) = sqrt(s2) - 1`` (convex, decreasing: every iterate from the left stays
   a lower bound), each gathering ``k = |{x > tau}|``, ``s1 = sum (x - tau)_+``, ``s2 = sum (x -
   tau)_+^2``. Each pass also forms the closed form of the quadratic on its support (the smaller root of
   ``k d^2 - 2 s1 d + s2 - 1 = 0``, cancellation-free), and the next pass counts the keys above that
   candidate: when the count equals ``k``, no key lies between ``tau`` and the candidate, the support
   is the root's and the candidate is the exact threshold. A row is done then, or when its Newton step is
   below ``sqrt(float32 eps)`` (the closed form of that pass); the passes end when every row of the tile
   is done (``NEWTON_MAX_STEPS`` at most). A row masked by a large finite value (``-1e6``) converges
   like any other, since ``x`` is shifted;
3. the output pass accumulates ``p V`` with ``p = (x - tau)_+^2``.

No key loop branches on data: K and V are loaded on every tile (the loads pipeline); the passes and the
decision to stop are per tile of rows, outside the key loops.

With a Gaussian bias and no window every pass visits grid-aligned key tiles (``_common``, "grid-aligned
key tiles": the prefix keys' tiles, then per chunk of grid columns the tiles of whole grid rows) and adds
the bias as one multiply-add per score (:func:`~vitattn.kernels._tiles.grid_scores`); otherwise tiles of
``BLOCK_N`` tokens, the bias (with a window) built per score.

Saved for backward: ``STAT`` = ``m + tau`` (the threshold in units of ``z / 2``), float32
``(B, H, Nq)`` (``+inf`` for a row whose keys are all masked), and, when a gradient is needed,
``OG`` = ``sum_j g_j v_j / sum_j g_j`` with ``g = (x - tau)_+ = sqrt(p)``, float32 ``(B, H, Nq, Dv)``:
the backward's row term is then ``delta = dO . OG`` (the entmax analogue of softmax's ``dO . O``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    NEWTON_MAX_STEPS,
    NEWTON_TOL,
    _coords_start,
    _coords_step,
    _dot,
    _fwd_prologue,
    _store_tile,
    key_slots,
    load_tile_at,
    row_partial_mins,
    row_partial_sums,
    threshold_excess,
    tile_offsets,
    warp_uniform,
)
from ._tiles import (
    coords_jump,
    grid_chunk,
    grid_scores,
    grid_tile,
    listed_scores,
    load_slots,
    prefix_tile,
    small_int_to_float,
    tile_index,
    tile_list,
    window_rows,
)

# The two levels of the first pass, relative to the first key block's row max (units of z / 2).
LEVEL_LO: tl.constexpr = tl.constexpr(-0.25)
LEVEL_HI: tl.constexpr = tl.constexpr(0.25)
# Below the root, the closed form replaces Newton's step once the step is this small (the support is near).
NEAR_STEP: tl.constexpr = tl.constexpr(0.05)
# A closed-form move this small (2^-21, a few float32 ulps of the row's scale 1) is rounding: stop there.
SETTLED: tl.constexpr = tl.constexpr(4.76837158203125e-07)


# 2^126: a normal float32 times it is >= 1
POSITIVE_SCALE: tl.constexpr = tl.constexpr(8.507059173023462e37)


if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8):

    @triton.jit
    def _positive(a, ASM: tl.constexpr):
        """``1.0`` where ``a > 0``, ``0.0`` where ``a = 0`` (``a >= 0``). Summed by ``tl.sum``,
        ``where(a > 0, 1.0, 0.0)`` compiles under Triton 3.6 to packed integer counters (a select, a
        shift, a logic op and an add per score besides the compare). Compiled (``ASM``), one PTX
        ``set.gt.f32.f32`` the optimizer cannot see through (one ``FSET`` per score, as under 3.8);
        in the interpreter (no PTX) ``min(a 2^126, 1)``, two operations per score."""
        if ASM:
            return tl.inline_asm_elementwise(
                "set.gt.f32.f32 $0, $1, 0f00000000;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return tl.minimum(a * POSITIVE_SCALE, 1.0)

else:

    @triton.jit
    def _positive(a, ASM: tl.constexpr):
        """``1.0`` where ``a > 0``, ``0.0`` where ``a = 0``: one ``FSET`` per score under Triton 3.8
        (``ASM`` unused: older Triton needs inline PTX for it)."""
        return tl.where(a > 0.0, 1.0, 0.0)


@triton.jit
def _newton_step(s1, s2):
    """Newton's step on ``h = sqrt(s2) - 1`` from the left: ``(sqrt(s2) - 1) sqrt(s2) / s1``, >= 0
    (0 for an empty support or ``s2 <= 1``)."""
    norm = tl.sqrt(tl.maximum(s2, 1.0))
    step = tl.where(s1 > 0.0, (norm - 1.0) * norm / tl.where(s1 > 0.0, s1, 1.0), 0.0)
    return tl.maximum(step, 0.0)


@triton.jit
def _closed_form(s0, s1, s2):
    """``(inc, valid)``: the threshold is ``tau + inc`` if the support ``{x > tau}`` (``s0`` keys, sums
    ``s1``, ``s2``) is the root's: ``inc = (s2 - 1) / (s1 + sqrt(s1^2 - s0 (s2 - 1)))``, the smaller root
    of ``s0 d^2 - 2 s1 d + s2 - 1 = 0`` without cancellation; ``valid``: that quadratic has a real root
    (the discriminant is clamped at 0 otherwise)."""
    disc = s1 * s1 - s0 * (s2 - 1.0)
    denom = s1 + tl.sqrt(tl.maximum(disc, 0.0))
    inc = tl.where(denom > 0.0, (s2 - 1.0) / tl.where(denom > 0.0, denom, 1.0), 0.0)
    return inc, disc >= 0.0


@triton.jit
def _level_bound(t, k, s1, s2):
    """A lower bound of the threshold from exact sums at a level ``t`` (shifted scale; ``k`` keys above
    it, ``s1 = sum (x - t)_+``, ``s2 = sum (x - t)_+^2``), or -1: below the root (``s2 >= 1``) Newton's
    step from ``t``; above it (``s2 < 1``, some key above) the closed form, whose support lacks only keys
    below the root, so it lands at or below it."""
    inc, _valid = _closed_form(k, s1, s2)
    below = t + _newton_step(s1, s2)
    above = tl.where(s1 > 0.0, t + inc, -1.0)
    return tl.where(s2 >= 1.0, below, above)


@triton.jit
def _squares_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, PER_SCORE: tl.constexpr):
    """Zeros for a row's running sum of squares: ``(BLOCK_M, BLOCK_N)`` (one per score slot) with
    ``PER_SCORE``, else ``(BLOCK_M, PARTS)`` (:func:`row_partial_sums`); ``tl.sum(., 1)`` is the sum."""
    if PER_SCORE:
        return tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        return tl.zeros([BLOCK_M, PARTS], tl.float32)


@triton.jit
def _add_squares(
    acc, a, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, PER_SCORE: tl.constexpr
):
    """``acc`` (:func:`_squares_init`) plus the squares of the tile ``a``. Per score slot it is one
    multiply-add per score; a tile summed into partial sums first costs 1.5 (the compiler sums the
    squares of a thread's slots as a tree: half the squares a multiply, half a multiply-add, then adds),
    for ``BLOCK_M * BLOCK_N / threads`` more registers."""
    if PER_SCORE:
        return acc + a * a
    else:
        return acc + row_partial_sums(a * a, BLOCK_M, BLOCK_N, PARTS)


@triton.jit
def _first_sums(
    y,
    first,
    m,
    ref,
    k_lo,
    s1_lo,
    s2_lo,
    k_hi,
    s1_hi,
    s2_hi,
    count_p,
    MASKED: tl.constexpr,
    UNIFORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_PARTS: tl.constexpr,
    SQUARES: tl.constexpr,
):
    """The first pass over one key tile ``y`` (``first``: the pass' first tile, whose row max fixes the
    levels): the row max, the sums at both levels and (``MASKED``) the finite keys' count."""
    m = tl.maximum(m, tl.max(y, 1))
    ref = tl.where(first, tl.where(m == float("-inf"), 0.0, m), ref)
    a = tl.maximum(y - (ref + LEVEL_LO)[:, None], 0.0)
    k_lo += row_partial_sums(_positive(a, UNIFORM), BLOCK_M, BLOCK_N, ROW_PARTS)
    s1_lo += row_partial_sums(a, BLOCK_M, BLOCK_N, ROW_PARTS)
    s2_lo = _add_squares(s2_lo, a, BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES)
    a = tl.maximum(y - (ref + LEVEL_HI)[:, None], 0.0)
    k_hi += row_partial_sums(_positive(a, UNIFORM), BLOCK_M, BLOCK_N, ROW_PARTS)
    s1_hi += row_partial_sums(a, BLOCK_M, BLOCK_N, ROW_PARTS)
    s2_hi = _add_squares(s2_hi, a, BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES)
    if MASKED:
        count_p += row_partial_sums(tl.where(y > float("-inf"), 1.0, 0.0), BLOCK_M, BLOCK_N, ROW_PARTS)
    return m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi, count_p


@triton.jit
def _search_sums(
    y,
    m,
    tau,
    s0,
    s1,
    s2,
    near,
    offs_m,
    n_q,
    FOLD: tl.constexpr,
    UNIFORM: tl.constexpr,
    EVEN_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_PARTS: tl.constexpr,
    SQUARES: tl.constexpr,
):
    """A search pass over one key tile ``y`` at the thresholds ``m + tau``: the sums ``s0, s1, s2``, the
    nearest key's distance, and ``live``: a key of the tile lies above some row's threshold."""
    d = threshold_excess(y, m, tl.full([BLOCK_M], 1.0, tl.float32), tau, FOLD)
    g = tl.maximum(d, 0.0)
    above = tl.sum(_positive(g, UNIFORM), 1)
    s0 += above
    if EVEN_M:
        live = tl.max(above, 0) > 0.0
    else:  # padded query rows (zero scores) keep every key: not theirs to decide
        live = tl.max(tl.where(offs_m < n_q, above, 0.0), 0) > 0.0
    s1 += row_partial_sums(g, BLOCK_M, BLOCK_N, ROW_PARTS)
    s2 = _add_squares(s2, g, BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES)
    near = tl.minimum(near, row_partial_mins(tl.abs(d), BLOCK_M, BLOCK_N, ROW_PARTS))
    return s0, s1, s2, near, live


@triton.jit
def _output_tile(
    y,
    v,
    m,
    tau_fin,
    acc,
    acc_g,
    g_sum,
    FOLD: tl.constexpr,
    STORE_OG: tl.constexpr,
    F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_PARTS: tl.constexpr,
):
    """The output pass over one key tile: ``acc += p V`` with ``p = g^2``, ``g = (y - m - tau)_+``, and
    (``STORE_OG``) ``acc_g += g V``, ``g_sum += g``."""
    g = tl.maximum(threshold_excess(y, m, tl.full([BLOCK_M], 1.0, tl.float32), tau_fin, FOLD), 0.0)
    acc += _dot((g * g).to(v.dtype), v, F32_DOT)
    if STORE_OG:
        acc_g += _dot(g.to(v.dtype), v, F32_DOT)
        g_sum += row_partial_sums(g, BLOCK_M, BLOCK_N, ROW_PARTS)
    return acc, acc_g, g_sum


@triton.jit
def _mark_live(
    live_base,
    cells_q,
    offs_n,
    ok,
    n_cells_q,
    n_cells_k,
    GRAIN: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Marks the live-tile map's cells of the query block (``cells_q``) and the key slots ``offs_n`` (their
    positions along the map's key axis: tokens, or ``ops.live_key_index`` with grid-aligned key tiles;
    ``ok``: those inside the keys, with ``MASKED``): one store per query cell and key slot."""
    inside = cells_q[:, None] < n_cells_q
    if MASKED:
        inside = inside & ok[None, :]
    ones = tl.full([BLOCK_M // GRAIN, BLOCK_N], 1, tl.uint8)
    tl.store(live_base + cells_q[:, None] * n_cells_k + (offs_n // GRAIN)[None, :], ones, mask=inside)


@triton.jit
def _fwd_entmax15_kernel(
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
    grid_h,
    LIST,
    LIVE,
    n_cells_q,
    n_cells_k,
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
    SPARSE: tl.constexpr,
    GRAIN: tl.constexpr,
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
    GAUSS_SQUARES: tl.constexpr = True,
    GWP: tl.constexpr = 16,
    PAD_W: tl.constexpr = False,
    GRID_TW: tl.constexpr = 16,
):
    """``O[b, h, rows] = entmax15(z) V``, ``STAT = tau`` (and ``OG``) for one block of query rows.

    Shapes as in the softmax kernel; OG contiguous float32 ``(B, H, Nq, Dv)`` (written if ``STORE_OG``).
    ``SPARSE``: the last search pass writes the key tiles with a weight above its threshold into this
    program's row of ``LIST`` (int32 scratch ``(B * H * cdiv(Nq, BLOCK_M), ops.entmax_list_cols)``: with
    grid-aligned tiles, whatever ``SPARSE`` says, ``CH + 1`` counts and then a list per section), the
    output pass visits those only and marks them in ``LIVE`` (uint8 ``(B * H, n_cells_q, n_cells_k)``,
    cells of ``GRAIN x GRAIN`` scores, zero-initialized: what the backward's tile lists are built from;
    with grid-aligned tiles the keys' axis is ``ops.live_key_index``'s).
    ``GAUSS_SQUARES``: a Gaussian forward with whole tiles keeps its sums of squares per score slot
    (:func:`_add_squares`; the other forwards always do). ``GWP``, ``PAD_W``, ``GRID_TW`` and ``grid_h``
    as in the softmax kernel (the grid-aligned key tiles of a Gaussian bias without a window; ``EVEN_N``
    then means no prefix keys and whole tiles of grid rows).
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
    # every tile is y = z / 2 (the 1/2 of entmax-1.5 folded into the scale and the Gaussian amplitude)
    alpha_y = alpha * 0.5
    kr0, kc0 = _coords_start(tl.arange(0, BLOCK_N), num_prefix, grid_w)
    _step_r, _step_c, gw = _coords_step(BLOCK_N, grid_w)  # with tiles of tokens a bias comes with a window
    ctr_r, half_r, ctr_c, half_c = 0.0, 0.0, 0.0, 0.0
    if WINDOW:  # the window's key tiles (every tile without one) and its bounds per query
        ctr_r, half_r, ctr_c, half_c = window_rows(WIN, offs_m, n_q)
    n_wit, wrow = tile_list(WLIST, WCNT, n_wcols, 0, tl.cdiv(n_q, BLOCK_M), n_k, BLOCK_N, WINDOW, UNIFORM)
    masked = HAS_ADD or HAS_KEEP or WINDOW
    # the sums of squares per score slot (_add_squares); a Gaussian forward only where GAUSS_SQUARES and
    # without prefix keys or a partial tile (configs.ENTMAX_GAUSS_SQUARES_BY_ARCH: elsewhere they spill)
    SQUARES: tl.constexpr = (not GAUSS) or (GAUSS_SQUARES and EVEN_N)
    FOLD: tl.constexpr = not HAS_ADD  # threshold_excess: m + tau formed once per row
    masks = (add_base, s_am, s_an, keep_base, s_mm, s_mn)  # listed_scores' operands
    gq = (qr, qc, cr, fr, cc, fc, alpha_y)
    win = (ctr_r, half_r, ctr_c, half_c, WIN)
    # grid-aligned key tiles (a Gaussian bias without a window; _common, "grid-aligned key tiles"): the
    # prefix keys in tiles of their own (no bias), then per chunk of TILE_W grid columns (its column
    # factors once) the tiles of NR whole grid rows (their row factors once per tile)
    GRID: tl.constexpr = GAUSS and not WINDOW
    TILE_W: tl.constexpr = GRID_TW
    CH: tl.constexpr = GWP // GRID_TW
    NR: tl.constexpr = BLOCK_N // GRID_TW
    MASKED_G: tl.constexpr = PAD_W or not EVEN_N  # grid slots past the grid width or the keys
    slot_off, col = key_slots(BLOCK_N, TILE_W, grid_w)
    kg_tile = tile_offsets(slot_off, offs_d, s_kn, s_kd, OFFS32)
    n_pre = tl.cdiv(num_prefix, BLOCK_N)
    n_gt = tl.cdiv(grid_h, NR)
    amp = alpha / scale  # the bias in units of q kᵀ (grid_scores scales it with the scores)

    # 1. row max m of y, the finite keys, and exact sums at two levels fixed by the first block's max
    # (the sums as partial sums per row: row_partial_sums)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ref = tl.zeros([BLOCK_M], tl.float32)
    k_lo = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)
    s1_lo = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)
    s2_lo = _squares_init(BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES)
    k_hi = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)
    s1_hi = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)
    s2_hi = _squares_init(BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES)
    count_p = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)
    if GRID:
        vis = tl.full([], 0, tl.int32)  # the tiles visited: the first one's row max fixes the levels
        if not EVEN_N:  # prefix keys
            for t in range(0, n_pre):
                tok0, offs_n, ok = prefix_tile(t, num_prefix, BLOCK_N)
                y = grid_scores(q, k_base, k_tile, tok0, offs_n, ok, offs_m, offs_d,
                                n_q, n_k, head_d, scale, 0.5, masks, 0.0, 0.0, False, HAS_ADD, HAS_KEEP,
                                F32_DOT, True, EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, False)  # fmt: skip
                m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi, count_p = _first_sums(
                    y, vis == 0, m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi, count_p,
                    masked, UNIFORM, BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES,
                )  # fmt: skip
                vis += 1
        for ch in tl.static_range(CH):
            c, col_ok = grid_chunk(qc, cc, fc, amp, col, ch, grid_w, TILE_W)
            a0 = 0.0
            for i in range(0, n_gt):
                r, tok0, offs_n, ok = grid_tile(qr, cr, fr, a0, ch, i, slot_off, col_ok, num_prefix,
                                                grid_w, n_k, TILE_W, NR)  # fmt: skip
                y = grid_scores(q, k_base, kg_tile, tok0, offs_n, ok, offs_m, offs_d,
                                n_q, n_k, head_d, scale, 0.5, masks, r, c, True, HAS_ADD, HAS_KEEP, F32_DOT,
                                MASKED_G, EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, OFFS32)  # fmt: skip
                m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi, count_p = _first_sums(
                    y, vis == 0, m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi,
                    count_p, masked, UNIFORM, BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES,
                )  # fmt: skip
                vis += 1
                a0 += NR
    else:
        kr, kc = kr0, kc0
        for it in range(0, n_wit):
            tile = tile_index(wrow, it, WINDOW)
            start_n = tile * BLOCK_N
            if WINDOW and GAUSS:  # a listed tile's grid coordinates (the Gaussian bias')
                kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
            y, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d, scale,
                                      0.5, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, WINDOW,
                                      EVEN_M, EVEN_N, EVEN_D, BLOCK_N, OFFS32)  # fmt: skip
            m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi, count_p = _first_sums(
                y, it == 0, m, ref, k_lo, s1_lo, s2_lo, k_hi, s1_hi, s2_hi, count_p,
                masked, UNIFORM, BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES,
            )  # fmt: skip
    k_lo, s1_lo, s2_lo = tl.sum(k_lo, 1), tl.sum(s1_lo, 1), tl.sum(s2_lo, 1)
    k_hi, s1_hi, s2_hi = tl.sum(k_hi, 1), tl.sum(s1_hi, 1), tl.sum(s2_hi, 1)
    if masked:
        count = tl.sum(count_p, 1)
        dead = m == float("-inf")
    else:
        count = tl.full([BLOCK_M], 1.0, tl.float32) * n_k
        dead = count == 0.0
    m = tl.where(dead, 0.0, m)
    # in the shifted scale x = y - m (x <= 0, the row's scale is 1) the root lies in [-1, hi]
    hi = -1.0 / tl.sqrt(tl.maximum(count, 1.0))
    tau = tl.full([BLOCK_M], -1.0, tl.float32)
    tau = tl.maximum(tau, _level_bound(ref + LEVEL_LO - m, k_lo, s1_lo, s2_lo))
    tau = tl.maximum(tau, _level_bound(ref + LEVEL_HI - m, k_hi, s1_hi, s2_hi))
    tau = tl.minimum(tau, hi)

    # 2. passes over the keys: each certifies its closed form, else moves tau (Newton or the closed form)
    done = dead
    tau_fin = tau
    inc = tl.zeros([BLOCK_M], tl.float32)
    steps = tl.full([], 0, tl.int32)
    going = steps == 0
    n_list = tl.full([], 0, tl.int32)
    # with grid tiles a list row holds CH + 1 counts (the prefix tiles', each chunk's), then the prefix
    # tiles' list and each chunk's (ops.entmax_list_cols)
    if GRID:
        n_list_cols = CH + 1 + n_pre + CH * n_gt
    else:
        n_list_cols = tl.cdiv(n_k, BLOCK_N)
    list_row = LIST + (bh.to(tl.int64) * tl.cdiv(n_q, BLOCK_M) + tl.program_id(0)) * n_list_cols
    list_pre = list_row + (CH + 1)
    while going:
        s0 = tl.zeros([BLOCK_M], tl.float32)
        s1 = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)  # partial sums and minima (row_partial_sums)
        s2 = _squares_init(BLOCK_M, BLOCK_N, ROW_PARTS, SQUARES)
        near = tl.full([BLOCK_M, ROW_PARTS], float("inf"), tl.float32)
        n_list = tl.full([], 0, tl.int32)
        if GRID:
            if not EVEN_N:  # prefix keys
                for t in range(0, n_pre):
                    tok0, offs_n, ok = prefix_tile(t, num_prefix, BLOCK_N)
                    y = grid_scores(q, k_base, k_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k,
                                    head_d, scale, 0.5, masks, 0.0, 0.0, False, HAS_ADD, HAS_KEEP, F32_DOT,
                                    True, EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, False)  # fmt: skip
                    s0, s1, s2, near, live = _search_sums(y, m, tau, s0, s1, s2, near, offs_m, n_q, FOLD,
                                                          UNIFORM, EVEN_M, BLOCK_M, BLOCK_N, ROW_PARTS,
                                                          SQUARES)  # fmt: skip
                    tl.store(list_pre + n_list, t, mask=live)
                    n_list += live.to(tl.int32)
            tl.store(list_row, n_list)
            for ch in tl.static_range(CH):
                c, col_ok = grid_chunk(qc, cc, fc, amp, col, ch, grid_w, TILE_W)
                list_ch = list_pre + n_pre + ch * n_gt
                n_list = tl.full([], 0, tl.int32)
                a0 = 0.0
                for i in range(0, n_gt):
                    r, tok0, offs_n, ok = grid_tile(qr, cr, fr, a0, ch, i, slot_off, col_ok, num_prefix,
                                                    grid_w, n_k, TILE_W, NR)  # fmt: skip
                    y = grid_scores(q, k_base, kg_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d,
                                    scale, 0.5, masks, r, c, True, HAS_ADD, HAS_KEEP, F32_DOT, MASKED_G,
                                    EVEN_M, EVEN_D, BLOCK_M, NR, TILE_W, OFFS32)  # fmt: skip
                    s0, s1, s2, near, live = _search_sums(y, m, tau, s0, s1, s2, near, offs_m, n_q, FOLD,
                                                          UNIFORM, EVEN_M, BLOCK_M, BLOCK_N, ROW_PARTS,
                                                          SQUARES)  # fmt: skip
                    tl.store(list_ch + n_list, i, mask=live)
                    n_list += live.to(tl.int32)
                    a0 += NR
                tl.store(list_row + 1 + ch, n_list)
        else:
            kr, kc = kr0, kc0
            for it in range(0, n_wit):
                tile = tile_index(wrow, it, WINDOW)
                start_n = tile * BLOCK_N
                if WINDOW and GAUSS:
                    kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
                y, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d,
                                          scale, 0.5, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP,
                                          F32_DOT, WINDOW, EVEN_M, EVEN_N, EVEN_D, BLOCK_N,
                                          OFFS32)  # fmt: skip
                s0, s1, s2, near, live = _search_sums(y, m, tau, s0, s1, s2, near, offs_m, n_q, FOLD,
                                                      UNIFORM, EVEN_M, BLOCK_M, BLOCK_N, ROW_PARTS,
                                                      SQUARES)  # fmt: skip
                if SPARSE:  # a key above some row's threshold: record the tile (the last pass' list stays)
                    tl.store(list_row + n_list, start_n // BLOCK_N, mask=live)
                    n_list += live.to(tl.int32)
        s1, s2, near = tl.sum(s1, 1), tl.sum(s2, 1), tl.min(near, 1)
        steps += 1
        live = ~done
        inc, valid = _closed_form(s0, s1, s2)
        step = _newton_step(s1, s2)
        # no key within |inc| of tau: the support at tau + inc is this pass' support, so tau + inc is the root
        exact = live & (near > tl.abs(inc))
        # the torch path's stop: Newton's step (in the shifted scale: relative to the row) below sqrt(eps);
        # or the closed form moves tau by rounding only (a key at the root itself: none is ever certified)
        small = live & (((step <= NEWTON_TOL) & (s2 >= 1.0)) | (tl.abs(inc) <= SETTLED))
        tau_fin = tl.where(exact | small, tau + inc, tau_fin)
        done = done | exact | small
        # from below (s2 >= 1) Newton's step, or the closed form once it is near; from above the closed form
        closed = (s2 < 1.0) | (valid & (step < NEAR_STEP))
        nxt = tl.minimum(tl.maximum(tl.where(closed, tau + inc, tau + step), -1.0), hi)
        # a done row's later passes (and their list) see its final threshold
        tau = tl.where(done, tau_fin, nxt)
        going = (tl.max(tl.where(done, 0, 1), 0) > 0) & (steps < NEWTON_MAX_STEPS)
    tau_fin = tl.where(done, tau_fin, tau + inc)  # rows stopped by the pass bound: their last closed form
    tau_fin = tl.where(dead, float("inf"), tau_fin)

    # 3. output pass
    g_sum = tl.zeros([BLOCK_M, ROW_PARTS], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    cells_q = tl.program_id(0) * (BLOCK_M // GRAIN) + tl.arange(0, BLOCK_M // GRAIN)
    live_base = LIVE + bh.to(tl.int64) * n_cells_q * n_cells_k
    if GRID:  # the live tiles of each list (SPARSE)
        tl.debug_barrier()  # the lists' stores are seen by every thread
        n_iter = warp_uniform(tl.load(list_row), UNIFORM)
        if not EVEN_N:  # prefix keys
            for it in range(0, n_iter):
                t = tl.load(list_pre + it)
                tok0, offs_n, ok = prefix_tile(t, num_prefix, BLOCK_N)
                _mark_live(live_base, cells_q, offs_n, ok, n_cells_q, n_cells_k, GRAIN, True, BLOCK_M,
                           BLOCK_N)  # fmt: skip
                y = grid_scores(q, k_base, k_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d,
                                scale, 0.5, masks, 0.0, 0.0, False, HAS_ADD, HAS_KEEP, F32_DOT, True, EVEN_M,
                                EVEN_D, BLOCK_M, NR, TILE_W, False)  # fmt: skip
                v = load_slots(v_base, tok0, v_tile, offs_n, ok, offs_dv, head_dv, True, EVEN_D, False)
                acc, acc_g, g_sum = _output_tile(y, v, m, tau_fin, acc, acc_g, g_sum, FOLD, STORE_OG, F32_DOT,
                                                 BLOCK_M, BLOCK_N, ROW_PARTS)  # fmt: skip
        vg_tile = tile_offsets(slot_off, offs_dv, s_vn, s_vd, OFFS32)
        # the live map's key axis: the prefix tokens, then the grid padded to GWP columns from the next
        # cell (ops.live_key_index): a slot's position from its chunk's first one
        map_slots, _col = key_slots(BLOCK_N, TILE_W, GWP)
        map_first = tl.cdiv(num_prefix, GRAIN) * GRAIN
        for ch in tl.static_range(CH):
            c, col_ok = grid_chunk(qc, cc, fc, amp, col, ch, grid_w, TILE_W)
            map_ch = map_first + ch * TILE_W + map_slots
            list_ch = list_pre + n_pre + ch * n_gt
            n_iter = warp_uniform(tl.load(list_row + 1 + ch), UNIFORM)
            for it in range(0, n_iter):
                i = tl.load(list_ch + it)
                row0 = small_int_to_float(i) * NR  # the listed tile's first grid row
                r, tok0, offs_n, ok = grid_tile(qr, cr, fr, row0, ch, i, slot_off, col_ok, num_prefix,
                                                grid_w, n_k, TILE_W, NR)  # fmt: skip
                _mark_live(live_base, cells_q, map_ch + i * (NR * GWP), ok, n_cells_q, n_cells_k, GRAIN,
                           MASKED_G, BLOCK_M, BLOCK_N)  # fmt: skip
                y = grid_scores(q, k_base, kg_tile, tok0, offs_n, ok, offs_m, offs_d, n_q, n_k, head_d, scale,
                                0.5, masks, r, c, True, HAS_ADD, HAS_KEEP, F32_DOT, MASKED_G, EVEN_M, EVEN_D,
                                BLOCK_M, NR, TILE_W, OFFS32)  # fmt: skip
                v = load_slots(v_base, tok0, vg_tile, offs_n, ok, offs_dv, head_dv, MASKED_G, EVEN_D, OFFS32)
                acc, acc_g, g_sum = _output_tile(y, v, m, tau_fin, acc, acc_g, g_sum, FOLD, STORE_OG, F32_DOT,
                                                 BLOCK_M, BLOCK_N, ROW_PARTS)  # fmt: skip
    else:
        kr, kc = kr0, kc0
        if SPARSE:
            n_iter = warp_uniform(n_list, UNIFORM)
            tl.debug_barrier()  # the list's stores are seen by every thread
        else:
            n_iter = n_wit
        for it in range(0, n_iter):
            if SPARSE:  # the live key tiles only, in order; the Gaussian coordinates from the tile's start
                tile = tl.load(list_row + it)
                start_n = tile * BLOCK_N
                if GAUSS:
                    kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
                cells_k = tile * (BLOCK_N // GRAIN) + tl.arange(0, BLOCK_N // GRAIN)
                inside = (cells_q[:, None] < n_cells_q) & (cells_k[None, :] < n_cells_k)
                ones = tl.full([BLOCK_M // GRAIN, BLOCK_N // GRAIN], 1, tl.uint8)
                tl.store(live_base + cells_q[:, None] * n_cells_k + cells_k[None, :], ones, mask=inside)
            else:
                tile = tile_index(wrow, it, WINDOW)
                start_n = tile * BLOCK_N
                if WINDOW and GAUSS:
                    kr, kc = coords_jump(kr0, kc0, tile, BLOCK_N, gw)
            y, offs_n = listed_scores(q, k_base, k_tile, start_n, offs_m, offs_d, n_q, n_k, head_d, scale,
                                      0.5, masks, gq, kr, kc, win, GAUSS, HAS_ADD, HAS_KEEP, F32_DOT, WINDOW,
                                      EVEN_M, EVEN_N, EVEN_D, BLOCK_N, OFFS32)  # fmt: skip
            v = load_tile_at(v_base, start_n, v_tile, offs_n, offs_dv, n_k, head_dv, EVEN_N, EVEN_D, OFFS32)
            acc, acc_g, g_sum = _output_tile(y, v, m, tau_fin, acc, acc_g, g_sum, FOLD, STORE_OG, F32_DOT,
                                             BLOCK_M, BLOCK_N, ROW_PARTS)  # fmt: skip

    row = bh.to(tl.int64) * n_q
    _store_tile(O + row * head_dv, acc, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
    # the backward recomputes y and takes g = (y - STAT)_+: STAT = m + tau in units of z / 2
    if EVEN_M:
        tl.store(STAT + row + offs_m, m + tau_fin)
    else:
        tl.store(STAT + row + offs_m, m + tau_fin, mask=offs_m < n_q)
    if STORE_OG:
        og_den = tl.sum(g_sum, 1)
        og = acc_g / tl.where(og_den > 0.0, og_den, 1.0)[:, None]
        _store_tile(OG + row * head_dv, og, offs_m, offs_dv, head_dv, 1, n_q, head_dv, EVEN_M, EVEN_D)
